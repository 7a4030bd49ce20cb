"""Transformer vs a float64 numpy reference; padding, packing, KV cache, sketches, configs.

Tolerances: the tests that compare against the reference run in float64 (the `x64` fixture),
where the model and the numpy reference differ only by summation order (~1e-15 relative);
1e-9 leaves ample room and still catches any bug.
"""
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from logra_jax.models.config import ModelConfig
from logra_jax.models.kv_cache import init_cache
from logra_jax.models.positions import rope_inv_freq
from logra_jax.models.presets import PRESETS, get_preset
from logra_jax.models.transformer import Transformer, decode_variables, init_params, param_count

TOL = 1e-9
SKETCHED = (('attn', 'q_proj'), ('attn', 'k_proj'), ('attn', 'v_proj'), ('attn', 'o_proj'),
            ('mlp', 'gate_proj'), ('mlp', 'up_proj'), ('mlp', 'down_proj'))


def small_config(**kw):
  base = dict(vocab_size=24, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=6, intermediate_size=20, rope_theta=100.0, rms_norm_eps=1e-5,
              max_position_embeddings=64, dtype='float64', param_dtype='float64')
  return ModelConfig(**{**base, **kw})


def random_params(config, seed=0):
  """init_params with every leaf randomised (norm scales around 1, biases nonzero too)."""
  rng = np.random.default_rng(seed)
  def draw(path, x):
    noise = rng.normal(size=x.shape)
    return jnp.asarray(1.0 + 0.2 * noise if path[-1].key == 'scale' else 0.5 * noise)
  return jax.tree_util.tree_map_with_path(draw, init_params(config, jax.random.key(seed)))


