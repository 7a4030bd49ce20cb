r"""Generator sync cost: bytes on the wire and wall time per update, low-rank vs full weights.

  python experiments/sync_bench.py [--model=<.gguf | HF dir>] [--rank=32] [--updates=5] \
      [--drift_updates=100] [--vllm=true]

Part 1 (computed, no allocation): bytes of one update for the paper's shapes at rank 256 —
full weights in bf16 (what the paper's generators received) and fp32, against low-rank U in
each wire dtype (sketched projections only; embeddings, norms and the head do not move) —
and the relative error each U dtype adds to U @ A.
Part 2 (measured, end to end over HTTP on 127.0.0.1, ``--model``, default the packaged
SmolLM2-135M in fp32): the embedded JAX engine and a real vLLM server
(`third_party/vllm/serve`, its own environment, stopped by its process id) each receive
``--updates`` full and ``--updates`` low-rank updates through the trainer's fleet client
(pause → start → update → finish → resume); medians of the bytes, the wall time per update
and the server's own phases: on vLLM its apply (`logra_status.last_apply_s`), on the JAX
engine read / parse / draw / apply / commit (`/weight_info` `last_update`); the client's write
of the blob file is timed apart (``write_s``).
Part 3 (drift): ``--drift_updates`` low-rank updates without a full-weight anchor go to both
servers at once while a stand-in trainer applies the same steps as LoGRA does (kernel layout,
XLA fp32: K ← K + Aᵀ U); then ‖W_trainer − W_generator‖ / ‖W_trainer‖ on each server.
Last line: one JSON object.
"""
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from safetensors.numpy import save_file

from logra_jax.bridge import sync, wire
from logra_jax.bridge.client import Fleet, ServerClient
from logra_jax.bridge.engine import JaxEngine
from logra_jax.bridge.server import BridgeServer
from logra_jax.models import api, get_preset, hf_io
from logra_jax.models.gguf_io import packaged_smollm2_gguf
from logra_jax.sketch import projection

_MODEL = flags.DEFINE_string('model', None, 'Model to serve (default: packaged SmolLM2).')
_RANK = flags.DEFINE_integer('rank', 32, 'Rank of the measured low-rank updates.')
_UPDATES = flags.DEFINE_integer('updates', 5, 'Updates of each kind to time (medians).')
_DRIFT = flags.DEFINE_integer('drift_updates', 100, 'Low-rank updates before the drift.')
_VLLM = flags.DEFINE_bool('vllm', True, 'Also measure a real vLLM server (.venv-vllm).')
_JAX = flags.DEFINE_bool('jax_engine', True, 'Also measure the JAX engine server.')
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = {'1.5b': 'qwen2.5-math-1.5b', '7b': 'qwen2.5-math-7b', '27b': 'qwen2.5-32b'}
U_BYTES = {'fp32': 4, 'bf16': 2, 'fp8-e4m3': 1, 'int4': 0.5}
TOKEN = 'sync-bench'
REL_STEP = 1e-3  # ‖U @ A‖ / ‖W‖ of one update, per matrix (a LoGRA step's size)


def planned_bytes(config, rank: int) -> dict:
  """Bytes of a full update (bf16, fp32) and of a low-rank one per U dtype (+ row scales)."""
  shapes = sync.hf_shapes(config)
  total = sum(int(np.prod(s)) for s in shapes.values())
  proj = [s for n, s in shapes.items() if wire.is_projection_weight(n)]
  rows = sum(s[0] for s in proj)
  out = {'full_bf16': 2 * total, 'full_fp32': 4 * total}
  for dt, b in U_BYTES.items():
    out[f'lowrank_{dt}'] = int(rows * rank * b + (4 * rows if dt in ('fp8-e4m3', 'int4') else 0))
  out['lowrank_fp32_over_full_bf16'] = out['lowrank_fp32'] / out['full_bf16']
  out['lowrank_bf16_over_full_bf16'] = out['lowrank_bf16'] / out['full_bf16']
  return out


def quantization_error(rank: int) -> dict:
  """‖U A − Q(U) A‖ / ‖U A‖ for a Gaussian U (d_out 576, d_in 576) and a Rademacher A."""
  rng = np.random.default_rng(0)
  u = rng.normal(size=(576, rank)).astype(np.float32)
  a = projection.sample_projection(0, 0, 'w', rank, 576)
  out = {}
  for dt in wire.U_DTYPES:
    q = wire.quantize_u(u, dt)
    d = wire.dequantize_u(q[''], q.get('.scale'), dt, rank)
    out[dt] = float(np.linalg.norm((u - d) @ a) / np.linalg.norm(u @ a))
  return out


