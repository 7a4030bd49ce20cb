"""Checkpoint I/O: the real SmolLM2 GGUF against transformers, HF export round trips, errors.

torch and transformers' modelling code are the reference here only (the library never imports
torch). Logit tolerance: both sides run the same float32 maths with different summation
orders; on SmolLM2-135M the measured max |ours - HF| is ~4e-6 of the largest |logit| (~1.5e-4
absolute at logits up to ~38). A real conversion bug (q/k permutation, transposition, a norm,
rope) moves logits by O(1), i.e. > 1e-2 of the scale (`test_gguf_qk_permutation_matters`
shows it), so a bound of 2e-5 of the scale is 5x above the noise and far below any bug.
"""
import copy
import dataclasses
import json
import os
import subprocess
import sys

import gguf
import jax
import numpy as np
import pytest
import tokenizers
import torch
import transformers

from logra_jax import models
from logra_jax.models import gguf_io, hf_io, stops
from logra_jax.train import tasks
from logra_jax.train.config import TrainConfig

# One torch thread: with 2 cores shared with JAX (and other jobs) torch's OpenMP threads spin
# against each other; measured 25 s -> 1.2 s for a 16-token HF generate here.
torch.set_num_threads(1)

REL_TOL = 2e-5  # of max |logit|; see the module docstring
GGUF_PATH = gguf_io.packaged_smollm2_gguf()
CHATS = [
    [{'role': 'user', 'content': 'What is the capital of France?'}],
    [{'role': 'user', 'content': 'Write a short poem about the sea.'}],
    [{'role': 'system', 'content': 'You are a terse math tutor.'},
     {'role': 'user', 'content': 'What is 17 * 23? Explain step by step.'}],
    [{'role': 'user', 'content': 'List three uses of a paperclip.'}],
]


def rel_err(ours, ref):
  return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def hf_logits(hf_model, ids):
  with torch.no_grad():
    return hf_model(torch.tensor([ids])).logits.numpy()


@pytest.fixture(scope='module')
def smollm():
  return models.load(GGUF_PATH)


@pytest.fixture(scope='module')
def prompts(smollm):
  return [smollm.tokenizer.apply_chat_template(c, add_generation_prompt=True,
                                               return_dict=False) for c in CHATS]


@pytest.fixture(scope='module')
def hf_smollm():
  return transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH), dtype=torch.float32)


@pytest.fixture(scope='module')
def export_dir(smollm, tmp_path_factory):
  return smollm.save(str(tmp_path_factory.mktemp('smollm2_hf')))


# --- the real model -----------------------------------------------------------------------


def test_gguf_config(smollm):
  assert smollm.config == models.get_preset('smollm2-135m', rms_norm_eps=smollm.config.rms_norm_eps)
  assert abs(smollm.config.rms_norm_eps - 1e-5) < 1e-12  # stored as float32 in the GGUF


def test_gguf_logits_match_transformers(smollm, hf_smollm, prompts):
  for ids in prompts:
    assert rel_err(smollm.logits(ids)[0], hf_logits(hf_smollm, ids)[0]) < REL_TOL


def test_gguf_greedy_matches_transformers(smollm, hf_smollm, prompts):
  """16 greedy tokens, EOS ignored on both sides so every row has exactly 16.

  The attention mask must be passed to HF: without it `generate` masks every token equal to
  pad_token_id (2 = <|im_end|>, which chat prompts contain) and diverges from its own forward.
  """
  ours = smollm.generate(prompts, max_new_tokens=16, stop_token_ids=())
  for ids, row in zip(prompts, ours):
    ids_1xL = torch.tensor([ids])
    ref = hf_smollm.generate(ids_1xL, attention_mask=torch.ones_like(ids_1xL), max_new_tokens=16,
                             do_sample=False, eos_token_id=None)[0, len(ids):].tolist()
    assert row == ref and len(row) == 16