def reference_logits(params, c, tokens):
  """Llama / Qwen2 forward in float64 numpy for one unpadded sequence (HF conventions)."""
  p = jax.tree.map(np.asarray, params)
  lay = p['layers']
  def rms(x, s):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + c.rms_norm_eps) * s
  def proj(x, mod, i):
    return x @ mod['kernel'][i] + (mod['bias'][i] if 'bias' in mod else 0.0)
  n, e, g = len(tokens), c.head_dim, c.num_heads // c.num_kv_heads
  inv = 1.0 / c.rope_theta ** (np.arange(0, e, 2) / e)
  ang = np.arange(n)[:, None] * inv
  cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
  def rope(x):  # (n, heads, e)
    rot = np.concatenate([-x[..., e // 2:], x[..., :e // 2]], -1)
    return x * cos[:, None] + rot * sin[:, None]
  x = p['embed']['embedding'][np.asarray(tokens)]
  for i in range(c.num_layers):
    h = rms(x, lay['attn_norm']['scale'][i])
    q = rope(proj(h, lay['attn']['q_proj'], i).reshape(n, c.num_heads, e))
    k = rope(proj(h, lay['attn']['k_proj'], i).reshape(n, c.num_kv_heads, e))
    v = proj(h, lay['attn']['v_proj'], i).reshape(n, c.num_kv_heads, e)
    k, v = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # HF repeat_kv
    s = np.einsum('lhe,she->hls', q, k) / np.sqrt(e)
    s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    x = x + np.einsum('hls,she->lhe', a, v).reshape(n, -1) @ lay['attn']['o_proj']['kernel'][i]
    h = rms(x, lay['mlp_norm']['scale'][i])
    gate = h @ lay['mlp']['gate_proj']['kernel'][i]
    up = h @ lay['mlp']['up_proj']['kernel'][i]
    x = x + (gate / (1 + np.exp(-gate)) * up) @ lay['mlp']['down_proj']['kernel'][i]
  x = rms(x, p['final_norm']['scale'])
  return x @ (p['embed']['embedding'].T if c.tie_embeddings else p['lm_head']['kernel'])


def forward(params, c, tokens, **kw):
  return Transformer(c).apply({'params': params}, jnp.asarray(tokens), **kw)[0]


@pytest.mark.parametrize('qkv_bias,tied', [(False, False), (True, True), (True, False)])
def test_logits_match_numpy_reference(x64, qkv_bias, tied):
  c = small_config(qkv_bias=qkv_bias, tie_embeddings=tied,
                   architecture='qwen2' if qkv_bias else 'llama')
  params = random_params(c)
  assert ('bias' in params['layers']['attn']['q_proj']) == qkv_bias
  assert ('lm_head' in params) == (not tied)
  tokens = [3, 1, 4, 1, 5, 9, 2, 6]
  got = forward(params, c, [tokens])[0]
  np.testing.assert_allclose(got, reference_logits(params, c, tokens), atol=TOL, rtol=TOL)


def test_left_padding_matches_unpadded(x64):
  c = small_config()
  params = random_params(c)
  row = [7, 3, 8, 2, 5]
  padded = [[0, 0, 0] + row, [1, 2, 3, 4, 5, 6, 7, 8]]
  mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8], bool)
  got = forward(params, c, padded, attn_mask_BxL=mask)
  np.testing.assert_allclose(got[0, 3:], forward(params, c, [row])[0], atol=TOL, rtol=TOL)
  np.testing.assert_allclose(got[1], forward(params, c, [padded[1]])[0], atol=TOL, rtol=TOL)


def test_packed_segments_match_separate_sequences(x64):
  c = small_config()
  params = random_params(c)
  a, b = [4, 8, 15, 16], [23, 4, 2]
  got = forward(params, c, [a + b], segment_ids_BxL=np.array([[1] * 4 + [2] * 3]))[0]
  np.testing.assert_allclose(got[:4], forward(params, c, [a])[0], atol=TOL, rtol=TOL)
  np.testing.assert_allclose(got[4:], forward(params, c, [b])[0], atol=TOL, rtol=TOL)


@pytest.mark.parametrize('decode,tie', [(False, False), (True, False), (True, True)])
def test_prefill_then_decode_matches_full_forward(x64, decode, tie):
  """The cached, layer-by-layer path; with `decode=`, from the (D, K) kernel copies (and the
  head as (V, D): the tied embedding, or the LM head transposed)."""
  c = small_config(qkv_bias=True, architecture='qwen2', tie_embeddings=tie)
  params = random_params(c)
  tokens = np.array([[0, 0, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 6, 7, 8]])
  mask = np.array([[0, 0, 1, 1, 1, 1, 1, 1], [1] * 8], bool)
  full = forward(params, c, tokens, attn_mask_BxL=mask)
  model = Transformer(c)
  kw = {'decode': decode_variables(c, params)} if decode else {}
  step = jax.jit(lambda t, m, cache: model.apply({'params': params}, t, attn_mask_BxL=m,
                                                 cache=cache, **kw))
  logits, cache = step(tokens[:, :5], mask[:, :5], init_cache(c, 2, 12))
  pieces = [logits]
  for i in range(5, 8):
    logits, cache = step(tokens[:, i:i + 1], mask[:, i:i + 1], cache)
    pieces.append(logits)
  got = jnp.concatenate(pieces, axis=1)
  np.testing.assert_allclose(got[0, 2:], full[0, 2:], atol=TOL, rtol=TOL)
  np.testing.assert_allclose(got[1], full[1], atol=TOL, rtol=TOL)
  assert int(cache['index']) == 8


def _sketch_trees(c, params, rank, seed=1):
  """Projection A (N, R, K) and zero probes (N, R, D) for every sketched kernel."""
  rng = np.random.default_rng(seed)
  proj, probe = {}, {}
  for group, name in SKETCHED:
    n, k, d = params['layers'][group][name]['kernel'].shape
    proj.setdefault(group, {})[name] = {'kernel': jnp.asarray(rng.normal(size=(n, rank, k)))}
    probe.setdefault(group, {})[name] = {'kernel': jnp.zeros((n, rank, d))}
  return {'layers': proj}, {'layers': probe}


@pytest.mark.parametrize('remat_policy', ['none', 'full'])
def test_probe_gradient_is_projected_kernel_gradient(x64, remat_policy):
  c = small_config(remat_policy=remat_policy, qkv_bias=True, architecture='qwen2')
  params = random_params(c)
  proj, probe = _sketch_trees(c, params, rank=3)
  tokens = jnp.array([[3, 1, 4, 1, 5, 9], [2, 6, 5, 3, 5, 8]])
  weights = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, c.vocab_size)))
  model = Transformer(c)

  def loss(params, probe, proj):
    variables = {'params': params, 'projection': proj, 'probe': probe}
    return jnp.sum(model.apply(variables, tokens)[0] * weights)

  sketch = jax.jit(jax.grad(loss, argnums=1))(params, probe, proj)
  dense = jax.jit(jax.grad(lambda p: jnp.sum(forward(p, c, tokens) * weights)))(params)
  for group, name in SKETCHED:
    a = proj['layers'][group][name]['kernel']
    g = dense['layers'][group][name]['kernel']
    expected = jnp.einsum('nrk,nkd->nrd', a, g)
    np.testing.assert_allclose(sketch['layers'][group][name]['kernel'], expected,
                               atol=TOL, rtol=TOL, err_msg=f'{group}/{name}')


