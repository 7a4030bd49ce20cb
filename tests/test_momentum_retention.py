"""`experiments/momentum_retention.py`'s arithmetic against explicit float64 references: the
share of the sketch momentum's dense form Z = A_old⁺ m that a change of A keeps
(‖P_new Z‖² / ‖Z‖², P_new = A_new⁺ A_new), and the energy of Z's leading singular directions.
The whole-run reading (a refresh checkpoint of an adaptive run) is tested in
tests/test_probe_from_checkpoint.py."""
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                'experiments'))
import momentum_retention as mr  # noqa: E402  pylint: disable=g-import-not-at-top

R, K, D = 6, 20, 9


def explicit(m, a_old, a_new, top_j):
  """The reference: Z and the projector formed densely, pinv and SVD in float64."""
  z = np.linalg.pinv(a_old) @ m
  kept = np.linalg.pinv(a_new) @ a_new @ z
  s = np.linalg.svd(z, compute_uv=False)
  return {'energy': np.sum(z * z), 'kept': np.sum(kept * kept),
          'top_j': {j: np.sum(s[:j] ** 2) for j in top_j}}


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_retention_is_the_projection_of_the_dense_moment(seed):
  """Gaussian A (not orthogonal rows, so Γ = A Aᵀ matters) and a moment of full rank."""
  rng = np.random.default_rng(seed)
  m, a_old, a_new = rng.normal(size=(R, D)), rng.normal(size=(R, K)), rng.normal(size=(R, K))
  got, want = mr.retention(m, a_old, a_new, (1, 3)), explicit(m, a_old, a_new, (1, 3))
  # float64 throughout, R × R Gram matrices with condition numbers below 1e3: 1e-10 relative
  # holds with a wide margin over the rounding (~1e-13).
  np.testing.assert_allclose(got['energy'], want['energy'], rtol=1e-10)
  np.testing.assert_allclose(got['kept'], want['kept'], rtol=1e-10)
  for j in (1, 3):
    np.testing.assert_allclose(got['top_j'][j], want['top_j'][j], rtol=1e-10)
  assert got['random'] == pytest.approx(want['energy'] * R / K, rel=1e-10)
  assert 0 < got['kept'] < got['energy']


def test_an_unchanged_subspace_keeps_everything_and_its_complement_nothing():
  rng = np.random.default_rng(3)
  m, a_old = rng.normal(size=(R, D)), rng.normal(size=(R, K))
  mixed = rng.normal(size=(R, R)) @ a_old  # the same row space in another basis
  same = mr.retention(m, a_old, mixed)
  assert same['kept'] == pytest.approx(same['energy'], rel=1e-10)
  q, _ = np.linalg.qr(np.concatenate([a_old.T, rng.normal(size=(K, R))], axis=1))
  orthogonal = mr.retention(m, a_old, q[:, R:].T)  # rows orthogonal to A_old's row space
  assert abs(orthogonal['kept']) < 1e-10 * orthogonal['energy']
  shares = mr.shares(same)
  assert shares['kept'] == pytest.approx(1.0) and shares['random'] == pytest.approx(R / K)


def test_a_stack_of_matrices_sums_over_them():
  rng = np.random.default_rng(4)
  m, a_old, a_new = (rng.normal(size=(3,) + s) for s in ((R, D), (R, K), (R, K)))
  got = mr.retention(m, a_old, a_new, (2,))
  parts = [mr.retention(*x, (2,)) for x in zip(m, a_old, a_new)]
  for k in ('energy', 'kept', 'random'):
    assert got[k] == pytest.approx(sum(p[k] for p in parts), rel=1e-12)
  assert got['top_j'][2] == pytest.approx(sum(p['top_j'][2] for p in parts), rel=1e-12)


@pytest.mark.parametrize('seed', [0, 1])
def test_subspace_share_is_the_projection_onto_a_row_space(seed):
  rng = np.random.default_rng(10 + seed)
  x, a = rng.normal(size=(2, K, D)), rng.normal(size=(2, R, K))
  got = mr.subspace_share(x, a, 3)
  energy = in_sub = top = 0.0
  for xx, aa in zip(x, a):
    p = np.linalg.pinv(aa) @ aa @ xx
    s = np.linalg.svd(xx, compute_uv=False)
    energy, in_sub, top = energy + np.sum(xx * xx), in_sub + np.sum(p * p), top + np.sum(s[:3] ** 2)
  np.testing.assert_allclose([got['energy'], got['in_subspace'], got['top']],
                             [energy, in_sub, top], rtol=1e-10)
  assert got['random'] == pytest.approx(energy * R / K, rel=1e-12)


