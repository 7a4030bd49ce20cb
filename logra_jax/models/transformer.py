"""Decoder-only Llama / Qwen2 transformer (Flax Linen) whose projections are SketchDense.

Shape key: B batch, L query length, S key length (cache slots), D hidden, H query heads,
K kv heads, G = H // K, E head dim, F MLP hidden, V vocab, N layers.

Layers run through `nn.scan` (params, projections and probes stacked on a leading N axis,
logical axis 'layers'), with `jax.checkpoint` per `ModelConfig.remat_policy`. With a KV cache
(an explicit pytree, `kv_cache.init_cache`: one buffer per layer) the layers run one by one
instead, each reading and writing its own buffers in place, so the module stays purely functional:

    logits_BxLxV, cache = Transformer(config).apply({'params': params}, tokens_BxL, cache=cache)

Masks: keys that are padding (`attn_mask_BxL` False), in the future, or in another segment
(`segment_ids_BxL`) are never attended; with `shared_prefix=True` segment 0 is a prefix that
every later segment attends (a prompt shared by the completions packed after it). Positions
default to the count of real tokens before each token, so left padding gives the same logits
as no padding (`positions.py`). `ModelConfig.attention` 'blockwise' never forms the L×L scores;
`return_hidden=True` skips the vocabulary head.
"""
import functools
from typing import Any, Optional

from flax import traverse_util
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.models import attention as attn_lib
from logra_jax.models import kv_cache
from logra_jax.models.config import ModelConfig
from logra_jax.models.positions import (apply_rope, attention_masks, default_positions,
                                        rope_sin_cos)
from logra_jax.sketch.dense import (COPROBE, COPROJECTION, KERNEL_T, PROBE, PROJECTION,
                                    SketchDense, matmul_t)

# Mesh axes the batch is split over (`logra_jax.parallel`: batches data-parallel over both).
BATCH_AXES = ('data', 'fsdp')


def _acc(dtype):
  return jnp.promote_types(jnp.float32, dtype)


def constrain_batch(x_BxLxD):
  """Rows split over the ambient mesh's batch axes (`jax.set_mesh`), where they divide.

  A sharding constraint only (same values): after the gather from a vocab-sharded embedding
  the partitioner would otherwise replicate the batch, so each device ran every row.
  No mesh set, a mesh without those axes, or rows that do not divide: ``x`` unchanged.
  """
  mesh = jax.sharding.get_abstract_mesh()
  axes = tuple(a for a in BATCH_AXES if not mesh.empty and a in mesh.axis_names)
  size = int(np.prod([mesh.shape[a] for a in axes]))
  if size == 1 or x_BxLxD.shape[0] % size:
    return x_BxLxD
  return jax.lax.with_sharding_constraint(x_BxLxD, jax.sharding.PartitionSpec(axes))


def attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, masks, cached=None, config=None):
  """`config.attention` (models/attention.py): 'dense' with the (B, L, L) bool mask, or
  'blockwise' with {'attn': (B, L) bool[, 'segments': (B, L)[, 'prefix': (B, L) bool]]};
  cached = (k, v, key_mask)."""
  if config is None or config.attention == 'dense':
    return attn_lib.dense_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, masks, cached)
  return attn_lib.blockwise_attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, masks['attn'],
                                      masks.get('segments'), cached, config.attention_block,
                                      masks.get('prefix'))


class RMSNorm(nn.Module):
  eps: float
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxLxD):
    scale = self.param('scale', nn.with_logical_partitioning(nn.initializers.ones_init(),
                                                             ('embed',)),
                       (x_BxLxD.shape[-1],), self.param_dtype)
    x = x_BxLxD.astype(_acc(x_BxLxD.dtype))
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
    return (x * scale.astype(x.dtype)).astype(self.dtype)


def _dense(config, sketch_mode, features, axes, name, use_bias=False):
  return SketchDense(features, use_bias=use_bias, kernel_axes=axes, sketch_mode=sketch_mode,
                     dtype=config.jnp_dtype, param_dtype=config.jnp_param_dtype, name=name)


