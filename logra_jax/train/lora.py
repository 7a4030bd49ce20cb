"""LoRA computed in the layer: y = x W + s·(x a) b, gradients for the adapters a, b only.

Shapes: K input features, D output features, r LoRA rank; a kernel stacked over scanned
layers (N, K, D) gets a (N, K, r) and b (N, r, D).

No new layer: every sketched projection is a `SketchDense`, and in its 'linear' sketch mode
it computes ``x W + (x Aᵀ) P`` from the `projection` (A, (r, K)) and `probe` (P, (r, D))
variable collections. With A = s·aᵀ and P = b that is LoRA's forward, term for term, so the
adapters ride in the slots (and paths) of the sketch tree. Differentiating w.r.t. (a, b)
only, with W under stop_gradient, the backward forms x a (tokens × r), its cotangent g bᵀ and
the two small gradients (r, K), (r, D): never a (K, D) kernel or kernel gradient (checked
with `logra_jax.analysis.hlo` in tests/test_lora.py). `merge` builds W + s·a b for generation
and export only.
"""
import math

import jax
import jax.numpy as jnp
from flax import traverse_util

from logra_jax import sketch


def _is_adapter(_, node) -> bool:
  return isinstance(node, dict) and 'a' in node


def init(params, rank: int, key):
  """Adapters a (…, K, r) ~ N(0, 1/K) and b (…, r, D) = 0 on every sketch target kernel."""
  flat = traverse_util.flatten_dict(params)
  out = {}
  paths = sketch.target_paths(params)
  for path, k in zip(paths, jax.random.split(key, len(paths))):
    w = flat[path]
    *lead, d_in, d_out = w.shape
    r = min(rank, d_in, d_out)
    out[path] = {'a': jax.random.normal(k, (*lead, d_in, r), w.dtype) / math.sqrt(d_in),
                 'b': jnp.zeros((*lead, r, d_out), w.dtype)}
  return traverse_util.unflatten_dict(out)


def adapters(lora):
  """{kernel path: {'a': a, 'b': b}} of a LoRA tree."""
  return traverse_util.flatten_dict(lora, is_leaf=_is_adapter)


def layer_model(model):
  """The model whose SketchDense layers add (x Aᵀ) P in the forward (see the module doc)."""
  return model.clone(sketch_mode='linear')


def variables(params, lora, scale: float):
  """Flax variables of `layer_model` computing x W + s·(x a) b; W is stop_gradient'ed."""
  flat = adapters(lora)
  a_t = {p: scale * jnp.swapaxes(ab['a'], -1, -2) for p, ab in flat.items()}  # (…, r, K)
  b = {p: ab['b'] for p, ab in flat.items()}
  return sketch.sketch_variables(jax.lax.stop_gradient(params),
                                 traverse_util.unflatten_dict(a_t),
                                 traverse_util.unflatten_dict(b))


def merge(params, lora, scale: float):
  """params with kernel + scale · a @ b on every adapted kernel (generation and export)."""
  flat = traverse_util.flatten_dict(params)
  for path, ab in adapters(lora).items():
    delta = jnp.einsum('...kr,...rd->...kd', ab['a'], ab['b'])
    flat[path] = flat[path] + (scale * delta).astype(flat[path].dtype)
  return traverse_util.unflatten_dict(flat)
