"""`logra`: a vLLM `WeightTransferEngine` applying `logra-update/1` blobs (docs/bridge.md).

The blob arrives in `update_weights` as update_info ``{"path": FILE}`` or ``{"url": URL}``,
read under the checks both engines share (`admission`: update dirs, allowed origins, size).
Everything is validated by `wire.decode` (names, shapes, dtypes, finiteness, A checksums, base
version, whole fused groups) and `admission.check_versions` (never backward; a full blob for
another base holds every tensor) before any weight changes. The engine keeps an fp32 master copy
of the checkpoint's tensors (HF names and layouts): a low-rank update is W ← W + U @ A on the
master, and the new values of the touched tensors are loaded through vLLM's layerwise reload
(on the CPU the linear weights are repacked by oneDNN, so there is no in-place add); wire.decode
guarantees every touched fused group (qkv_proj, gate_up_proj) is reloaded whole.

A refused update is not raised to vLLM (vLLM would end the session, and the client's
/finish_weight_update would fail): it is recorded, the session's earlier updates are rolled
back, and the middleware answers /update_weights with its HTTP status and message. A reload
that fails part-way (the layers before the failure already reloaded) reloads every touched
tensor from the master copy and is refused with 500. A session
is kept only if /finish_weight_update names its new_version (the middleware then calls
`commit`); a finish without one rolls it back, as on the JAX engine server.
"""
import dataclasses
import glob
import os
import time
from typing import Optional

import numpy as np
import torch
from safetensors import safe_open
from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                   WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.logger import init_logger
from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                     initialize_layerwise_reload)

from logra_vllm.refs import admission, fingerprint, projection, wire

logger = init_logger(__name__)


@dataclasses.dataclass
class LograInitInfo(WeightTransferInitInfo):
  """No fields: the blob locations come with each update."""


@dataclasses.dataclass
class LograUpdateInfo(WeightTransferUpdateInfo):
  path: Optional[str] = None
  url: Optional[str] = None


def read_checkpoint(directory: str) -> dict:
  """{HF name: float32 numpy array} of every tensor in the directory's safetensors files."""
  files = sorted(glob.glob(os.path.join(directory, '*.safetensors')))
  if not files:
    raise FileNotFoundError(f'no *.safetensors in {directory}: the logra engine needs the '
                            'HF checkpoint for its fp32 master copy')
  out = {}
  for path in files:
    with safe_open(path, framework='pt') as f:
      for name in f.keys():
        out[name] = f.get_tensor(name).float().numpy()
  return out


FUSED_ORDER = {'qkv_proj': ('q_proj', 'k_proj', 'v_proj'),
               'gate_up_proj': ('gate_proj', 'up_proj')}


def _served_slice(params: dict, name: str, spec: dict):
  """The served parameter of HF tensor ``name`` (its rows of a fused one), or None."""
  prefix, _, leaf = name.rpartition('.')
  module_path, _, proj = prefix.rpartition('.')
  fused = wire.FUSED.get(proj)
  if fused is None:
    return params.get(name)
  param = params.get(f'{module_path}.{fused}.{leaf}')
  if param is None:
    return None
  start = 0
  for member in FUSED_ORDER[fused]:
    rows = spec[f'{module_path}.{member}.{leaf}'][0]
    if member == proj:
      return param[start:start + rows] if param.shape[0] >= start + rows else None
    start += rows
  return None


@torch.no_grad()
def _torch_fingerprint(name: str, x, k: int) -> list:
  """`fingerprint.tensor_fingerprint` of a torch tensor, in float64 on its device."""
  rows, cols = fingerprint.sign_vectors(name, tuple(x.shape), k)
  w = x.to(torch.float64).reshape(rows.shape[1], cols.shape[1])
  y = w @ torch.from_numpy(cols).to(w.device).T  # (d_out, k)
  proj = (torch.from_numpy(rows).to(w.device).T * y).sum(0)
  return [float(torch.linalg.vector_norm(w))] + [float(p) for p in proj.cpu()]


