"""Batched KV-cache sampling: prefill left-padded prompts, then a `lax.while_loop` decode.

Shape key: U prompts, B = U·samples generated rows, P prompt length (left padded), T new
tokens, V vocab.

`generate_arrays` is the jitted array core (one compile per config, sampling settings and
shapes). It runs the layers one by one from `decode_copy(config, params)`, per-layer
copies of the weights with (D, K) kernels, made by its own jitted call before each generation
(on XLA:CPU a 16-row `x @ W` is 2-3x slower than `(Wᵀ xᵀ)ᵀ`, and a scan's per-layer slice
of stacked weights is a copy every step), and writes each layer's KV-cache buffer in place
(docs/benchmarks.md, "The embedded sampler's decode"). The copy costs one more set of layer
weights while generating. `generate` is the list-in / list-out wrapper that pads batch and
prompt length to power-of-two buckets to limit recompiles. Each row samples with its own key
derived from its seed, so a row's sample does not depend on the rest of the batch. The
returned log-prob of a token is under softmax(logits / T) of the full vocabulary
(softmax(logits) when greedy), before top-k / top-p truncation. A stop token is kept in the
completion and counted in its length. A prompt plus `max_new_tokens` must fit the model's
context (`max_position_embeddings`): a longer request is an error before anything is generated.
"""
import dataclasses
import functools
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.models.config import ModelConfig
from logra_jax.models.kv_cache import init_cache
from logra_jax.models.transformer import Transformer, decode_variables


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f'temperature must be >= 0, got {self.temperature}')
    if not 0 < self.top_p <= 1:
      raise ValueError(f'top_p must be in (0, 1], got {self.top_p}')
    if self.top_k < 0:
      raise ValueError(f'top_k must be >= 0, got {self.top_k}')


@dataclasses.dataclass
class SampleOutput:
  tokens: list[list[int]]
  logprobs: list[list[float]]
  finish_reasons: list[str]  # 'stop' | 'length'


@flax.struct.dataclass
class _State:
  step: jax.Array          # () int32
  logits_BxV: jax.Array    # logits of the next token
  tokens_BxT: jax.Array    # int32, 0 after the end
  logprobs_BxT: jax.Array  # float32, 0 after the end
  lengths_B: jax.Array     # int32
  stopped_B: jax.Array     # bool: emitted a stop token
  cache: dict


def _truncate(scaled_BxV, sampling: SamplingParams):
  """Masks (to -inf) the logits outside the top-k / top-p set."""
  if sampling.top_k > 0:
    kth = jax.lax.top_k(scaled_BxV, sampling.top_k)[0][:, -1:]
    scaled_BxV = jnp.where(scaled_BxV < kth, -jnp.inf, scaled_BxV)
  if sampling.top_p < 1.0:
    sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # keep a token if the mass above < p
    kept = jnp.where(mass_before < sampling.top_p, sorted_BxV, jnp.inf)
    threshold = jnp.min(kept, axis=-1, keepdims=True)
    scaled_BxV = jnp.where(scaled_BxV < threshold, -jnp.inf, scaled_BxV)
  return scaled_BxV


# Ids per block of `categorical_two_stage`: 49,152 (SmolLM2) = 192 blocks of 256.
SAMPLE_BLOCK = 256


def categorical_two_stage(key, logits_V, block: int = SAMPLE_BLOCK):
  """One id drawn from softmax(logits_V), exactly: a block of ``block`` ids by its total mass,
  then an id inside that block by its own logit (Gumbel-max both times).

  P(block b) · P(i | b) = (Σ_{j∈b} p_j) · p_i / Σ_{j∈b} p_j = p_i, with V / block + block
  Gumbel variates instead of V (`jax.random.categorical` draws one per id; at 16 rows of a
  49,152-word vocabulary that was ~11 ms of an ~80 ms decode step on XLA:CPU). -inf logits (the
  top-k / top-p truncation) are never drawn: a block of them has mass 0.
  """
  v = logits_V.shape[0]
  nb = -(-v // block)
  z = jnp.pad(logits_V, (0, nb * block - v), constant_values=-jnp.inf).reshape(nb, block)
  k_block, k_inner = jax.random.split(key)
  b = jax.random.categorical(k_block, jax.nn.logsumexp(z, axis=-1))
  return b * block + jax.random.categorical(k_inner, z[b])


def sample_token(logits_BxV, keys_B, step, sampling: SamplingParams):
  """(token_B, logprob_B): one token per row and its log-prob under softmax(logits / T)."""
  logits_BxV = logits_BxV.astype(jnp.promote_types(jnp.float32, logits_BxV.dtype))
  if sampling.temperature == 0.0:
    token_B = jnp.argmax(logits_BxV, axis=-1)
    logp_BxV = jax.nn.log_softmax(logits_BxV, axis=-1)
  else:
    scaled_BxV = logits_BxV / sampling.temperature
    logp_BxV = jax.nn.log_softmax(scaled_BxV, axis=-1)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, step)
    token_B = jax.vmap(categorical_two_stage)(step_keys, _truncate(scaled_BxV, sampling))
  logprob_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  return token_B.astype(jnp.int32), logprob_B


