"""Where the dense backward's time goes on XLA:CPU (docs/benchmarks.md).

  python experiments/backward_cost.py [--layers=4] [--hlo=OUT.txt]

SmolLM2-135M dimensions, vocabulary cut to 512 (the head negligible), batch 16 x 128, fp32:
process CPU time (robust to a loaded machine) of the forward, the gradient of all params and
the gradient of the RMSNorm scales only (the activations' backward, no weight gradient), and
the weight-gradient part's GFLOP/s. --hlo writes the compiled gradient's HLO text.
"""
import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params

B, L, V = 16, 128, 512


def cpu_median(fn, args, reps):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.process_time()
    jax.block_until_ready(fn(*args))
    times.append(time.process_time() - start)
  return float(np.median(times))


def main():
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--reps', type=int, default=5)
  p.add_argument('--hlo', default='')
  args = p.parse_args()
  mc = get_preset('smollm2-135m', vocab_size=V, num_layers=args.layers, dtype='float32')
  model, params = Transformer(mc), init_params(mc, jax.random.key(0))
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, V, (B, L)), jnp.int32)
  loss = lambda prm: jnp.mean(jax.nn.log_softmax(model.apply({'params': prm}, tokens)[0])[..., 0])
  flat = traverse_util.flatten_dict(params)
  scales = {k: v for k, v in flat.items() if k[-1] == 'scale'}
  rest = {k: v for k, v in flat.items() if k[-1] != 'scale'}
  join = lambda r, s: traverse_util.unflatten_dict({**r, **s})
  grad_all = jax.jit(jax.grad(loss))
  fns = {'forward': (jax.jit(loss), (params,)), 'grad_all': (grad_all, (params,)),
         'grad_scales_only': (jax.jit(lambda r, s: jax.grad(lambda s: loss(join(r, s)))(s)),
                              (rest, scales))}
  med = {k: cpu_median(f, a, args.reps) for k, (f, a) in fns.items()}
  d, f, kv = mc.hidden_size, mc.intermediate_size, mc.num_kv_heads * mc.head_dim
  gflop = 2 * B * L * args.layers * (2 * d * d + 2 * d * kv + 3 * d * f) / 1e9
  weight = med['grad_all'] - med['grad_scales_only']
  print({k: round(v, 3) for k, v in med.items()},
        f'weight-gradient part {weight:.3f} CPU-s for {gflop:.1f} GFLOP: {gflop / weight:.1f} '
        f'GFLOP/s (forward matmuls: {gflop / med["forward"]:.1f})')
  if args.hlo:
    with open(args.hlo, 'w') as out:
      out.write(grad_all.lower(params).compile().as_text())


if __name__ == '__main__':
  main()
