"""Grouped-query softmax attention: dense, or blockwise with an online softmax.

Shape key: B batch, L query length (the new tokens), S cached keys, K kv heads, G = H // K
query heads per kv head, E head dim; Q, C query and key block sizes.

`dense_attention` forms the (B, K, G, L, L) scores at once. `blockwise_attention` computes the
same numbers one query block at a time (a `lax.map` of `jax.checkpoint`ed blocks) and, inside
a block, one key block at a time with a running max / sum (online softmax), so no L×L array
exists, forward or backward: the largest score array is (B, K, G, Q, C), and the backward of
a query block recomputes it. Plain JAX (no custom_vjp): forward-mode AD (the KL probe's JVP)
works through it. A length that the block does not divide gets a last block that starts at
length − block; its keys counted by the block before are left out (not masked: a fully masked
row is a uniform average over every key exactly once, as in the dense softmax).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30


def _acc(dtype):
  return jnp.promote_types(jnp.float32, dtype)


def _grouped_queries(q_BxLxHxE, kv):
  b, l, h, e = q_BxLxHxE.shape
  return q_BxLxHxE.reshape(b, l, kv, h // kv, e) * jnp.asarray(e ** -0.5, q_BxLxHxE.dtype)


def _head_major_attention(q_BxLxKxGxE, k_BxLxKxE, v_BxLxKxE, mask_BxLxL):
  """`dense_attention` without a cache, its dots on head-major (B, K, G, L, E) / (B, K, L, E)
  operands: XLA:CPU runs the (B, L, K, G, E) form's dots slower, forward and backward
  (SmolLM2's heads, one layer: 2 rows × 128 tokens 1.4 vs 2.9 ms forward, 3.5 vs 4.6 ms
  backward; one packed row of 316 tokens 11 vs 21 ms backward)."""
  b, l, kv, g, e = q_BxLxKxGxE.shape
  q = jnp.transpose(q_BxLxKxGxE, (0, 2, 3, 1, 4))
  k, v = jnp.swapaxes(k_BxLxKxE, 1, 2), jnp.swapaxes(v_BxLxKxE, 1, 2)
  s_BxKxGxLxL = jnp.einsum('bkgle,bkse->bkgls', q, k, preferred_element_type=_acc(q.dtype))
  s_BxKxGxLxL = jnp.where(mask_BxLxL[:, None, None], s_BxKxGxLxL, NEG)
  p_BxKxGxLxL = jax.nn.softmax(s_BxKxGxLxL, axis=-1).astype(v.dtype)
  o_BxKxGxLxE = jnp.einsum('bkgls,bkse->bkgle', p_BxKxGxLxL, v)
  return jnp.transpose(o_BxKxGxLxE, (0, 3, 1, 2, 4)).reshape(b, l, kv * g * e)


def dense_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, mask_BxLxL, cached=None):
  """Softmax attention over the new keys and, if given, cached ones, all scores at once.

  `cached` = (k_BxSxKxE, v_BxSxKxE, key_mask_BxS): keys written earlier, all in the past of
  every new query, read in place (the cache is not copied). Fully masked rows give finite,
  unused outputs.
  """
  b, l, h, e = q_BxLxHxE.shape
  q_BxLxKxGxE = _grouped_queries(q_BxLxHxE, k_BxLxKxE.shape[2])
  if cached is None:
    return _head_major_attention(q_BxLxKxGxE, k_BxLxKxE, v_BxLxKxE, mask_BxLxL)
  scores = functools.partial(jnp.einsum, 'blkge,bske->bkgls', q_BxLxKxGxE,
                             preferred_element_type=_acc(q_BxLxHxE.dtype))
  s_BxKxGxLxL = jnp.where(mask_BxLxL[:, None, None], scores(k_BxLxKxE), NEG)
  k_BxSxKxE, v_BxSxKxE, key_mask_BxS = cached
  s_BxKxGxLxS = jnp.where(key_mask_BxS[:, None, None, None], scores(k_BxSxKxE), NEG)
  p = jax.nn.softmax(jnp.concatenate([s_BxKxGxLxS, s_BxKxGxLxL], axis=-1), axis=-1)
  p_BxKxGxLxS, p_BxKxGxLxL = jnp.split(p.astype(v_BxLxKxE.dtype), [k_BxSxKxE.shape[1]], -1)
  o_BxLxKxGxE = (jnp.einsum('bkgls,bske->blkge', p_BxKxGxLxS, v_BxSxKxE.astype(v_BxLxKxE.dtype))
                 + jnp.einsum('bkgls,bske->blkge', p_BxKxGxLxL, v_BxLxKxE))
  return o_BxLxKxGxE.reshape(b, l, h * e)


def block_starts(n: int, block: int):
  """(clamped starts, nominal starts) of ceil(n / block) blocks of `block` <= n items."""
  nominal = np.arange(-(-n // block), dtype=np.int32) * block
  return np.minimum(nominal, n - block).astype(np.int32), nominal


def _online_step(state, s_BxKxGxQxC, v_BxCxKxE):
  """Folds one key block's scores into the running (max, sum, weighted values)."""
  m, l, acc = state
  m_new = jax.lax.stop_gradient(jnp.maximum(m, jnp.max(s_BxKxGxQxC, axis=-1)))
  corr = jnp.exp(m - m_new)
  p = jnp.exp(s_BxKxGxQxC - m_new[..., None])
  pv = jnp.einsum('bkgqc,bcke->bqkge', p.astype(v_BxCxKxE.dtype), v_BxCxKxE,
                  preferred_element_type=acc.dtype)
  corr_q = jnp.moveaxis(corr, 3, 1)[..., None]
  return m_new, l * corr + jnp.sum(p, axis=-1), acc * corr_q + pv


