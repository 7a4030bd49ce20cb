"""KV-cache sampler: vs step-by-step full forward passes (float64), top-p sets, context limits."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.models.config import ModelConfig
from logra_jax.models.generator import JaxGenerator
from logra_jax.models.sampler import (SamplingParams, categorical_two_stage, decode_copy,
                                      generate, generate_arrays, sample_token)
from logra_jax.models.transformer import Transformer, init_params
from logra_jax.rl.types import GenerationRequest
from logra_jax.rl.types import SamplingParams as RequestParams

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]]
CONTEXT = 64  # max_position_embeddings of the test model


def _model(dtype):
  c = ModelConfig(vocab_size=20, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=24, rope_theta=100.0, max_position_embeddings=CONTEXT,
                  dtype=dtype, param_dtype=dtype, qkv_bias=True, architecture='qwen2')
  return c, init_params(c, jax.random.key(0))


@pytest.fixture(scope='module')
def model():
  """float32: for the tests that compare the sampler with itself (no float64 reference)."""
  return _model('float32')


@pytest.fixture(scope='module')
def _model64_arrays():
  with jax.enable_x64(True):
    c, params = _model('float64')
    return c, jax.tree.map(np.asarray, params)  # float64 numpy: usable in any x64 test


@pytest.fixture
def model64(x64, _model64_arrays):
  """float64: for the tests that compare against a float64 forward pass at 1e-9."""
  return _model64_arrays


def completion_logits(c, params, prompt, tokens):
  """Logits that predicted each completion token, from one full forward pass (unpadded)."""
  logits = Transformer(c).apply({'params': params}, jnp.asarray([list(prompt) + tokens]))[0][0]
  return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def test_greedy_equals_stepwise_argmax(model64):
  c, params = model64
  out = generate(params, c, PROMPTS, max_new_tokens=6)
  for prompt, tokens, logps in zip(PROMPTS, out.tokens, out.logprobs):
    # Causal: the logits at step i of a forward pass over prompt + completion are those of
    # the prefix, so this is the same as re-running the model after every token.
    logits = completion_logits(c, params, prompt, tokens)
    assert tokens == jnp.argmax(logits, axis=-1).tolist()
    chosen = jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.asarray(tokens)[:, None], 1)
    np.testing.assert_allclose(logps, chosen[:, 0], atol=1e-9)
  assert out.finish_reasons == ['length'] * 3
  assert [len(t) for t in out.tokens] == [6] * 3


def test_stop_token_and_length_finish_reasons(model):
  c, params = model
  greedy = generate(params, c, PROMPTS, max_new_tokens=6).tokens
  stop = greedy[0][2]
  first = greedy[0].index(stop)
  out = generate(params, c, PROMPTS, max_new_tokens=6, stop_token_ids=[stop])
  assert out.tokens[0] == greedy[0][:first + 1]  # the stop token is kept
  assert out.finish_reasons[0] == 'stop'
  for row in (1, 2):
    expect = 'stop' if stop in greedy[row] else 'length'
    assert out.finish_reasons[row] == expect
    cut = greedy[row].index(stop) + 1 if stop in greedy[row] else 6
    assert out.tokens[row] == greedy[row][:cut]


@pytest.mark.parametrize('temperature,top_p,top_k', [(0.7, 1.0, 0), (1.3, 0.8, 5)])
def test_sampled_logprobs_match_forward_pass(model64, temperature, top_p, top_k):
  c, params = model64
  out = generate(params, c, PROMPTS, max_new_tokens=5, temperature=temperature, top_p=top_p,
                 top_k=top_k, seeds=[11, 12, 13])
  for prompt, tokens, logps in zip(PROMPTS, out.tokens, out.logprobs):
    logits = completion_logits(c, params, prompt, tokens)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    expected = [float(logp[i, t]) for i, t in enumerate(tokens)]
    np.testing.assert_allclose(logps, expected, atol=1e-9)
    if top_k:
      ranks = [int(jnp.sum(logits[i] > logits[i, t])) for i, t in enumerate(tokens)]
      assert max(ranks) < top_k


def test_seeds_control_sampling(model):
  c, params = model
  kw = dict(max_new_tokens=12, temperature=1.5)
  a = generate(params, c, PROMPTS, seeds=[1, 2, 3], **kw)
  b = generate(params, c, PROMPTS, seeds=[1, 2, 3], **kw)
  d = generate(params, c, PROMPTS, seeds=[4, 5, 6], **kw)
  assert a.tokens == b.tokens and a.logprobs == b.logprobs
  assert a.tokens != d.tokens
  # A row's sample depends on its seed only, not on its batch neighbours.
  alone = generate(params, c, PROMPTS[1:2], seeds=[2], **kw)
  assert alone.tokens[0] == a.tokens[1]


def test_top_k_one_is_greedy(model):
  c, params = model
  greedy = generate(params, c, PROMPTS, max_new_tokens=6)
  top1 = generate(params, c, PROMPTS, max_new_tokens=6, temperature=1.0, top_k=1)
  assert top1.tokens == greedy.tokens


def test_no_recompile_for_same_bucket(model):
  c, params = model
  generate(params, c, [[1, 2, 3]], max_new_tokens=4)
  before = generate_arrays._cache_size()
  generate(params, c, [[4, 5]], max_new_tokens=4)  # same (batch, length) bucket
  generate(params, c, [[4, 5]], max_new_tokens=4, stop_token_ids=[3, 7])  # stop ids padded
  assert generate_arrays._cache_size() == before


# --- top-p: every sampled token lies in the nucleus, computed independently in numpy -------


def nucleus(logits_V, top_p):
  """The smallest set of tokens whose probability (float64 softmax) reaches top_p.

  Tokens tied with the last one needed are all in the set (the sampler keeps every token at
  or above the threshold logit); the random rows below have no ties.
  """
  z = np.asarray(logits_V, np.float64)
  probs = np.exp(z - z.max())
  probs /= probs.sum()
  order = np.argsort(-probs, kind='stable')
  k = min(int(np.searchsorted(np.cumsum(probs[order]), top_p)), len(z) - 1)
  return set(np.flatnonzero(z >= z[order[k]]).tolist())


def _clear_of(logits_V, top_p, margin):
  """Whether no partial mass of the sorted probabilities lies within `margin` of top_p."""
  z = np.asarray(logits_V, np.float64)
  probs = np.sort(np.exp(z - z.max()))[::-1]
  return np.min(np.abs(np.cumsum(probs / probs.sum()) - top_p)) > margin


@functools.partial(jax.jit, static_argnames=('steps', 'sampling'))
def _draw(logits_RxV, steps, sampling):
  """(steps, R) tokens: `steps` independent draws per row (the step is folded into the key)."""
  keys_R = jax.vmap(jax.random.key)(jnp.arange(logits_RxV.shape[0]))
  return jax.vmap(lambda s: sample_token(logits_RxV, keys_R, s, sampling)[0])(jnp.arange(steps))


def _random_rows(rng, n, vocab, top_p, temperature):
  """Random logit rows whose partial masses (at this temperature) all keep 1e-5 from top_p.

  float32 softmax/cumsum in the sampler and float64 here differ by ~1e-7 per partial sum
  (vocab 12), so a 1e-5 margin keeps both sides from landing on different sides of top_p.
  """
  rows = []
  while len(rows) < n:
    z = (2.0 * rng.normal(size=vocab)).astype(np.float32)
    if _clear_of(z / temperature, top_p, 1e-5):
      rows.append(z)
  return np.stack(rows)


@pytest.mark.parametrize('top_p,temperature', [(0.5, 1.0), (0.9, 1.0), (0.8, 0.7)])
def test_top_p_samples_lie_in_the_nucleus(top_p, temperature):
  logits_RxV = _random_rows(np.random.default_rng(0), 64, 12, top_p, temperature)
  drawn_SxR = np.asarray(_draw(logits_RxV, 256, SamplingParams(temperature, top_p)))
  for r in range(logits_RxV.shape[0]):
    allowed = nucleus(logits_RxV[r] / temperature, top_p)
    sampled = set(drawn_SxR[:, r].tolist())
    assert sampled <= allowed, (r, sorted(sampled - allowed), sorted(allowed))


@pytest.mark.parametrize('top_p,size', [(0.7 - 1e-4, 2), (0.7 + 1e-4, 3)])
def test_top_p_boundary(top_p, size):
  """Top masses 0.4, 0.3, 0.2 (the other 9 tokens share 0.1): p just below 0.7 keeps two
  tokens, just above keeps three. The 1e-4 margin is ~1000x the float32 error of the partial
  sums, and every kept token has renormalised probability >= 0.2, so 256 draws see each one
  (a miss has probability < 0.8 ** 256 ~ 1e-25): the sampled set must BE the nucleus."""
  probs = np.array([0.4, 0.3, 0.2] + [0.1 / 9] * 9)
  rng = np.random.default_rng(1)
  logits_RxV = np.stack([np.log(rng.permutation(probs)) for _ in range(8)]).astype(np.float32)
  drawn_SxR = np.asarray(_draw(logits_RxV, 256, SamplingParams(1.0, top_p)))
  for r in range(logits_RxV.shape[0]):
    allowed = nucleus(logits_RxV[r], top_p)
    assert len(allowed) == size
    assert set(drawn_SxR[:, r].tolist()) == allowed


@pytest.mark.parametrize('block', [4, 13, 64])
def test_two_stage_draws_follow_the_softmax(block):
  """`categorical_two_stage` draws id i with probability softmax(z)_i: 13 ids in blocks of 4
  (the last padded with 3 ids of mass 0), of 13 (one block) and of 64; two ids at -inf (a
  truncation) and a whole block of 4 at -inf. 200,000 draws: each frequency has standard error
  sqrt(p(1 − p)/n) <= 0.0012; 5 standard errors per id leaves a false failure below 1e-5 over
  the 13 ids, while drawing a block of 4 by its largest logit instead of its mass moves one
  frequency by 0.023 (~20 standard errors)."""
  rng = np.random.default_rng(3)
  z = rng.normal(size=13) * 0.5  # comparable masses inside each block
  z[[2, 11]] = -np.inf
  z[4:8] = [-np.inf] * 4 if block == 4 else z[4:8]
  n = 200_000
  keys = jax.random.split(jax.random.key(7), n)
  ids = np.asarray(jax.jit(jax.vmap(lambda k: categorical_two_stage(
      k, jnp.asarray(z, jnp.float32), block)))(keys))
  p = np.exp(z - np.max(z))
  p /= p.sum()
  freq = np.bincount(ids, minlength=13) / n
  assert freq[p == 0].sum() == 0  # truncated ids never drawn
  np.testing.assert_array_less(np.abs(freq - p), 5 * np.sqrt(p * (1 - p) / n) + 1e-12)


# --- context: prompt + max_new_tokens beyond the model's positions is an error up front ----


def test_generate_rejects_requests_beyond_the_context(model):
  c, params = model
  before = generate_arrays._cache_size()
  with pytest.raises(ValueError, match=r'longest prompt \(50 tokens\) \+ max_new_tokens \(15\) '
                                       r'= 65 exceeds the model context '
                                       r'max_position_embeddings=64'):
    generate(params, c, [[1] * 50, [2, 3]], max_new_tokens=15)
  with pytest.raises(ValueError, match='max_new_tokens must be a positive int, got 0'):
    generate(params, c, [[1, 2]], max_new_tokens=0)
  assert generate_arrays._cache_size() == before  # nothing was traced or run
  tokens = np.ones((1, 56), np.int32)  # a padded length that does not fit, called directly
  with pytest.raises(ValueError, match=r'padded prompt length \(56 tokens\) \+ max_new_tokens '
                                       r'\(9\) = 65 exceeds'):
    generate_arrays(params, decode_copy(c, params), tokens, tokens > 0, np.zeros(1, np.uint32),
                    np.array([-1], np.int32), config=c, max_new_tokens=9,
                    sampling=SamplingParams())


def test_generate_fills_the_context_exactly(model):
  """50 + 14 = 64 fits, though the prompt bucket (64) would not: the prompt is left unpadded,
  and the last position used is 63 (logits still match a forward pass over all 64 tokens)."""
  c, params = model
  prompt = [int(t) for t in np.random.default_rng(0).integers(3, 20, size=50)]
  out = generate(params, c, [prompt], max_new_tokens=14, stop_token_ids=())
  assert len(out.tokens[0]) == 14
  logits = completion_logits(c, params, prompt, out.tokens[0])
  assert out.tokens[0] == jnp.argmax(logits, axis=-1).tolist()


def test_jax_generator_rejects_requests_beyond_the_context(model):
  c, params = model
  gen = JaxGenerator(c, params)
  sp = RequestParams(temperature=1.0, max_new_tokens=20)
  with pytest.raises(ValueError, match=r'longest prompt \(45 tokens\) \+ max_new_tokens \(20\) '
                                       r'= 65 exceeds the model context '
                                       r'max_position_embeddings=64'):
    gen.generate([GenerationRequest([1, 2, 3], sp), GenerationRequest([4] * 45, sp)])
  other = RequestParams(temperature=1.0, max_new_tokens=20, stop_token_ids=(2,))
  with pytest.raises(ValueError, match='stop_token_ids'):
    gen.generate([GenerationRequest([1, 2, 3], sp), GenerationRequest([4, 5], other)])


# --- n samples of a prompt: one prefill, its KV cache forked ----------------------------------

def _padded(prompts, length=8):
  tokens = np.zeros((len(prompts), length), np.int32)
  for i, p in enumerate(prompts):
    tokens[i, length - len(p):] = p
  return tokens, tokens > 0


def test_forked_prefill_samples_like_repeated_prompts(model64):
  """samples=n prefills U prompts once and forks the cache; row i must be what prompt i // n
  repeated n times gives with the same seeds (float64: the two prefills batch 3 vs 9 rows)."""
  c, params = model64
  n, seeds = 3, np.arange(100, 109, dtype=np.uint32)
  kw = dict(config=c, max_new_tokens=6, sampling=SamplingParams(1.3, 0.9, 0))
  stops = np.array([7, -1, -1, -1], np.int32)  # some rows stop early
  decode = decode_copy(c, params)
  forked = generate_arrays(params, decode, *_padded(PROMPTS), seeds, stops, samples=n, **kw)
  repeated = generate_arrays(params, decode, *_padded([p for p in PROMPTS for _ in range(n)]),
                             seeds, stops, **kw)
  for a, b in zip(forked, repeated):
    assert a.shape == b.shape
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=0, atol=1e-12)
  assert len({tuple(r) for r in np.asarray(forked[0])}) > len(PROMPTS)  # samples do differ


def test_forked_prefill_costs_one_prefill_per_prompt(model):
  """XLA's FLOP count: the prefill runs on the U prompts, not on U·n rows."""
  c, params = model
  n, tokens, mask = 4, *_padded(PROMPTS, 32)
  flops = lambda t, m, samples: generate_arrays.lower(
      params, decode_copy(c, params), t, m, np.zeros(len(PROMPTS) * n, np.uint32),
      np.full(4, -1, np.int32), config=c, max_new_tokens=2, sampling=SamplingParams(1.0),
      samples=samples).compile().cost_analysis()
  forked = flops(tokens, mask, n)['flops']
  repeated = flops(np.repeat(tokens, n, 0), np.repeat(mask, n, 0), 1)['flops']
  assert forked < 0.5 * repeated, (forked, repeated)