def _decode_step(model, params, decode, keys_B, stop_ids, sampling, max_new, state: _State):
  done_B = state.stopped_B | (state.lengths_B >= max_new)
  token_B, logprob_B = sample_token(state.logits_BxV, keys_B, state.step, sampling)
  token_B = jnp.where(done_B, 0, token_B)
  logprob_B = jnp.where(done_B, 0.0, logprob_B)
  tokens_BxT = state.tokens_BxT.at[:, state.step].set(token_B)
  logprobs_BxT = state.logprobs_BxT.at[:, state.step].set(logprob_B)
  stopped_B = state.stopped_B | (~done_B & jnp.isin(token_B, stop_ids))
  logits_Bx1xV, cache = model.apply({'params': params}, token_B[:, None], cache=state.cache,
                                    decode=decode)
  return _State(step=state.step + 1, logits_BxV=logits_Bx1xV[:, -1], tokens_BxT=tokens_BxT,
                logprobs_BxT=logprobs_BxT, lengths_B=state.lengths_B + (~done_B),
                stopped_B=stopped_B, cache=cache)


def fork_cache(cache, logits_UxV, samples: int):
  """The prefill of U prompts as the start of U·samples rows: row i continues prompt
  i // samples (its keys, values and mask repeated; one cache slot index for all)."""
  if samples == 1:
    return cache, logits_UxV
  rep = lambda x: jnp.repeat(x, samples, axis=0)
  return ({'k': tuple(map(rep, cache['k'])), 'v': tuple(map(rep, cache['v'])),
           'mask': rep(cache['mask']), 'index': cache['index']}, rep(logits_UxV))


# Its own program: built inside `generate_arrays`, XLA keeps the per-layer slices it copies
# from alive next to the copy (0.90 vs 0.11 GiB temp at 16 rows of SmolLM2 + the 0.40 GiB copy).
decode_copy = jax.jit(decode_variables, static_argnums=0)


@functools.partial(jax.jit, static_argnames=('config', 'max_new_tokens', 'sampling', 'samples'))
def generate_arrays(params, decode, prompt_UxP, prompt_mask_UxP, seeds_B, stop_ids, *,
                    config: ModelConfig, max_new_tokens: int, sampling: SamplingParams,
                    samples: int = 1):
  """Generates up to `max_new_tokens` per row from left-padded prompts.

  Each prompt is prefilled once and its KV cache forked into `samples` rows (B = U·samples;
  row i continues prompt i // samples with seed seeds_B[i]), so n samples of a prompt pay one
  prefill. The rows are those that the prompts, each repeated `samples` times, give with
  `samples=1` and the same seeds (up to the last bits of the prefill's floats, which may
  depend on how many rows it batches).

  Args:
    params: model params (may be sharded).
    decode: `decode_copy(config, params)`; the prefill and the decode steps read it.
    prompt_UxP: int32 prompts, left padded; every row needs at least one real token.
    prompt_mask_UxP: bool, True on real prompt tokens.
    seeds_B: int seeds, one per generated row (U·samples).
    stop_ids: int32 (N,) stop token ids (may be empty; pad with -1).
    config, max_new_tokens, sampling, samples: static. P + max_new_tokens must be at most
      config.max_position_embeddings (ValueError otherwise, at trace time).

  Returns:
    completions_BxT int32 (0 after the end), logprobs_BxT float32 (float64 for a float64
    model; 0 after the end),
    lengths_B int32, stopped_B bool (True = finished on a stop token).
  """
  u, p = prompt_UxP.shape
  b = u * samples
  if seeds_B.shape != (b,):
    raise ValueError(f'generate_arrays: {u} prompts x samples={samples} need {b} seeds, got '
                     f'shape {seeds_B.shape}')
  check_context(config, p, max_new_tokens, 'the padded prompt length')
  model = Transformer(config)
  # The barrier keeps XLA from constant-folding prefill attention over the all-zero cache.
  cache = jax.lax.optimization_barrier(init_cache(config, u, p + max_new_tokens))
  logits_Ux1xV, cache = model.apply({'params': params}, prompt_UxP,
                                    attn_mask_BxL=prompt_mask_UxP, cache=cache, last_only=True,
                                    decode=decode)
  cache, logits_BxV = fork_cache(cache, logits_Ux1xV[:, -1], samples)
  keys_B = jax.vmap(jax.random.key)(seeds_B)
  state = _State(step=jnp.zeros((), jnp.int32), logits_BxV=logits_BxV,
                 tokens_BxT=jnp.zeros((b, max_new_tokens), jnp.int32),
                 logprobs_BxT=jnp.zeros((b, max_new_tokens), logits_BxV.dtype),
                 lengths_B=jnp.zeros((b,), jnp.int32), stopped_B=jnp.zeros((b,), bool),
                 cache=cache)

  def cond(s):
    return (s.step < max_new_tokens) & ~jnp.all(s.stopped_B | (s.lengths_B >= max_new_tokens))

  def body(s):
    return _decode_step(model, params, decode, keys_B, stop_ids, sampling, max_new_tokens, s)

  state = jax.lax.while_loop(cond, body, state)
  return state.tokens_BxT, state.logprobs_BxT, state.lengths_B, state.stopped_B


