"""Temp memory and time of the LoGRA apply on bf16 kernels: nearest vs stochastic rounding.

A Qwen2.5-7B gate/up kernel (K, D) = (3584, 18944), rank 256, one device: XLA's compiled
temp for the 28 stacked layers (abstract inputs, nothing allocated), and the median wall time
per layer over 3 timed calls on 2 real layers (about 0.3 GB of inputs).

  python experiments/apply_rounding_cost.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from logra_jax.sketch.update import apply_sketch_updates

K, D, R, LAYERS = 3584, 18944, 256, 28
MODES = ('nearest', 'stochastic')


def apply_fn(rounding):
  def f(params, a, u, key):
    return apply_sketch_updates(params, u, a, 1e-3, key=key if rounding == 'stochastic' else None)
  return jax.jit(f, donate_argnums=(0,))


def abstract_inputs(layers):
  s = jax.ShapeDtypeStruct
  tree = lambda shape, dtype: {'w': {'kernel': s(shape, dtype)}}
  return (tree((layers, K, D), jnp.bfloat16), tree((layers, R, K), jnp.bfloat16),
          tree((layers, R, D), jnp.float32), jax.eval_shape(lambda: jax.random.key(0)))


def real_inputs(layers):
  rng = np.random.default_rng(0)
  tree = lambda x, dtype: {'w': {'kernel': jnp.asarray(x, dtype)}}
  return (tree(rng.normal(0, 0.02, (layers, K, D)), jnp.bfloat16),
          tree(rng.choice([-1.0, 1.0], (layers, R, K)) / np.sqrt(R), jnp.bfloat16),
          tree(rng.normal(0, 1e-4, (layers, R, D)), jnp.float32))


def seconds_per_layer(fn, layers=2, calls=4):
  params, a, u = real_inputs(layers)
  times = []
  for i in range(calls):
    p = jax.block_until_ready(jax.tree.map(jnp.array, params))  # a fresh donated copy
    t0 = time.perf_counter()
    jax.block_until_ready(fn(p, a, u, jax.random.key(i)))
    times.append(time.perf_counter() - t0)
  return float(np.median(times[1:])) / layers


def main(_):
  for mode in MODES:
    m = apply_fn(mode).lower(*abstract_inputs(LAYERS)).compile().memory_analysis()
    print(f'{mode:10s} {LAYERS} layers: argument {m.argument_size_in_bytes / 2**30:.3f} GiB, '
          f'temp {m.temp_size_in_bytes / 2**20:.1f} MiB')
  for mode in MODES:
    print(f'{mode:10s} time per layer: {seconds_per_layer(apply_fn(mode)) * 1e3:.0f} ms')


if __name__ == '__main__':
  app.run(main)
