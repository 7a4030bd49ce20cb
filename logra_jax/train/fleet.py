"""The trainer on a fleet of generation servers (`rollout.engine = 'http'`).

`FleetGenerator` is the loop's `Generator` for servers given by `rollout.urls`, or for
`rollout.launch` local JAX-engine servers it starts (and stops) itself from an HF export of the
starting policy. After each step `sync` broadcasts the update: LoGRA's α·U as a low-rank blob
(A rebuilt by every server from the step's seed and the HF names), full weights for the dense
baselines, after a 409, and every `rollout.full_sync_every` steps (the anchor). It logs the
bytes and the time, and every `rollout.drift_check_every` steps the drift of the weights the
generators serve from the trainer's (`generator_drift`, from each server's fingerprint,
`bridge/fingerprint.py`): a server past the tolerance gets full weights (`generator_resyncs`).

A server the client marked down (dead, or not answering) is brought back between steps: a
launched one is relaunched (killed first if it still runs) and a `rollout.urls` one is asked
for /health; either serves again only after full weights of the current version
(`Fleet.rejoin`). Logged per step: `fleet_servers_up`, `fleet_rejoined`.
"""
import os
import secrets
import subprocess
import sys
import tempfile
import time

import jax

from logra_jax.bridge import device_fingerprint, sync
from logra_jax.bridge import fingerprint as fp_lib
from logra_jax.bridge.client import BridgeError, Fleet, ServerClient, Timeouts
from logra_jax.models import hf_io
from logra_jax.train.config import TrainConfig


def server_platform(launch_platform: str = '') -> str:
  """JAX_PLATFORMS for launched servers: ``launch_platform`` (config key
  rollout.launch_platform) or else the trainer's own (its JAX_PLATFORMS, or its backend)."""
  return launch_platform or os.environ.get('JAX_PLATFORMS') or jax.default_backend()


def launch_servers(model_dir: str, n: int, token: str, log_dir: str, pad_id: int = 0,
                   platform: str = ''):
  """Starts ``n`` JAX-engine servers on free 127.0.0.1 ports; returns (urls, processes).

  They run on ``platform`` (JAX_PLATFORMS; '': the trainer's own, `server_platform`).
  """
  procs, files = [], []
  for i in range(n):
    proc, port_file = start_server(i, model_dir, token, log_dir, pad_id, platform)
    procs.append(proc)
    files.append(port_file)
  deadline = time.monotonic() + 300
  while not all(os.path.exists(f) for f in files):
    if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
      stop_servers(procs)
      raise RuntimeError(f'a launched generation server failed to start: see {log_dir}')
    time.sleep(0.2)
  urls = [open(f).read().strip() for f in files]
  for url in urls:
    ServerClient(url, token).wait_healthy()
  return urls, procs


def start_server(i: int, model_dir: str, token: str, log_dir: str, pad_id: int = 0,
                 platform: str = '', log_mode: str = 'w'):
  """Starts server ``i`` (`launch_servers`) without waiting; returns (process, the file its
  URL is written to once it serves). ``log_mode`` 'a': a relaunch keeps the old log."""
  env = dict(os.environ, LOGRA_BRIDGE_TOKEN=token, JAX_PLATFORMS=server_platform(platform),
             XLA_FLAGS='')  # one device each, whatever the trainer simulates
  # On a shared accelerator each JAX process would take 75% of its memory at start: the
  # servers (and the trainer beside them) allocate as they go instead.
  env.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  port_file = os.path.join(log_dir, f'server{i}.url')
  if os.path.exists(port_file):
    os.unlink(port_file)
  log = open(os.path.join(log_dir, f'server{i}.log'), log_mode)
  proc = subprocess.Popen(
      [sys.executable, '-m', 'logra_jax.bridge.serve', f'--model={model_dir}', '--port=0',
       f'--port_file={port_file}', f'--pad_id={pad_id}'], stdout=log, stderr=log, env=env)
  return proc, port_file


def stop_servers(procs):
  for p in procs:
    p.terminate()
  for p in procs:
    try:
      p.wait(timeout=20)
    except subprocess.TimeoutExpired:
      p.kill()


def client_timeouts(rollout) -> Timeouts:
  """The client's `Timeouts` from config keys rollout.*_timeout_s."""
  return Timeouts(connect_s=rollout.connect_timeout_s, health_s=rollout.health_timeout_s,
                  generation_s=rollout.generation_timeout_s,
                  update_s=rollout.update_timeout_s)