def test_linear_mode_jvp_along_probe_equals_jvp_along_kernel(x64):
  c = small_config()
  params = random_params(c)
  proj, probe = _sketch_trees(c, params, rank=3)
  u = jax.tree.map(lambda x: jnp.asarray(np.random.default_rng(3).normal(size=x.shape)), probe)
  tokens = jnp.array([[3, 1, 4, 1, 5]])
  model = Transformer(c).clone(sketch_mode='linear')
  f_probe = lambda pr: model.apply({'params': params, 'projection': proj, 'probe': pr}, tokens)[0]
  _, jvp_probe = jax.jvp(f_probe, (probe,), (u,))
  tangent = jax.tree.map(jnp.zeros_like, params)
  for group, name in SKETCHED:
    tangent['layers'][group][name]['kernel'] = jnp.einsum(
        'nrk,nrd->nkd', proj['layers'][group][name]['kernel'], u['layers'][group][name]['kernel'])
  _, jvp_kernel = jax.jvp(lambda p: forward(p, c, tokens), (params,), (tangent,))
  np.testing.assert_allclose(jvp_probe, jvp_kernel, atol=TOL, rtol=TOL)


LLAMA3_TINY = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
               'high_freq_factor': 4.0, 'original_max_position_embeddings': 256}
LLAMA31 = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
           'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}  # Llama-3.1-8B


@pytest.mark.parametrize('scaling,theta,head_dim', [
    ({'rope_type': 'linear', 'factor': 4.0}, 10000.0, 32), (LLAMA3_TINY, 10000.0, 32),
    (LLAMA31, 500000.0, 128)], ids=['linear', 'llama3_tiny', 'llama3.1'])
def test_rope_inv_freq_matches_transformers(scaling, theta, head_dim):
  """Our inverse frequencies vs transformers' own rope init function for that rope_type.

  transformers computes them in float32 (its arange is cast to torch.float), ours in float64:
  measured max relative difference 2.6e-7 (~2 float32 ulp); 1e-6 bounds that, while any
  scaling mistake moves some frequency by >= 10% (a band missed: by the factor, 8x).
  """
  hf = transformers.LlamaConfig(vocab_size=64, hidden_size=4 * head_dim, num_hidden_layers=1,
                                num_attention_heads=4, num_key_value_heads=2,
                                head_dim=head_dim, intermediate_size=32, rope_theta=theta,
                                max_position_embeddings=32768, rope_scaling=scaling)
  ref, _ = ROPE_INIT_FUNCTIONS[scaling['rope_type']](hf)
  config = ModelConfig.from_hf_config(hf)
  ours = rope_inv_freq(config)
  np.testing.assert_allclose(ours, ref.double().numpy(), rtol=1e-6, atol=0)
  ratio = ours / rope_inv_freq(config.replace(rope_scaling=None))
  if scaling['rope_type'] == 'llama3':  # all three bands are exercised
    assert ratio.max() == 1.0 and ratio.min() == 1 / scaling['factor']
    assert np.any((ratio > 1 / scaling['factor'] + 1e-3) & (ratio < 1 - 1e-3))
  else:
    np.testing.assert_allclose(ratio, 1 / scaling['factor'], rtol=1e-12)