class Attention(nn.Module):
  config: ModelConfig
  sketch_mode: str = 'vjp'

  @nn.compact
  def __call__(self, x_BxLxD, sin, cos, masks, layer_cache, cache_mask_BxS):
    c = self.config
    b, l, _ = x_BxLxD.shape
    dense = functools.partial(_dense, c, self.sketch_mode, use_bias=c.qkv_bias)
    q = dense(c.num_heads * c.head_dim, ('embed', 'q_heads'), 'q_proj')(x_BxLxD)
    k = dense(c.num_kv_heads * c.head_dim, ('embed', 'kv_heads'), 'k_proj')(x_BxLxD)
    v = dense(c.num_kv_heads * c.head_dim, ('embed', 'kv_heads'), 'v_proj')(x_BxLxD)
    q_BxLxHxE = apply_rope(q.reshape(b, l, c.num_heads, c.head_dim), sin, cos)
    k_BxLxKxE = apply_rope(k.reshape(b, l, c.num_kv_heads, c.head_dim), sin, cos)
    v_BxLxKxE = v.reshape(b, l, c.num_kv_heads, c.head_dim)
    new_kv, cached = None, None
    if layer_cache is not None:
      # Written before it is read, so XLA updates the buffers in place; the new slots are not
      # in the old `cache_mask_BxS`, so the cached part of the attention leaves them out.
      new_kv = {n: kv_cache.write_slots(layer_cache[n], new, layer_cache['index'])
                for n, new in (('k', k_BxLxKxE), ('v', v_BxLxKxE))}
      # Stored (B, K, S, E) (`kv_cache.init_cache`); the attention reads it as (B, S, K, E).
      cached = (jnp.swapaxes(new_kv['k'], 1, 2), jnp.swapaxes(new_kv['v'], 1, 2),
                cache_mask_BxS)
    o_BxLxHE = attention(q_BxLxHxE, k_BxLxKxE, v_BxLxKxE, masks, cached, c)
    out = _dense(c, self.sketch_mode, c.hidden_size, ('q_heads', 'embed'), 'o_proj')(o_BxLxHE)
    return out, new_kv


class Mlp(nn.Module):
  config: ModelConfig
  sketch_mode: str = 'vjp'

  @nn.compact
  def __call__(self, x_BxLxD):
    c = self.config
    dense = functools.partial(_dense, c, self.sketch_mode)
    gate_BxLxF = dense(c.intermediate_size, ('embed', 'mlp'), 'gate_proj')(x_BxLxD)
    up_BxLxF = dense(c.intermediate_size, ('embed', 'mlp'), 'up_proj')(x_BxLxD)
    return dense(c.hidden_size, ('mlp', 'embed'), 'down_proj')(nn.silu(gate_BxLxF) * up_BxLxF)


class Block(nn.Module):
  """Pre-norm residual block; `(x, layer_cache)` -> `(x, new_layer_kv)` for nn.scan."""
  config: ModelConfig
  sketch_mode: str = 'vjp'

  @nn.compact
  def __call__(self, x_BxLxD, layer_cache, sin, cos, masks, cache_mask_BxS):
    c = self.config
    norm = functools.partial(RMSNorm, c.rms_norm_eps, c.jnp_dtype, c.jnp_param_dtype)
    h = norm(name='attn_norm')(x_BxLxD)
    a, new_cache = Attention(c, self.sketch_mode, name='attn')(
        h, sin, cos, masks, layer_cache, cache_mask_BxS)
    x_BxLxD = x_BxLxD + a
    x_BxLxD = x_BxLxD + Mlp(c, self.sketch_mode, name='mlp')(norm(name='mlp_norm')(x_BxLxD))
    return x_BxLxD, new_cache


