"""The key of the stochastic rounding with which a LoGRA step stores W + α·AᵀU in bf16."""
import jax

from logra_jax.train.steps.step_config import StepConfig

# Folded into the step's key for the stochastic rounding of the apply: independent of the
# key's other use (the sparse mask), and as reproducible as the key (a function of the step).
ROUNDING_KEY_SALT = 0x53520001
PARAM_ROUNDINGS = ('stochastic', 'nearest')


def check_rounding(sc: StepConfig):
  """Raises ValueError unless ``sc.param_rounding`` is one of `PARAM_ROUNDINGS`."""
  if sc.param_rounding not in PARAM_ROUNDINGS:
    raise ValueError(f'StepConfig.param_rounding={sc.param_rounding!r} must be one of '
                     f'{PARAM_ROUNDINGS} (config key optim.logra.param_rounding)')


def rounding_key(sc: StepConfig, key):
  """The apply's stochastic-rounding key (``sketch.apply_sketch_updates``), or None."""
  check_rounding(sc)
  if sc.param_rounding == 'nearest':
    return None
  return jax.random.fold_in(key, ROUNDING_KEY_SALT)