def test_overlap_of_row_spaces():
  rng = np.random.default_rng(5)
  a, b = rng.normal(size=(R, K)), rng.normal(size=(R + 2, K))
  p = lambda m: np.linalg.pinv(m) @ m
  assert mr.overlap(a, b) == pytest.approx(np.trace(p(a) @ p(b)) / R, rel=1e-10)
  assert mr.overlap(a, rng.normal(size=(R, R)) @ a) == pytest.approx(1.0, rel=1e-10)
  q, _ = np.linalg.qr(np.concatenate([a.T, rng.normal(size=(K, R))], axis=1))
  assert abs(mr.overlap(a, q[:, R:].T)) < 1e-10


def test_adam_moments_of_is_the_step_optax_took_last():
  """m̂/(√v̂ + ε) from the state after t updates is optax.adam's t-th update (lr 1, negated)."""
  import optax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(6)
  params = {'w': np.zeros((3, 4), np.float32)}
  opt = optax.chain(optax.clip_by_global_norm(1.0), optax.scale_by_adam(0.9, 0.95))
  state = opt.init(params)
  for _ in range(3):
    update, state = opt.update({'w': rng.normal(size=(3, 4)).astype(np.float32)}, state)
  mu, step = mr.adam_moments_of({'opt_state': state}, 0.9, 0.95)
  # optax's fp32 arithmetic (a few roundings, ~5e-7) against float64 from the same moments.
  np.testing.assert_allclose(step['w'], np.asarray(update['w']), rtol=1e-5)
  np.testing.assert_array_equal(mu['w'], np.asarray(state[1].mu['w']))


def test_gain_split_adds_up_and_projects_as_pinv():
  """⟨g, D⟩ on the kernels splits into ⟨g, P_A D⟩ (P_A = A⁺A, explicit pinv) and the rest of
  it; leaves without an A count as the rest."""
  rng = np.random.default_rng(7)
  a = {'k': rng.normal(size=(2, R, K))}
  g = {'k': rng.normal(size=(2, K, D)), 'emb': rng.normal(size=(5,))}
  d = {'k': rng.normal(size=(2, K, D)), 'emb': rng.normal(size=(5,))}
  got = mr.gain_split(g, d, a)
  inside = sum(np.sum(gg * (np.linalg.pinv(aa) @ aa @ dd))
               for gg, aa, dd in zip(g['k'], a['k'], d['k']))
  np.testing.assert_allclose(got['inside'], inside, rtol=1e-10)
  np.testing.assert_allclose(got['kernels'], np.sum(g['k'] * d['k']), rtol=1e-12)
  np.testing.assert_allclose(got['outside'], got['kernels'] - inside, rtol=1e-8)
  np.testing.assert_allclose(got['rest'], np.sum(g['emb'] * d['emb']), rtol=1e-12)
  assert got['per_kernel']['k']['inside'] == got['inside']


@pytest.mark.parametrize('with_rest', [False, True])
def test_refresh_retention_finds_the_momentum_with_or_without_a_trained_rest(with_rest):
  """A run without a trained rest has the sketch optimizer's state alone (a chain's tuple);
  with one, the pair (sketch state, rest state): the momentum is found in either."""
  from logra_jax import sketch  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(8)
  m, a_old, a_new = rng.normal(size=(R, D)), rng.normal(size=(R, K)), rng.normal(size=(R, K))
  chain = (optax.EmptyState(), sketch.SketchMomentumState(np.int32(3), {'k': m}, np.uint32(0)))
  opt_state = (chain, optax.EmptyState()) if with_rest else chain
  got = mr.refresh_retention({'opt_state': opt_state, 'projections': {'k': a_new},
                              'prev_projections': {'k': a_old}})
  want = mr.shares(mr.retention(m, a_old, a_new))
  assert got['kept'] == pytest.approx(want['kept'], rel=1e-12)
  assert set(got['kernels']) == {'k'}
