"""`model.param_dtype`: validated, and the storage dtype of the trainer's params.

`tasks.build_model` (what the trainer calls) creates a preset's params, or loads a checkpoint's,
in `model.param_dtype`; the paper configs keep bf16 params for LoGRA and fp32 master weights for
the dense-AdamW baseline (what docs/memory.md plans). A checkpoint loaded in bf16 must hold
exactly the fp32 load rounded to bf16 (one round-to-nearest cast: compared bit for bit).
"""
import dataclasses
import importlib.util
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import models
from logra_jax.train import tasks
from logra_jax.train.config import TrainConfig, default_config, from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_model(cfg: TrainConfig, **kw) -> TrainConfig:
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **kw))


def dtypes(params) -> set:
  return {x.dtype for x in jax.tree.leaves(params)}


def test_default_is_float32_and_a_bad_value_names_the_key():
  assert TrainConfig().model.param_dtype == 'float32'
  cfg = default_config()
  cfg.model.param_dtype = 'float16'
  with pytest.raises(ValueError, match=r'model\.param_dtype=.float16. must be one of'):
    from_config_dict(cfg)
  cfg.model.param_dtype = 'bfloat16'
  assert from_config_dict(cfg).model.param_dtype == 'bfloat16'


@pytest.mark.parametrize('dtype', ['bfloat16', 'float32'])
def test_preset_params_are_created_in_param_dtype(dtype):
  cfg = with_model(TrainConfig(), param_dtype=dtype)
  task = tasks.build_task(cfg)
  _, mc, params = tasks.build_model(cfg, task)
  assert mc.param_dtype == dtype
  assert dtypes(params) == {jnp.dtype(dtype)}


def save_checkpoint(path):
  """A random 2-layer Llama-style checkpoint (config.json + safetensors) at ``path``."""
  config = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, intermediate_size=48, max_position_embeddings=64,
                              bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
  models.Model(config, models.init_params(config, jax.random.key(3)), 'random').save(str(path))


def test_checkpoint_is_loaded_in_param_dtype(tmp_path):
  save_checkpoint(tmp_path)
  base = with_model(TrainConfig(), path=str(tmp_path))
  task = tasks.build_task(TrainConfig())
  _, mc32, p32 = tasks.build_model(base, task)
  _, mc16, p16 = tasks.build_model(with_model(base, param_dtype='bfloat16'), task)
  assert (mc32.param_dtype, mc16.param_dtype) == ('float32', 'bfloat16')
  assert dtypes(p32) == {jnp.dtype('float32')} and dtypes(p16) == {jnp.dtype('bfloat16')}
  for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(p16)):
    np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def _paper_config(name, arg=None):
  spec = importlib.util.spec_from_file_location(f'_cfg_{name}',
                                                os.path.join(ROOT, 'configs', name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return from_config_dict(module.get_config(arg) if arg else module.get_config())


@pytest.mark.parametrize('name', ['qwen2_5_math_1_5b.py', 'qwen2_5_math_7b.py',
                                  'paper_27b_reasoning_gym.py'])
def test_paper_configs_bf16_params_for_logra_fp32_master_weights_for_adam(name):
  logra = _paper_config(name)
  assert (logra.optim.name, logra.model.param_dtype) == ('logra', 'bfloat16')
  if name.startswith('qwen'):
    adam = _paper_config(name, 'adam')
    assert (adam.optim.name, adam.model.param_dtype) == ('adam', 'float32')
