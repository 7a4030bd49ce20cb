r"""Generator sync cost: bytes on the wire and wall time per update, low-rank vs full weights.

  python experiments/sync_bench.py [--model=<.gguf | HF dir | preset>] [--rank=32] [--updates=5]

Part 1 (computed, no allocation): bytes of one update for the paper's shapes at rank 256 —
full weights in bf16 (what the paper's generators received) and fp32, against low-rank U in
each wire dtype (sketched projections only; embeddings, norms and the head do not move).
Part 2 (measured, end to end over HTTP on 127.0.0.1): the embedded JAX engine serving
``--model`` (default: the packaged SmolLM2-135M), one full update and ``--updates`` low-rank
updates through the fleet client, with the relative error each U dtype adds to U @ A. Last
line: one JSON object.
"""
import json
import statistics
import time

import jax
import numpy as np
from absl import app, flags

from logra_jax.bridge import sync, wire
from logra_jax.bridge.client import Fleet
from logra_jax.bridge.engine import JaxEngine
from logra_jax.bridge.server import BridgeServer
from logra_jax.models import api, get_preset
from logra_jax.models.gguf_io import packaged_smollm2_gguf
from logra_jax.sketch import projection

_MODEL = flags.DEFINE_string('model', None, 'Model to serve (default: packaged SmolLM2).')
_RANK = flags.DEFINE_integer('rank', 32, 'Rank of the measured low-rank updates.')
_UPDATES = flags.DEFINE_integer('updates', 5, 'Low-rank updates to time.')
PAPER = {'1.5b': 'qwen2.5-math-1.5b', '7b': 'qwen2.5-math-7b', '27b': 'qwen2.5-32b'}
U_BYTES = {'fp32': 4, 'bf16': 2, 'fp8-e4m3': 1, 'int4': 0.5}


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


def measure(model_path: str, rank: int, updates: int) -> dict:
  model = api.load(model_path)
  engine = JaxEngine(model.config, model.params)
  server = BridgeServer(engine, 'bench').start()
  fleet = Fleet([server.url], 'bench')
  try:
    t0 = time.perf_counter()
    full = sync.full_blob(model.params, model.config, 0, 1)
    encode_full = time.perf_counter() - t0
    t0 = time.perf_counter()
    fleet.push(full, 1, full_blob=lambda: full)
    full_s = time.perf_counter() - t0
    low_s, low_bytes, enc_s = [], [], []
    names = [n for n in engine.spec if wire.is_projection_weight(n)]
    for t in range(2, 2 + updates):
      rng = np.random.default_rng(t)
      factors = {n: (1e-4 * rng.normal(size=(engine.spec[n][0], rank))).astype(np.float32)
                 for n in names}
      t0 = time.perf_counter()
      blob = wire.encode_lowrank(factors, {n: engine.spec[n][1] for n in names}, seed=0,
                                 step=t, kind='rademacher', base_version=t - 1, new_version=t,
                                 projection=projection)
      enc_s.append(time.perf_counter() - t0)
      t0 = time.perf_counter()
      fleet.push(blob, t, full_blob=lambda: full)
      low_s.append(time.perf_counter() - t0)
      low_bytes.append(len(blob))
  finally:
    fleet.close()
    server.shutdown()
  return {'full_bytes': len(full), 'full_push_s': full_s, 'full_encode_s': encode_full,
          'lowrank_bytes': low_bytes[0], 'lowrank_push_s': statistics.median(low_s),
          'lowrank_encode_s': statistics.median(enc_s),
          'lowrank_over_full_bytes': low_bytes[0] / len(full),
          'lowrank_over_full_push_time': statistics.median(low_s) / full_s}


def main(argv):
  del argv
  plan = {k: planned_bytes(get_preset(v), 256) for k, v in PAPER.items()}
  for k, p in plan.items():
    print(f'{k:>5} rank 256: full bf16 {p["full_bf16"] / 2**30:7.2f} GiB, low-rank fp32 '
          f'{p["lowrank_fp32"] / 2**20:8.1f} MiB ({100 * p["lowrank_fp32_over_full_bf16"]:.2f}%'
          f'), bf16 {p["lowrank_bf16"] / 2**20:8.1f} MiB, int4 {p["lowrank_int4"] / 2**20:7.1f} MiB')
  err = quantization_error(_RANK.value)
  print('relative error U dtype adds to U @ A:', {k: f'{v:.1e}' for k, v in err.items()})
  measured = measure(_MODEL.value or str(packaged_smollm2_gguf()), _RANK.value, _UPDATES.value)
  print(f'measured ({_MODEL.value or "SmolLM2-135M"}, JAX engine over HTTP): full '
        f'{measured["full_bytes"] / 2**20:.1f} MiB in {measured["full_push_s"]:.2f} s; low-rank '
        f'rank {_RANK.value} {measured["lowrank_bytes"] / 2**20:.2f} MiB in '
        f'{measured["lowrank_push_s"]:.2f} s (median of {_UPDATES.value})')
  print(json.dumps({'plan': plan, 'quantization_error': err, 'measured': measured}))


if __name__ == '__main__':
  app.run(main)
