"""The adaptive subspace's pieces in float64: the co-sketch G Bᵀ from the backward (the dense
gradient never formed) and the next A built from it (`sketch.subspace`)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sketch


def _layer_loss(x, w, target, fn):
  return jnp.sum(jnp.tanh(fn(x, w)) * target)


def test_cosketch_is_the_dense_gradient_times_b_transposed(x64):
  rng = np.random.default_rng(0)
  n, k, d, r, r2 = 12, 7, 5, 3, 2
  x, w = rng.normal(size=(2, n // 2, k)), rng.normal(size=(k, d))
  target = rng.normal(size=(2, n // 2, d))
  a, b = rng.normal(size=(r, k)), rng.normal(size=(r2, d))
  dense = jax.grad(lambda w: _layer_loss(x, w, target, lambda x, w: x @ w))(w)  # (K, D)
  probe, coprobe = jnp.zeros((r, d)), jnp.zeros((k, r2))
  s, c = jax.grad(lambda p, cp: _layer_loss(
      x, w, target, lambda x, w: sketch.cosketch_matmul(x, w, a, p, b, cp)),
      argnums=(0, 1))(probe, coprobe)
  np.testing.assert_allclose(s, a @ dense, rtol=1e-12, atol=1e-12)   # the sketch A G
  np.testing.assert_allclose(c, dense @ b.T, rtol=1e-12, atol=1e-12)  # the co-sketch G Bᵀ
  # The input cotangent is the ordinary one.
  dx = jax.grad(lambda x: _layer_loss(x, w, target, lambda x, w: x @ w))(x)
  dx2 = jax.grad(lambda x: _layer_loss(
      x, w, target, lambda x, w: sketch.cosketch_matmul(x, w, a, probe, b, coprobe)))(x)
  np.testing.assert_allclose(dx2, dx, rtol=1e-12)


def test_orthonormal_columns_is_the_polar_factor(x64):
  rng = np.random.default_rng(1)
  # Singular values over 6 decades: the ill-conditioned co-sketch of a nearly rank-1 update.
  u, _ = np.linalg.qr(rng.normal(size=(3, 9, 4)))
  v, _ = np.linalg.qr(rng.normal(size=(3, 4, 4)))
  m = u @ (np.array([1.0, 1e-2, 1e-4, 1e-6])[:, None] * v)
  q = np.asarray(sketch.orthonormal_columns(jnp.asarray(m)))
  for l in range(3):
    np.testing.assert_allclose(q[l].T @ q[l], np.eye(4), atol=1e-12)
    np.testing.assert_allclose(q[l], u[l] @ v[l], atol=1e-10)  # m = U S V: the factor U V
  # In float32 (the trainer's), to float32's precision at 1e-6 relative singular values.
  q32 = np.asarray(sketch.orthonormal_columns(jnp.asarray(m, jnp.float32)), np.float64)
  for l in range(3):
    np.testing.assert_allclose(q32[l].T @ q32[l], np.eye(4), atol=1e-5)


def test_adaptive_projection_spans_the_cosketch_and_keeps_random_rows(x64):
  rng = np.random.default_rng(2)
  k_dim, rank, keep_random = 16, 6, 2
  # A nearly rank-one co-sketch (the RL update's shape): every column along u.
  u = rng.normal(size=k_dim)
  c = np.outer(u, rng.uniform(1, 2, size=rank)) + 1e-9 * rng.normal(size=(k_dim, rank))
  a = np.asarray(sketch.adaptive_projection(jnp.asarray(c), jax.random.key(0), rank,
                                            keep_random, dtype=jnp.float64))
  assert a.shape == (rank, k_dim) and np.all(np.isfinite(a))
  np.testing.assert_allclose(a @ a.T, (k_dim / rank) * np.eye(rank), atol=1e-10)
  # u lies in A's row space, to the jitter (1e-3 of each column's norm).
  rows = a.T / np.sqrt(k_dim / rank)                       # orthonormal columns (K, R)
  assert np.linalg.norm(u - rows @ (rows.T @ u)) < 1e-2 * np.linalg.norm(u)
  # Seeded: the same key gives the same A, another key other random rows.
  again = sketch.adaptive_projection(jnp.asarray(c), jax.random.key(0), rank, keep_random,
                                     dtype=jnp.float64)
  np.testing.assert_array_equal(np.asarray(again), a)
  other = np.asarray(sketch.adaptive_projection(jnp.asarray(c), jax.random.key(1), rank,
                                                keep_random, dtype=jnp.float64))
  assert not np.allclose(other, a)
  # A full-rank co-sketch: A's row space holds C's first R − k columns exactly (no jitter),
  # and k more directions.
  c = rng.normal(size=(k_dim, rank))
  a = np.asarray(sketch.adaptive_projection(jnp.asarray(c), jax.random.key(3), rank,
                                            keep_random, jitter=0.0, dtype=jnp.float64))
  rows = a.T / np.sqrt(k_dim / rank)
  lead = c[:, : rank - keep_random]
  np.testing.assert_allclose(rows @ (rows.T @ lead), lead, atol=1e-10)
  assert np.linalg.norm(c[:, -1] - rows @ (rows.T @ c[:, -1])) > 0.1 * np.linalg.norm(c[:, -1])
  # A zero co-sketch (no moment yet) gives a random orthogonal A, never NaN.
  a = np.asarray(sketch.adaptive_projection(jnp.zeros((k_dim, rank)), jax.random.key(4), rank,
                                            keep_random, dtype=jnp.float64))
  np.testing.assert_allclose(a @ a.T, (k_dim / rank) * np.eye(rank), atol=1e-10)
  with pytest.raises(ValueError, match='random_rows'):
    sketch.adaptive_projection(jnp.asarray(c), jax.random.key(0), rank, rank + 1)


# The step: the refresh's co-sketch through the whole model (scan, micro-batches) in float64.
from test_train_steps import (P, RANK, BUDGET, close, copy, dense_grads, flat,  # noqa: E402,F401
                              loss_config, setup, step_config)
from logra_jax.train import optimizers, steps  # noqa: E402
from logra_jax.train.config import LograSection, OptimSection  # noqa: E402

RANDOM_ROWS = 1


def test_refresh_builds_the_next_a_from_the_gradient_times_the_moment(x64, setup, dense_grads):
  """A refresh step with a known moment m: its co-sketch is G mᵀ of the dense kernel gradient
  (summed over 2 micro-batches), the update is the ordinary step's, and the next A's first
  R − k rows span G mᵀ's first R − k columns, orthogonal, rows of norm √(K/R)."""
  _, model, params, batch, a = setup
  section = OptimSection(logra=LograSection(learning_rate=1e-2, momentum=0.9))
  opt = optimizers.logra_optimizer(section, total_steps=10)
  state = opt.init(sketch.zero_probes(params, a))
  rng = np.random.default_rng(7)
  m = jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s.shape)), sketch.zero_probes(params, a))
  state = (state[0], state[1]._replace(mu=m)) + tuple(state[2:])  # RowAdam, momentum, lr
  assert steps.sketch_momentum_state(state).mu is m
  step_fn, refresh_fn = steps.make_adaptive_logra_step(
      model, loss_config(), opt, step_config(m=2), RANDOM_ROWS)
  args = lambda: (copy(params), copy(state), batch, a, a, np.uint32(0))
  budget = jnp.asarray(BUDGET, jnp.float64)
  p1, s1, m1 = step_fn(*args(), budget, jax.random.key(0))
  p2, s2, m2, a_next = refresh_fn(*args(), np.uint32(3), np.uint32(5), budget,
                                  jax.random.key(0))
  for x, y in zip(jax.tree.leaves((p1, s1, m1)), jax.tree.leaves((p2, s2, m2))):
    close(y, x, rtol=1e-12)  # the refresh's update is the ordinary step's
  _, grads = dense_grads
  g, mm = flat(grads), flat(m)
  for path, an in flat(a_next).items():
    k_dim = an.shape[-1]
    c = np.einsum('lkd,lrd->lkr', g[path], mm[path])    # G mᵀ per layer
    for l in range(an.shape[0]):
      np.testing.assert_allclose(an[l] @ an[l].T, (k_dim / RANK) * np.eye(RANK), atol=1e-9)
      rows = an[l].T / np.sqrt(k_dim / RANK)
      lead = c[l][:, : RANK - RANDOM_ROWS]
      # Spans to the jitter (1e-3 of each column's norm, spread over K directions).
      resid = lead - rows @ (rows.T @ lead)
      assert np.linalg.norm(resid) < 1e-2 * np.linalg.norm(lead), (path, l)
  # A different (seed, t) draws other random rows; a different moment other leading rows.
  *_, a_other = refresh_fn(*args(), np.uint32(4), np.uint32(5), budget, jax.random.key(0))
  assert not all(np.allclose(x, y) for x, y in zip(jax.tree.leaves(a_other),
                                                   jax.tree.leaves(a_next)))