def test_hf_config_round_trip_and_transformers_config():
  c = PRESETS['qwen2.5-math-1.5b']
  assert ModelConfig.from_hf_config(c.to_hf_config()) == c
  hf = transformers.LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=32, rope_theta=500000.0,
                                max_position_embeddings=16384, rope_scaling={
                                    'rope_type': 'llama3', 'factor': 8.0,
                                    'low_freq_factor': 1.0, 'high_freq_factor': 4.0,
                                    'original_max_position_embeddings': 8192})
  got = ModelConfig.from_hf_config(hf)
  assert (got.rope_theta, got.head_dim, got.num_kv_heads) == (500000.0, 4, 2)
  assert got.rope_scaling_dict['rope_type'] == 'llama3'
  assert ModelConfig.from_hf_config(got.to_hf_config()) == got


def test_config_errors_name_the_field():
  good = PRESETS['smollm2-135m'].to_hf_config()
  with pytest.raises(ValueError, match='model_type'):
    ModelConfig.from_hf_config({**good, 'model_type': 'gpt2'})
  with pytest.raises(ValueError, match='intermediate_size'):
    ModelConfig.from_hf_config({k: v for k, v in good.items() if k != 'intermediate_size'})
  with pytest.raises(ValueError, match='num_kv_heads'):
    small_config(num_kv_heads=3)
  with pytest.raises(ValueError, match='remat_policy'):
    small_config(remat_policy='sometimes')
  with pytest.raises(ValueError, match='rope_type'):
    small_config(rope_scaling={'rope_type': 'yarn', 'factor': 4.0})


def test_preset_sizes():
  # Published sizes: SmolLM2 "135M"; Qwen2.5-7B model card "7.61B" (tied vs untied matters).
  assert abs(param_count(init_abstract('smollm2-135m')) - 134.5e6) < 0.1e6
  assert abs(param_count(init_abstract('qwen2.5-7b')) - 7.61e9) < 0.01e9
  assert get_preset('tiny', vocab_size=16).vocab_size == 16


def init_abstract(name):
  from logra_jax.models.transformer import abstract_variables
  return abstract_variables(PRESETS[name])['params']


def test_smollm2_preset_matches_packaged_gguf():
  from logra_jax.models.gguf_io import packaged_smollm2_gguf
  path = packaged_smollm2_gguf()
  fields = gguf.GGUFReader(str(path)).fields
  value = lambda k: fields[k].contents()
  c = PRESETS['smollm2-135m']
  assert (value('llama.block_count'), value('llama.embedding_length'),
          value('llama.feed_forward_length'), value('llama.attention.head_count'),
          value('llama.attention.head_count_kv'), value('llama.context_length'),
          value('llama.vocab_size')) == (c.num_layers, c.hidden_size, c.intermediate_size,
                                          c.num_heads, c.num_kv_heads,
                                          c.max_position_embeddings, c.vocab_size)
  assert value('llama.rope.freq_base') == c.rope_theta
  assert abs(value('llama.attention.layer_norm_rms_epsilon') - c.rms_norm_eps) < 1e-12
  assert (value('tokenizer.ggml.bos_token_id'),) + (value('tokenizer.ggml.eos_token_id'),) == (
      c.bos_token_id, c.eos_token_ids[0])
