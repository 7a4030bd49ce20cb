"""Sketch-space momentum carried across redraws of A (`sketch.momentum`), in float64.

The transfer m ← A_new A_old⁺ m against numpy's pseudo-inverse; the identity when A does not
change; the EMA against a numpy reference through a change of basis; the errors.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sketch

R, K, D = 3, 7, 5


def rademacher(rng, shape):
  return rng.choice([-1.0, 1.0], size=shape) / np.sqrt(shape[-2])


def test_transfer_is_a_new_times_the_pseudo_inverse_of_a_old(x64):
  """M m = A_new pinv(A_old) m (numpy's SVD pseudo-inverse), per matrix and per stacked layer.

  Tolerance: both sides are O(1) products of O(1) entries; the solve's error is
  cond(A_old A_oldᵀ) · 1e-16 with cond < 1e2 here, so 1e-12 relative leaves 4 digits."""
  rng = np.random.default_rng(0)
  a_old = {'w': rademacher(rng, (R, K)), 'stack': rademacher(rng, (2, R, K))}
  a_new = {'w': rademacher(rng, (R, K)), 'stack': rademacher(rng, (2, R, K))}
  mu = {'w': rng.normal(size=(R, D)), 'stack': rng.normal(size=(2, R, D))}
  got = sketch.transfer_moments(jax.tree.map(jnp.asarray, mu),
                                sketch.basis_transfer(a_new, a_old))
  want = {'w': a_new['w'] @ np.linalg.pinv(a_old['w']) @ mu['w'],
          'stack': np.stack([a_new['stack'][i] @ np.linalg.pinv(a_old['stack'][i])
                             @ mu['stack'][i] for i in range(2)])}
  for k in want:
    assert got[k].dtype == jnp.float64
    np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-12 * np.abs(want[k]).max())


def test_transfer_is_the_identity_when_a_does_not_change(x64):
  rng = np.random.default_rng(1)
  a = {'w': rademacher(rng, (R, K))}
  m = sketch.basis_transfer(a, a)['w']
  np.testing.assert_allclose(m, np.eye(R), atol=1e-13)


def test_transfer_keeps_the_component_in_the_old_row_space():
  """Sketching a dense G by A_old, then transferring, equals sketching G's projection onto
  A_old's row space by A_new: m = A_old G ↦ A_new P_old G (float32 inputs, fp32 math; 1e-5
  relative is ~ 50 ulp of the O(1) results after a K-term product and a solve)."""
  rng = np.random.default_rng(2)
  a_old, a_new = rademacher(rng, (R, K)), rademacher(rng, (R, K))
  g = rng.normal(size=(K, D))
  p_old = np.linalg.pinv(a_old) @ a_old
  m = sketch.transfer_moments({'w': jnp.asarray(a_old @ g, jnp.float32)},
                              sketch.basis_transfer({'w': jnp.asarray(a_new, jnp.float32)},
                                                    {'w': jnp.asarray(a_old, jnp.float32)}))
  np.testing.assert_allclose(m['w'], a_new @ p_old @ g, rtol=1e-5,
                             atol=1e-5 * np.abs(a_new @ p_old @ g).max())


def numpy_momentum(updates, bases, changes, decay):
  """The reference: mu ← M mu when the basis changes (after the first step), then the
  debiased EMA."""
  mu, basis, outs = np.zeros_like(updates[0]), None, []
  for t, (u, b) in enumerate(zip(updates, bases), start=1):
    if basis is not None and b != basis:
      mu = changes[(b, basis)] @ mu
    basis = b
    mu = decay * mu + (1 - decay) * u
    outs.append(mu / (1 - decay**t))
  return outs


def test_momentum_through_a_change_of_basis_matches_numpy(x64):
  rng = np.random.default_rng(3)
  decay = 0.8
  a = {b: rademacher(rng, (R, K)) for b in (0, 3)}
  changes = {(3, 0): a[3] @ np.linalg.pinv(a[0])}
  bases = [0, 0, 0, 3, 3]
  updates = [rng.normal(size=(R, D)) for _ in bases]
  opt = sketch.scale_by_sketch_momentum(decay)
  state = opt.init(jnp.zeros((R, D)))
  want = numpy_momentum(updates, bases, changes, decay)
  calls = []

  def change(old):
    calls.append(old)  # traced: the transfer is built under lax.cond
    return sketch.basis_transfer(a[3], a[0])

  for u, b, w in zip(updates, bases, want):
    out, state = opt.update(jnp.asarray(u), state, basis=np.uint32(b), basis_change=change)
    np.testing.assert_allclose(out, w, rtol=1e-12, atol=1e-12)
    assert int(state.basis) == b
  assert calls  # the change was traced (and taken only at step 4: the comparison above)


def test_momentum_without_a_basis_is_a_plain_debiased_ema(x64):
  rng = np.random.default_rng(5)
  decay = 0.6
  updates = [rng.normal(size=(R, D)) for _ in range(4)]
  opt = sketch.scale_by_sketch_momentum(decay)
  state = opt.init(jnp.zeros((R, D)))
  for u, w in zip(updates, numpy_momentum(updates, [0] * 4, {}, decay)):
    out, state = opt.update(jnp.asarray(u), state)
    np.testing.assert_allclose(out, w, rtol=1e-12)


def test_a_basis_without_its_change_and_a_bad_decay_are_errors():
  opt = sketch.scale_by_sketch_momentum(0.9)
  state = opt.init(jnp.zeros((R, D)))
  with pytest.raises(ValueError, match='basis given without basis_change'):
    opt.update(jnp.ones((R, D)), state, basis=np.uint32(1))
  with pytest.raises(ValueError, match=r'must be in \[0, 1\)'):
    sketch.scale_by_sketch_momentum(1.0)


def test_transfer_at_the_tiny_config_shape_calls_no_lapack_and_inverts_the_gram():
  """R = 64 of K = 128 Rademacher rows over 3 stacked layers, fp32 as the trainer runs it.

  No custom call in the compiled program: jaxlib's CPU LAPACK kernels deadlocked a run when
  XLA ran several solves at once. And M A_old = A_new P_old exactly in exact arithmetic, so
  M A_old A_oldᵀ = A_new A_oldᵀ: checked to 1e-5 of its scale (fp32 eps 6e-8 times κ ≈ 34
  and a 128-term sum)."""
  rng = np.random.default_rng(7)
  a_old = {'w': jnp.asarray(rademacher(rng, (3, 64, 128)), jnp.float32)}
  a_new = {'w': jnp.asarray(rademacher(rng, (3, 64, 128)), jnp.float32)}
  fn = jax.jit(sketch.basis_transfer)
  hlo = fn.lower(a_new, a_old).compile().as_text()
  assert 'custom-call' not in hlo and 'custom_call' not in hlo
  m = np.asarray(fn(a_new, a_old)['w'], np.float64)
  ao, an = np.asarray(a_old['w'], np.float64), np.asarray(a_new['w'], np.float64)
  got = m @ ao @ np.swapaxes(ao, -1, -2)
  want = an @ np.swapaxes(ao, -1, -2)
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
