"""RowAdam / SGD sketch transformations, against an independent numpy implementation."""
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from logra_jax import sketch


def numpy_row_adam(sketches, b2=0.95, eps=1e-8):
  """The authors' RowAdam as written (docs/method.md §7), paper layout S^T (D, R), float64."""
  v, outs = None, []
  for t, s in enumerate(sketches, start=1):
    s = np.asarray(s, np.float64).T  # (D, R): one row per output unit
    row = np.mean(s * s, axis=1)
    v = (1 - b2) * row if v is None else b2 * v + (1 - b2) * row
    root = np.sqrt(v / (1 - b2**t))
    denom = root + max(eps * root.mean(), 1e-30)
    scale = np.min(denom) / denom
    scale = scale / np.sqrt(np.mean(scale**2))
    d = scale[:, None] * s
    d *= np.linalg.norm(s) / np.linalg.norm(d)
    outs.append(d.T)
  return outs


def test_row_adam_matches_numpy_and_keeps_the_norm(x64):
  rng = np.random.default_rng(0)
  seq = [rng.normal(size=(4, 6)) * rng.uniform(0.1, 10, size=(1, 6)) for _ in range(5)]
  opt = sketch.scale_by_row_adam()
  state = opt.init(jnp.zeros((4, 6)))
  assert state.nu.shape == (6,)  # one second moment per output unit (column)
  want = numpy_row_adam(seq)
  for s, w in zip(seq, want):
    u, state = opt.update(jnp.asarray(s), state)
    # float64 throughout; the two implementations differ only in operation order.
    np.testing.assert_allclose(u, w, rtol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(u), np.linalg.norm(s), rtol=1e-12)
  assert int(state.count) == 5


def test_row_adam_without_norm_preservation_is_the_plain_row_scaling(x64):
  # preserve_norm=False: D = S / (root + eps·mean root), Adam's scale-free magnitude (a unit
  # whose sketch is steady gets entries of size ~1 whatever the gradient's scale).
  rng = np.random.default_rng(2)
  seq = [rng.normal(size=(4, 6)) * rng.uniform(0.1, 10, size=(1, 6)) for _ in range(3)]
  opt = sketch.scale_by_row_adam(b2=0.9, eps=1e-3, preserve_norm=False)
  state = opt.init(jnp.zeros((4, 6)))
  v = np.zeros(6)
  for t, s in enumerate(seq, start=1):
    u, state = opt.update(jnp.asarray(s), state)
    v = 0.9 * v + 0.1 * np.mean(s * s, axis=0)
    root = np.sqrt(v / (1 - 0.9**t))
    np.testing.assert_allclose(u, s / (root + 1e-3 * root.mean()), rtol=1e-12)
  # Same direction as the norm-preserving version, only the matrix's scale differs.
  kept, _ = sketch.scale_by_row_adam(b2=0.9, eps=1e-3).update(jnp.asarray(seq[0]),
                                                                opt.init(jnp.zeros((4, 6))))
  free, _ = opt.update(jnp.asarray(seq[0]), opt.init(jnp.zeros((4, 6))))
  ratio = np.asarray(kept) / np.asarray(free)
  np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-12)
  assert abs(np.sqrt(np.mean(np.square(free))) - 1) < 0.5  # ≈ unit RMS at step 1


def test_row_adam_stacked_layers_per_matrix_and_zero_sketch(x64):
  rng = np.random.default_rng(1)
  s = rng.normal(size=(3, 4, 6))
  opt = sketch.scale_by_row_adam()
  u, st = opt.update(jnp.asarray(s), opt.init(jnp.asarray(s)))
  assert st.nu.shape == (3, 6)
  for l in range(3):  # each layer's matrix is its own RowAdam problem
    np.testing.assert_allclose(u[l], numpy_row_adam([s[l]])[0], rtol=1e-12)
  z, _ = opt.update(jnp.zeros((4, 6)), opt.init(jnp.zeros((4, 6))))
  assert np.all(np.isfinite(z)) and np.all(z == 0)


def test_row_adam_keeps_dtype_state_fp32_and_no_recompile():
  opt = sketch.logra(1e-2)
  tree = {'a': jnp.ones((2, 3), jnp.bfloat16), 'b': jnp.ones((5,), jnp.bfloat16),
          'c': jnp.ones((), jnp.bfloat16)}
  state = opt.init(tree)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state[0].nu))
  step = jax.jit(opt.update)
  u, state = step(tree, state)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(u))
  n = step._cache_size()
  u, state = step(tree, state)
  assert step._cache_size() == n


