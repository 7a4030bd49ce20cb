"""ModelConfig: the one schema of a decoder-only Llama / Qwen2 model.

Frozen and hashable, so it can be a static argument of `jax.jit`. Converts to and from a
Hugging Face config (`transformers.PretrainedConfig` or the dict of a `config.json`), in both
the legacy (`rope_theta`, `rope_scaling`) and the transformers>=5 (`rope_parameters`) forms.
"""
import dataclasses
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp

ARCHITECTURES = {'llama': 'LlamaForCausalLM', 'qwen2': 'Qwen2ForCausalLM'}
REMAT_POLICIES = ('none', 'full', 'dots_saveable', 'nothing_saveable', 'everything_saveable',
                  'dots_with_no_batch_dims_saveable', 'checkpoint_dots',
                  'checkpoint_dots_with_no_batch_dims')
ROPE_TYPES = ('default', 'linear', 'llama3')
ATTENTION_KINDS = ('dense', 'blockwise')
_REQUIRED_HF = ('vocab_size', 'hidden_size', 'num_hidden_layers', 'num_attention_heads',
                'intermediate_size')


def _freeze(value):
  """Makes a JSON value hashable: dicts -> sorted item tuples, lists -> tuples."""
  if isinstance(value, Mapping):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  if isinstance(value, (list, tuple)):
    return tuple(_freeze(v) for v in value)
  return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shape and numerics of a decoder-only transformer (Llama / Qwen2 family).

  `rope_scaling` is the HF rope-scaling dict frozen to a tuple of sorted (key, value) items
  (see `rope_scaling_dict`), or None. `head_dim` defaults to hidden_size // num_heads.
  `remat_policy` names a `jax.checkpoint_policies` entry, or 'none' / 'full'.
  `attention` is 'dense' (all L×L scores at once) or 'blockwise' (online softmax over blocks
  of `attention_block` queries and keys); `vocab_chunk` > 0 computes the training losses and
  KL probes over vocabulary chunks of that size from the final hidden states (0: full logits).
  These three change memory, not the model (they are not part of an HF config).
  """
  vocab_size: int
  hidden_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: Optional[int] = None
  intermediate_size: int
  rope_theta: float = 10000.0
  rope_scaling: Optional[tuple] = None
  rms_norm_eps: float = 1e-6
  qkv_bias: bool = False
  tie_embeddings: bool = False
  max_position_embeddings: int = 2048
  architecture: str = 'llama'
  bos_token_id: Optional[int] = None
  eos_token_ids: tuple = ()
  pad_token_id: Optional[int] = None
  dtype: str = 'float32'
  param_dtype: str = 'float32'
  remat_policy: str = 'none'
  attention: str = 'dense'
  attention_block: int = 512
  vocab_chunk: int = 0

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, 'head_dim', self.hidden_size // max(self.num_heads, 1))
    object.__setattr__(self, 'eos_token_ids', tuple(self.eos_token_ids))
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, 'rope_scaling', _freeze(self.rope_scaling))
    self._validate()

  def _validate(self):
    for name in ('vocab_size', 'hidden_size', 'num_layers', 'num_heads', 'num_kv_heads',
                 'head_dim', 'intermediate_size', 'max_position_embeddings'):
      if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
        raise ValueError(f'ModelConfig.{name} must be a positive int, got {getattr(self, name)!r}')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'ModelConfig.num_heads ({self.num_heads}) must be a multiple of '
                       f'num_kv_heads ({self.num_kv_heads})')
    if self.head_dim % 2:
      raise ValueError(f'ModelConfig.head_dim must be even for RoPE, got {self.head_dim}')
    if self.architecture not in ARCHITECTURES:
      raise ValueError(f'ModelConfig.architecture must be one of {tuple(ARCHITECTURES)}, '
                       f'got {self.architecture!r}')
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f'ModelConfig.remat_policy must be one of {REMAT_POLICIES}, '
                       f'got {self.remat_policy!r}')
    for name in ('dtype', 'param_dtype'):
      try:
        jnp.dtype(getattr(self, name))
      except TypeError as e:
        raise ValueError(f'ModelConfig.{name}: unknown dtype {getattr(self, name)!r}') from e
    if self.attention not in ATTENTION_KINDS:
      raise ValueError(f'ModelConfig.attention must be one of {ATTENTION_KINDS}, '
                       f'got {self.attention!r}')
    if not isinstance(self.attention_block, int) or self.attention_block <= 0:
      raise ValueError(f'ModelConfig.attention_block must be a positive int, '
                       f'got {self.attention_block!r}')
    if not isinstance(self.vocab_chunk, int) or self.vocab_chunk < 0:
      raise ValueError(f'ModelConfig.vocab_chunk must be an int >= 0 (0: off), '
                       f'got {self.vocab_chunk!r}')
    rope_type = self.rope_scaling_dict.get('rope_type', 'default')
    if rope_type not in ROPE_TYPES:
      raise ValueError(f'ModelConfig.rope_scaling: rope_type {rope_type!r} is not supported '
                       f'(supported: {ROPE_TYPES})')

  @property
  def rope_scaling_dict(self) -> dict:
    """The rope-scaling settings as a dict ({} when none); 'type' is normalised to 'rope_type'."""
    d = {k: v for k, v in (self.rope_scaling or ())}
    if 'type' in d and 'rope_type' not in d:
      d['rope_type'] = d.pop('type')
    return d

  @property
  def jnp_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def jnp_param_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def checkpoint_policy(self):
    """The jax.checkpoint policy (None = save nothing) or False when remat is off."""
    if self.remat_policy == 'none':
      return False
    if self.remat_policy == 'full':
      return None
    return getattr(jax.checkpoint_policies, self.remat_policy)

  def replace(self, **kw) -> 'ModelConfig':
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf_config(cls, cfg: Any, **overrides) -> 'ModelConfig':
    """From a `transformers.PretrainedConfig` or a `config.json` dict; `overrides` win."""
    d = cfg.to_dict() if hasattr(cfg, 'to_dict') else dict(cfg)
    arch = _hf_architecture(d)
    missing = [k for k in _REQUIRED_HF if d.get(k) is None]
    if missing:
      raise ValueError(f'HF config is missing required field(s): {", ".join(missing)}')
    if d.get('hidden_act', 'silu') != 'silu':
      raise ValueError(f"HF config field hidden_act={d['hidden_act']!r}: only 'silu' is supported")
    if d.get('mlp_bias'):
      raise ValueError('HF config field mlp_bias=True is not supported')
    rope_theta, rope_scaling = _hf_rope(d)
    eos = d.get('eos_token_id')
    eos = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
    kw = dict(
        vocab_size=d['vocab_size'], hidden_size=d['hidden_size'],
        num_layers=d['num_hidden_layers'], num_heads=d['num_attention_heads'],
        num_kv_heads=d.get('num_key_value_heads') or d['num_attention_heads'],
        head_dim=d.get('head_dim') or d['hidden_size'] // d['num_attention_heads'],
        intermediate_size=d['intermediate_size'], rope_theta=float(rope_theta),
        rope_scaling=rope_scaling, rms_norm_eps=float(d.get('rms_norm_eps', 1e-6)),
        qkv_bias=True if arch == 'qwen2' else bool(d.get('attention_bias', False)),
        tie_embeddings=bool(d.get('tie_word_embeddings', False)),
        max_position_embeddings=d.get('max_position_embeddings') or 2048,
        architecture=arch, bos_token_id=d.get('bos_token_id'), eos_token_ids=eos,
        pad_token_id=d.get('pad_token_id'))
    kw.update(overrides)
    return cls(**kw)

  def to_hf_config(self) -> dict:
    """A `config.json` dict for LlamaForCausalLM / Qwen2ForCausalLM (legacy rope keys)."""
    d = {
        'architectures': [ARCHITECTURES[self.architecture]],
        'model_type': self.architecture, 'hidden_act': 'silu',
        'vocab_size': self.vocab_size, 'hidden_size': self.hidden_size,
        'num_hidden_layers': self.num_layers, 'num_attention_heads': self.num_heads,
        'num_key_value_heads': self.num_kv_heads, 'head_dim': self.head_dim,
        'intermediate_size': self.intermediate_size, 'rope_theta': self.rope_theta,
        'rope_scaling': self.rope_scaling_dict or None, 'rms_norm_eps': self.rms_norm_eps,
        'tie_word_embeddings': self.tie_embeddings,
        'max_position_embeddings': self.max_position_embeddings,
        'bos_token_id': self.bos_token_id,
        'eos_token_id': (self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                         else list(self.eos_token_ids) or None),
        'pad_token_id': self.pad_token_id, 'torch_dtype': self.param_dtype,
    }
    if self.architecture == 'llama':
      d.update(attention_bias=self.qkv_bias, mlp_bias=False)
    elif not self.qkv_bias:
      raise ValueError('ModelConfig.qkv_bias=False cannot be expressed as a Qwen2 HF config')
    return d


def _hf_architecture(d: dict) -> str:
  model_type = d.get('model_type')
  if model_type is None:
    archs = d.get('architectures') or []
    by_class = {v: k for k, v in ARCHITECTURES.items()}
    model_type = next((by_class[a] for a in archs if a in by_class), None)
    if model_type is None:
      raise ValueError(f'HF config field model_type is missing and architectures={archs!r} '
                       f'is not one of {tuple(by_class)}')
  if model_type not in ARCHITECTURES:
    raise ValueError(f'HF config field model_type={model_type!r} is not supported '
                     f'(supported: {tuple(ARCHITECTURES)})')
  return model_type


def _hf_rope(d: dict):
  """(rope_theta, frozen rope_scaling or None) from legacy or transformers>=5 keys."""
  params = dict(d.get('rope_parameters') or {})
  scaling = dict(d.get('rope_scaling') or {})
  theta = d.get('rope_theta', params.pop('rope_theta', scaling.pop('rope_theta', 10000.0)))
  params.pop('rope_theta', None)
  scaling = scaling or params
  if 'type' in scaling and 'rope_type' not in scaling:
    scaling['rope_type'] = scaling.pop('type')
  if scaling.get('rope_type', 'default') == 'default':
    return theta, None
  return theta, _freeze(scaling)
