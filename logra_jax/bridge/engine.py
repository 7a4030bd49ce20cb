"""The embedded JAX engine behind the bridge routes: sampling, pause/resume, weight transfer.

Weights live as an fp32 master copy keyed by HF tensor name (`hf_io.hf_tensors`); the sampler
reads an immutable snapshot (params + version) taken when a request starts, and an update
session stages a new copy that `finish` swaps in at once, so a completion's reported version is
always the one that produced it and no request ever sees half an update.

Lifecycle (vLLM's): pause → start → update (repeatable) → finish(version) → resume. A refused
update marks the session failed; `finish` without a version then discards it.
"""
import dataclasses
import threading
from typing import Optional, Sequence

import jax
import numpy as np

from logra_jax.bridge import wire
from logra_jax.models import hf_io
from logra_jax.models.config import ModelConfig
from logra_jax.rl.types import GenerationRequest, GenerationResult
from logra_jax.sketch import projection
from logra_jax.train.rollout import JaxGenerator

PAUSE_MODES = ('abort', 'wait', 'keep')


class EngineError(Exception):
  """A refused call: HTTP ``status`` and a message."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass
class _Session:
  master: dict
  new_version: Optional[str] = None
  failed: Optional[str] = None


class JaxEngine:
  """Thread-safe generation + weight transfer over one model's params."""

  def __init__(self, config: ModelConfig, params, pad_id: int = 0, version: str = '0'):
    self.config, self.pad_id = config, pad_id
    self._master = {k: np.asarray(v, np.float32) for k, v in hf_io.hf_tensors(params,
                                                                               config).items()}
    self.spec = {k: v.shape for k, v in self._master.items()}
    self._gen = JaxGenerator(config, params, version=int(version), pad_id=pad_id)
    self._version = version
    self._cond = threading.Condition()
    self._paused, self._in_flight, self._abort_epoch = False, 0, 0
    self._session: Optional[_Session] = None
    self.transfer_info: dict = {}

  # --- state ------------------------------------------------------------------------------
  @property
  def weight_version(self) -> str:
    return self._version

  def info(self) -> dict:
    with self._cond:
      return {'weight_version': self._version, 'paused': self._paused,
              'update_in_progress': self._session is not None, 'num_tensors': len(self.spec)}

  def master_weights(self) -> dict:
    """The served weights {HF name: float32 array} (a snapshot; do not modify)."""
    return self._master

  # --- generation -------------------------------------------------------------------------
  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    with self._cond:
      self._cond.wait_for(lambda: not self._paused)
      self._in_flight += 1
      gen, epoch = self._gen, self._abort_epoch
    try:
      results = gen.generate(requests)
    finally:
      with self._cond:
        self._in_flight -= 1
        aborted = epoch != self._abort_epoch
        self._cond.notify_all()
    if aborted:
      return [dataclasses.replace(r, completion_token_ids=(), behaviour_logprobs=(),
                                  finish_reason='abort') for r in results]
    return results

  # --- pause / resume ---------------------------------------------------------------------
  def pause(self, mode: str = 'abort'):
    """abort: in-flight results are dropped ('abort'); wait: they finish first; keep: they
    finish on the weights they started with. New requests wait for `resume` in every mode."""
    if mode not in PAUSE_MODES:
      raise EngineError(400, f'pause mode must be one of {PAUSE_MODES}, got {mode!r}')
    with self._cond:
      self._paused = True
      if mode == 'abort':
        self._abort_epoch += 1
      if mode != 'keep':
        self._cond.wait_for(lambda: self._in_flight == 0)

  def resume(self):
    with self._cond:
      self._paused = False
      self._cond.notify_all()

  # --- weight transfer --------------------------------------------------------------------
  def init_transfer(self, init_info: dict):
    self.transfer_info = dict(init_info or {})

  def start_update(self):
    with self._cond:
      if not self._paused:
        raise EngineError(400, 'call /pause before /start_weight_update')
      if self._session is not None:
        raise EngineError(400, 'a weight update is already in progress: finish it first')
      self._session = _Session(dict(self._master))

  def update(self, blob: bytes):
    """Validates ``blob`` fully, then applies it to the staged copy (never to served weights)."""
    with self._cond:
      session = self._session
      if session is None:
        raise EngineError(400, 'call /start_weight_update before /update_weights')
      if session.failed:
        raise EngineError(400, f'this update session already failed ({session.failed}): '
                               'finish it without a version')
      try:
        upd = wire.decode(blob, self.spec, self._version, projection)
        if session.new_version not in (None, upd.new_version):
          raise wire.UpdateError(400, f'new_version {upd.new_version} differs from this '
                                      f"session's {session.new_version}")
      except wire.UpdateError as e:
        session.failed = str(e)
        raise EngineError(e.status, str(e)) from None
      session.master.update(wire.apply(session.master, upd))
      session.new_version = upd.new_version

  def finish_update(self, weight_version: Optional[str] = None) -> str:
    """Commits the staged weights as ``weight_version``; without one, discards them."""
    with self._cond:
      session, self._session = self._session, None
      if session is None:
        raise EngineError(400, 'no weight update in progress')
      if weight_version is None:
        return self._version
      if session.failed or session.new_version is None:
        raise EngineError(400, 'nothing to commit: '
                               + (session.failed or 'no update was received'))
      if str(weight_version) != session.new_version:
        raise EngineError(400, f'weight_version {weight_version!r} differs from the updates\' '
                               f'new_version {session.new_version}')
      self._commit(session.master, session.new_version)
      return self._version

  def _commit(self, master: dict, version: str):
    get = lambda name: master[name]
    params = hf_io.params_from_hf_tensors(get, set(master), self.config,
                                          dtype=self.config.param_dtype)
    params = jax.tree.map(jax.numpy.asarray, params)
    self._master, self._version = master, version
    self._gen = JaxGenerator(self.config, params, version=int(version), pad_id=self.pad_id)