def test_gguf_qk_permutation_matters(smollm, hf_smollm, prompts):
  """Without undoing llama.cpp's q/k row permutation the logits are far off."""
  c = smollm.config
  permute = lambda k, n: np.stack([_llamacpp_permute(np.asarray(w).T, n).T for w in k])
  attn = smollm.params['layers']['attn']
  bad_attn = dict(attn, q_proj={'kernel': permute(attn['q_proj']['kernel'], c.num_heads)},
                  k_proj={'kernel': permute(attn['k_proj']['kernel'], c.num_kv_heads)})
  bad = dict(smollm.params, layers=dict(smollm.params['layers'], attn=bad_attn))
  wrong = models.Model(c, bad, 'permuted').logits(prompts[0])[0]
  assert rel_err(wrong, hf_logits(hf_smollm, prompts[0])[0]) > 1e-2


def _llamacpp_permute(w, n_head):
  """convert_hf_to_gguf.py's LlamaModel.permute, on an HF (out, in) weight."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def test_export_loads_in_transformers(smollm, export_dir, prompts):
  files = set(os.listdir(export_dir))
  assert {'config.json', 'generation_config.json', 'model.safetensors'} <= files
  hf = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
  for ids in prompts[:2]:
    assert rel_err(smollm.logits(ids)[0], hf_logits(hf, ids)[0]) < REL_TOL
  tok = transformers.AutoTokenizer.from_pretrained(export_dir)
  chat = tok.apply_chat_template(CHATS[2], add_generation_prompt=True, return_dict=False)
  assert chat == prompts[2]


def test_export_reload_is_exact(smollm, export_dir):
  again = models.load(export_dir)
  assert again.config == smollm.config
  jax.tree.map(np.testing.assert_array_equal, again.params, smollm.params)


ARITH = [{'role': 'user', 'content': 'What is 2+2? Answer with a number only.'}]


def test_chat_model_stops_at_end_of_turn(smollm, prompts):
  """A tokenizer whose eos is `<|endoftext|>` while turns end with `<|im_end|>` (as Qwen2.5's
  base tokenizers): stopping on eos alone runs to max_new_tokens; the full stop set stops.

  The packaged SmolLM2 tokenizer's eos is `<|im_end|>` itself; the copy only renames eos.
  Same 4-row batch shape as the greedy test above, so the sampler compiles once for both.
  """
  tok = copy.deepcopy(smollm.tokenizer)
  tok.eos_token = '<|endoftext|>'
  im_end = tok.convert_tokens_to_ids('<|im_end|>')
  assert (tok.eos_token_id, im_end, stops.end_of_turn_token_id(smollm.tokenizer)) == (0, 2, 2)
  assert smollm.stop_token_ids == (2,)
  chat = models.Model(smollm.config.replace(eos_token_ids=(0,)), smollm.params, 'eos 0',
                      lambda: tok)
  assert chat.stop_token_ids == (0, im_end)
  ids = prompts[:3] + [tok.apply_chat_template(ARITH, add_generation_prompt=True,
                                               return_dict=False)]
  eos_only = chat.generate(ids, max_new_tokens=16, stop_token_ids=[tok.eos_token_id])
  stopped = chat.generate(ids, max_new_tokens=16)
  assert len(eos_only[3]) == 16  # '2 + 2 = 4<|im_end|>' and on, never <|endoftext|>
  assert stopped[3][-1] == im_end and len(stopped[3]) < 16
  assert tok.decode(stopped[3], skip_special_tokens=True).strip() == '2 + 2 = 4'
  assert stopped[3] == eos_only[3][:len(stopped[3])]


def file_task_config(tmp_path, model_path=''):
  """A TrainConfig whose prompts are a 10-problem JSONL file (chat template on)."""
  problems = tmp_path / 'problems.jsonl'
  problems.write_text(''.join(json.dumps({'problem': f'what is {i}', 'answer': str(i)}) + '\n'
                              for i in range(10)))
  cfg = TrainConfig()
  return dataclasses.replace(
      cfg, data=dataclasses.replace(cfg.data, source='file', path=str(problems),
                                    prompts_per_step=2),
      model=dataclasses.replace(cfg.model, path=model_path))


def test_task_stop_ids_include_the_end_of_turn_token(smollm, tmp_path):
  """The RL task's stop ids (what every rollout request carries) on the SmolLM2 tokenizer
  with eos renamed as above: <|endoftext|> and the template's <|im_end|>."""
  tok = copy.deepcopy(smollm.tokenizer)
  tok.eos_token = '<|endoftext|>'
  assert tasks.build_task(file_task_config(tmp_path), tokenizer=tok).stop_ids == (0, 2)
  assert tasks.build_task(file_task_config(tmp_path), tokenizer=smollm.tokenizer).stop_ids == (2,)