def test_sgd_sketch_and_relative_step(x64):
  a = {'w': jnp.asarray(sketch.sample_projection(0, 0, 'w', 2, 5), jnp.float64)}
  w = {'w': jnp.asarray(np.random.default_rng(2).normal(size=(5, 3)))}
  s = {'w': jnp.asarray(np.random.default_rng(3).normal(size=(2, 3)))}
  opt = sketch.logra(1.0, optimizer='sgd', update_ratio=0.01)
  u, _ = opt.update(s, opt.init(s), w, projections=a)
  delta = sketch.expand_update(a['w'], u['w'])
  # ‖Aᵀ U‖ = update_ratio · ‖W‖ by construction, and the direction is −Aᵀ S.
  np.testing.assert_allclose(np.linalg.norm(delta), 0.01 * np.linalg.norm(w['w']), rtol=1e-12)
  cos = np.sum(delta * -(a['w'].T @ s['w'])) / np.linalg.norm(delta) / np.linalg.norm(a['w'].T @ s['w'])
  np.testing.assert_allclose(cos, 1.0, rtol=1e-12)
  with pytest.raises(ValueError, match='projections'):
    opt.update(s, opt.init(s), w)


def test_bad_arguments():
  with pytest.raises(ValueError, match='b2'):
    sketch.scale_by_row_adam(b2=1.0)
  with pytest.raises(ValueError, match='optimizer'):
    sketch.logra(1e-2, optimizer='adamw')


def _optax_contract_module():
  """optax's own contract tests for contrib optimizers, with `logra` as the optimizer under test.

  The installed optax ships `optax/contrib/_common_test.py`; we load its source with the list
  of optimizers under test replaced by ours (its test logic runs unchanged).
  """
  spec = importlib.util.find_spec('optax.contrib._common_test')
  src = open(spec.origin).read()
  start = src.index('_MAIN_OPTIMIZERS_UNDER_TEST = [')
  end = src.index('# Adding here instantiations of wrappers')
  ours = ("_MAIN_OPTIMIZERS_UNDER_TEST = [\n"
          "    {'opt_name': 'logra', 'opt_kwargs': {'learning_rate': 1e-3},\n"
          "     'wrapper_name': None, 'wrapper_kwargs': None}]\n")
  src = src[:start] + ours + src[end:]
  src = re.sub(r'_BASE_OPTIMIZERS = \[.*?\n\]\n', '_BASE_OPTIMIZERS = []\n', src, flags=re.S)
  mod = type(importlib)('optax_contract_for_logra')
  optax.contrib.logra = sketch.logra  # the tests look optimizers up by name in optax.contrib
  exec(compile(src, spec.origin, 'exec'), mod.__dict__)
  return mod


OptaxContractTest = _optax_contract_module().ContribTest


def test_sketch_momentum_is_a_debiased_ema_of_row_adam_updates(x64):
  # optax.ema with debias over D_t = RowAdam(S_1..S_t): e_1 = D_1 and
  # e_2 = (m(1−m) D_1 + (1−m) D_2) / (1 − m²) = (m D_1 + D_2) / (1 + m).
  m = 0.5
  rng = np.random.default_rng(4)
  s1, s2 = rng.normal(size=(3, 5)), rng.normal(size=(3, 5))
  opt = sketch.logra(1.0, momentum=m)
  state = opt.init(jnp.zeros((3, 5)))
  _, state = opt.update(jnp.asarray(s1), state)
  u2, _ = opt.update(jnp.asarray(s2), state)
  d1, d2 = numpy_row_adam([s1, s2])
  np.testing.assert_allclose(u2, -(m * d1 + d2) / (1 + m), rtol=1e-12)

def numpy_sketch_adam(sketches, bases, b2=0.9, eps=1e-3, factored=False):
  """Sketch Adam written out per matrix in float64 (docs/method.md §12): v per entry of S, or
  Adafactor's row/column means with v̂ = r cᵀ / mean(r); at a change of basis each column's
  moments are reset to their mean over the rank axis; D = S / (√(v̂ / (1 − b2ᵗ)) + eps·mean)."""
  v = r = c = None
  outs = []
  for t, (s, basis) in enumerate(zip(sketches, bases), start=1):
    s = np.asarray(s, np.float64)
    if t > 1 and basis != bases[t - 2]:
      if factored:
        r = np.full_like(r, r.mean())
      else:
        v = np.broadcast_to(v.mean(axis=0, keepdims=True), v.shape).copy()
    if factored:
      rs, cs = (s * s).mean(axis=1), (s * s).mean(axis=0)
      r = (1 - b2) * rs if r is None else b2 * r + (1 - b2) * rs
      c = (1 - b2) * cs if c is None else b2 * c + (1 - b2) * cs
      v_hat = np.outer(r, c) / r.mean()
    else:
      v = (1 - b2) * s * s if v is None else b2 * v + (1 - b2) * s * s
      v_hat = v
    root = np.sqrt(v_hat / (1 - b2**t))
    outs.append(s / (root + eps * root.mean()))
  return outs


