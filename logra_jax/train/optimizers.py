"""Optimizer builders from the config: LoGRA (sketch tree), AdamW (dense and LoRA adapters).

The LoRA adapters themselves (init, in-layer forward, merge) are in `logra_jax.train.lora`.
"""
import jax.numpy as jnp
import optax

from logra_jax import sketch
from logra_jax.train import steps
from logra_jax.train.config import OptimSection, parse_rank_rules


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
  return sketch.logra(learning_rate(o, total_steps, o.learning_rate), optimizer=o.sketch_optimizer, b2=o.b2,
                      eps=o.eps, update_ratio=o.update_ratio or None,
                      momentum=o.momentum or None, preserve_norm=o.preserve_norm)


def adam_optimizer(o: OptimSection, total_steps: int):
  parts = [optax.clip_by_global_norm(o.max_grad_norm)] if o.max_grad_norm else []
  parts.append(optax.adamw(learning_rate(o, total_steps, o.adam_learning_rate), b1=o.b1, b2=o.adam_b2,
                           weight_decay=o.weight_decay))
  return optax.chain(*parts)


def rank_rules(o: OptimSection, step: int) -> sketch.RankRules:
  """Per-module ranks at ``step`` (the dynamic schedule scales them with r_t / r_0)."""
  rules = sketch.RankRules(parse_rank_rules(o.rank_rules), default=o.rank)
  if not o.rank_delta:
    return rules
  return rules.scaled(sketch.dynamic_rank(step, o.rank, o.rank_delta, o.rank_tau), o.rank)


def projection_step(o: OptimSection, step: int) -> int:
  """The step that seeds A: ``step`` when refreshed every step, 0 when fixed."""
  return step if o.refresh else 0


def projection_spec(o: OptimSection, step: int, name_fn=sketch.stacked_name,
                    dtype=jnp.bfloat16) -> steps.ProjectionSpec:
  """How the LoGRA step draws A at ``step`` (ranks, kind, names; ``dtype`` where exact)."""
  return steps.ProjectionSpec(rank_rules(o, step), o.projection, name_fn, dtype)


def projections_at(o: OptimSection, params, seed: int, step: int,
                   name_fn=sketch.stacked_name):
  """A for every sketched kernel at ``step``, with numpy (``projection.py``) on the host.

  What a generator rebuilds from (seed, step, kind); the LoGRA step draws the same bits on
  device (``steps.draw_projections`` of ``projection_spec``). ``name_fn`` names the matrices
  in the derivation (the trainer: HF tensor names)."""
  return sketch.make_projections(params, seed, projection_step(o, step), rank_rules(o, step),
                                 o.projection, name_fn=name_fn)
