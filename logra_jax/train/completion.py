"""The policy at the completion positions, as full logits or as hidden states + the head.

Shape key: N sequences, P prompt length, T completion length, D hidden, V vocabulary.

`forward` runs the model and keeps positions P−1 … P+T−2 only (those predicting the T
completion tokens). With `ModelConfig.vocab_chunk` = 0 it returns their fp32 logits
(N, T, V) — the original path, bit for bit. With C > 0 it returns a `Hidden`: the final
hidden states (N, T, D) and the head weight, and the functions below compute the token
log-probs, entropies, mean KL and predicted-KL coefficient over vocabulary chunks of C, so no
(N, T, V) array exists, forward or backward.
"""
from typing import Any, NamedTuple

from logra_jax import sketch
from logra_jax.models.transformer import head_weights
from logra_jax.rl import blockwise
from logra_jax.rl import losses as rl_losses


class Hidden(NamedTuple):
  """Final hidden states at the completion positions and the (fixed-layout) head weight."""
  h_NxTxD: Any
  w: Any


def _chunking(model):
  c = model.config
  return dict(vocab_axis=0 if c.tie_embeddings else 1, chunk=c.vocab_chunk)


def forward(model, variables, batch, prompt_len):
  """Logits (N, T, V) (vocab_chunk = 0) or `Hidden` predicting the T completion tokens."""
  t = batch['targets'].shape[1]
  if not model.config.vocab_chunk:
    logits, _ = model.apply(variables, batch['tokens'], attn_mask_BxL=batch['mask'])
    return logits[:, prompt_len - 1:prompt_len - 1 + t]
  h, _ = model.apply(variables, batch['tokens'], attn_mask_BxL=batch['mask'],
                     return_hidden=True)
  w, _ = head_weights(model.config, variables['params'])
  return Hidden(h[:, prompt_len - 1:prompt_len - 1 + t], w)


def logprobs_and_entropy(model, out, targets_NxT, temperature):
  """(logp_NxT, entropy_NxT) of the targets under softmax(z / τ)."""
  if isinstance(out, Hidden):
    return blockwise.token_logprobs_and_entropy(out.h_NxTxD, out.w, targets_NxT, temperature,
                                                **_chunking(model))
  return (rl_losses.token_logprobs(out, targets_NxT, temperature),
          rl_losses.token_entropy(out, temperature))


def logprobs(model, out, targets_NxT, temperature):
  if isinstance(out, Hidden):
    return logprobs_and_entropy(model, out, targets_NxT, temperature)[0]
  return rl_losses.token_logprobs(out, targets_NxT, temperature)


def mean_kl(model, out_p, out_q, temperature, mask):
  """The masked mean KL(π_p ‖ π_q) between two forwards of the same batch."""
  if isinstance(out_p, Hidden):
    return sketch.chunked_mean_kl(out_p.h_NxTxD, out_p.w, out_q.h_NxTxD, out_q.w, temperature,
                                  mask, **_chunking(model))
  return sketch.mean_kl(out_p, out_q, temperature, mask)


def kl_coefficient(model, out, tangent, temperature, mask):
  """q from a forward and its JVP along the update (`jax.jvp` of `forward`; the head fixed)."""
  if isinstance(out, Hidden):
    return sketch.chunked_kl_coefficient(out.h_NxTxD, tangent.h_NxTxD, out.w, temperature, mask,
                                         **_chunking(model))
  return sketch.kl_coefficient(out, tangent, temperature, mask)