@pytest.mark.parametrize('factored', [False, True])
def test_sketch_adam_matches_numpy_through_a_change_of_basis(x64, factored):
  rng = np.random.default_rng(5)
  # Rows and columns of very different scales: what the per-entry scaling is for.
  seq = [rng.normal(size=(4, 6)) * rng.uniform(0.1, 10, size=(4, 1))
         * rng.uniform(0.1, 10, size=(1, 6)) for _ in range(6)]
  bases = [0, 0, 0, 3, 3, 5]
  opt = sketch.scale_by_sketch_adam(b2=0.9, eps=1e-3, preserve_norm=False, factored=factored)
  state = opt.init(jnp.zeros((4, 6)))
  shapes = [x.shape for x in jax.tree.leaves(state.nu)]
  assert shapes == ([(4,), (6,)] if factored else [(4, 6)])
  for s, b, want in zip(seq, bases, numpy_sketch_adam(seq, bases, factored=factored)):
    u, state = opt.update(jnp.asarray(s), state, basis=jnp.uint32(b))
    np.testing.assert_allclose(u, want, rtol=1e-12)
  assert int(state.basis) == 5 and int(state.count) == 6
  # Without the reset at a change of basis the updates differ (the check sees the reset).
  stale = numpy_sketch_adam(seq, [0] * 6, factored=factored)
  assert not np.allclose(stale[3], numpy_sketch_adam(seq, bases, factored=factored)[3])


def test_sketch_adam_scales_each_entry_where_row_adam_scales_each_column(x64):
  # A steady sketch with rows of different scales: per-entry scaling evens them out (each
  # entry ~1), RowAdam keeps the rows' ratio; Adafactor's rank-1 v̂ is exact here.
  s = np.outer([1.0, 10.0, 0.1], [1.0, 2.0, 3.0, 4.0])
  seq = [s] * 4
  for factored in (False, True):
    opt = sketch.scale_by_sketch_adam(b2=0.9, eps=0.0, preserve_norm=False, factored=factored)
    state = opt.init(jnp.zeros(s.shape))
    for x in seq:
      u, state = opt.update(jnp.asarray(x), state)
    np.testing.assert_allclose(np.abs(u), 1.0, rtol=1e-12)  # Adam's |m̂/√v̂| = 1 when steady
  row = sketch.scale_by_row_adam(b2=0.9, eps=0.0, preserve_norm=False)
  state = row.init(jnp.zeros(s.shape))
  for x in seq:
    u, state = row.update(jnp.asarray(x), state)
  np.testing.assert_allclose(u[1] / u[0], 10.0, rtol=1e-12)


def test_sketch_adam_norm_layers_state_and_logra_chain(x64):
  rng = np.random.default_rng(6)
  s = rng.normal(size=(3, 4, 6)) * rng.uniform(0.1, 10, size=(3, 4, 1))
  for factored in (False, True):
    opt = sketch.scale_by_sketch_adam(factored=factored)
    u, st = opt.update(jnp.asarray(s), opt.init(jnp.asarray(s)))
    for l in range(3):  # each layer's matrix its own problem, rescaled to its sketch's norm
      want = numpy_sketch_adam([s[l]], [0], b2=0.95, eps=1e-8, factored=factored)[0]
      want = want * np.linalg.norm(s[l]) / np.linalg.norm(want)
      np.testing.assert_allclose(u[l], want, rtol=1e-12)
  # Through sketch.logra with momentum, on a tree with 1-D and scalar leaves (per element).
  tree = {'a': jnp.ones((2, 3), jnp.bfloat16), 'b': jnp.ones((5,), jnp.bfloat16),
          'c': jnp.ones((), jnp.bfloat16)}
  for name in ('adam', 'adafactor'):
    opt = sketch.logra(1e-2, optimizer=name, momentum=0.9)
    state = opt.init(tree)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state[0].nu))
    u, state = jax.jit(opt.update)(tree, state)
    assert all(x.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(x, np.float32)))
               for x in jax.tree.leaves(u))
  with pytest.raises(ValueError, match='b2'):
    sketch.scale_by_sketch_adam(b2=1.0)