def test_an_adaptive_step_returns_alpha_u_on_the_a_it_applied(x64, setup):
  """With the low-rank payload on, both the step and the refresh also return α·U, and the
  kernels moved by exactly Aᵀ(α·U) with A the one passed in (not the refresh's next A: the
  generators get that one with the next step's blob). α·U travels as float32, so the float64
  kernels' move matches it to float32 rounding (rtol 1e-6); a wrong A or α is off by O(1)."""
  _, model, params, batch, a = setup
  opt = optimizers.logra_optimizer(
      OptimSection(logra=LograSection(learning_rate=1e-2, momentum=0.9)), 10)
  state = opt.init(sketch.zero_probes(params, a))
  step_fn, refresh_fn = steps.make_adaptive_logra_step(
      model, loss_config(), opt, step_config(return_update=True), RANDOM_ROWS)
  args = lambda: (copy(params), copy(state), batch, a, a, np.uint32(0))
  budget = jnp.asarray(BUDGET, jnp.float64)
  stepped = step_fn(*args(), budget, jax.random.key(0))
  refreshed = refresh_fn(*args(), np.uint32(3), np.uint32(5), budget, jax.random.key(0))
  assert len(stepped) == 4 and len(refreshed) == 5
  before, fa = flat(params), flat(a)
  for new_params, applied in ((stepped[0], stepped[-1]), (refreshed[0], refreshed[-1])):
    moved, au = flat(new_params), flat(applied)
    assert set(au) == set(fa)
    for path, u in au.items():
      want = np.einsum('lrk,lrd->lkd', np.asarray(fa[path], np.float64),
                       np.asarray(u, np.float64))
      np.testing.assert_allclose(np.asarray(moved[path]) - np.asarray(before[path]), want,
                                 rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=str(path))


def test_the_trainer_syncs_low_rank_with_an_adaptive_subspace():
  """An adaptive A travels in the payload (`sync.lowrank_blob(..., a_tree=)`): the low-rank
  sync stays on; only the densely trained rest needs full weights."""
  from test_configs import config_dict  # pylint: disable=g-import-not-at-top
  from logra_jax.train import config as config_lib, methods  # pylint: disable=g-import-not-at-top
  sc = lambda **kw: methods._step_config(config_lib.from_config_dict(config_dict(
      rollout__engine='http', rollout__launch=1, **{
          'optim__logra__rest_learning_rate': 0.0, **kw})), 4)
  assert sc().return_update                                   # the low-rank payload
  assert sc(optim__logra__subspace='adaptive').return_update  # with its A
  assert not sc(optim__logra__subspace='adaptive',
                optim__logra__rest_learning_rate=1e-3).return_update  # full weights