def _scan_keys(state, q_BxQxKxGxE, k_BxSxKxE, v_BxSxKxE, allowed_fn, block):
  """Runs `_online_step` over the key blocks; allowed_fn(key_idx_C, j0) -> (B, Q, C) bool."""
  n = k_BxSxKxE.shape[1]
  c = min(block, n)
  starts, nominal = block_starts(n, c)

  def body(st, xs):
    j0, j_nominal = xs
    k_blk = jax.lax.dynamic_slice_in_dim(k_BxSxKxE, j0, c, axis=1)
    v_blk = jax.lax.dynamic_slice_in_dim(v_BxSxKxE, j0, c, axis=1)
    idx_C = j0 + jnp.arange(c, dtype=jnp.int32)
    s = jnp.einsum('bqkge,bcke->bkgqc', q_BxQxKxGxE, k_blk,
                   preferred_element_type=st[2].dtype)
    s = jnp.where(allowed_fn(idx_C, j0)[:, None, None], s, NEG)
    s = jnp.where(idx_C >= j_nominal, s, -jnp.inf)  # counted by the block before
    return _online_step(st, s, v_blk), None

  state, _ = jax.lax.scan(body, state, (jnp.asarray(starts), jnp.asarray(nominal)))
  return state


def _assemble(blocks_NxBxQx, length):
  """(nq, B, Q, ...) query blocks (the last one clamped) -> (B, length, ...)."""
  nq, b, q = blocks_NxBxQx.shape[:3]
  rest = blocks_NxBxQx.shape[3:]
  x = jnp.moveaxis(blocks_NxBxQx, 0, 1)
  if nq * q == length:
    return x.reshape((b, length) + rest)
  head = x[:, :-1].reshape((b, (nq - 1) * q) + rest)
  return jnp.concatenate([head, x[:, -1, nq * q - length:]], axis=1)


def blockwise_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, attn_mask_BxL, segment_ids_BxL=None,
                        cached=None, block: int = 512, prefix_BxL=None):
  """`dense_attention` with the causal/padding/segment mask of `attn_mask_BxL` (keys that
  are padding, in the future or in another segment are never attended), in blocks.
  ``prefix_BxL`` (bool): keys every segment attends (a shared prompt), causality still holds.

  `cached` as in `dense_attention`: its keys are visited first, in blocks, in place.
  """
  b, l, h, e = q_BxLxHxE.shape
  kv = k_BxLxKxE.shape[2]
  q_BxLxKxGxE = _grouped_queries(q_BxLxHxE, kv)
  acc = _acc(q_BxLxHxE.dtype)
  bq = min(block, l)
  seg_BxL = (jnp.zeros((b, l), jnp.int32) if segment_ids_BxL is None else segment_ids_BxL)

  def query_block(i0):
    q_blk = jax.lax.dynamic_slice_in_dim(q_BxLxKxGxE, i0, bq, axis=1)
    seg_q = jax.lax.dynamic_slice_in_dim(seg_BxL, i0, bq, axis=1)
    qi_Q = i0 + jnp.arange(bq, dtype=jnp.int32)
    shape = (b, kv, h // kv, bq)
    state = (jnp.full(shape, -jnp.inf, acc), jnp.zeros(shape, acc),
             jnp.zeros((b, bq, kv, h // kv, e), acc))
    if cached is not None:
      k_c, v_c, key_mask_BxS = cached

      def cache_allowed(idx_C, j0):
        m = jax.lax.dynamic_slice_in_dim(key_mask_BxS, j0, idx_C.shape[0], axis=1)
        return jnp.broadcast_to(m[:, None, :], (b, bq, idx_C.shape[0]))
      state = _scan_keys(state, q_blk, k_c, v_c.astype(v_BxLxKxE.dtype), cache_allowed, block)

    def allowed(idx_C, j0):
      key_m = jax.lax.dynamic_slice_in_dim(attn_mask_BxL, j0, idx_C.shape[0], axis=1)
      seg_k = jax.lax.dynamic_slice_in_dim(seg_BxL, j0, idx_C.shape[0], axis=1)
      causal_QxC = idx_C[None, :] <= qi_Q[:, None]
      same = seg_q[:, :, None] == seg_k[:, None, :]
      if prefix_BxL is not None:
        same |= jax.lax.dynamic_slice_in_dim(prefix_BxL, j0, idx_C.shape[0], axis=1)[:, None, :]
      return causal_QxC[None] & key_m[:, None, :] & same
    m, s, o = _scan_keys(state, q_blk, k_BxLxKxE, v_BxLxKxE, allowed, block)
    return (o / jnp.moveaxis(s, 3, 1)[..., None]).astype(v_BxLxKxE.dtype)

  starts, _ = block_starts(l, bq)
  blocks = jax.lax.map(jax.checkpoint(query_block), jnp.asarray(starts))
  return _assemble(blocks, l).reshape(b, l, h * e)