def _decode_loop(hlo: str) -> str:
  """The body computation of the compiled decode `while` loop (the one running the model)."""
  computations = {m.group(1): m.group(0)
                  for m in re.finditer(r'^%([\w.-]+) \(.*?^}$', hlo, re.M | re.S)}
  bodies = [computations[name] for name in re.findall(r'body=%([\w.-]+)', hlo)]
  decode = [b for b in bodies if 'while/body/Transformer' in b]
  assert len(decode) == 1, [b[:80] for b in bodies]
  return decode[0]


def test_decode_loop_updates_the_cache_and_reads_the_weights_in_place(model):
  """In the compiled generation no KV-cache buffer is copied in the decode loop and no weight
  is sliced or copied anywhere: each layer's (B, K, S, E) buffer is written before it is read
  (read first, XLA copies it every step), and the prefill and the steps read the per-layer
  (D, K) kernels of `decode_copy` (slicing the stacked params would copy every weight, in
  the loop every step)."""
  c, params = model
  tokens, mask = _padded(PROMPTS, 10)  # 30 tokens: no kernel's shape
  hlo = generate_arrays.lower(
      params, decode_copy(c, params), tokens, mask, np.zeros(len(PROMPTS), np.uint32),
      np.full(4, -1, np.int32), config=c, max_new_tokens=4,
      sampling=SamplingParams(1.0)).compile().as_text()
  results = lambda text: re.findall(r'= (\w+\[[\d,]*\])\S* ([\w-]+)\(', text)  # (shape, op)
  loop = results(_decode_loop(hlo))
  buffer = f'f32[{len(PROMPTS)},{c.num_kv_heads},14,{c.head_dim}]'  # 10 + 4 slots
  assert (buffer, 'copy') not in loop
  assert any(shape == buffer for shape, _ in loop)  # the buffers are in the loop
  d, f, kv = c.hidden_size, c.intermediate_size, c.num_kv_heads * c.head_dim
  kernels = {f'f32[{a},{b}]' for a, b in [(d, f), (f, d), (d, d), (d, kv), (kv, d)]}
  kernels |= {s.replace('[', '[1,') for s in kernels}
  made = [(s, op) for s, op in results(hlo)
          if s in kernels and op not in ('get-tuple-element', 'parameter', 'bitcast')]
  assert not made, made


