"""The policy at the completion positions, as full logits or as hidden states + the head.

Shape key: N sequences, P prompt length, T completion length, D hidden, V vocabulary.

`forward` runs the model and keeps positions P−1 … P+T−2 only (those predicting the T
completion tokens). With `ModelConfig.vocab_chunk` = 0 it returns their fp32 logits
(N, T, V), the head applied to those positions only (the same numbers as the model's own
logits there, bit for bit: tests/test_chunked.py). With C > 0 it returns a `Hidden`: the final
hidden states (N, T, D) and the head weight, and the functions below compute the token
log-probs, entropies, mean KL and predicted-KL coefficient over vocabulary chunks of C, so no
(N, T, V) array exists, forward or backward.

Prompt sharing (``share`` = s > 1): rows come in runs of s that share one prompt (a GRPO
group's samples: identical left-padded prompt tokens and mask). Causal attention makes the
prompt's activations the same for every row of a run, so `pack_prompt_groups` packs a run into
one row — the prompt once (segment 0), then each completion's first T − 1 tokens as segments
1 … s, each attending the prompt and itself (`Transformer(shared_prefix=True)`) — and the
first completion token's logits come from the prompt's last position. Same numbers, P·(s − 1)
+ s fewer positions per run, forward and backward (docs/benchmarks.md, "Prompt sharing").
"""
from typing import Any, NamedTuple

import jax.numpy as jnp

from logra_jax import sketch
from logra_jax.models.positions import default_positions
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


class Packed(NamedTuple):
  """A batch's runs of s rows packed into one row each: (N/s, P + s·(T − 1)) arrays."""
  tokens: Any
  mask: Any
  positions: Any
  segments: Any


def pack_prompt_groups(batch, prompt_len: int, share: int) -> Packed:
  """Each run of ``share`` rows (same prompt) as one row: the prompt, then the completions.

  The completions keep the positions they have in their own rows; the last completion token
  predicts nothing and is left out.
  """
  tokens, mask = batch['tokens'], batch['mask']
  n, p, t = tokens.shape[0], prompt_len, batch['targets'].shape[1]
  if n % share:
    raise ValueError(f'pack_prompt_groups: {n} rows do not split into runs of {share}')
  positions = default_positions(mask)
  comp = lambda x: x[:, p:p + t - 1].reshape(n // share, share * (t - 1))
  head = lambda x: x[::share, :p]
  seg = jnp.repeat(jnp.arange(1, share + 1, dtype=jnp.int32), t - 1)
  segments = jnp.concatenate([jnp.zeros((p,), jnp.int32), seg])
  return Packed(jnp.concatenate([head(tokens), comp(tokens)], axis=1),
                jnp.concatenate([head(mask), comp(mask)], axis=1).astype(bool),
                jnp.concatenate([head(positions), comp(positions)], axis=1),
                jnp.broadcast_to(segments, (n // share, segments.shape[0])))


def unpack_prompt_groups(h_RxLxD, prompt_len: int, share: int, t: int):
  """(N, T, D): the packed rows' states at the positions predicting each completion token."""
  r, _, d = h_RxLxD.shape
  first = jnp.broadcast_to(h_RxLxD[:, None, prompt_len - 1:prompt_len], (r, share, 1, d))
  rest = h_RxLxD[:, prompt_len:].reshape(r, share, t - 1, d)
  return jnp.concatenate([first, rest], axis=2).reshape(r * share, t, d)


def _head_logits(config, h_NxTxD, w):
  """fp32 (at least) logits of hidden states, as `Transformer`'s own head computes them."""
  acc = jnp.promote_types(jnp.float32, config.jnp_dtype)
  spec = 'ntd,vd->ntv' if config.tie_embeddings else 'ntd,dv->ntv'
  return jnp.einsum(spec, h_NxTxD, w, preferred_element_type=acc).astype(acc)


def _shared_hidden(model, variables, batch, prompt_len, share):
  t = batch['targets'].shape[1]
  packed = pack_prompt_groups(batch, prompt_len, share)
  h, _ = model.apply(variables, packed.tokens, positions_BxL=packed.positions,
                     segment_ids_BxL=packed.segments, attn_mask_BxL=packed.mask,
                     return_hidden=True, shared_prefix=True)
  return unpack_prompt_groups(h, prompt_len, share, t)


def forward(model, variables, batch, prompt_len, share: int = 1):
  """Logits (N, T, V) (vocab_chunk = 0) or `Hidden` predicting the T completion tokens.

  ``share`` > 1: rows in runs of ``share`` with the same prompt, computed packed (above).
  """
  t = batch['targets'].shape[1]
  if share > 1:
    h = _shared_hidden(model, variables, batch, prompt_len, share)
    w, _ = head_weights(model.config, variables['params'])
    return Hidden(h, w) if model.config.vocab_chunk else _head_logits(model.config, h, w)
  # The head runs on the T completion positions only (XLA does not move the slice above the
  # head's product: on SmolLM2's 8 x 112-token KL probe rows, ~12% of a forward).
  h, _ = model.apply(variables, batch['tokens'], attn_mask_BxL=batch['mask'],
                     return_hidden=True)
  h = h[:, prompt_len - 1:prompt_len - 1 + t]
  w, _ = head_weights(model.config, variables['params'])
  return Hidden(h, w) if model.config.vocab_chunk else _head_logits(model.config, h, w)


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