# --- tiny models: every family variant, sharding, errors ------------------------------------


def tiny_config(**kw):
  base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              intermediate_size=48, rope_theta=500.0, rms_norm_eps=1e-5,
              max_position_embeddings=128, bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
  return models.ModelConfig(**{**base, **kw})


def random_params(config, seed=0):
  """init_params with every leaf redrawn (norm scales near 1, biases nonzero)."""
  rng = np.random.default_rng(seed)
  draw = lambda path, x: np.asarray(
      (1.0 + 0.2 * rng.normal(size=x.shape)) if path[-1].key == 'scale'
      else 0.3 * rng.normal(size=x.shape), np.float32)
  return jax.tree_util.tree_map_with_path(draw, models.init_params(config, jax.random.key(0)))


@pytest.mark.parametrize('kw', [dict(), dict(tie_embeddings=True),
                                dict(architecture='qwen2', qkv_bias=True),
                                dict(qkv_bias=True)], ids=['llama', 'tied', 'qwen2', 'llama_bias'])
def test_tiny_export_matches_transformers(kw, tmp_path):
  config = tiny_config(**kw)
  model = models.Model(config, random_params(config), 'random')
  model.save(str(tmp_path))
  hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  assert type(hf).__name__ == hf_io_arch(config)
  ids = [1, 5, 9, 33, 7, 2, 60, 11]
  assert rel_err(model.logits(ids)[0], hf_logits(hf, ids)[0]) < REL_TOL


