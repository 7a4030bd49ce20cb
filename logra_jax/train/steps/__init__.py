"""The training steps: one jitted function per phase, the LoGRA step and the dense-Adam / LoRA
baseline steps, built from one module per job:

  step_config.py    `StepConfig` (static settings) and `StepShardings` (placements)
  losses.py         the micro-batch RL loss; reference log-probs (`make_ref_logp`)
  micro_batches.py  splitting a batch, placing its rows, summing over it; prompt sharing
  kl_probe.py       the KL probe's rows, q along the update, realised-KL telemetry
  projections.py    `ProjectionSpec` and `draw_projections` (A drawn on device)
  rounding.py       the stochastic-rounding key of the bf16 apply
  logra_step.py     `make_logra_step`, `logra_update_fn`, `make_adaptive_logra_step`
  dense_step.py     `make_dense_step` (AdamW on all params, or on LoRA adapters)

Shape key: N sequences in the step's batch, M micro-batches, P prompt length (left padded),
T completion length, L = P + T, V vocabulary.
"""
from logra_jax.train.steps.dense_step import make_dense_step
from logra_jax.train.steps.kl_probe import telemetry_at
from logra_jax.train.steps.logra_step import (logra_update_fn, make_adaptive_logra_step,
                                              make_logra_step, sketch_momentum_state)
from logra_jax.train.steps.losses import make_ref_logp
from logra_jax.train.steps.projections import ProjectionSpec, draw_projections
from logra_jax.train.steps.rounding import PARAM_ROUNDINGS
from logra_jax.train.steps.step_config import StepConfig, StepShardings