class LograWeightTransferEngine(WeightTransferEngine[LograInitInfo, LograUpdateInfo]):
  """Receives `logra-update/1` blobs by path or URL; versions are decimal strings from '0'."""
  init_info_cls = LograInitInfo
  update_info_cls = LograUpdateInfo
  supports_draft_weight_update = False

  def __init__(self, config, vllm_config, device, model):
    super().__init__(config, vllm_config, device, model)
    self.master = read_checkpoint(self.model_config.model)
    self.spec = {name: tuple(x.shape) for name, x in self.master.items()}
    self.max_bytes = int(os.environ.get('LOGRA_MAX_UPDATE_BYTES')
                         or admission.max_update_bytes(self.spec))
    self.update_dirs = admission.update_dirs()
    self.update_origins = admission.update_origins()
    self.token = os.environ.get('LOGRA_BRIDGE_TOKEN', '')
    self.version = '0'         # the committed version (what the weights are, outside a session)
    self.pending = None        # the session's new_version once an update is applied
    self.refusal = None        # (status, message) of the session's refused update
    self._undo = None          # {name: master value before this session}, None outside one
    self.last_apply_s = None

  def init_transfer_engine(self, init_info: LograInitInfo) -> None:
    del init_info  # nothing to connect: every update names its blob

  def start_weight_update(self) -> None:
    self._undo, self.pending, self.refusal = {}, None, None

  def commit(self) -> str:
    """Keeps the session's updates as version `pending` (the middleware calls it on a finish
    whose weight_version matches)."""
    if self._undo is None or self.pending is None or self.refusal is not None:
      raise RuntimeError('logra: nothing to commit')
    self.version, self.pending, self._undo = self.pending, None, {}
    return self.version

  def finish_weight_update(self) -> None:
    """Ends the session; whatever was not committed is rolled back."""
    self._rollback()
    self._undo, self.pending = None, None

  def shutdown(self) -> None:
    pass

  def status(self) -> dict:
    refusal = None if self.refusal is None else {'status': self.refusal[0],
                                                 'error': self.refusal[1]}
    return {'version': self.version, 'pending': self.pending, 'refusal': refusal,
            'in_session': self._undo is not None, 'last_apply_s': self.last_apply_s}

  def served_tensors(self) -> tuple:
    """({HF name: the served tensor (torch, on its device) or its fp32 master copy (numpy)},
    the names read from the master copy).

    A fused parameter (qkv_proj, gate_up_proj) is split back into its HF tensors by rows, in
    `FUSED_ORDER`, the way `load_weights` stacks them. A tensor whose parameter is not readable
    at its full HF shape (vLLM's CPU backend repacks linear weights for oneDNN and empties the
    parameter; tensor parallelism shards it) is taken from the fp32 master copy, which is what
    the last load put there.
    """
    params = dict(self.model.named_parameters())
    out, from_master = {}, []
    for name, shape in self.spec.items():
      x = _served_slice(params, name, self.spec)
      if x is None or tuple(x.shape) != shape:
        out[name] = self.master[name]
        from_master.append(name)
      else:
        out[name] = x.detach()
    return out, from_master

  def fingerprint(self, k: int) -> dict:
    """The served weights' fingerprint (`fingerprint.py`, float64, computed where each
    tensor lives: only K + 1 numbers a tensor leave the device), version and dtype."""
    tensors, from_master = self.served_tensors()
    dtype = str(self.model_config.dtype).replace('torch.', '')
    fps = {name: _torch_fingerprint(name, x, k) if isinstance(x, torch.Tensor)
           else fingerprint.tensor_fingerprint(name, x, k) for name, x in tensors.items()}
    return {'weight_version': self.version, 'update_in_progress': self._undo is not None,
            'dtype': dtype, 'fingerprint_k': k, 'fingerprint_from_master': len(from_master),
            'fingerprint': fps}

  def drift(self, path: str) -> dict:
    """{'num': Σ‖W_ref − W‖², 'den': Σ‖W_ref‖², 'tensors'} of the fp32 master against the
    reference safetensors file ``path`` (in the update dirs; the sync benchmark's drift)."""
    from safetensors.numpy import load  # pylint: disable=g-import-not-at-top
    ref = load(admission.read_path(path, self.update_dirs, self.max_bytes))
    num = den = 0.0
    for name, want in ref.items():
      want = want.astype(np.float64)
      num += float(np.sum((want - self.master[name]) ** 2))
      den += float(np.sum(want * want))
    return {'num': num, 'den': den, 'tensors': len(ref)}

  def update_weights(self, update_info) -> None:
    """Validates, then applies one blob; a refusal is recorded, never half-applied.

    Every blob of a session applies to the session's base (`version`) and carries the same
    new_version (chunks of one update), as on the JAX engine server.
    """
    try:
      if self._undo is None:
        raise admission.Refused(400, 'update_weights outside a session: call '
                                     '/start_weight_update')
      if self.refusal is not None:
        raise admission.Refused(400, f'this update session already failed '
                                     f'({self.refusal[1]}): finish it without a version')
      info = {k: v for k, v in update_info.items() if v is not None} if isinstance(
          update_info, dict) else update_info
      blob = admission.read_update(info, dirs=self.update_dirs, origins=self.update_origins,
                                   token=self.token, max_bytes=self.max_bytes)
      update = wire.decode(blob, self.spec, self.version, projection)
      admission.check_versions(update.kind, update.base_version, update.new_version,
                               update.tensors, self.spec, self.version)
      if self.pending not in (None, update.new_version):
        raise admission.Refused(400, f'new_version {update.new_version} differs from this '
                                     f"session's {self.pending}")
      self._apply(update)
    except (wire.UpdateError, admission.Refused) as e:
      self._refuse(e.status, str(e))

  def receive_weights(self, update_info: LograUpdateInfo) -> None:
    self.update_weights(dataclasses.asdict(update_info))

  def _apply(self, update) -> None:
    new = wire.apply(self.master, update)
    for name, x in new.items():
      if not np.all(np.isfinite(x)):
        raise admission.Refused(400, f'tensor {name} would become non-finite after the '
                                     'update')
    start = time.perf_counter()
    try:
      self._load(new)
    except Exception as e:  # pylint: disable=broad-except  # layers before it were reloaded
      self._restore(new, e)
    for name in new:
      self._undo.setdefault(name, self.master[name])
    self.master.update(new)
    self.pending = update.new_version
    self.last_apply_s = time.perf_counter() - start
    logger.info('logra: %s update to version %s, %d tensors applied in %.3f s', update.kind,
                self.pending, len(new), self.last_apply_s)

  def _load(self, tensors: dict) -> None:
    """Layerwise reload of the given tensors (whole fused groups, checked by wire.decode)."""
    dtype = self.model_config.dtype
    initialize_layerwise_reload(self.model)
    try:
      self.model.load_weights(
          (name, torch.from_numpy(tensors[name]).to(dtype)) for name in sorted(tensors))
    finally:
      finalize_layerwise_reload(self.model, self.model_config)

  def _restore(self, names, error: Exception) -> None:
    """After a layerwise reload of ``names`` failed part-way (the layers before the failure
    hold the new values): reloads every one of them from the master copy, which the update had
    not touched yet, then refuses the update (500) so the session fails and rolls back."""
    logger.error('logra: the layerwise reload failed (%s); restoring %d tensors', error,
                 len(names))
    try:
      self._load({name: self.master[name] for name in names})
    except Exception as again:
      raise RuntimeError(f'logra: the layerwise reload failed ({error}) and restoring the '
                         f'touched tensors failed too ({again}): the served weights are not '
                         f'version {self.version}; restart this server') from again
    raise admission.Refused(500, f'the layerwise reload failed ({type(error).__name__}: '
                                 f'{error}); every touched tensor was reloaded from the '
                                 'master copy (weights and version unchanged)')

  def _rollback(self) -> None:
    """Reloads the master values of before the session for every tensor it changed."""
    if self._undo:
      self._load(self._undo)
      self.master.update(self._undo)
      self._undo = {}
    self.pending = None

  def _refuse(self, status: int, message: str) -> None:
    """Rolls the session back to its start and records the refusal."""
    logger.warning('logra: update refused (%d): %s', status, message)
    self._rollback()
    self.refusal = (status, message)
