"""Sketch-space momentum that survives a change of projections (docs/method.md §10).

A sketch-space moment m (…, R, D) lives in the basis of the projections A (…, R, K) that made
it. When A is held for T steps and then redrawn (`optim.logra.refresh_every`), the moment is
carried into the new basis by the projection-aware transfer

    m ← A_new A_old⁺ m,     A_old⁺ = A_oldᵀ (A_old A_oldᵀ)⁻¹,

i.e. the least-norm dense matrix whose old sketch is m (A_old⁺ m, the moment's component in
A_old's row space) sketched by A_new. It is the identity when A does not change (A A⁺ = I), and
for orthogonal rows (A Aᵀ = (K/R) I) it is (R/K) A_new A_oldᵀ m: Flora's resampling transfer
scaled to what of the old moment the new subspace can hold.
"""
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax


class SketchMomentumState(NamedTuple):
  """count: steps taken (int32); mu: the moments (fp32, fp64 for fp64 updates); basis: the
  projection step (uint32) whose A the moments are expressed in."""
  count: jax.Array
  mu: Any
  basis: jax.Array


def _swap(x):
  return jnp.swapaxes(x, -1, -2)


NEWTON_SCHULZ_STEPS = 32


def _spd_inverse(gram):
  """G⁻¹ of symmetric positive definite G (…, R, R) by Newton–Schulz, matmuls only.

  X₀ = I / ‖G‖_∞ (‖G‖_∞ ≥ λ_max, so the residual I − X₀G has eigenvalues in [0, 1 − 1/κ')
  with κ' = ‖G‖_∞/λ_min), then X ← X(2I − GX), which squares the residual: 32 steps reach
  machine precision for κ' up to ~1e8. Random A with R ≤ K/2 gives κ' < 1e2 (R = K/2
  Rademacher: (1 + √½)²/(1 − √½)² ≈ 34 by Marchenko–Pastur); orthogonal rows give G = (K/R) I.
  No LAPACK call: jaxlib's CPU LAPACK kernels can deadlock when XLA runs several at once in
  one program (seen here: one solve per sketched matrix hung a run at a redraw).
  """
  eye = jnp.eye(gram.shape[-1], dtype=gram.dtype)
  norm = jnp.max(jnp.sum(jnp.abs(gram), axis=-1), axis=-1)[..., None, None]
  x = jnp.broadcast_to(eye, gram.shape) / norm
  return jax.lax.fori_loop(0, NEWTON_SCHULZ_STEPS, lambda _, x: x @ (2 * eye - gram @ x), x)


def basis_transfer(a_new, a_old):
  """M = A_new A_old⁺ (…, R_new, R_old) for every matrix of two projection trees.

  A_old must have full row rank (R ≤ K; true for every kind here almost surely). Computed in
  fp32 (fp64 for fp64 A) as (A_new A_oldᵀ)(A_old A_oldᵀ)⁻¹, the Gram inverse by
  Newton–Schulz (`_spd_inverse`), never forming A_old⁺.
  """
  def one(an, ao):
    dt = jnp.promote_types(jnp.float32, jnp.promote_types(an.dtype, ao.dtype))
    an, ao = an.astype(dt), ao.astype(dt)
    gram = ao @ _swap(ao)    # (…, R_old, R_old), symmetric positive definite
    cross = an @ _swap(ao)   # (…, R_new, R_old)
    return cross @ _spd_inverse(gram)

  return jax.tree.map(one, a_new, a_old)


def transfer_moments(mu, change):
  """m ← M m per leaf (M (…, R_new, R_old), m (…, R_old, D))."""
  return jax.tree.map(lambda m, c: (c.astype(m.dtype) @ m).astype(m.dtype), mu, change)


def scale_by_sketch_momentum(
    decay: float) -> optax.GradientTransformationExtraArgs:
  """A debiased EMA of the (normalised) sketch updates, carried across changes of A.

  ``mu ← decay·mu + (1 − decay)·u``, output ``mu / (1 − decay^t)`` (optax.ema with debias).
  Extra arguments of ``update``: ``basis`` (a uint32 scalar naming the current A: its
  projection step) and ``basis_change`` (``old_basis → tree of M = A_new A_old⁺``, see
  `basis_transfer`). When ``basis`` differs from the state's, the moments are transferred
  first (``M`` computed only then, under ``lax.cond``); without ``basis`` the moments are
  taken to be in a fixed basis.

  Example:
    >>> opt = scale_by_sketch_momentum(0.9)
    >>> u, state = opt.update(u, state, basis=step, basis_change=lambda old: transfer(old))
  """
  if isinstance(decay, (int, float)) and not 0.0 <= decay < 1.0:
    raise ValueError(f'momentum decay must be in [0, 1), got {decay}')

  def init_fn(params):
    mu = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(jnp.float32, p.dtype)),
                      params)
    return SketchMomentumState(count=jnp.zeros([], jnp.int32), mu=mu,
                               basis=jnp.zeros([], jnp.uint32))

  def update_fn(updates, state, params=None, basis: Optional[jax.Array] = None,
                basis_change: Optional[Callable[[jax.Array], Any]] = None, **extra_args):
    del params, extra_args
    mu, new_basis = state.mu, state.basis
    if basis is not None:
      new_basis = jnp.asarray(basis, jnp.uint32)
      if basis_change is None:
        raise ValueError('scale_by_sketch_momentum: basis given without basis_change '
                         '(old basis -> tree of A_new A_old⁺), so the moments cannot follow A')
      # The first step has no moments to carry (all zero): any basis is theirs.
      moved = (new_basis != state.basis) & (state.count > 0)
      mu = jax.lax.cond(moved, lambda m: transfer_moments(m, basis_change(state.basis)),
                        lambda m: m, mu)
    count = optax.safe_increment(state.count)
    mu = jax.tree.map(lambda m, u: (decay * m + (1.0 - decay) * u.astype(m.dtype)).astype(m.dtype),
                      mu, updates)
    out = jax.tree.map(
        lambda m, u: (m / (1.0 - decay ** count.astype(m.dtype))).astype(u.dtype), mu, updates)
    return out, SketchMomentumState(count=count, mu=mu, basis=new_basis)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