class FleetGenerator:
  """A `Generator` over HTTP servers, with the trainer's update broadcast."""

  def __init__(self, cfg: TrainConfig, workdir: str, model_config, params, version: int,
               pad_id: int = 0):
    r = cfg.rollout
    self.cfg, self.config, self._procs = cfg, model_config, []
    self._starting = {}  # index of a relaunched server -> its port file (not serving yet)
    token = os.environ.get('LOGRA_BRIDGE_TOKEN') or (secrets.token_hex(16) if r.launch else '')
    if not token:
      raise ValueError('rollout.urls servers need LOGRA_BRIDGE_TOKEN in the environment')
    urls = [u.strip() for u in r.urls.split(',') if u.strip()]
    if r.launch:
      fleet_dir = os.path.join(workdir, 'fleet')
      os.makedirs(fleet_dir, exist_ok=True)
      model_dir = hf_io.save_hf_checkpoint(tempfile.mkdtemp(dir=fleet_dir, prefix='model-'),
                                           params, model_config)
      urls, self._procs = launch_servers(model_dir, r.launch, token, fleet_dir, pad_id,
                                         r.launch_platform)
      self._relaunch = (model_dir, token, fleet_dir, pad_id, r.launch_platform)
    self.fleet = Fleet(urls, token, blob_dir=r.blob_dir or None, timeouts=client_timeouts(r))
    if r.drift_check_every < 0:
      raise ValueError('config key rollout.drift_check_every must be >= 0 (0: never)')
    self._full_sync(params, version)

  @property
  def weight_version(self) -> int:
    return self.fleet.weight_version

  def generate(self, requests):
    return self.fleet.generate(requests)

  def _full_blob(self, params, version):
    return sync.full_blob(params, self.config, self.fleet.version, version)

  def _full_sync(self, params, version):
    blob = self._full_blob(params, version)
    return self.fleet.push(blob, version, full_blob=lambda: blob)

  def update_weights(self, params, version: int, update=None) -> dict:
    """Sends step ``version``'s update (``update`` = (α·U tree, seed, step, kind[, A tree:
    sent in the blob]), or None for full weights); returns sync metrics, the drift
    included."""
    start = time.perf_counter()
    every = self.cfg.rollout.full_sync_every
    if update is None or (every and version % every == 0):
      stats, kind = self._full_sync(params, version), 1.0
    else:
      u, seed, step, projection_kind, *a = update
      blob = sync.lowrank_blob(u, self.config, seed=seed, step=step, kind=projection_kind,
                               base_version=self.fleet.version, new_version=version,
                               u_dtype=self.cfg.rollout.u_dtype, a_tree=a[0] if a else None)
      stats = self.fleet.push(blob, version, full_blob=lambda: self._full_blob(params, version))
      kind = 0.0
    stats = dict(stats, sync_full=kind, sync_s=time.perf_counter() - start)
    check = self.cfg.rollout.drift_check_every
    if check and version % check == 0:
      stats.update(self.check_drift(params))
    stats.update(self.revive(params))
    return stats

  def revive(self, params) -> dict:
    """Servers marked down that can serve again get full weights of the current version and
    rejoin (`_ready`; never waits for one to start). Returns fleet_servers_up, fleet_rejoined."""
    rejoined, blob = 0, None
    for i in self.fleet.down():
      url = self._ready(i)
      if url is None:
        continue
      if blob is None:
        blob = self._full_blob(params, self.fleet.version)
      rejoined += self.fleet.rejoin(i, blob, url or None)
    return {'fleet_servers_up': float(self.fleet.servers_up),
            'fleet_rejoined': float(rejoined)}

  def _ready(self, i: int):
    """Down server ``i``'s URL once it answers /health ('': its URL is unchanged), else None.
    A launched server is first relaunched (killed if it still runs: it stopped answering)."""
    if not self._procs:
      try:
        self.fleet.servers[i].wait_healthy(timeout_s=0)
        return ''
      except BridgeError:
        return None
    if i not in self._starting:
      if self._procs[i].poll() is None:
        self._procs[i].kill()
        self._procs[i].wait()
      self._procs[i], self._starting[i] = start_server(i, *self._relaunch, log_mode='a')
      return None
    if self._procs[i].poll() is not None:  # died while starting: relaunched next step
      del self._starting[i]
      return None
    if not os.path.exists(self._starting[i]):
      return None
    with open(self._starting[i]) as f:
      url = f.read().strip()
    try:
      ServerClient(url, self.fleet.token, self.fleet.timeouts).wait_healthy(timeout_s=0)
    except BridgeError:
      return None
    del self._starting[i]
    return url

  def check_drift(self, params) -> dict:
    """Compares every server's fingerprint of its served weights with the trainer's ``params``
    and sends full weights to any past the tolerance (or at another version). Returns
    generator_drift (max over servers and tensors, relative), generator_resyncs (servers
    re-synced now) and drift_check_s."""
    start = time.perf_counter()
    infos = self.fleet.weight_infos(fp_lib.K)
    mine = device_fingerprint.params_fingerprint(params, self.config)
    dtype = max({str(x.dtype) for x in jax.tree.leaves(params)}, key=fp_lib.tolerance)
    drifts, stale = [], []
    for i, info in enumerate(infos):
      if info is None:  # down: full weights when it rejoins (`revive`)
        continue
      drift, _ = fp_lib.drift(mine, info.get('fingerprint') or {})
      drifts.append(drift)
      if (drift > fp_lib.tolerance(dtype, info.get('dtype', 'bfloat16'))
          or str(info.get('weight_version')) != str(self.fleet.version)):
        stale.append(i)
    if stale:
      self.fleet.resync(stale, self._full_blob(params, self.fleet.version))
    return {'generator_drift': max(drifts, default=float('nan')),
            'generator_resyncs': float(len(stale)),
            'drift_check_s': time.perf_counter() - start}

  def close(self):
    self.fleet.close()
    stop_servers(self._procs)
