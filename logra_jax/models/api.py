"""`load`: one call from an HF directory, a GGUF file or a preset name to a usable model.

    model = load('SmolLM2-135M-Instruct.Q4_1.gguf')   # or an HF dir, or 'tiny'
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    logits_1xLxV = model.logits(ids)
    new_ids = model.generate(ids, max_new_tokens=16)
    model.save('/tmp/smollm2-hf')                      # transformers / vLLM load it
"""
import dataclasses
import functools
import os
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.models import gguf_io, hf_io, sampler, stops
from logra_jax.models.config import ModelConfig
from logra_jax.models.presets import PRESETS, get_preset
from logra_jax.models.transformer import Transformer, init_params

PRESET_SEED = 0


@functools.partial(jax.jit, static_argnames=('config',))
def _forward(params, tokens_BxL, mask_BxL, *, config: ModelConfig):
  logits_BxLxV, _ = Transformer(config).apply({'params': params}, tokens_BxL,
                                              attn_mask_BxL=mask_BxL)
  return logits_BxLxV


def _as_batch(token_ids) -> tuple[list, bool]:
  """(list of token lists, whether the input was a single sequence)."""
  if isinstance(token_ids, (np.ndarray, jax.Array)):
    token_ids = np.asarray(token_ids).tolist()
  token_ids = list(token_ids)
  if not token_ids:
    raise ValueError('token_ids is empty')
  if all(isinstance(t, (int, np.integer)) for t in token_ids):
    return [[int(t) for t in token_ids]], True
  return [[int(t) for t in row] for row in token_ids], False


@dataclasses.dataclass
class Model:
  """A model with its weights; `tokenizer` is built on first use (None for presets)."""
  config: ModelConfig
  params: Any
  source: str
  _tokenizer_fn: Optional[Any] = dataclasses.field(default=None, repr=False)

  @functools.cached_property
  def tokenizer(self):
    return self._tokenizer_fn() if self._tokenizer_fn else None

  @functools.cached_property
  def stop_token_ids(self) -> tuple:
    """The full stop set: the config's EOS ids (config.json, generation_config.json or the
    GGUF's eos/eot ids), the tokenizer's EOS and its chat template's end-of-turn token."""
    return stops.stop_token_ids(self.tokenizer, self.config.eos_token_ids)

  def logits(self, token_ids) -> np.ndarray:
    """float32 logits [batch, seq, vocab] of a token list or a batch of them.

    Ragged rows are right padded; logits past a row's length are not meaningful.
    """
    rows, _ = _as_batch(token_ids)
    length = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), length), np.int32)
    mask = np.zeros((len(rows), length), bool)
    for i, r in enumerate(rows):
      tokens[i, :len(r)], mask[i, :len(r)] = r, True
    return np.asarray(_forward(self.params, tokens, mask, config=self.config), np.float32)

  def generate(self, token_ids, max_new_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, top_k: int = 0,
               stop_token_ids: Optional[Sequence[int]] = None, seed: int = 0):
    """New token ids (a list, or a list of lists for a batch) from the KV-cache sampler.

    Stops at `stop_token_ids` (default: `self.stop_token_ids`, the model's full stop set;
    `()` never stops), which are kept in the output. Row i samples with seed `seed + i`.
    """
    rows, single = _as_batch(token_ids)
    stop = self.stop_token_ids if stop_token_ids is None else tuple(stop_token_ids)
    out = sampler.generate(self.params, self.config, rows, max_new_tokens,
                           temperature=temperature, top_p=top_p, top_k=top_k,
                           stop_token_ids=stop, seeds=[seed + i for i in range(len(rows))])
    return out.tokens[0] if single else out.tokens

  def save(self, directory: str, max_shard_bytes: Optional[int] = None) -> str:
    """Exports an HF checkpoint directory (safetensors, config, tokenizer, generation config)."""
    return hf_io.save_hf_checkpoint(directory, self.params, self.config, self.tokenizer,
                                    max_shard_bytes=max_shard_bytes)


def _hf_tokenizer(directory: str):
  from transformers import AutoTokenizer  # heavy import, only when a tokenizer is wanted
  try:
    return AutoTokenizer.from_pretrained(directory, local_files_only=True)
  except (OSError, ValueError):  # an export without tokenizer files
    return None


def load(path_or_preset: str, dtype: str = 'float32', on_host: bool = False) -> Model:
  """Loads a model from an HF checkpoint directory, a `.gguf` file or a preset name.

  Args:
    path_or_preset: a directory with config.json + safetensors, a `.gguf` file, or a name in
      `PRESETS` (random init params, seed `PRESET_SEED`, no tokenizer).
    dtype: the compute and storage dtype ('float32', 'bfloat16', ...).
    on_host: keep a checkpoint's params as numpy (the trainer places them shard by shard).

  Returns:
    A `Model` with `.config`, `.params` (jax arrays), `.tokenizer`, `.logits`, `.generate`,
    `.save`.
  """
  path = os.fspath(path_or_preset)
  name = jnp.dtype(dtype).name
  if os.path.isdir(path):
    params, config = hf_io.load_hf_checkpoint(path, dtype=name)
    tokenizer_fn = functools.partial(_hf_tokenizer, path)
  elif os.path.isfile(path) and path.endswith('.gguf'):
    params, config = gguf_io.load_gguf(path, dtype=name)
    tokenizer_fn = functools.partial(gguf_io.gguf_tokenizer, path)
  elif path in PRESETS:
    config = get_preset(path, dtype=name, param_dtype=name)
    return Model(config, init_params(config, jax.random.key(PRESET_SEED)), f'preset:{path}')
  else:
    raise ValueError(f'{path!r} is neither an HF checkpoint directory, a .gguf file nor a '
                     f'preset name (presets: {sorted(PRESETS)})')
  config = config.replace(dtype=name, param_dtype=name)
  return Model(config, params if on_host else jax.tree.map(jnp.asarray, params), path,
               tokenizer_fn)
