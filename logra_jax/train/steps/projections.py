"""The LoGRA step's projections A: how they are specified (`ProjectionSpec`) and drawn on
device (`draw_projections`), bit-identical to ``sketch/projection.py``."""
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp

from logra_jax import sketch
from logra_jax.sketch import projection_jax


class ProjectionSpec(NamedTuple):
  """How a LoGRA step draws its projections A on device (static, hashable).

  ranks: an int or a ``sketch.RankRules``; kind: 'rademacher' | 'gaussian' | 'orthogonal';
  name_fn: the names that seed A (the trainer: ``hf_io.projection_name_fn``); dtype: A's
  dtype where ``projection.exact_dtype`` allows it, float32 elsewhere.
  """
  ranks: Any
  kind: str = 'rademacher'
  name_fn: Callable = sketch.stacked_name
  dtype: Any = jnp.bfloat16


def draw_projections(params, seed, step, proj: ProjectionSpec):
  """A for every sketched kernel: ``projection.py``'s bits, drawn on device (jittable).

  ``seed``/``step`` may be traced uint32 scalars; ``params`` may be abstract.
  """
  return projection_jax.make_projections_jax(params, seed, step, proj.ranks, proj.kind,
                                             dtype=proj.dtype, name_fn=proj.name_fn)
