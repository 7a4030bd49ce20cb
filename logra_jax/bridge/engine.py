"""The embedded JAX engine behind the bridge routes: sampling, pause/resume, weight transfer.

Weights live on device as an fp32 master tree in our layout (`device_apply`); the served params
are that tree (cast per leaf to the dtype the engine was given, when it is not float32). The
sampler reads an immutable snapshot (params + version) taken when a request starts; an update
session stages new leaves for the touched tensors only (copy-on-write: a served buffer is never
written or donated) and `finish` swaps them in at once, so a completion's reported version is
always the one that produced it and no request ever sees half an update. The compiled sampler
is shared by every version (same shapes and dtypes: no retrace).

Lifecycle (vLLM's): pause → start → update (repeatable) → finish(version) → resume. A refused
update marks the session failed; `finish` without a version then discards it. A session may
carry a key (the client's `X-Logra-Session` header, fresh per push): a start with another key
while a session is open discards that one (a trainer that died mid-update leaves it open; the
next trainer's start ends it: staged copy dropped, served weights and version unchanged), and
a call naming a key that is not the open session's is refused (409).
"""
import dataclasses
import threading
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from logra_jax.bridge import admission, device_apply, device_fingerprint, wire
from logra_jax.bridge import fingerprint as fp_lib
from logra_jax.models.config import ModelConfig
from logra_jax.rl.types import GenerationRequest, GenerationResult
from logra_jax.sketch import projection
from logra_jax.models.generator import JaxGenerator

PAUSE_MODES = ('abort', 'wait', 'keep')
PAUSE_TIMEOUT_S = 300.0  # the longest a request waits out a pause, or a pause in-flight work


def _sharding(x):
  return x.sharding if isinstance(x, jax.Array) else jax.sharding.SingleDeviceSharding(
      jax.devices()[0])


