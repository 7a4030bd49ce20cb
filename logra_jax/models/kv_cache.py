"""The transformer's KV cache: its buffers, one per layer (`init_cache`), and how a forward
over L new tokens writes them.

Shape key: B batch, L new tokens, S cache slots, K kv heads, E head dim, N layers.

    {'k', 'v': N-tuples of (B, K, S, E); 'mask': (B, S) bool (real tokens); 'index': () int32}

Every row writes at the same slot `index`; the layers read their own buffers in place, so the
module that uses them stays purely functional (`transformer.Transformer(cache=...)`).
"""
from typing import Any

import jax
import jax.numpy as jnp

from logra_jax.models.config import ModelConfig

Cache = dict  # {'k', 'v': N-tuples of (B, K, S, E); 'mask': (B, S) bool; 'index': () int32}


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None) -> Cache:
  """An empty KV cache of `max_len` slots; every row writes at the same slot `index`.

  A separate (B, K, S, E) buffer per layer: a slice of one stacked buffer would be a copy
  per layer per step on XLA:CPU, and (B, K, S, E) is the layout the attention's dots read
  without a transpose copy (docs/benchmarks.md, "The embedded sampler's decode").
  """
  shape = (batch, config.num_kv_heads, max_len, config.head_dim)
  zeros = lambda: tuple(jnp.zeros(shape, dtype or config.jnp_dtype)
                        for _ in range(config.num_layers))
  return {'k': zeros(), 'v': zeros(), 'mask': jnp.zeros((batch, max_len), bool),
          'index': jnp.zeros((), jnp.int32)}


def write_slots(buffer_BxKxSxE, new_BxLxKxE, index):
  """The L new keys (or values) written at slots index.. of a layer's cache buffer."""
  zero = jnp.zeros_like(index)
  return jax.lax.dynamic_update_slice(
      buffer_BxKxSxE, jnp.swapaxes(new_BxLxKxE, 1, 2).astype(buffer_BxKxSxE.dtype),
      (zero, zero, index, zero))


def write_cache(cache: Cache, layers_kv, attn_mask_BxL) -> Cache:
  """The cache after L new tokens: the layers' written buffers, the tokens' mask at slot
  `index` (in place under jit), the next slot."""
  index = cache['index']
  zero = jnp.zeros_like(index)
  mask = jax.lax.dynamic_update_slice(cache['mask'], attn_mask_BxL, (zero, index))
  return {'k': tuple(kv['k'] for kv in layers_kv), 'v': tuple(kv['v'] for kv in layers_kv),
          'mask': mask, 'index': index + attn_mask_BxL.shape[1]}


def layer_cache(cache: Cache, i: int) -> dict:
  """Layer i's view of the cache: its own 'k' and 'v' buffers and the write slot 'index'."""
  return {'k': cache['k'][i], 'v': cache['v'][i], 'index': cache['index']}
