"""Expanding and applying low-rank updates: kernel += scale · Aᵀ U, one matrix at a time.

A kernel stored narrower than fp32 (bf16) is written back with unbiased stochastic rounding
when a ``key`` is given: the paper's relative steps (~6e-5) are far below bf16's resolution
(2⁻⁸), and round-to-nearest would drop most of every update (docs/memory.md).
"""
import zlib

import jax
import jax.numpy as jnp
from flax import traverse_util

_BF16_MAX_BITS = 0x7F7F0000  # the largest finite bf16, as the high half of an f32 pattern


def expand_update(projection, update):
  """Aᵀ U: (…, R, K), (…, R, D) -> (…, K, D), accumulated in at least fp32."""
  acc = jnp.promote_types(jnp.float32, update.dtype)
  return jnp.einsum('...rk,...rd->...kd', projection.astype(acc), update.astype(acc))


def update_sq_norm(projection, update):
  """‖Aᵀ U‖_F² = Σ (A Aᵀ) ∘ (U Uᵀ), without forming the (K, D) matrix."""
  acc = jnp.promote_types(jnp.float32, update.dtype)
  a, u = projection.astype(acc), update.astype(acc)
  return jnp.sum(jnp.einsum('...rk,...sk->...rs', a, a) * jnp.einsum('...rd,...sd->...rs', u, u))


def stochastic_round_bf16(x, key):
  """bf16 SR(x) of an fp32 x: floor or ceil (in magnitude) with E[SR(x)] = x.

  Adds 16 uniform random bits below bf16's mantissa to x's f32 bit pattern and truncates
  them. Sign-magnitude makes this unbiased for negative x too; exact bf16 values (low bits
  0) and ±inf stay as they are, NaN stays NaN, and a finite x whose carry would reach inf
  saturates at ±max bf16 (never inf from a finite weight).
  """
  if x.dtype != jnp.float32:
    raise ValueError(f'stochastic_round_bf16: x must be float32, got {x.dtype}')
  bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint16).astype(jnp.uint32)
  rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
  sign = bits & jnp.uint32(0x80000000)
  overflow = jnp.isfinite(x) & ((rounded & jnp.uint32(0x7FFFFFFF)) > _BF16_MAX_BITS)
  rounded = jnp.where(overflow, sign | jnp.uint32(_BF16_MAX_BITS), rounded)
  y = jax.lax.bitcast_convert_type(rounded, jnp.float32)
  return jnp.where(jnp.isnan(x), x, y).astype(jnp.bfloat16)


def _store(w_new, dtype, key):
  """w_new (≥ fp32) written back in ``dtype``: exact cast, nearest, or SR (bf16 with a key)."""
  if key is None or jnp.finfo(dtype).bits >= 32:
    return w_new.astype(dtype)
  if dtype != jnp.bfloat16:
    raise ValueError(f'stochastic rounding supports bf16 kernels only, got {dtype}; '
                     'store params in float32 or bfloat16 (config key model.param_dtype)')
  return stochastic_round_bf16(w_new.astype(jnp.float32), key)


def _apply_one(kernel, projection, update, scale, key=None):
  """kernel + scale · Aᵀ U; ``key``: stochastic rounding of a bf16 kernel (one key per layer)."""
  def add(w, a, u, k):
    return _store(w + scale * expand_update(a, u), w.dtype, k)
  if kernel.ndim == 2:
    return add(kernel, projection, update, key)
  # Stacked layers: one (K, D) temporary at a time, written in place into the kernel buffer.
  def body(l, w):
    k = None if key is None else jax.random.fold_in(key, l)
    return jax.lax.dynamic_update_index_in_dim(w, add(w[l], projection[l], update[l], k), l, 0)
  return jax.lax.fori_loop(0, kernel.shape[0], body, kernel)


def path_key(key, path):
  """An independent key per parameter path (a stable hash of its name, not its position)."""
  return jax.random.fold_in(key, zlib.crc32('/'.join(path).encode()) & 0x7FFFFFFF)


def apply_sketch_updates(params, updates, projections, scale=1.0, key=None):
  """params with ``kernel += scale · Aᵀ U`` for every sketched kernel; other leaves unchanged.

  Args:
    params: the model's params tree.
    updates: U, a tree with the projections' structure, leaves (…, R, D).
    projections: A, leaves (…, R, K).
    scale: a scalar (e.g. α·η); the update's sign is carried by U (optax convention).
    key: a PRNG key: bf16 kernels are stochastically rounded (`stochastic_round_bf16`),
      one key per matrix (`path_key`) and per stacked layer; None: round to nearest.
      fp32 (and wider) kernels never use it: their path is exact and unchanged.

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
    k = None if key is None else path_key(key, path)
    flat[path] = _apply_one(flat[path], a, flat_u[path], scale, k)
  return traverse_util.unflatten_dict(flat)


def apply_dense_updates(params, updates, scale=1.0, key=None):
  """params with ``leaf += scale · update`` at every leaf of ``updates``, a sub-tree of
  ``params`` (the leaves trained densely beside the sketch: `tree.rest_of`); other leaves
  unchanged. bf16 leaves are stochastically rounded with ``key`` (one key per path, as the
  kernels in `apply_sketch_updates`); None: round to nearest."""
  flat = traverse_util.flatten_dict(params)
  for path, u in traverse_util.flatten_dict(updates).items():
    if path not in flat:
      raise ValueError(f'no parameter at path {"/".join(path)}')
    w = flat[path]
    acc = jnp.promote_types(jnp.float32, w.dtype)
    k = None if key is None else path_key(key, path)
    flat[path] = _store(w.astype(acc) + scale * u.astype(acc), w.dtype, k)
  return traverse_util.unflatten_dict(flat)
