"""A tiny attention+MLP language model built from SketchDense, for tests and demos.

Shapes: B batch, L length, D model width, F MLP width, V vocabulary, N layers.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp

from logra_jax.sketch.dense import SketchDense


class TinyBlock(nn.Module):
  d: int
  f: int
  sketch_mode: str = 'vjp'

  @nn.compact
  def __call__(self, x_BxLxD, _=None):
    dense = lambda n, name: SketchDense(n, sketch_mode=self.sketch_mode, name=name,
                                        dtype=x_BxLxD.dtype, param_dtype=x_BxLxD.dtype)
    q, k, v = (dense(self.d, n)(x_BxLxD) for n in ('q_proj', 'k_proj', 'v_proj'))
    L = x_BxLxD.shape[1]
    att_BxLxL = jnp.einsum('bld,bmd->blm', q, k) / jnp.sqrt(self.d)
    att_BxLxL = jnp.where(jnp.tril(jnp.ones((L, L), bool)), att_BxLxL, -1e9)
    h = jnp.einsum('blm,bmd->bld', jax.nn.softmax(att_BxLxL, -1), v)
    x_BxLxD = x_BxLxD + dense(self.d, 'o_proj')(h)
    g = jax.nn.silu(dense(self.f, 'gate_proj')(x_BxLxD)) * dense(self.f, 'up_proj')(x_BxLxD)
    return x_BxLxD + dense(self.d, 'down_proj')(g), None


class TinyLM(nn.Module):
  """N blocks through ``nn.scan`` (optionally remat); logits by the tied embedding."""
  vocab: int = 11
  d: int = 8
  f: int = 12
  layers: int = 2
  remat: bool = False
  sketch_mode: str = 'vjp'
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens_BxL):
    emb = self.param('embedding', nn.initializers.normal(1.0), (self.vocab, self.d), self.dtype)
    x = emb[tokens_BxL]
    block = nn.remat(TinyBlock) if self.remat else TinyBlock
    stack = nn.scan(block, variable_axes={'params': 0, 'projection': 0, 'probe': 0},
                    split_rngs={'params': True}, length=self.layers,
                    metadata_params={nn.PARTITION_NAME: 'layers'})
    x, _ = stack(self.d, self.f, self.sketch_mode, name='layers')(x, None)
    return jnp.einsum('bld,vd->blv', x, emb)


def init_params(model, rng, tokens_BxL):
  """Unboxed params (logical-axis metadata stripped)."""
  return nn.unbox(model.init(rng, tokens_BxL))['params']


def token_nll(logits_BxLxV, tokens_BxL):
  """Mean next-token negative log-likelihood."""
  logp = jax.nn.log_softmax(logits_BxLxV[:, :-1], -1)
  return -jnp.mean(jnp.take_along_axis(logp, tokens_BxL[:, 1:, None], -1))