# --- servers --------------------------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def start_vllm(hf_dir: str, workdir: str):
  """(url, process) of `third_party/vllm/serve` on 127.0.0.1 (its own process group)."""
  port = _free_port()
  log = open(os.path.join(workdir, 'vllm.log'), 'wb')
  proc = subprocess.Popen(
      [os.path.join(REPO, 'third_party', 'vllm', 'serve'), f'--model={hf_dir}',
       '--host=127.0.0.1', f'--port={port}', f'--token={TOKEN}', f'--workdir={workdir}'],
      stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
  url = f'http://127.0.0.1:{port}'
  try:
    ServerClient(url, TOKEN).wait_healthy(900)
  except Exception:
    stop(proc)
    raise RuntimeError(f'vLLM did not start: see {workdir}/vllm.log') from None
  return url, proc


def stop(proc):
  """Stops a server started by `start_vllm` by its process (group) id."""
  os.killpg(proc.pid, signal.SIGTERM)
  try:
    proc.wait(60)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _vllm_status(url: str) -> dict:
  return ServerClient(url, TOKEN).call('POST', '/collective_rpc',
                                       {'method': 'logra_status'})['results'][0]


# --- measurements ---------------------------------------------------------------------------


def _factors(weights: dict, names, rank: int, rng) -> dict:
  """U (d_out, r) with ‖U @ A‖ ≈ REL_STEP ‖W‖ (A's rows have E[AᵀA] = I)."""
  return {n: (REL_STEP * np.sqrt(np.mean(weights[n] ** 2))
              * rng.standard_normal((weights[n].shape[0], rank))).astype(np.float32)
          for n in names}


def _lowrank(weights, names, rank, t, rng):
  factors = _factors(weights, names, rank, rng)
  blob = wire.encode_lowrank(factors, {n: weights[n].shape[1] for n in names}, seed=0, step=t,
                             kind='rademacher', base_version=t - 1, new_version=t,
                             projection=projection)
  return factors, blob


def write_s(blob: bytes) -> float:
  """Seconds to write ``blob`` where the fleet client puts it (part of every push)."""
  directory = '/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir()
  fd, path = tempfile.mkstemp(prefix='sync-bench-', dir=directory)
  try:
    start = time.perf_counter()
    with os.fdopen(fd, 'wb') as f:
      f.write(blob)
    return time.perf_counter() - start
  finally:
    os.unlink(path)


def time_updates(url: str, weights: dict, rank: int, updates: int, apply_s=None,
                 phases=None, names=None) -> dict:
  """Medians over ``updates`` full and ``updates`` low-rank pushes to one server.

  ``weights``: every tensor of the model (a full update holds them all, or is refused);
  ``names``: the projection weights the low-rank updates touch (default: all of them).

  ``apply_s()``: seconds the server's engine spent applying its last update (vLLM);
  ``phases()``: {phase: seconds} of it (the JAX engine); both recorded per kind as
  ``<kind>_<phase>``. ``<kind>_write_s`` is the client writing the blob file.
  """
  fleet = Fleet([url], TOKEN)
  version = int(ServerClient(url, TOKEN).call('GET', '/weight_info')['weight_version'])
  fleet.version = version
  names = names or [n for n in weights if wire.is_projection_weight(n)]
  rng = np.random.default_rng(0)
  out = {}
  try:
    for kind in ('full', 'lowrank'):
      for _ in range(updates):
        version += 1
        if kind == 'full':
          blob = wire.encode_full(weights, version - 1, version)
        else:
          blob = _lowrank(weights, names, rank, version, rng)[1]
        out.setdefault(f'{kind}_write_s', []).append(write_s(blob))
        start = time.perf_counter()
        fleet.push(blob, version, full_blob=lambda: None)
        out.setdefault(f'{kind}_s', []).append(time.perf_counter() - start)
        out.setdefault(f'{kind}_bytes', []).append(len(blob))
        got = dict(phases() if phases is not None else {})
        if apply_s is not None:
          got['apply_s'] = apply_s()
        for phase, seconds in got.items():
          out.setdefault(f'{kind}_{phase}', []).append(seconds)
  finally:
    fleet.close()
  return {k: statistics.median(v) for k, v in out.items() if v}


def jax_phases(url: str) -> dict:
  """The JAX engine's last update: read (the blob file), parse (validation without A), draw
  (A on device, checksums), apply (W + U @ A on device, or the full tensors), commit (swap);
  ``engine_s`` is their sum without the read: validation, apply and commit."""
  info = ServerClient(url, TOKEN).call('GET', '/weight_info')['last_update']
  out = {f'{k}': float(v) for k, v in info.items() if k.endswith('_s')}
  out['engine_s'] = sum(v for k, v in out.items() if k != 'read_s')
  return out


def _rel(a: dict, b: dict) -> float:
  """‖a − b‖ / ‖a‖ over the tensors of ``a``, in float64."""
  num = sum(np.sum((a[k].astype(np.float64) - b[k]) ** 2) for k in a)
  return float(np.sqrt(num / sum(np.sum(a[k].astype(np.float64) ** 2) for k in a)))


def vllm_drift(url: str, trainer: dict) -> float:
  """‖W_trainer − W_vLLM‖ / ‖W_trainer‖ of the logra engine's fp32 master (`logra_drift`)."""
  path = os.path.join('/dev/shm' if os.path.isdir('/dev/shm') else tempfile.gettempdir(),
                      f'logra-drift-{os.getpid()}.safetensors')
  save_file(trainer, path)
  try:
    r = ServerClient(url, TOKEN).call('POST', '/collective_rpc',
                                      {'method': 'logra_drift', 'args': [path]})['results'][0]
  finally:
    os.unlink(path)
  return float(np.sqrt(r['num'] / r['den']))


def measure_drift(urls: list, readers: dict, weights: dict, rank: int, n: int,
                  names=None) -> dict:
  """``n`` low-rank updates of ``weights``' projections (``names``, default all) to every
  server while the trainer's kernels take the same steps; {reader name: its drift over those
  tensors, 'moved_rel', 'updates'}.

  ``readers``: {name: f(trainer weights {HF name: array}) -> relative drift}.
  """
  names = names or [k for k in weights if wire.is_projection_weight(k)]
  kernels = {k: jnp.asarray(weights[k].T) for k in names}
  step = jax.jit(lambda k, a, u: k + jnp.einsum('rk,rd->kd', a, u))
  fleet = Fleet(urls, TOKEN)
  fleet.version = base = max(int(ServerClient(u, TOKEN).call('GET', '/weight_info')[
      'weight_version']) for u in urls)
  rng = np.random.default_rng(1)
  try:
    for t in range(base + 1, base + n + 1):
      factors, blob = _lowrank(weights, names, rank, t, rng)
      fleet.push(blob, t, full_blob=lambda: None)
      for k, u in factors.items():
        a = projection.sample_projection(0, t, k, rank, weights[k].shape[1], 'rademacher')
        kernels[k] = step(kernels[k], jnp.asarray(a), jnp.asarray(u.T))
  finally:
    fleet.close()
  trainer = {k: np.ascontiguousarray(np.asarray(v).T) for k, v in kernels.items()}
  out = {'updates': n, 'moved_rel': _rel({k: weights[k] for k in names}, trainer)}
  out.update({name: read(trainer) for name, read in readers.items()})
  return out


def reset(urls: list, weights: dict):
  """Full weights ``weights`` (every tensor of the model: a full update holds them all) on
  every server, one version past the newest."""
  version = max(int(ServerClient(u, TOKEN).call('GET', '/weight_info')['weight_version'])
                for u in urls) + 1
  fleet = Fleet(urls, TOKEN)
  try:
    fleet.push(wire.encode_full(weights, version - 1, version), version, full_blob=lambda: None)
  finally:
    fleet.close()


# --- the run --------------------------------------------------------------------------------


def print_plan(plan: dict, err: dict):
  for k, p in plan.items():
    print(f'{k:>5} rank 256: full bf16 {p["full_bf16"] / 2**30:7.2f} GiB, low-rank fp32 '
          f'{p["lowrank_fp32"] / 2**20:8.1f} MiB ({100 * p["lowrank_fp32_over_full_bf16"]:.2f}%'
          f'), bf16 {p["lowrank_bf16"] / 2**20:8.1f} MiB, int4 {p["lowrank_int4"] / 2**20:7.1f} MiB')
  print('relative error U dtype adds to U @ A:', {k: f'{v:.1e}' for k, v in err.items()})


def print_measured(name: str, m: dict, rank: int, updates: int):
  print(f'{name}: full {m["full_bytes"] / 2**20:.1f} MiB in {m["full_s"]:.2f} s; low-rank rank '
        f'{rank} {m["lowrank_bytes"] / 2**20:.2f} MiB in {m["lowrank_s"]:.2f} s (medians of '
        f'{updates}, end to end)')
  for kind in ('full', 'lowrank'):
    parts = {k[len(kind) + 1:]: v for k, v in m.items() if k.startswith(kind + '_')
             and k.endswith('_s') and k != f'{kind}_s'}
    print(f'  {kind} phases: ' + ', '.join(f'{k} {v:.3f} s' for k, v in sorted(parts.items())))


def _applied(m: dict) -> str:
  """The server's own apply figure: the JAX engine's validate + apply + commit, vLLM's reload
  (its `last_apply_s`; it validates before that)."""
  return 'engine_s' if 'full_engine_s' in m else 'apply_s'


def main(argv):
  del argv
  plan = {k: planned_bytes(get_preset(v), 256) for k, v in PAPER.items()}
  err = quantization_error(_RANK.value)
  print_plan(plan, err)
  work = tempfile.mkdtemp(prefix='sync-bench-')
  model = api.load(_MODEL.value or str(packaged_smollm2_gguf()))
  hf_dir = model.save(os.path.join(work, 'hf'))
  weights = {k: np.asarray(v, np.float32) for k, v in
             hf_io.hf_tensors(model.params, model.config).items()}
  proc, vllm_url, measured = None, None, {}
  try:
    if _VLLM.value:
      vllm_url, proc = start_vllm(hf_dir, work)
    urls, readers, server = [], {}, None
    timed = _UPDATES.value > 0
    if _JAX.value:
      engine = JaxEngine(model.config, model.params)
      server = BridgeServer(engine, TOKEN).start()
      if timed:
        measured['jax_engine'] = time_updates(server.url, weights, _RANK.value, _UPDATES.value,
                                              phases=lambda: jax_phases(server.url))
        print_measured('JAX engine over HTTP', measured['jax_engine'], _RANK.value,
                       _UPDATES.value)
      urls.append(server.url)
      readers['jax_engine'] = lambda trainer: _rel(trainer, engine.master_weights())
    del model  # the servers hold the weights
    if _VLLM.value and timed:
      measured['vllm'] = time_updates(vllm_url, weights, _RANK.value, _UPDATES.value,
                                      apply_s=lambda: _vllm_status(vllm_url)['last_apply_s'])
      print_measured('vLLM (logra engine) over HTTP', measured['vllm'], _RANK.value,
                     _UPDATES.value)
    if vllm_url:
      urls.append(vllm_url)
    if timed:
      reset(urls, weights)  # back to the checkpoint's weights everywhere, then the drift run
    if vllm_url:
      readers['vllm'] = lambda trainer: vllm_drift(vllm_url, trainer)
    drift = measure_drift(urls, readers, weights, _RANK.value, _DRIFT.value)
    print(f'drift after {drift["updates"]} low-rank updates (no anchor; the weights moved '
          f'{drift["moved_rel"]:.2e} relative):'
          + (f' JAX engine {drift["jax_engine"]:.2e}' if 'jax_engine' in drift else '')
          + (f', vLLM {drift["vllm"]:.2e}' if 'vllm' in drift else ''))
    if server is not None:
      server.shutdown()
  finally:
    if proc is not None:
      stop(proc)
  for m in measured.values():
    m['lowrank_over_full_bytes'] = m['lowrank_bytes'] / m['full_bytes']
    m['lowrank_over_full_time'] = m['lowrank_s'] / m['full_s']
  goals = {'lowrank_fp32_le_10pct_full_bf16_at_7b': plan['7b']['lowrank_fp32_over_full_bf16']
           <= 0.10,
           'lowrank_apply_not_slower_than_full': all(
               m[f'lowrank_{_applied(m)}'] <= m[f'full_{_applied(m)}']
               for m in measured.values()),
           'lowrank_push_not_slower_than_full': all(
               m['lowrank_s'] <= m['full_s'] for m in measured.values()),
           'drift_le_1e-5': all(v <= 1e-5 for k, v in drift.items()
                                if k in ('jax_engine', 'vllm'))}
  print(json.dumps({'plan': plan, 'quantization_error': err, 'measured': measured,
                    'drift': drift, 'goals': goals, 'python': sys.version.split()[0]}))


if __name__ == '__main__':
  app.run(main)