def test_jax_generator_forks_each_prompt_n_times(model, monkeypatch):
  """JaxGenerator hands the sampler each prompt once with samples=n, and its results keep
  (request, sample) order; requests with different n fall back to one row per sample."""
  from logra_jax.models import generator  # pylint: disable=g-import-not-at-top
  c, params = model
  calls = []
  real = generator.generate_arrays

  def spy(params, decode, tokens, mask, seeds, stops, **kw):
    calls.append((tokens.shape, seeds.shape, kw['samples']))
    return real(params, decode, tokens, mask, seeds, stops, **kw)
  monkeypatch.setattr(generator, 'generate_arrays', spy)
  gen = JaxGenerator(c, params)
  sp = RequestParams(temperature=1.0, max_new_tokens=5, n=4, seed=3)
  out = gen.generate([GenerationRequest(p, sp, request_id=str(i)) for i, p in enumerate(PROMPTS)])
  assert calls[-1] == ((4, 8), (16,), 4)  # 3 prompts in a bucket of 4, 4 samples each
  assert [(r.request_id, r.sample_index) for r in out] == [
      (str(i), j) for i in range(3) for j in range(4)]
  two = RequestParams(temperature=1.0, max_new_tokens=5, n=2, seed=3)
  mixed = gen.generate([GenerationRequest(PROMPTS[0], sp), GenerationRequest(PROMPTS[1], two)])
  assert [r.sample_index for r in mixed] == [0, 1, 2, 3, 0, 1]
  assert calls[-1][2] == 1 and calls[-1][1] == (8,)  # 6 rows, one per sample, bucket 8