class EngineError(Exception):
  """A refused call: HTTP ``status`` and a message."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass
class _Session:
  master: dict  # {path: fp32 leaf}: the served leaves, replaced by staged ones when touched
  owned: set = dataclasses.field(default_factory=set)  # staged paths (safe to donate)
  new_version: Optional[str] = None
  failed: Optional[str] = None
  key: Optional[str] = None  # the client's session key (None: a keyless client)


class JaxEngine:
  """Thread-safe generation + weight transfer over one model's params."""

  def __init__(self, config: ModelConfig, params, pad_id: int = 0, version: str = '0',
               pause_timeout_s: float = PAUSE_TIMEOUT_S):
    """``pause_timeout_s``: a request arriving while paused waits at most this long for
    `resume` (then 503: a trainer that paused and died hangs no client); `pause` waits at most
    this long for the in-flight requests (then 503, and the pause is undone)."""
    self.config, self.pad_id = config, pad_id
    self.pause_timeout_s = pause_timeout_s
    flat = traverse_util.flatten_dict(params)
    self._dtypes = {p: jnp.dtype(v.dtype) for p, v in flat.items()}
    # A copy (the caller's params may be donated later: the trainer's step does), committed
    # to its device like every leaf an update makes, so the sampler never retraces.
    self._master = {p: jax.device_put(jnp.array(v, jnp.float32, copy=True), _sharding(v))
                    for p, v in flat.items()}
    self._slots = device_apply.slots(config)
    self.spec = {n: self._hf_shape(s) for n, s in self._slots.items()}
    self._version = version
    self._gen, self._served = self._generator(self._master, set(self._master), None, version)
    self._hf_cache = (None, None)
    self._xfer = threading.Lock()  # serialises start / update / finish
    self.timings: dict = {}
    self._cond = threading.Condition()
    self._paused, self._in_flight, self._abort_epoch = False, 0, 0
    self._session: Optional[_Session] = None
    self.sessions_superseded = 0  # open sessions a start with another key discarded
    self.transfer_info: dict = {}

  # --- state ------------------------------------------------------------------------------
  @property
  def weight_version(self) -> str:
    return self._version

  def info(self) -> dict:
    with self._cond:
      return {'weight_version': self._version, 'paused': self._paused,
              'update_in_progress': self._session is not None, 'num_tensors': len(self.spec),
              'sessions_superseded': self.sessions_superseded,
              'last_update': dict(self.timings)}

  def fingerprint(self, k: int = fp_lib.K) -> dict:
    """The served weights' fingerprint (`fingerprint.py`), their version and dtype, from one
    snapshot (an update committing meanwhile is not seen half-way)."""
    if not 1 <= k <= 64:
      raise EngineError(400, f'fingerprint must be an integer in [1, 64], got {k}')
    with self._cond:
      served, version = self._served, self._version
      in_session = self._session is not None
    dtypes = {jnp.dtype(v.dtype).name for v in served.values()}
    return {'weight_version': version, 'update_in_progress': in_session,
            'dtype': max(dtypes, key=lambda d: fp_lib.tolerance(d)), 'fingerprint_k': k,
            'fingerprint': device_fingerprint.params_fingerprint(served, self.config, k)}

  @property
  def params(self):
    """The served params tree, what the sampler runs on (do not modify or donate it)."""
    with self._cond:
      return self._gen.params

  def master_weights(self) -> dict:
    """The served fp32 weights {HF name: numpy (out, in)}, copied to the host on first call
    per version (a snapshot; do not modify)."""
    with self._cond:
      master = self._master
    cached_master, views = self._hf_cache
    if cached_master is not master:
      views = device_apply.hf_views(master, self.config)
      self._hf_cache = (master, views)
    return views

  def _hf_shape(self, s) -> tuple:
    shape = tuple(self._master[s.path].shape[1:] if s.layer is not None
                  else self._master[s.path].shape)
    return tuple(reversed(shape)) if s.transpose else shape

  def _generator(self, master, touched, previous, version) -> tuple:
    """(sampler, its flat params) over ``master`` in the served dtypes (the casts of leaves
    not ``touched`` are reused from ``previous``)."""
    flat = {}
    for p, leaf in master.items():
      if self._dtypes[p] == jnp.float32:
        flat[p] = leaf
      elif p in touched or previous is None:
        flat[p] = leaf.astype(self._dtypes[p])
      else:
        flat[p] = previous[p]
    gen = JaxGenerator(self.config, traverse_util.unflatten_dict(flat), version=int(version),
                       pad_id=self.pad_id)
    return gen, flat

  # --- generation -------------------------------------------------------------------------
  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    with self._cond:
      if not self._cond.wait_for(lambda: not self._paused, timeout=self.pause_timeout_s):
        raise EngineError(503, f'generation has been paused for more than '
                               f'{self.pause_timeout_s:g} s (a weight update with no /resume '
                               'yet): try again later')
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
      was_paused, self._paused = self._paused, True
      if mode == 'abort':
        self._abort_epoch += 1
      if mode != 'keep' and not self._cond.wait_for(lambda: self._in_flight == 0,
                                                    timeout=self.pause_timeout_s):
        self._paused = was_paused
        self._cond.notify_all()
        raise EngineError(503, f'pause(mode={mode}): {self._in_flight} requests still in '
                               f'flight after {self.pause_timeout_s:g} s; not paused (use '
                               'mode=keep to pause without waiting)')

  def resume(self):
    with self._cond:
      self._paused = False
      self._cond.notify_all()

  # --- weight transfer --------------------------------------------------------------------
  def init_transfer(self, init_info: dict):
    self.transfer_info = dict(init_info or {})

  def start_update(self, key: Optional[str] = None):
    """Opens a session (``key``: the client's, or None). An open session with another key is
    discarded first: no call of it is running (``_xfer`` is held), so it is one its client
    left (a trainer that died between start and finish); its staged leaves are dropped, the
    served weights and version stay. Without a key an open session is an error (400)."""
    with self._xfer, self._cond:
      if not self._paused:
        raise EngineError(400, 'call /pause before /start_weight_update')
      if self._session is not None:
        if key is None or self._session.key == key:
          raise EngineError(400, 'a weight update is already in progress: finish it first')
        self.sessions_superseded += 1
      self._session = _Session(dict(self._master), key=key)

  def _own(self, session: Optional[_Session], key: Optional[str], route: str) -> _Session:
    """``session`` if a keyed call may act on it, else 400 (none open) / 409 (another's)."""
    if session is None:
      raise EngineError(400, f'call /start_weight_update before {route}')
    if key is not None and session.key != key:
      raise EngineError(409, f'{route}: this update session was superseded by another '
                             '/start_weight_update (another client started an update)')
    return session

  def check_session(self, key: Optional[str], route: str):
    """Raises (`_own`) unless a call with ``key`` may act on the open session."""
    self._own(self._session, key, route)

  def update(self, blob: bytes, key: Optional[str] = None):
    """Validates ``blob`` fully, then applies it to the staged leaves (never to served ones)."""
    with self._xfer:
      session = self._own(self._session, key, '/update_weights')
      if session.failed:
        raise EngineError(400, f'this update session already failed ({session.failed}): '
                               'finish it without a version')
      try:
        start = time.perf_counter()
        upd = wire.parse(blob, self.spec, self._version)
        admission.check_versions(upd.kind, upd.base_version, upd.new_version,
                                 upd.tensors or upd.factors, self.spec, self._version)
        if session.new_version not in (None, upd.new_version):
          raise wire.UpdateError(400, f'new_version {upd.new_version} differs from this '
                                      f"session's {session.new_version}")
        self.timings = {'kind': upd.kind, 'parse_s': time.perf_counter() - start}
        new = self._stage(session, upd)
      except (wire.UpdateError, admission.Refused) as e:
        session.failed = str(e)
        raise EngineError(e.status, str(e)) from None
      except BaseException:
        session.failed = 'the update failed while it was applied to the staged copy'
        raise
      session.master.update(new)
      session.owned |= set(new)
      session.new_version = upd.new_version

  def _stage(self, session: _Session, upd: wire.Update) -> dict:
    """{path: new staged leaf}; raises UpdateError before returning anything unchecked."""
    start = time.perf_counter()
    if upd.kind == 'full':
      new = device_apply.apply_full(session.master, session.owned, upd.tensors, self._slots)
      jax.block_until_ready(new)
      self.timings['apply_s'] = time.perf_counter() - start
      return new
    groups = device_apply.lowrank_groups(upd, self._slots)
    d_in = {n: self.spec[n][1] for n in upd.factors}
    try:
      a_list = device_apply.draw_projections(upd, groups, d_in)
    except ValueError as e:
      wire.refuse_rebuild(groups[0].names[0], e)
    host = jax.device_get(a_list)  # the A's the engine applies, checked against A_sha256
    wire.check_projections(upd, {n: a[i] for g, a in zip(groups, host)
                                 for i, n in enumerate(g.names)}, projection)
    self.timings['draw_s'] = time.perf_counter() - start
    # Staged leaves this session made are donated; served ones are only read.
    new, flags = device_apply.apply_lowrank(session.master, session.owned, upd, groups, a_list)
    for g, ok in zip(groups, flags):
      for n, finite in zip(g.names, ok):
        if not finite:
          raise wire.UpdateError(400, f'tensor {n} would become non-finite after the update '
                                      '(U @ A or W + U @ A is not finite)')
    self.timings['apply_s'] = time.perf_counter() - start - self.timings['draw_s']
    return new

  def finish_update(self, weight_version: Optional[str] = None,
                    key: Optional[str] = None) -> str:
    """Commits the staged weights as ``weight_version``; without one, discards them."""
    with self._xfer:
      with self._cond:
        session = self._session
        if session is None:
          if weight_version is not None and str(weight_version) == self._version:
            return self._version  # a repeated finish of a commit that landed: idempotent
          raise EngineError(400, 'no weight update in progress')
        self._own(session, key, '/finish_weight_update')
        self._session = None
      if weight_version is None:
        return self._version
      if session.failed or session.new_version is None:
        raise EngineError(400, 'nothing to commit: '
                               + (session.failed or 'no update was received'))
      if str(weight_version) != session.new_version:
        raise EngineError(400, f'weight_version {weight_version!r} differs from the updates\' '
                               f'new_version {session.new_version}')
      start = time.perf_counter()
      gen, served = self._generator(session.master, session.owned, self._served,
                                    session.new_version)
      with self._cond:
        self._master, self._version = session.master, session.new_version
        self._gen, self._served = gen, served
        self._hf_cache = (None, None)  # the host copy of the old version, if any, goes
      self.timings['commit_s'] = time.perf_counter() - start
      return self._version