def hf_io_arch(config):
  return {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM'}[config.architecture]


def hf_random_model(model_cls, hf_config, seed=0):
  """A transformers model with every parameter redrawn (its init zeroes the q/k/v biases)."""
  torch.manual_seed(seed)
  hf = model_cls(hf_config).float().eval()
  with torch.no_grad():
    for name, p in hf.named_parameters():
      noise = torch.randn(p.shape)
      p.copy_(1.0 + 0.2 * noise if name.endswith('norm.weight') else 0.3 * noise)
  return hf


ROPE_SCALINGS = {'linear': {'rope_type': 'linear', 'factor': 4.0},
                 # original context 256 over head_dim 32, theta 1e4: wavelengths 6..283k put
                 # frequencies in all three llama3 bands (kept, smoothed, divided by factor).
                 'llama3': {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
                            'high_freq_factor': 4.0, 'original_max_position_embeddings': 256}}


@pytest.mark.parametrize('kind', sorted(ROPE_SCALINGS))
def test_rope_scaled_llama_matches_transformers(kind, tmp_path):
  """A random LlamaForCausalLM with rope scaling, saved by transformers, through our loader.

  48 positions so the low frequencies turn far enough for the scaling to move the logits.
  Measured max |ours - HF| / max |HF|: 2.8e-6 (linear), 3.3e-6 (llama3), under REL_TOL; with
  the scaling dropped 1.5 and 0.83 (checked below: > 1e-2).
  """
  hf_config = transformers.LlamaConfig(
      vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
      num_key_value_heads=1, head_dim=32, intermediate_size=48, rope_theta=10000.0,
      max_position_embeddings=1024, rope_scaling=ROPE_SCALINGS[kind], tie_word_embeddings=False)
  hf = hf_random_model(transformers.LlamaForCausalLM, hf_config)
  hf.save_pretrained(str(tmp_path))
  ours = models.load(str(tmp_path))
  assert ours.config.rope_scaling_dict['rope_type'] == kind
  ids = np.random.default_rng(0).integers(0, 64, size=48).tolist()
  ref = hf_logits(hf, ids)[0]
  assert rel_err(ours.logits(ids)[0], ref) < REL_TOL
  unscaled = models.Model(ours.config.replace(rope_scaling=None), ours.params, 'unscaled')
  assert rel_err(unscaled.logits(ids)[0], ref) > 1e-2


def test_qwen2_checkpoint_from_transformers(tmp_path):
  """A random Qwen2ForCausalLM (q/k/v biases redrawn nonzero, tied head as in Qwen2.5-0.5B
  and -1.5B) saved by transformers, loaded by our HF loader. Measured 9.3e-7 of the scale
  (REL_TOL 2e-5); with the biases zeroed it is 0.63."""
  hf_config = transformers.Qwen2Config(
      vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, intermediate_size=48, rope_theta=1e6, rms_norm_eps=1e-6,
      max_position_embeddings=128, tie_word_embeddings=True)
  hf = hf_random_model(transformers.Qwen2ForCausalLM, hf_config)
  hf.save_pretrained(str(tmp_path))
  ours = models.load(str(tmp_path))
  assert (ours.config.architecture, ours.config.qkv_bias, ours.config.tie_embeddings) == (
      'qwen2', True, True)
  bias = np.asarray(ours.params['layers']['attn']['k_proj']['bias'])
  np.testing.assert_array_equal(
      bias[1], hf.model.layers[1].self_attn.k_proj.bias.detach().numpy())
  ids = [1, 5, 9, 33, 7, 2, 60, 11, 0, 42, 17, 3]
  assert rel_err(ours.logits(ids)[0], hf_logits(hf, ids)[0]) < REL_TOL


def test_sharded_round_trip(tmp_path):
  config = tiny_config(architecture='qwen2', qkv_bias=True)
  params = random_params(config)
  hf_io.save_hf_checkpoint(str(tmp_path), params, config, max_shard_bytes=20_000)
  with open(tmp_path / hf_io.SAFETENSORS_INDEX) as f:
    shards = set(json.load(f)['weight_map'].values())
  assert len(shards) > 2 and not (tmp_path / hf_io.SAFETENSORS).exists()
  loaded, config2 = hf_io.load_hf_checkpoint(str(tmp_path))
  assert config2 == config
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_preset_load():
  model = models.load('tiny')
  assert model.tokenizer is None and model.config == models.get_preset('tiny')
  assert model.logits([[1, 2, 3], [4, 5, 6]]).shape == (2, 3, 32)
  new = model.generate([1, 5, 7], max_new_tokens=4, stop_token_ids=())
  assert len(new) == 4 and all(0 <= t < 32 for t in new)


def write_tiny_gguf(path, params, config, arch='llama', q8_1_tensor=None, eot_token_id=None):
  """A GGUF as llama.cpp's converter writes it: HF layout, q/k rows permuted (llama)."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(config.num_layers)
  w.add_context_length(config.max_position_embeddings)
  w.add_embedding_length(config.hidden_size)
  w.add_feed_forward_length(config.intermediate_size)
  w.add_head_count(config.num_heads)
  w.add_head_count_kv(config.num_kv_heads)
  w.add_rope_freq_base(config.rope_theta)
  w.add_layer_norm_rms_eps(config.rms_norm_eps)
  w.add_vocab_size(config.vocab_size)
  w.add_bos_token_id(config.bos_token_id)
  w.add_eos_token_id(config.eos_token_ids[0])
  w.add_pad_token_id(config.pad_token_id)
  if eot_token_id is not None:
    w.add_eot_token_id(eot_token_id)
  to_gguf = {hf: g for g, hf in gguf_io.GGUF_TO_HF.items()}
  for name, array in hf_io.hf_tensors(params, config).items():
    key = name if '.layers.' not in name else '.'.join(
        name.split('.')[:2] + ['{i}'] + name.split('.')[3:])
    g = to_gguf[key].format(i=name.split('.')[2] if '{i}' in key else '')
    if name.endswith(('q_proj.weight', 'k_proj.weight')):
      n = config.num_heads if 'q_proj' in name else config.num_kv_heads
      array = _llamacpp_permute(array, n)
    if g == q8_1_tensor:  # raw Q8_1 blocks: 32 values in 40 bytes
      array = np.zeros((array.shape[0], array.shape[1] // 32 * 40), np.uint8)
      w.add_tensor(g, array, raw_dtype=gguf.GGMLQuantizationType.Q8_1)
    else:
      w.add_tensor(g, array)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


def test_tiny_gguf_round_trip(tmp_path):
  config = tiny_config()
  params = random_params(config)
  loaded, config2 = gguf_io.load_gguf(write_tiny_gguf(tmp_path / 'm.gguf', params, config))
  assert config2 == config.replace(rms_norm_eps=float(np.float32(1e-5)))  # GGUF stores f32
  jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_tiny_gguf_eot_token_is_a_stop_id(tmp_path):
  config = tiny_config()
  path = write_tiny_gguf(tmp_path / 'm.gguf', random_params(config), config, eot_token_id=9)
  assert gguf_io.load_gguf(path)[1].eos_token_ids == (2, 9)


def chat_tokenizer():
  """A word-level tokenizer: eos <|endoftext|> (2), turns end with <|im_end|> (4)."""
  words = ['<unk>', '<s>', '<|endoftext|>', '<|im_start|>', '<|im_end|>', 'user', 'assistant']
  word = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token='<unk>'))
  word.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  word.add_special_tokens(['<|endoftext|>', '<|im_start|>', '<|im_end|>'])
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word, eos_token='<|endoftext|>',
                                             unk_token='<unk>', pad_token='<unk>')
  tok.chat_template = ('{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}'
                       '<|im_end|>\n{% endfor %}'
                       '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')
  return tok


def test_hf_dir_stop_set_from_generation_config_and_template(tmp_path):
  """generation_config.json lists several eos ids: all of them stop, as does the template's
  end-of-turn token; the RL task built from model.path carries the whole set."""
  config = tiny_config()
  model = models.Model(config, random_params(config), 'random')
  greedy = model.generate([1, 5, 9], max_new_tokens=8, stop_token_ids=())
  stop = greedy[1]  # a token of no other stop kind, emitted before any of them
  assert greedy[0] not in (2, 4, stop) and stop not in (2, 4)
  directory = tmp_path / 'hf'
  hf_io.save_hf_checkpoint(str(directory), model.params, config, tokenizer=chat_tokenizer())
  gen = json.loads((directory / 'generation_config.json').read_text())
  (directory / 'generation_config.json').write_text(json.dumps(gen | {'eos_token_id': [2, stop]}))
  loaded = models.load(str(directory))
  assert loaded.config.eos_token_ids == (2, stop)
  assert loaded.stop_token_ids == (2, stop, 4)
  assert loaded.generate([1, 5, 9], max_new_tokens=8) == greedy[:2]
  task = tasks.build_task(file_task_config(tmp_path, model_path=str(directory)))
  assert task.stop_ids == (2, stop, 4)


# --- bad input ------------------------------------------------------------------------------


@pytest.fixture
def tiny_export(tmp_path):
  config = tiny_config()
  hf_io.save_hf_checkpoint(str(tmp_path), random_params(config), config)
  return tmp_path


def _edit_config(directory, **changes):
  path = directory / 'config.json'
  cfg = json.loads(path.read_text())
  cfg.update(changes)
  path.write_text(json.dumps(cfg))


def test_error_unknown_architecture(tiny_export):
  _edit_config(tiny_export, model_type='mistral', architectures=['MistralForCausalLM'])
  with pytest.raises(ValueError, match="model_type='mistral'"):
    models.load(str(tiny_export))


def test_error_missing_tensor(tiny_export):
  from safetensors.numpy import load_file, save_file
  file = str(tiny_export / hf_io.SAFETENSORS)
  tensors = load_file(file)
  del tensors['model.layers.1.mlp.up_proj.weight']
  save_file(tensors, file)
  with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
    models.load(str(tiny_export))


def test_error_missing_lm_head_when_untied(tiny_export):
  _edit_config(tiny_export, tie_word_embeddings=False)
  from safetensors.numpy import load_file, save_file
  file = str(tiny_export / hf_io.SAFETENSORS)
  tensors = load_file(file)
  del tensors['lm_head.weight']
  save_file(tensors, file)
  with pytest.raises(ValueError, match="missing tensor 'lm_head.weight'"):
    models.load(str(tiny_export))


def test_error_shape_mismatch(tiny_export):
  _edit_config(tiny_export, intermediate_size=40)
  with pytest.raises(ValueError, match=r'mlp\.gate_proj\.weight .* has shape \(2, 32, 48\).*'
                                       r'expects \(2, 32, 40\)'):
    models.load(str(tiny_export))


def test_error_gguf_unreadable_quant_type(tmp_path):
  config = tiny_config()
  path = write_tiny_gguf(tmp_path / 'm.gguf', random_params(config), config,
                         q8_1_tensor='blk.1.ffn_up.weight')
  with pytest.raises(ValueError, match="'blk.1.ffn_up.weight' has quantization type Q8_1"):
    models.load(path)


def test_error_gguf_unknown_architecture(tmp_path):
  config = tiny_config()
  path = write_tiny_gguf(tmp_path / 'm.gguf', random_params(config), config, arch='gpt2')
  with pytest.raises(ValueError, match="general.architecture='gpt2'"):
    models.load(path)


def test_error_unknown_source():
  with pytest.raises(ValueError, match='neither an HF checkpoint directory'):
    models.load('no-such-model')


def test_gguf_tokenizer_builds_without_torch():
  """transformers' GGUF reader imports torch; ours must not (it is only in requirements-test)."""
  code = ('import sys; sys.modules["torch"] = None\n'
          'from logra_jax.models import gguf_io\n'
          'tok = gguf_io.gguf_tokenizer(gguf_io.packaged_smollm2_gguf())\n'
          'print(tok.encode("12 + 30 ="), tok.eos_token)\n')
  out = subprocess.run([sys.executable, '-c', code], check=True, capture_output=True,
                       text=True).stdout
  assert out.strip() == '[33, 34, 1232, 216, 35, 32, 446] <|im_end|>', out


TOKENIZER_TEXTS = (
    'Hello world', '  two  spaces\tand a tab\n\nnewlines', '12 + 30 = 42', '-7 - 1234567',
    'caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \U0001f600', '<answer>42</answer>',
    '<|im_start|>user\nhi<|im_end|>', "don't  I'll we've", '', ' leading', 'trailing ',
    'x' * 300)


def test_gguf_tokenizer_equals_transformers_own_loader(smollm):
  """Ours (gguf's reader, transformers' converter) against AutoTokenizer's GGUF path (which
  imports torch): the same ids, decodes, special tokens and chat template."""
  ref = transformers.AutoTokenizer.from_pretrained(
      os.path.dirname(GGUF_PATH), gguf_file=os.path.basename(GGUF_PATH), local_files_only=True)
  ours = smollm.tokenizer
  for text in TOKENIZER_TEXTS:
    ids = ours.encode(text)
    assert ids == ref.encode(text), text
    assert ours.decode(ids) == ref.decode(ids), text
  assert ours.all_special_tokens == ref.all_special_tokens
  assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
      ref.bos_token_id, ref.eos_token_id, ref.pad_token_id, ref.unk_token_id)
  assert ours.chat_template == ref.chat_template and ours.chat_template
  chat = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': '2 + 2?'}]
  assert ours.apply_chat_template(chat, add_generation_prompt=True) == ref.apply_chat_template(
      chat, add_generation_prompt=True)
  assert len(ours) == len(ref) == smollm.config.vocab_size
