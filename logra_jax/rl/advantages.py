"""Advantage estimators: small pure functions, registered by name.

Shape key: B = completions in the batch, G = completions per prompt (group size), P = B / G
prompts. Completions of one prompt are contiguous: completion i belongs to prompt i // G.

Every registered estimator is an `AdvantageEstimator(init, update)` (optax-like):
`state = est.init()`, then `advantages_B, state = est.update(rewards_B, state, group_size)`.
Stateless estimators keep `state` as an empty tuple. All are jittable (group_size static).
"""
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp


class BaselineState(NamedTuple):
  """value: the running baseline (fp32). count: batches seen so far (int32)."""
  value: jax.Array
  count: jax.Array


def init_baseline() -> BaselineState:
  return BaselineState(value=jnp.zeros((), jnp.float32), count=jnp.zeros((), jnp.int32))


def running_baseline_advantages(rewards_B, state: BaselineState, ema: float = 0.1):
  """The authors' REINFORCE baseline: reward minus an EMA over previous batches only.

    A_i = r_i - b_t,   b_{t+1} = (1 - ema) b_t + ema mean(r_t).

  The baseline never sees the batch it is subtracted from. First batch (count == 0): there are
  no previous batches, so b_0 is the first batch's own mean (A = r - mean(r)), and the state
  after it is b_1 = mean(r_0); the EMA starts from there.

  Args:
    rewards_B: one reward per completion (one completion per prompt in the authors' runs).
    state: a `BaselineState` (from `init_baseline()`).
    ema: weight of the newest batch mean in the baseline (authors: 0.1).

  Returns:
    (advantages_B, new_state).

  Example:
    >>> adv, s = running_baseline_advantages(jnp.array([1., 0.]), init_baseline())
  """
  mean = jnp.mean(rewards_B.astype(jnp.float32))
  first = state.count == 0
  baseline = jnp.where(first, mean, state.value)
  new_value = jnp.where(first, mean, (1.0 - ema) * state.value + ema * mean)
  advantages = rewards_B - baseline.astype(rewards_B.dtype)
  return advantages, BaselineState(new_value, state.count + 1)


def _groups(rewards_B, group_size: int):
  if group_size < 2:
    raise ValueError(f'this estimator needs group_size >= 2, got {group_size}.')
  if rewards_B.shape[0] % group_size:
    raise ValueError(f'batch of {rewards_B.shape[0]} is not a multiple of group_size '
                     f'{group_size}.')
  return rewards_B.reshape(-1, group_size)


def grpo_advantages(rewards_B, group_size: int, eps: float = 1e-6):
  """GRPO: reward standardised within its prompt's group.

    A_i = (r_i - mean_g r) / (std_g r + eps),  std with Bessel's correction (ddof=1), as TRL.

  Returns:
    advantages_B.
  """
  r_PxG = _groups(rewards_B, group_size)
  mean = jnp.mean(r_PxG, axis=1, keepdims=True)
  std = jnp.std(r_PxG, axis=1, keepdims=True, ddof=1)
  return ((r_PxG - mean) / (std + eps)).reshape(-1)


def rloo_advantages(rewards_B, group_size: int):
  """RLOO: reward minus the mean of the other G - 1 rewards of its group.

    A_i = r_i - (sum_g r - r_i) / (G - 1) = G / (G - 1) (r_i - mean_g r).

  Returns:
    advantages_B.
  """
  r_PxG = _groups(rewards_B, group_size)
  others = (jnp.sum(r_PxG, axis=1, keepdims=True) - r_PxG) / (group_size - 1)
  return (r_PxG - others).reshape(-1)


def reinforce_pp_advantages(rewards_B, eps: float = 1e-6):
  """REINFORCE++: rewards normalised over the whole (global) batch.

    A_i = (r_i - mean_B r) / (std_B r + eps),  population std (ddof=0).

  Returns:
    advantages_B.
  """
  return (rewards_B - jnp.mean(rewards_B)) / (jnp.std(rewards_B) + eps)


class AdvantageEstimator(NamedTuple):
  """init() -> state; update(rewards_B, state, group_size) -> (advantages_B, state)."""
  init: Callable[[], Any]
  update: Callable[..., tuple[jax.Array, Any]]


def _stateless(fn, grouped: bool, **hparams) -> AdvantageEstimator:
  def update(rewards_B, state, group_size: int = 1):
    if grouped:
      return fn(rewards_B, group_size=group_size, **hparams), state
    return fn(rewards_B, **hparams), state
  return AdvantageEstimator(init=tuple, update=update)


def _running_baseline(ema: float = 0.1) -> AdvantageEstimator:
  def update(rewards_B, state, group_size: int = 1):
    del group_size  # Each completion is compared with the running baseline.
    return running_baseline_advantages(rewards_B, state, ema=ema)
  return AdvantageEstimator(init=init_baseline, update=update)


ADVANTAGES: dict[str, Callable[..., AdvantageEstimator]] = {
    'running_baseline': _running_baseline,
    'grpo': functools.partial(_stateless, grpo_advantages, True),
    'rloo': functools.partial(_stateless, rloo_advantages, True),
    'reinforce_pp': functools.partial(_stateless, reinforce_pp_advantages, False),
}


def get_advantage_fn(name: str, **hparams) -> AdvantageEstimator:
  """The estimator registered as `name`, with its hyper-parameters (e.g. ema=0.1, eps=1e-6).

  Example:
    >>> est = get_advantage_fn('grpo', eps=1e-6)
    >>> adv, _ = est.update(jnp.array([1., 0., 0., 0.]), est.init(), group_size=4)
  """
  if name not in ADVANTAGES:
    raise ValueError(f'unknown advantage estimator {name!r}; known: {sorted(ADVANTAGES)}.')
  return ADVANTAGES[name](**hparams)