def _scanned_block(config: ModelConfig):
  block = Block
  if config.checkpoint_policy is not False:
    block = nn.remat(Block, policy=config.checkpoint_policy, prevent_cse=False)
  return nn.scan(block, variable_axes={'params': 0, PROJECTION: 0, PROBE: 0, COPROJECTION: 0,
                                       COPROBE: 0},
                 split_rngs={'params': True},
                 in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast, nn.broadcast),
                 length=config.num_layers, metadata_params={nn.PARTITION_NAME: 'layers'})


def _unrolled_blocks(config: ModelConfig, layers, x_BxLxD, cache: kv_cache.Cache, sin, cos,
                     masks):
  """The blocks one by one over a KV cache: (x, [each layer's written {'k', 'v'}]).

  `layers`: one variable tree per layer. Each layer reads its own cache buffers in place;
  `nn.scan` would slice its weights and cache out of stacked arrays, a copy per layer.
  """
  new_kv = []
  for i, variables in enumerate(layers):
    x_BxLxD, kv = Block(config).apply(variables, x_BxLxD, kv_cache.layer_cache(cache, i), sin,
                                      cos, masks, cache['mask'])
    new_kv.append(kv)
  return x_BxLxD, new_kv


def _layer_variables(params, num_layers: int):
  """Layer i's variable tree, sliced out of the stacked `params['layers']`."""
  return tuple({'params': jax.tree.map(lambda a: a[i], params['layers'])}
               for i in range(num_layers))


def decode_variables(config: ModelConfig, params) -> dict:
  """`Transformer(...)(decode=...)`'s trees for few-row steps (decoding), from `params`.

  One variable tree per layer (its norms and biases, and each kernel transposed to (D, K)
  in the `kernel_t` collection) and the head as (V, D). A copy of the layer weights:
  `sampler.decode_copy` makes it in its own program, once per generation.
  """
  def transposed(variables):
    flat = traverse_util.flatten_dict(variables['params'])
    return {'params': traverse_util.unflatten_dict(
                {k: v for k, v in flat.items() if k[-1] != 'kernel'}),
            KERNEL_T: traverse_util.unflatten_dict(
                {k: v.T for k, v in flat.items() if k[-1] == 'kernel'})}
  head, vocab_axis = head_weights(config, params)
  return {'layers': tuple(map(transposed, _layer_variables(params, config.num_layers))),
          'head_t': head if vocab_axis == 0 else head.T}


class LMHead(nn.Module):
  vocab_size: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x_BxLxD):
    kernel = self.param('kernel', nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ('embed', 'vocab')),
        (x_BxLxD.shape[-1], self.vocab_size), self.param_dtype)
    return jnp.einsum('bld,dv->blv', x_BxLxD, kernel.astype(self.dtype),
                      preferred_element_type=_acc(self.dtype))


def head_weights(config: ModelConfig, params):
  """(w, vocab_axis): the output head in the compute dtype, logits = x·w over axis D.

  The tied embedding (V, D), vocab_axis 0, or the LM-head kernel (D, V), vocab_axis 1; for
  callers that project chosen positions themselves (`Transformer(return_hidden=True)`).
  """
  if config.tie_embeddings:
    return params['embed']['embedding'].astype(config.jnp_dtype), 0
  return params['lm_head']['kernel'].astype(config.jnp_dtype), 1


