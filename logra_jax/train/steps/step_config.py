"""The static settings (`StepConfig`) and device placements (`StepShardings`) of a step."""
from typing import Any, NamedTuple


class StepConfig(NamedTuple):
  """Static settings of a step function (hashable)."""
  prompt_len: int
  micro_batches: int
  kl_sequences: int
  kl_control: bool
  kl_probe: str
  alpha_max: float
  sparse_mask: float
  return_update: bool = False  # also return α·U (zeros when skipped), for the generator sync
  # The realised-KL telemetry runs at steps where the caller passes telemetry=True; 0: never
  # compiled (and with kl_control=False, no KL probe at all: no JVP, no extra forward).
  telemetry_every: int = 1
  # How a bf16 kernel stores W + α·AᵀU: 'stochastic' (unbiased, keyed by the step's key) or
  # 'nearest'. fp32 kernels are exact either way (config key optim.logra.param_rounding).
  param_rounding: str = 'stochastic'
  # Rows come in runs of this many sharing one prompt (the trainer: data.samples_per_prompt
  # with optim.share_prompts): each run's prompt is computed once (`completion.forward`,
  # `micro_batches.prompt_share`). 1: every row computes its own prompt.
  prompt_group: int = 1
  # With a trained rest (`logra_update_fn`'s rest_opt): True scales its step by α with the
  # kernels' (one probe along both); False applies it at its own learning rate, α from the
  # kernels' direction alone (config key optim.logra.rest_step='own').
  rest_under_budget: bool = True


class StepShardings(NamedTuple):
  """Explicit placements of a step's trees (`logra_jax.parallel`); None: plain jit.

  params: the model params (frozen ones for LoRA, None for dense Adam); train: what dense /
  LoRA steps update; accum: the sketch (LoGRA) or gradient accumulators; replicated: for
  projections, scalars, keys and metrics.
  """
  params: Any
  opt_state: Any
  batch: Any
  replicated: Any
  train: Any = None
  accum: Any = None
