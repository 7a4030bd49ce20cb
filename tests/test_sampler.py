"""KV-cache sampler vs step-by-step full forward passes (float64)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

jax.config.update('jax_enable_x64', True)

from logra_jax.models.config import ModelConfig  # noqa: E402
from logra_jax.models.sampler import generate, generate_arrays  # noqa: E402
from logra_jax.models.transformer import Transformer, init_params  # noqa: E402

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3]]


@pytest.fixture(scope='module')
def model():
  c = ModelConfig(vocab_size=20, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                  intermediate_size=24, rope_theta=100.0, max_position_embeddings=64,
                  dtype='float64', param_dtype='float64', qkv_bias=True, architecture='qwen2')
  return c, init_params(c, jax.random.key(0))


def completion_logits(c, params, prompt, tokens):
  """Logits that predicted each completion token, from one full forward pass (unpadded)."""
  logits = Transformer(c).apply({'params': params}, jnp.asarray([list(prompt) + tokens]))[0][0]
  return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]


def test_greedy_equals_stepwise_argmax(model):
  c, params = model
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
def test_sampled_logprobs_match_forward_pass(model, temperature, top_p, top_k):
  c, params = model
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
  assert generate_arrays._cache_size() == before
