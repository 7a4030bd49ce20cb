"""`--worker-extension-cls logra_vllm.extension.LograWorkerExtension`.

Importing this module (vLLM does, in every worker, before the model loads) registers the
`logra` weight-transfer engine, selected with `--weight-transfer-config '{"backend": "logra"}'`.
"""
from vllm.distributed.weight_transfer import WeightTransferEngineFactory

ENGINE = 'logra'
if ENGINE not in WeightTransferEngineFactory._registry:  # pylint: disable=protected-access
  WeightTransferEngineFactory.register_engine(ENGINE, 'logra_vllm.engine',
                                              'LograWeightTransferEngine')


class LograWorkerExtension:
  """Mixed into vLLM's worker: what the middleware asks the `logra` engine over RPC."""

  def _logra_engine(self):
    from logra_vllm.engine import LograWeightTransferEngine  # pylint: disable=g-import-not-at-top
    engine = getattr(self, 'weight_transfer_engine', None)
    if not isinstance(engine, LograWeightTransferEngine):
      raise RuntimeError('the logra engine is not configured (--weight-transfer-config '
                         '\'{"backend": "logra"}\')')
    return engine

  def logra_status(self) -> dict:
    """{'version', 'pending', 'refusal': None | {'status', 'error'}, 'in_session',
    'last_apply_s'} of this worker's engine."""
    return self._logra_engine().status()

  def logra_commit(self) -> str:
    """Keeps the session's applied updates as its new_version (before /finish_weight_update)."""
    return self._logra_engine().commit()

  def logra_drift(self, path: str) -> dict:
    """{'num', 'den', 'tensors'}: this worker's fp32 master against the safetensors at path."""
    return self._logra_engine().drift(path)

  def logra_fingerprint(self, k: str) -> dict:
    """The served weights' fingerprint (`logra_jax/bridge/fingerprint.py`) with K = int(k)."""
    return self._logra_engine().fingerprint(int(k))
