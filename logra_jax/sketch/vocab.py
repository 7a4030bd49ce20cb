"""The output head over vocabulary chunks: logits of C entries at a time, never all V.

Shape key: M tokens (flattened), D hidden, V vocabulary, C chunk size.

A head weight is the tied embedding (V, D) (vocab_axis 0) or an LM-head kernel (D, V)
(vocab_axis 1); logits z = h·w over D. `scan_vocab` folds a function over the chunks in a
`lax.scan` whose body is `jax.checkpoint`ed, so the backward recomputes one chunk's logits at
a time too and keeps only the scan carries (O(M) per chunk). The chunk start is clamped so a
chunk never leaves the vocabulary; entries already seen by the chunk before come with
`fresh` False and must be ignored by the body. No weight is copied or padded.
"""
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

NEG = -1e30  # stands for log 0 in a running max: finite, so 0 · NEG = 0


def acc_dtype(dtype):
  return jnp.promote_types(jnp.float32, dtype)


def vocab_size(w, vocab_axis: int) -> int:
  if vocab_axis not in (0, 1) or w.ndim != 2:
    raise ValueError(f'head weight must be 2-D with vocab_axis 0 (V, D) or 1 (D, V), got '
                     f'shape {w.shape} and vocab_axis={vocab_axis!r}')
  return w.shape[vocab_axis]


def chunk_logits(h_MxD, w_chunk, vocab_axis: int, temperature=1.0):
  """z / T of one chunk, (M, C), in (at least) fp32 (the dense head's precision)."""
  spec = 'md,cd->mc' if vocab_axis == 0 else 'md,dc->mc'
  acc = acc_dtype(h_MxD.dtype)
  z = jnp.einsum(spec, h_MxD, w_chunk.astype(h_MxD.dtype), preferred_element_type=acc)
  return z.astype(acc) / temperature


def scan_vocab(body: Callable, carry, ws, vocab_axis: int, chunk: int):
  """Folds body(carry, w_chunks, ids_C, fresh_C) -> carry over the vocabulary chunks.

  Args:
    body: one chunk: w_chunks are the weights' slices, ids_C the vocabulary ids they cover,
      fresh_C False on ids the chunk before already covered (the clamped last chunk).
    carry: the initial accumulators (per-token arrays).
    ws: a tuple of head weights of one layout; vocab_axis: 0 for (V, D), 1 for (D, V).
    chunk: C > 0 (clipped to V).

  Returns:
    The final carry.
  """
  if not isinstance(chunk, int) or chunk <= 0:
    raise ValueError(f'vocab chunk must be a positive int, got {chunk!r}')
  v = vocab_size(ws[0], vocab_axis)
  if any(w.shape != ws[0].shape for w in ws):
    raise ValueError(f'head weights differ in shape: {[w.shape for w in ws]}')
  c = min(chunk, v)
  nominal = np.arange(-(-v // c), dtype=np.int32) * c
  starts = np.minimum(nominal, v - c).astype(np.int32)

  def step(acc, xs):
    start, first_new = xs
    w_chunks = tuple(jax.lax.dynamic_slice_in_dim(w, start, c, axis=vocab_axis) for w in ws)
    ids_C = start + jnp.arange(c, dtype=jnp.int32)
    return body(acc, w_chunks, ids_C, ids_C >= first_new), None

  xs = (jnp.asarray(starts), jnp.asarray(nominal))
  carry, _ = jax.lax.scan(jax.checkpoint(step), carry, xs)
  return carry


def chunk_max(u_MxC, fresh_C):
  """The max over the fresh entries, without gradient (the callers' sums are shift-free)."""
  return jax.lax.stop_gradient(jnp.max(jnp.where(fresh_C, u_MxC, NEG), axis=-1))


def fold_max(m_M, u_MxC, fresh_C):
  """The new running max (no gradient)."""
  return jnp.maximum(m_M, chunk_max(u_MxC, fresh_C))


def shifted_exp(u_MxC, m_M, fresh_C):
  """exp(u − m), 0 on entries that are not fresh."""
  return jnp.where(fresh_C, jnp.exp(jnp.where(fresh_C, u_MxC, NEG) - m_M[:, None]), 0.0)


def flatten_tokens(h_xD):
  """(..., D) -> (M, D) and the leading shape."""
  return h_xD.reshape(-1, h_xD.shape[-1]), h_xD.shape[:-1]
