"""Optimizer builders from the config: LoGRA (sketch tree), AdamW (dense and LoRA adapters).

The LoRA adapters themselves (init, in-layer forward, merge) are in `logra_jax.train.lora`.
"""
import jax
import jax.numpy as jnp
import optax

from logra_jax import sketch
from logra_jax.train import steps
from logra_jax.train.config import (AdamSection, LograSection, LoraSection, OptimSection,
                                    parse_rank_rules)


def learning_rate(o: OptimSection, total_steps: int, peak: float) -> optax.Schedule:
  """``peak`` constant, or linear warm-up then cosine to 0.1× over the run."""
  if o.lr_schedule == 'constant':
    main = optax.constant_schedule(peak)
  else:
    main = optax.cosine_decay_schedule(peak, max(1, total_steps - o.warmup_steps), alpha=0.1)
  if not o.warmup_steps:
    return main
  warm = optax.linear_schedule(peak / o.warmup_steps, peak, o.warmup_steps)
  return optax.join_schedules([warm, main], [o.warmup_steps])


def logra_optimizer(o: OptimSection, total_steps: int):
  lg = o.logra
  return sketch.logra(learning_rate(o, total_steps, lg.learning_rate),
                      optimizer=lg.sketch_optimizer, b2=lg.b2, eps=lg.eps,
                      update_ratio=lg.update_ratio or None, momentum=lg.momentum or None,
                      preserve_norm=lg.preserve_norm)


def rest_optimizer(o: OptimSection, total_steps: int):
  """Adam for the leaves LoGRA does not sketch (`optim.logra.rest_learning_rate`, b1 0.9, b2 as
  RowAdam's, the shared schedule), or None when they stay frozen (rest_learning_rate = 0)."""
  lg = o.logra
  if not lg.rest_learning_rate:
    return None
  return optax.adam(learning_rate(o, total_steps, lg.rest_learning_rate), b1=0.9, b2=lg.b2)


def adam_optimizer(o: OptimSection, total_steps: int, trainable=None):
  """AdamW of ``optim.adam`` (or ``optim.lora`` for LoRA's adapters), with the shared schedule.

  ``trainable``: a pytree of bools like the params (``optim.adam.trainable='sketched'``): the
  others get a zero update and no optimizer state."""
  s: AdamSection | LoraSection = o.lora if o.name == 'lora' else o.adam
  parts = [optax.clip_by_global_norm(s.max_grad_norm)] if s.max_grad_norm else []
  parts.append(optax.adamw(learning_rate(o, total_steps, s.learning_rate), b1=s.b1, b2=s.b2,
                           weight_decay=s.weight_decay))
  opt = optax.chain(*parts)
  if trainable is None:
    return opt
  labels = lambda params: jax.tree.map(lambda t: 'train' if t else 'freeze', trainable)
  return optax.multi_transform({'train': opt, 'freeze': optax.set_to_zero()}, labels)


def rank_rules(o: LograSection, step: int) -> sketch.RankRules:
  """Per-module ranks at ``step`` (the dynamic schedule scales them with r_t / r_0)."""
  rules = sketch.RankRules(parse_rank_rules(o.rank_rules), default=o.rank)
  if not o.rank_delta:
    return rules
  return rules.scaled(sketch.dynamic_rank(step, o.rank, o.rank_delta, o.rank_tau), o.rank)


def projection_step(o: LograSection, step: int) -> int:
  """The step that seeds A: the first step of ``step``'s block of ``refresh_every`` steps
  (``step`` itself when A is redrawn every step), 0 when A is fixed."""
  return (step // o.refresh_every) * o.refresh_every if o.refresh else 0


def projection_spec(o: LograSection, step: int, name_fn=sketch.stacked_name,
                    dtype=jnp.bfloat16) -> steps.ProjectionSpec:
  """How the LoGRA step draws A at ``step`` (ranks, kind, names; ``dtype`` where exact)."""
  return steps.ProjectionSpec(rank_rules(o, step), o.projection, name_fn, dtype)


def projections_at(o: LograSection, params, seed: int, step: int,
                   name_fn=sketch.stacked_name):
  """A for every sketched kernel at ``step``, with numpy (``projection.py``) on the host.

  What a generator rebuilds from (seed, step, kind); the LoGRA step draws the same bits on
  device (``steps.draw_projections`` of ``projection_spec``). ``name_fn`` names the matrices
  in the derivation (the trainer: HF tensor names)."""
  return sketch.make_projections(params, seed, projection_step(o, step), rank_rules(o, step),
                                 o.projection, name_fn=name_fn)
