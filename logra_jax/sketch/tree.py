"""The sketch tree: projections, probes and sketches keyed by the sketched kernels' paths.

A projection/probe/sketch tree is the ``params`` tree restricted to the sketched kernels
(nested dicts, same keys). A kernel (K, D) gets A (R, K) and a probe (R, D); a kernel stacked
over scanned layers (L, K, D) gets (L, R, K) and (L, R, D), one A per layer.
"""
import re
from typing import Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from logra_jax.sketch.dense import COPROBE, COPROJECTION, PROBE, PROJECTION
from logra_jax.sketch.projection import sample_projection
from logra_jax.sketch.rank import RankRules

DEFAULT_TARGETS = (r'(^|/)(q|k|v|o|gate|up|down)_proj/kernel$',)


def path_str(path: Sequence[str]) -> str:
  return '/'.join(str(p) for p in path)


def target_paths(params, patterns: Iterable[str] = DEFAULT_TARGETS):
  """Paths (tuples) of the kernels to sketch: those whose '/'-joined path matches a regex."""
  regs = [re.compile(p) for p in patterns]
  flat = traverse_util.flatten_dict(params)
  paths = [k for k in flat if any(r.search(path_str(k)) for r in regs)]
  if not paths:
    raise ValueError(f'no parameter matches the sketch targets {list(patterns)}')
  return sorted(paths)


def select(tree, paths):
  """The sub-tree of ``tree`` at ``paths``."""
  flat = traverse_util.flatten_dict(tree)
  return traverse_util.unflatten_dict({p: flat[p] for p in paths})


def kernels_of(params, projections):
  """The kernels of ``params`` that ``projections`` sketches, as a tree of the same shape."""
  return select(params, list(traverse_util.flatten_dict(projections)))


def stacked_name(name: str, layer: Optional[int]) -> str:
  """The default projection name of a kernel (``layer`` None) or of one layer of a stack."""
  return name if layer is None else f'{name}/{layer}'


def make_projections(params, seed: int, step: int, ranks=16, kind: str = 'rademacher',
                     patterns: Iterable[str] = DEFAULT_TARGETS, dtype=jnp.float32,
                     name_fn: Callable[[str, Optional[int]], str] = stacked_name):
  """Draws A for every sketched kernel of ``params`` (arrays or ShapeDtypeStructs).

  Args:
    params: the model's params tree (only shapes are read).
    seed, step: see ``sample_projection`` (pass step=0 for fixed projections).
    ranks: an int, or a ``RankRules`` (per-module ranks by name pattern).
    kind: 'rademacher', 'gaussian' or 'orthogonal' (see `sample_projection`).
    patterns: regexes selecting the sketched kernels.
    name_fn: (kernel path 'layers/attn/q_proj/kernel', layer or None) -> the name that seeds
      A. The trainer passes HF tensor names, so that a generator rebuilds A from them.

  Returns:
    The projection tree (jnp arrays).
  """
  rules = ranks if isinstance(ranks, RankRules) else RankRules(default=int(ranks))
  flat = traverse_util.flatten_dict(params)
  out = {}
  for path in target_paths(params, patterns):
    shape = flat[path].shape
    name = path_str(path)
    d_in, d_out = shape[-2:]
    r = rules.rank(name, d_in, d_out)
    if len(shape) == 2:
      a = sample_projection(seed, step, name_fn(name, None), r, d_in, kind)
    elif len(shape) == 3:
      a = np.stack([sample_projection(seed, step, name_fn(name, l), r, d_in, kind)
                    for l in range(shape[0])])
    else:
      raise ValueError(f'sketched kernel {name} must be 2-D or layer-stacked 3-D, got {shape}')
    out[path] = jnp.asarray(a, dtype)
  return traverse_util.unflatten_dict(out)


