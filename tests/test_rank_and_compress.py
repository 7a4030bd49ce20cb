"""Rank control, per-module ranks, the sparse mask and the randomized-SVD compressor."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from logra_jax import sketch
from logra_jax.analysis.tiny_lm import TinyLM, init_params


def test_dynamic_rank_and_heuristic():
  # r_t = 32 + ceil(96·tanh(t/1000)): t=0 → 32; t=1000 → 32 + ceil(73.11) = 106.
  assert sketch.dynamic_rank(0, 32, 96, 1000) == 32
  assert sketch.dynamic_rank(1000, 32, 96, 1000) == 32 + math.ceil(96 * math.tanh(1.0)) == 106
  assert sketch.dynamic_rank(10**6, 32, 96, 1000, max_rank=100) == 100
  assert sketch.heuristic_rank(4096) == 10  # ceil(0.15·64) = ceil(9.6)
  assert sketch.heuristic_rank(10**6) == 64


def test_per_module_ranks_and_rank_change_keeps_row_adam_state():
  model = TinyLM(d=8, f=16)
  tokens = jnp.zeros((1, 4), jnp.int32)
  params = init_params(model, jax.random.key(0), tokens)
  rules = sketch.RankRules(rules=((r'(q|k|v|o)_proj', 2),
                                  (r'(gate|up|down)_proj', 5)), default=1)
  a = traverse_util.flatten_dict(sketch.make_projections(params, 0, 0, rules))
  ranks = {'/'.join(k[1:2]): v.shape[1] for k, v in a.items()}
  assert ranks == {'q_proj': 2, 'k_proj': 2, 'v_proj': 2, 'o_proj': 2,
                   'gate_proj': 5, 'up_proj': 5, 'down_proj': 5}
  # A rank change leaves the per-output-unit RowAdam state valid.
  opt = sketch.scale_by_row_adam()
  s3 = jnp.ones((3, 16))
  state = opt.init(s3)
  _, state = opt.update(s3, state)
  u, state = opt.update(jnp.ones((7, 16)), state)
  assert u.shape == (7, 16) and state.nu.shape == (16,)
  # The moments carry over by value: mean_j S_ij² = 1 at both ranks, so with β2 = 0.95
  # v_1 = 0.05 and v_2 = 0.95·0.05 + 0.05 = 0.0975 per output unit; the count goes on.
  np.testing.assert_allclose(state.nu, np.full(16, 0.0975), rtol=1e-6)
  assert int(state.count) == 2
  with pytest.raises(ValueError, match='rank'):
    sketch.RankRules(rules=(('x', 0),))


def test_sparse_mask_is_unbiased(x64):
  s = jnp.asarray(np.random.default_rng(0).normal(size=(3, 10)))
  masked = jax.vmap(lambda k: sketch.sparse_mask_sketch(s, k, 0.3))(
      jax.random.split(jax.random.key(0), 20000))
  one = masked[0]
  zero_cols = np.all(one == 0, axis=0)
  assert 0 < zero_cols.sum() < 10  # whole output units are dropped
  np.testing.assert_allclose(one[:, ~zero_cols], s[:, ~zero_cols] / 0.7)
  # Each entry's mean over n draws has std |s|·sqrt(p/(1−p)/n); 6 std bounds every entry.
  bound = 6 * np.abs(s) * np.sqrt(0.3 / 0.7 / 20000)
  assert np.all(np.abs(masked.mean(0) - s) < bound)


def test_randomized_svd_is_the_best_rank_r_approximation(x64):
  rng = np.random.default_rng(0)
  g = rng.normal(size=(20, 6)) @ np.diag([10, 5, 3, 1, 0.5, 0.1]) @ rng.normal(size=(6, 15))
  left, s, right = sketch.randomized_svd_compress(jnp.asarray(g), 3, jax.random.key(0),
                                                  oversample=6)
  u, sv, vt = np.linalg.svd(g, full_matrices=False)
  best = (u[:, :3] * sv[:3]) @ vt[:3]
  # rank(G) = 6 = range-finder width, so the range is captured exactly (float64 SVD rounding).
  np.testing.assert_allclose(sketch.low_rank_reconstruct(left, s, right), best, atol=1e-10)
  np.testing.assert_allclose(s, sv[:3], rtol=1e-12)


def test_apply_sketch_updates_only_touches_kernels_and_jits_donated(x64):
  model = TinyLM()
  params = init_params(model, jax.random.key(0), jnp.zeros((1, 3), jnp.int32))
  a = sketch.make_projections(params, 0, 1, 2, dtype=jnp.float64)
  u = jax.tree.map(jnp.ones_like, sketch.zero_probes(params, a))
  new = jax.jit(sketch.apply_sketch_updates, donate_argnums=0)(
      jax.tree.map(jnp.copy, params), u, a, 0.5)
  flat_new, flat_old = traverse_util.flatten_dict(new), traverse_util.flatten_dict(params)
  flat_a, flat_u = traverse_util.flatten_dict(a), traverse_util.flatten_dict(u)
  for path, w in flat_old.items():
    if path in flat_a:
      want = w + 0.5 * np.einsum('lrk,lrd->lkd', flat_a[path], flat_u[path])
      np.testing.assert_allclose(flat_new[path], want, atol=1e-12)
    else:
      np.testing.assert_array_equal(flat_new[path], w)
