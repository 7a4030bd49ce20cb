"""Decoder-only Llama / Qwen2 models (Flax Linen), the KV-cache sampler and checkpoint I/O.

    from logra_jax import models
    model = models.load('tiny')  # or an HF directory, or a .gguf file
"""
from logra_jax.models.api import Model, load
from logra_jax.models.config import ModelConfig
from logra_jax.models.gguf_io import gguf_tokenizer, load_gguf, packaged_smollm2_gguf
from logra_jax.models.hf_io import WEIGHT_TABLES, load_hf_checkpoint, save_hf_checkpoint
from logra_jax.models.kv_cache import init_cache
from logra_jax.models.presets import PRESETS, get_preset
from logra_jax.models.sampler import SampleOutput, SamplingParams, generate
from logra_jax.models.transformer import Transformer, init_params, param_count

__all__ = ['Model', 'load', 'ModelConfig', 'gguf_tokenizer', 'load_gguf', 'packaged_smollm2_gguf', 'WEIGHT_TABLES',
           'load_hf_checkpoint', 'save_hf_checkpoint', 'PRESETS', 'get_preset', 'SampleOutput',
           'SamplingParams', 'generate', 'Transformer', 'init_cache', 'init_params',
           'param_count']