def zero_probes(params, projections, dtype=None):
  """Zero probes (…, R, D) for every projection (…, R, K); fp32 (fp64 for fp64 A) by default."""
  kernels = kernels_of(params, projections)
  return jax.tree.map(
      lambda k, a: jnp.zeros(a.shape[:-1] + k.shape[-1:],
                             dtype or jnp.promote_types(jnp.float32, a.dtype)),
      kernels, projections)


def sketch_variables(params, projections, probes, coprojections=None, coprobes=None):
  """The Flax variables dict that turns on sketching in every SketchDense (and co-sketching,
  with ``coprojections`` B (…, R', D) and zero ``coprobes`` (…, K, R'))."""
  out = {'params': params, PROJECTION: projections, PROBE: probes}
  if coprojections is not None:
    out.update({COPROJECTION: coprojections, COPROBE: coprobes})
  return out


def zero_coprobes(params, coprojections, dtype=None):
  """Zero coprobes (…, K, R') for every coprojection B (…, R', D) (fp32 by default)."""
  kernels = kernels_of(params, coprojections)
  return jax.tree.map(
      lambda k, b: jnp.zeros(b.shape[:-2] + k.shape[-2:-1] + b.shape[-2:-1],
                             dtype or jnp.promote_types(jnp.float32, b.dtype)),
      kernels, coprojections)


def rest_of(params, projections):
  """The leaves of ``params`` that ``projections`` does not sketch (embeddings, the head, norm
  scales), as a tree of the same nesting."""
  sketched = set(traverse_util.flatten_dict(projections))
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict({k: v for k, v in flat.items() if k not in sketched})


def with_rest(params, rest):
  """``params`` with the leaves of ``rest`` (a `rest_of`-shaped tree) put in their places."""
  flat = traverse_util.flatten_dict(params)
  flat.update(traverse_util.flatten_dict(rest))
  return traverse_util.unflatten_dict(flat)


def _with_cosketch(loss_fn, has_aux, rest, params, projections, probes, coprojections, *args):
  """`sketch_value_and_grad`'s co-sketch form: the gradient with respect to (probes, coprobes
  [, the rest]) in one backward."""
  point = (probes, zero_coprobes(params, coprojections))
  if rest:
    point = point + (rest_of(params, projections),)

  def loss_at(pt):
    p = with_rest(params, pt[2]) if rest else params
    return loss_fn(sketch_variables(p, projections, pt[0], coprojections, pt[1]), *args)

  value, grads = jax.value_and_grad(loss_at, has_aux=has_aux)(point)
  return value, ((grads[0], grads[1], grads[2]) if rest else (grads[0], grads[1]))


def sketch_value_and_grad(loss_fn: Callable, has_aux: bool = False, rest: bool = False,
                          cosketch: bool = False):
  """Wraps ``loss_fn(variables, *args)`` into ``f(params, projections, *args)``.

  ``f`` returns ``(loss, sketches)`` (or ``((loss, aux), sketches)``): the sketch tree of the
  whole model from one ``jax.grad`` with respect to the probes only — the dense kernel
  gradients are never formed. ``rest=True``: ``(loss, (sketches, rest_grads))``, the same
  backward also giving the dense gradient of the leaves LoGRA does not sketch (`rest_of`).
  ``cosketch=True``: ``f(params, projections, coprojections, *args)`` returns ``(loss,
  (sketches, cosketches[, rest_grads]))``, the co-sketches ``G Bᵀ`` (…, K, R') of the same
  backward (`dense.cosketch_matmul`).
  """
  def f(params, projections, *args):
    probes = zero_probes(params, projections)
    if cosketch:
      return _with_cosketch(loss_fn, has_aux, rest, params, projections, probes, *args)
    if not rest:
      g = jax.value_and_grad(
          lambda p: loss_fn(sketch_variables(params, projections, p), *args), has_aux=has_aux)
      return g(probes)
    g = jax.value_and_grad(
        lambda pr: loss_fn(sketch_variables(with_rest(params, pr[1]), projections, pr[0]),
                           *args), has_aux=has_aux)
    return g((probes, rest_of(params, projections)))
  return f