class Transformer(nn.Module):
  """Decoder-only LM. Returns (float32 logits (B, L, V), new cache or None).

  `last_only=True` computes the logits of the last position only (B, 1, V) (prefill).
  `return_hidden=True` returns the final (normed) hidden states (B, L, D) in the compute
  dtype instead of logits: project the positions you need with `head_weights`.
  `shared_prefix=True` (with `segment_ids_BxL` and explicit `positions_BxL`): segment 0 is
  attended by every segment (`logra_jax.train.completion.pack_prompt_groups`).
  `decode=decode_variables(config, params)` runs the same numbers for few rows (decoding):
  the layers one by one from per-layer copies with (D, K) kernels, and the head as (V, D)
  (`sketch.dense.matmul_t`); `params['layers']` is then not read.
  """
  config: ModelConfig
  sketch_mode: str = 'vjp'

  @nn.compact
  def __call__(self, tokens_BxL, positions_BxL=None, segment_ids_BxL=None,
               attn_mask_BxL=None, cache: Optional[kv_cache.Cache] = None,
               last_only: bool = False,
               return_hidden: bool = False, decode: Optional[dict] = None,
               shared_prefix: bool = False):
    c = self.config
    attn_mask_BxL = (jnp.ones(tokens_BxL.shape, bool) if attn_mask_BxL is None
                     else attn_mask_BxL.astype(bool))
    if cache is not None and segment_ids_BxL is not None:
      raise ValueError('segment_ids_BxL cannot be combined with a KV cache')
    if shared_prefix and (segment_ids_BxL is None or positions_BxL is None):
      raise ValueError('shared_prefix=True needs segment_ids_BxL and explicit positions_BxL '
                       '(the default positions restart at every segment)')
    if positions_BxL is None:
      positions_BxL = default_positions(attn_mask_BxL, segment_ids_BxL)
      if cache is not None:  # continue after the real tokens already in the cache
        positions_BxL += cache['mask'].sum(axis=1, dtype=positions_BxL.dtype)[:, None]
    masks = attention_masks(c, attn_mask_BxL, segment_ids_BxL, shared_prefix)
    if decode is not None and cache is None:
      raise ValueError('decode= needs a KV cache')
    embed = nn.Embed(c.vocab_size, c.hidden_size, dtype=c.jnp_dtype,
                     param_dtype=c.jnp_param_dtype, name='embed',
                     embedding_init=nn.with_logical_partitioning(
                         nn.initializers.normal(1.0), ('vocab', 'embed')))
    x_BxLxD = constrain_batch(embed(tokens_BxL))
    sin, cos = rope_sin_cos(c, positions_BxL)
    if cache is None:
      x_BxLxD, _ = _scanned_block(c)(c, self.sketch_mode, name='layers')(
          x_BxLxD, None, sin, cos, masks, None)
    else:
      layers = (decode['layers'] if decode is not None
                else _layer_variables(self.variables['params'], c.num_layers))
      x_BxLxD, new_kv = _unrolled_blocks(c, layers, x_BxLxD, cache, sin, cos, masks)
    x_BxLxD = RMSNorm(c.rms_norm_eps, c.jnp_dtype, c.jnp_param_dtype, name='final_norm')(x_BxLxD)
    if last_only:
      x_BxLxD = x_BxLxD[:, -1:]
    new_cache = None if cache is None else kv_cache.write_cache(cache, new_kv, attn_mask_BxL)
    if return_hidden:
      return x_BxLxD, new_cache
    if decode is not None:
      logits = matmul_t(x_BxLxD, decode['head_t'])
    elif c.tie_embeddings:
      logits = jnp.einsum('bld,vd->blv', x_BxLxD, embed.embedding.astype(c.jnp_dtype),
                          preferred_element_type=_acc(c.jnp_dtype))
    else:
      logits = LMHead(c.vocab_size, c.jnp_dtype, c.jnp_param_dtype, name='lm_head')(x_BxLxD)
    return logits.astype(_acc(c.jnp_dtype)), new_cache


def abstract_variables(config: ModelConfig):
  """Shapes of the boxed (logically partitioned) variables, without allocating."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return jax.eval_shape(lambda r: Transformer(config).init(r, tokens), jax.random.key(0))


def logical_axes(config: ModelConfig):
  """The params tree of PartitionSpecs of logical axis names ('layers', 'embed', ...)."""
  return nn.get_partition_spec(abstract_variables(config))['params']


def init_params(config: ModelConfig, rng) -> dict:
  """Randomly initialised params (plain arrays, unboxed)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  variables = jax.jit(lambda r: Transformer(config).init(r, tokens))(rng)
  return nn.unbox(variables['params'])


def param_count(params) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params))))
