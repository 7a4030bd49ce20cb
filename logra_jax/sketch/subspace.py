"""An adaptive sketch subspace: the next projections A from this step's co-sketches.

A power-iteration (PowerSGD) warm start built without the dense gradient G (K, D) of a kernel:
the backward gives the co-sketch C = G Bᵀ (K, R') for output-space directions B (R', D)
(`dense.cosketch_matmul`); with B the sketch-space moment m (R, D) of the current A, C's
columns are G applied to the directions the update has been taking, so span(C) is one step of
subspace iteration towards G's dominant input directions. The new A (R, K) takes the first
R − k of them (k = ``random_rows``) and k seeded random directions (GoLore's advice: a noisy
gradient's subspace estimate must keep exploring), orthonormalised together and scaled to
rows of norm √(K/R), the scale of `projection`'s 'orthogonal' kind (E[AᵀA] = I over a random
subspace). docs/method.md §13.

Orthonormalisation is the polar factor by Newton–Schulz (`orthonormal_columns`: matmuls only,
no LAPACK call, see `momentum._spd_inverse`): A's row space is what matters (the sketch's
optimizers are invariant to a rotation of its rows, or reset at a change of A), and the polar
factor is its best-conditioned basis. C is nearly rank one when the update is, and its later
singular values fall far below fp32's precision; each column of C is therefore first mixed
with a relative ``jitter`` of its own random direction (a zero column is replaced by one), so
the directions C does not determine come out random instead of degenerate.
"""
import jax
import jax.numpy as jnp

TINY = 1e-30


POLAR_STEPS = 64


def orthonormal_columns(m):
  """The polar factor of m (…, K, R): orthonormal columns with m's column space (m = Q H).

  Newton–Schulz, X ← 1.5 X − 0.5 X XᵀX from X₀ = m / ‖m‖_F (singular values in (0, 1]):
  matmuls only, and stable where Gram–Schmidt is not. A singular value σ of X₀ grows ×1.5 a
  step until it nears 1, then converges quadratically: 64 steps bring σ ≥ 1e-9 to 1 (to
  fp32's precision). A zero singular value stays 0, so m must have full column rank.
  """
  dt = jnp.promote_types(jnp.float32, m.dtype)
  x = m.astype(dt)
  x = x / jnp.maximum(jnp.sqrt(jnp.sum(x * x, axis=(-2, -1), keepdims=True)), TINY)
  step = lambda _, x: 1.5 * x - 0.5 * x @ (jnp.swapaxes(x, -1, -2) @ x)
  return jax.lax.fori_loop(0, POLAR_STEPS, step, x)


def adaptive_projection(cosketch, key, rank: int, random_rows: int, jitter: float = 1e-3,
                        dtype=jnp.float32):
  """A (…, R, K) from one kernel's co-sketch C (…, K, R') (R' ≥ R − random_rows).

  Args:
    cosketch: C = G Bᵀ, fp32 or fp64.
    key: a jax.random key for the random rows and the jitter (the trainer folds in the
      step and the kernel's path: reproducible on resume).
    rank: R, the rows of A.
    random_rows: k, seeded random directions among the R (0 ≤ k ≤ R).
    jitter: the random part mixed into each of C's columns, relative to its norm.

  Returns:
    A with orthogonal rows of norm √(K/R) whose span holds C's first R − k columns (to the
    jitter) and k random directions.
  """
  k_dim, n_cols = cosketch.shape[-2], cosketch.shape[-1]
  if not 0 <= random_rows <= rank or rank - random_rows > n_cols or rank > k_dim:
    raise ValueError(f'adaptive_projection: need 0 <= random_rows ({random_rows}) <= rank '
                     f'({rank}) <= K ({k_dim}) and rank - random_rows <= the co-sketch\'s '
                     f'{n_cols} columns')
  dt = jnp.promote_types(jnp.float32, cosketch.dtype)
  c = cosketch[..., : rank - random_rows].astype(dt)
  k_noise, k_rand = jax.random.split(key)
  noise = jax.random.normal(k_noise, c.shape, dt)
  norm = jnp.linalg.norm(c, axis=-2, keepdims=True)
  # A zero column (no moment yet along that row) becomes its random direction.
  c = jnp.where(norm > 0, c + jitter * (norm / jnp.sqrt(k_dim)) * noise, noise)
  rand = jax.random.normal(k_rand, cosketch.shape[:-2] + (k_dim, random_rows), dt)
  q = orthonormal_columns(jnp.concatenate([c, rand], axis=-1))
  return (jnp.swapaxes(q, -1, -2) * jnp.sqrt(k_dim / rank)).astype(dtype)
