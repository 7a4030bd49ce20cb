"""Expanding and applying low-rank updates: kernel += scale · Aᵀ U, one matrix at a time."""
import jax
import jax.numpy as jnp
from flax import traverse_util


def expand_update(projection, update):
  """Aᵀ U: (…, R, K), (…, R, D) -> (…, K, D), accumulated in at least fp32."""
  acc = jnp.promote_types(jnp.float32, update.dtype)
  return jnp.einsum('...rk,...rd->...kd', projection.astype(acc), update.astype(acc))


def update_sq_norm(projection, update):
  """‖Aᵀ U‖_F² = Σ (A Aᵀ) ∘ (U Uᵀ), without forming the (K, D) matrix."""
  acc = jnp.promote_types(jnp.float32, update.dtype)
  a, u = projection.astype(acc), update.astype(acc)
  return jnp.sum(jnp.einsum('...rk,...sk->...rs', a, a) * jnp.einsum('...rd,...sd->...rs', u, u))


def _apply_one(kernel, projection, update, scale):
  def add(w, a, u):
    return (w + scale * expand_update(a, u)).astype(w.dtype)
  if kernel.ndim == 2:
    return add(kernel, projection, update)
  # Stacked layers: one (K, D) temporary at a time, written in place into the kernel buffer.
  def body(l, w):
    return jax.lax.dynamic_update_index_in_dim(w, add(w[l], projection[l], update[l]), l, 0)
  return jax.lax.fori_loop(0, kernel.shape[0], body, kernel)


def apply_sketch_updates(params, updates, projections, scale=1.0):
  """params with ``kernel += scale · Aᵀ U`` for every sketched kernel; other leaves unchanged.

  Args:
    params: the model's params tree.
    updates: U, a tree with the projections' structure, leaves (…, R, D).
    projections: A, leaves (…, R, K).
    scale: a scalar (e.g. α·η); the update's sign is carried by U (optax convention).

  Returns:
    The new params. Jit with ``donate_argnums`` on params for an in-place update; no
    full-size copy of all weights is ever made (one (K, D) temporary at a time).
  """
  flat = traverse_util.flatten_dict(params)
  flat_a = traverse_util.flatten_dict(projections)
  flat_u = traverse_util.flatten_dict(updates)
  if set(flat_a) != set(flat_u):
    raise ValueError('updates and projections must have the same paths')
  for path, a in flat_a.items():
    if path not in flat:
      raise ValueError(f'no parameter at sketched path {"/".join(path)}')
    flat[path] = _apply_one(flat[path], a, flat_u[path], scale)
  return traverse_util.unflatten_dict(flat)
