"""Hugging Face checkpoint directory <-> our stacked param tree.

A directory holds `config.json`, `model.safetensors` (or shards listed in
`model.safetensors.index.json`) and tokenizer files. HF stores a projection weight as
(out, in); our Flax kernels are (in, out), stacked over layers on a leading axis N:

    params, config = load_hf_checkpoint('/path/to/dir')
    save_hf_checkpoint('/tmp/export', params, config, tokenizer=tok)  # transformers / vLLM load it

The name mapping is one declarative table per model family (`WEIGHT_TABLES`). Loading checks
every tensor's presence and shape against the model's own abstract shapes, and names the
tensor in the error. The library reads and writes tensors with numpy only (no torch).
"""
import dataclasses
import functools
import json
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from logra_jax.models.config import ModelConfig, _hf_architecture
from logra_jax.models.transformer import abstract_variables

SAFETENSORS = 'model.safetensors'
SAFETENSORS_INDEX = 'model.safetensors.index.json'


@dataclasses.dataclass(frozen=True)
class WeightSpec:
  """One HF tensor. `hf_name` has `{i}` for a per-layer tensor (stacked on axis 0 in ours);
  `transpose`: HF (out, in) <-> ours (in, out); `when`: None, 'qkv_bias' or 'untied'."""
  path: tuple
  hf_name: str
  transpose: bool = False
  when: Optional[str] = None


def _llama_table() -> tuple:
  layer = 'model.layers.{i}.'
  table = [
      WeightSpec(('embed', 'embedding'), 'model.embed_tokens.weight'),
      WeightSpec(('layers', 'attn_norm', 'scale'), layer + 'input_layernorm.weight'),
      WeightSpec(('layers', 'mlp_norm', 'scale'), layer + 'post_attention_layernorm.weight'),
      WeightSpec(('final_norm', 'scale'), 'model.norm.weight'),
      WeightSpec(('lm_head', 'kernel'), 'lm_head.weight', True, 'untied'),
  ]
  for name in ('q_proj', 'k_proj', 'v_proj', 'o_proj'):
    table.append(WeightSpec(('layers', 'attn', name, 'kernel'),
                            f'{layer}self_attn.{name}.weight', True))
  for name in ('q_proj', 'k_proj', 'v_proj'):
    table.append(WeightSpec(('layers', 'attn', name, 'bias'),
                            f'{layer}self_attn.{name}.bias', when='qkv_bias'))
  for name in ('gate_proj', 'up_proj', 'down_proj'):
    table.append(WeightSpec(('layers', 'mlp', name, 'kernel'), f'{layer}mlp.{name}.weight', True))
  return tuple(table)


# Llama (optional attention_bias) and Qwen2 (always q/k/v biases) share HF names; a new
# family with other names adds its own table here.
WEIGHT_TABLES = {'llama': _llama_table(), 'qwen2': _llama_table()}


def weight_specs(config: ModelConfig) -> tuple:
  """The table entries that exist for this config (biases, untied head)."""
  active = {None, 'qkv_bias' if config.qkv_bias else None,
            'untied' if not config.tie_embeddings else None}
  return tuple(s for s in WEIGHT_TABLES[config.architecture] if s.when in active)


@functools.lru_cache(maxsize=16)
def projection_name_fn(config: ModelConfig):
  """(kernel path 'layers/attn/q_proj/kernel', layer) -> its HF tensor name, the name that
  seeds the kernel's projection A so that a generator rebuilds A from HF names alone."""
  table = {'/'.join(s.path): s.hf_name for s in weight_specs(config) if s.transpose}

  def name_fn(name, layer):
    if name not in table:
      raise ValueError(f'no HF tensor for sketched kernel {name!r}')
    return table[name].format(i=layer)
  return name_fn


def param_shapes(config: ModelConfig) -> dict:
  """{path tuple: shape} of every param of the model, from Flax's abstract init."""
  params = abstract_variables(config)['params']
  flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: hasattr(x, 'value'))[0]
  shape = lambda x: tuple((x.value if hasattr(x, 'value') else x).shape)
  return {tuple(k.key for k in path): shape(x) for path, x in flat}


def _set(tree: dict, path: tuple, value):
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def read_generation_eos(directory: str) -> tuple:
  """The `eos_token_id` (one id or a list) of `directory/generation_config.json`, or ()."""
  path = os.path.join(directory, 'generation_config.json')
  if not os.path.isfile(path):
    return ()
  with open(path) as f:
    eos = json.load(f).get('eos_token_id')
  ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f'{path}: field eos_token_id must be a token id or a list of them, '
                     f'got {eos!r}')
  return ids


def read_hf_config(directory: str) -> ModelConfig:
  """`ModelConfig` from `directory/config.json` (errors name the bad field).

  Its `eos_token_ids` are config.json's followed by any other ids generation_config.json
  lists (chat models list their end-of-turn ids there).
  """
  path = os.path.join(directory, 'config.json')
  if not os.path.isfile(path):
    raise FileNotFoundError(f'no config.json in HF checkpoint directory {directory!r}')
  with open(path) as f:
    fields = json.load(f)
  model_type = _hf_architecture(fields)  # our error naming the field, before transformers'
  # Through transformers' config class for the family, so its defaults fill absent fields.
  from transformers import AutoConfig  # pylint: disable=g-import-not-at-top
  fields = {k: v for k, v in fields.items() if k != 'model_type'}
  config = ModelConfig.from_hf_config(AutoConfig.for_model(model_type, **fields))
  eos = tuple(dict.fromkeys(config.eos_token_ids + read_generation_eos(directory)))
  return config.replace(eos_token_ids=eos)


