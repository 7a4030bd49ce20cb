"""Token log-probs and entropies from final hidden states, over vocabulary chunks.

Shape key: B completions, T tokens, D hidden, V vocabulary, M = B·T, C chunk.

`token_logprobs_and_entropy` equals `losses.token_logprobs` and `losses.token_entropy` of the
logits h·w, but never forms the (B, T, V) logits: a `jax.checkpoint`ed scan over vocabulary
chunks (`logra_jax.sketch.vocab`) keeps per token a running max m, s = Σ e^{u−m},
t = Σ e^{u−m}(u−m) and the target's u = z/τ, so

    log p(y) = u_y − (m + log s),      H = log s − t / s.

Gradients (w.r.t. h and w) come from JAX through the scan; its backward recomputes one
chunk at a time.
"""
import jax
import jax.numpy as jnp

from logra_jax.sketch import vocab


def token_logprobs_and_entropy(h_BxTxD, w, targets_BxT, temperature: float = 1.0, *,
                               vocab_axis: int, chunk: int):
  """(logp_BxT, entropy_BxT) of softmax(h·w / τ), in (at least) fp32.

  Args:
    h_BxTxD: final hidden states of the positions predicting targets_BxT.
    w: the head weight, (V, D) for vocab_axis 0 or (D, V) for vocab_axis 1.
    targets_BxT: token ids in [0, V).
    temperature: τ.
    vocab_axis, chunk: the head's layout and the vocabulary chunk size C.
  """
  h_MxD, lead = vocab.flatten_tokens(h_BxTxD)
  y_M = targets_BxT.reshape(-1)
  acc = vocab.acc_dtype(h_MxD.dtype)
  zeros = jnp.zeros(y_M.shape, acc)
  init = (jnp.full(y_M.shape, vocab.NEG, acc), zeros, zeros, zeros)

  def body(carry, w_chunks, ids_C, fresh_C):
    m, s, t, u_y = carry
    u = vocab.chunk_logits(h_MxD, w_chunks[0], vocab_axis, temperature)
    m_new = vocab.fold_max(m, u, fresh_C)
    p = vocab.shifted_exp(u, m_new, fresh_C)
    a = jnp.exp(m - m_new)
    t = a * (t + (m - m_new) * s) + jnp.sum(p * (u - m_new[:, None]), axis=-1)
    s = a * s + jnp.sum(p, axis=-1)
    hit = fresh_C & (ids_C == y_M[:, None])
    return m_new, s, t, u_y + jnp.sum(jnp.where(hit, u, 0.0), axis=-1)

  m, s, t, u_y = vocab.scan_vocab(body, init, (w,), vocab_axis, chunk)
  logp = u_y - (m + jnp.log(s))
  entropy = jnp.log(s) - t / s
  return logp.reshape(lead), entropy.reshape(lead)
