"""Other low-rank gradient compressors offered beside the sketch (docs/method.md §8).

* ``randomized_svd_compress`` — the second seed's GaLore-style projector: a random range
  finder of width 2r, an economy SVD, keep the top r. It needs the DENSE gradient G, so it
  saves no gradient memory (only optimizer-state/transport memory); the sketch never forms G.
  ``experiments/compressor_cost.py`` measures its memory and time against the sketch.
* ``sparse_mask_sketch`` — drop a random fraction p of output units, rescale the rest by
  1/(1−p): E[masked] = S, so the estimate stays unbiased.
"""
import jax
import jax.numpy as jnp


def randomized_svd_compress(grad, rank: int, key, oversample=None):
  """Best-effort rank-``rank`` approximation of ``grad`` (K, D) by a randomized SVD.

  Range finder Y = G Ω with Ω (D, w), w = oversample or 2·rank; Q = qr(Y); B = Qᵀ G;
  B = Ũ Σ Vᵀ (economy); keep the top ``rank``. Equals the best rank-r approximation when
  range(Q) ⊇ the top-r left singular space (e.g. when rank(G) ≤ w).

  Returns:
    (left (K, r), singular values (r,), right (r, D)); left * s @ right ≈ G.
  """
  k, d = grad.shape
  w = min(oversample or 2 * rank, k, d)
  if rank > w:
    raise ValueError(f'rank {rank} exceeds min(grad.shape)={min(k, d)}')
  omega = jax.random.normal(key, (d, w), grad.dtype)
  q, _ = jnp.linalg.qr(grad @ omega)
  u_b, s, vt = jnp.linalg.svd(q.T @ grad, full_matrices=False)
  return (q @ u_b)[:, :rank], s[:rank], vt[:rank]


def low_rank_reconstruct(left, s, right):
  return (left * s) @ right


def sparse_mask_sketch(sketch, key, p: float):
  """Zeros a random fraction ``p`` of output units (last axis), scales the rest by 1/(1−p)."""
  if not 0.0 <= p < 1.0:
    raise ValueError(f'mask fraction p must be in [0, 1), got {p}')
  keep = jax.random.bernoulli(key, 1.0 - p, sketch.shape[:-2] + sketch.shape[-1:])
  keep = jnp.expand_dims(keep, -2)
  return jnp.where(keep, sketch / (1.0 - p), 0.0).astype(sketch.dtype)


def sparse_mask_tree(sketches, key, p: float):
  """``sparse_mask_sketch`` on every leaf, with independent keys."""
  leaves, treedef = jax.tree.flatten(sketches)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [sparse_mask_sketch(s, k, p) for s, k in zip(leaves, keys)])