def _tensor_files(directory: str) -> dict:
  """{HF tensor name: safetensors file}, from the shard index or the single file."""
  index = os.path.join(directory, SAFETENSORS_INDEX)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f)['weight_map']
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  files = sorted(f for f in os.listdir(directory) if f.endswith('.safetensors'))
  if not files:
    raise FileNotFoundError(f'no *.safetensors file in HF checkpoint directory {directory!r}')
  names = {}
  for file in files:
    with safe_open(os.path.join(directory, file), 'np') as h:
      names.update({name: os.path.join(directory, file) for name in h.keys()})
  return names


class _TensorReader:
  """Reads named tensors from a set of safetensors files, each opened once."""

  def __init__(self, files: dict):
    self.files, self._handles = files, {}

  def get(self, name: str) -> np.ndarray:
    file = self.files[name]
    if file not in self._handles:
      self._handles[file] = safe_open(file, 'np')
    return self._handles[file].get_tensor(name)


def _read(get_tensor, names, spec: WeightSpec, num_layers: int):
  """(array in our layout, a description for errors) for one table entry."""
  per_layer = '{i}' in spec.hf_name
  wanted = [spec.hf_name.format(i=i) for i in range(num_layers)] if per_layer else [spec.hf_name]
  missing = [n for n in wanted if n not in names]
  if missing:
    raise ValueError(f'checkpoint is missing tensor {missing[0]!r}'
                     + (f' ({len(missing)} of {num_layers} layers missing)' if per_layer else ''))
  arrays = [get_tensor(n) for n in wanted]
  arrays = [a.T if spec.transpose else a for a in arrays]
  notes = (['stacked over layers'] if per_layer else []) + (['transposed'] if spec.transpose else [])
  shown = spec.hf_name.replace('{i}', '*') + (f' ({", ".join(notes)})' if notes else '')
  return (np.stack(arrays) if per_layer else arrays[0]), shown


def params_from_hf_tensors(get_tensor, names, config: ModelConfig, dtype: Any = None) -> dict:
  """Our param tree (numpy) from HF-named tensors.

  Args:
    get_tensor: name -> numpy array in HF layout.
    names: the available tensor names.
    config: the model; every param's presence and shape is checked against it.
    dtype: storage dtype (default `config.param_dtype`).
  """
  dtype = jnp.dtype(dtype or config.param_dtype)
  shapes, params = param_shapes(config), {}
  for spec in weight_specs(config):
    array, shown = _read(get_tensor, names, spec, config.num_layers)
    want = shapes[spec.path]
    if tuple(array.shape) != want:
      raise ValueError(f'tensor {shown} has shape {tuple(array.shape)}, but the model '
                       f'expects {want} at params/{"/".join(spec.path)}')
    _set(params, spec.path, np.ascontiguousarray(array.astype(dtype)))
  unmapped = set(shapes) - {s.path for s in weight_specs(config)}
  if unmapped:
    raise ValueError(f'no checkpoint tensor maps to params {sorted(unmapped)}')
  return params


def load_hf_checkpoint(directory: str, dtype: Any = None):
  """(params as numpy arrays, ModelConfig) from an HF checkpoint directory."""
  config = read_hf_config(directory)
  reader = _TensorReader(_tensor_files(directory))
  return params_from_hf_tensors(reader.get, reader.files, config, dtype), config


def hf_tensors(params: dict, config: ModelConfig) -> dict:
  """{HF name: contiguous numpy array (out, in)} from our tree (per layer, unstacked)."""
  out = {}
  for spec in weight_specs(config):
    array = np.asarray(jax.device_get(_get(params, spec.path)))
    layers = (enumerate(array) if '{i}' in spec.hf_name else [(None, array)])
    for i, a in layers:
      out[spec.hf_name.format(i=i)] = np.ascontiguousarray(a.T if spec.transpose else a)
  return out


def generation_config(config: ModelConfig) -> dict:
  eos = list(config.eos_token_ids)
  return {'bos_token_id': config.bos_token_id,
          'eos_token_id': eos[0] if len(eos) == 1 else (eos or None),
          'pad_token_id': config.pad_token_id, 'do_sample': False}


def save_hf_checkpoint(directory: str, params: dict, config: ModelConfig, tokenizer=None,
                       max_shard_bytes: Optional[int] = None) -> str:
  """Writes config.json, generation_config.json, safetensors (sharded with an index when
  larger than `max_shard_bytes`) and, if given, the tokenizer's files. Returns `directory`."""
  os.makedirs(directory, exist_ok=True)
  tensors = hf_tensors(params, config)
  hf_config = config.to_hf_config()
  for name, value in (('config.json', hf_config),
                      ('generation_config.json', generation_config(config))):
    with open(os.path.join(directory, name), 'w') as f:
      json.dump(value, f, indent=2)
  shards = _shard(tensors, max_shard_bytes)
  if len(shards) == 1:
    save_file(tensors, os.path.join(directory, SAFETENSORS), metadata={'format': 'pt'})
  else:
    weight_map = {}
    for k, shard in enumerate(shards):
      file = f'model-{k + 1:05d}-of-{len(shards):05d}.safetensors'
      save_file(shard, os.path.join(directory, file), metadata={'format': 'pt'})
      weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for a in tensors.values())
    with open(os.path.join(directory, SAFETENSORS_INDEX), 'w') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2)
  if tokenizer is not None:
    tokenizer.save_pretrained(directory)
  return directory


def _shard(tensors: dict, max_bytes: Optional[int]) -> list:
  if not max_bytes:
    return [tensors]
  shards, size = [{}], 0
  for name, array in tensors.items():
    if shards[-1] and size + array.nbytes > max_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = array
    size += array.nbytes
  return shards