def bucket_size(n: int, minimum: int = 1) -> int:
  """The power of two ≥ n (and ≥ minimum): padded shapes that limit recompiles."""
  return max(minimum, 1 << (n - 1).bit_length())


def check_context(config: ModelConfig, prompt_len: int, max_new_tokens: int,
                  what: str = 'the longest prompt'):
  """Raises ValueError unless prompt_len + max_new_tokens fits the model's context."""
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f'max_new_tokens must be a positive int, got {max_new_tokens!r}')
  if prompt_len + max_new_tokens > config.max_position_embeddings:
    raise ValueError(
        f'{what} ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = '
        f'{prompt_len + max_new_tokens} exceeds the model context '
        f'max_position_embeddings={config.max_position_embeddings}: shorten the prompt or '
        'lower max_new_tokens')


def prompt_length(config: ModelConfig, longest: int, max_new_tokens: int,
                  bucket: bool = True) -> int:
  """The padded prompt length P for prompts of at most `longest` tokens.

  The power-of-two bucket (≥ 8) when it fits the context with `max_new_tokens`, else the
  exact `longest`; a clear error (before any generation) when even that does not fit.
  """
  check_context(config, longest, max_new_tokens)
  p = bucket_size(longest, 8) if bucket else longest
  return p if p + max_new_tokens <= config.max_position_embeddings else longest


def stop_array(stop_token_ids: Sequence[int]) -> np.ndarray:
  """int32 stop ids padded with -1 to a power of two (≥ 4): one compile for small stop sets."""
  ids = [int(t) for t in stop_token_ids]
  out = np.full((bucket_size(len(ids) or 1, 4),), -1, np.int32)
  out[:len(ids)] = ids
  return out


def pad_prompts(prompt_ids: Sequence[Sequence[int]], batch: int, length: int, pad_id: int = 0):
  """Left-pads prompts into (batch, length) arrays; extra rows hold a single pad token."""
  tokens = np.full((batch, length), pad_id, np.int32)
  mask = np.zeros((batch, length), bool)
  mask[len(prompt_ids):, -1] = True
  for i, ids in enumerate(prompt_ids):
    if len(ids):
      tokens[i, length - len(ids):] = ids
      mask[i, length - len(ids):] = True
  return tokens, mask


def generate(params, config: ModelConfig, prompt_ids: Sequence[Sequence[int]],
             max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             stop_token_ids: Sequence[int] = (), seeds: Optional[Sequence[int]] = None,
             bucket: bool = True) -> SampleOutput:
  """Samples completions for token-id prompts (see `generate_arrays`)."""
  if not prompt_ids or any(len(ids) == 0 for ids in prompt_ids):
    raise ValueError('generate needs at least one prompt and every prompt needs a token')
  n = len(prompt_ids)
  seeds = list(range(n)) if seeds is None else list(seeds)
  if len(seeds) != n:
    raise ValueError(f'got {len(seeds)} seeds for {n} prompts')
  length = prompt_length(config, max(len(ids) for ids in prompt_ids), max_new_tokens, bucket)
  batch = bucket_size(n) if bucket else n
  tokens, mask = pad_prompts(prompt_ids, batch, length, config.pad_token_id or 0)
  seeds_B = np.zeros((batch,), np.uint32)
  seeds_B[:n] = np.asarray(seeds, np.int64).astype(np.uint32)
  out = generate_arrays(params, decode_copy(config, params), tokens, mask, seeds_B,
                        stop_array(stop_token_ids), config=config, max_new_tokens=max_new_tokens,
                        sampling=SamplingParams(temperature, top_p, top_k))
  toks, logps, lens, stopped = jax.device_get(out)
  return SampleOutput(
      tokens=[toks[i, :lens[i]].tolist() for i in range(n)],
      logprobs=[logps[i, :lens[i]].tolist() for i in range(n)],
      finish_reasons=['stop' if stopped[i] else 'length' for i in range(n)])
