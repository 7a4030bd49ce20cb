"""The three update methods behind one interface: LoGRA, dense AdamW, LoRA.

A method holds the run state as a dict of arrays (checkpointed as is) and exposes
``step(state, batch, prompt_len, step, budget) -> (state, metrics)`` and
``policy_params(state)`` (the weights the generator samples with).
"""
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from logra_jax import sketch
from logra_jax.rl import losses as rl_losses
from logra_jax.train import optimizers, steps
from logra_jax.train.config import TrainConfig


def loss_config(cfg: TrainConfig) -> rl_losses.LossConfig:
  hp = (('cap', cfg.rl.tis_cap),) if cfg.rl.loss == 'reinforce_tis' else (
      ('clip_eps', cfg.rl.clip_eps),)
  return rl_losses.LossConfig(policy=cfg.rl.loss, hparams=hp, entropy_coef=cfg.rl.entropy_coef,
                              kl_coef=cfg.rl.kl_coef, aggregation=cfg.rl.aggregation,
                              temperature=cfg.rollout.temperature)


def _step_config(cfg: TrainConfig, prompt_len: int) -> steps.StepConfig:
  o = cfg.optim
  return steps.StepConfig(prompt_len, o.micro_batches, o.kl_sequences, o.kl_control,
                          o.kl_probe, o.alpha_max, o.sparse_mask)


@dataclasses.dataclass
class Method:
  init: Callable[[Any], dict]
  step: Callable
  policy_params: Callable[[dict], Any]


def _cached(make):
  """Builds (and jits) one step function per prompt length."""
  cache = {}
  def get(prompt_len):
    if prompt_len not in cache:
      cache[prompt_len] = make(prompt_len)
    return cache[prompt_len]
  return get


def logra_method(cfg: TrainConfig, model) -> Method:
  o = cfg.optim
  opt = optimizers.logra_optimizer(o, cfg.total_steps)
  get = _cached(lambda p: steps.make_logra_step(model, loss_config(cfg), opt, _step_config(cfg, p)))

  def init(params):
    a = optimizers.projections_at(o, params, cfg.seed, 0)
    return {'params': params, 'opt_state': opt.init(sketch.zero_probes(params, a))}

  def step(state, batch, prompt_len, t, budget):
    a = optimizers.projections_at(o, state['params'], cfg.seed, t)
    key = jax.random.fold_in(jax.random.key(cfg.seed), t)
    params, opt_state, metrics = get(prompt_len)(state['params'], state['opt_state'], batch, a,
                                                 jnp.float32(budget), key)
    return {'params': params, 'opt_state': opt_state}, metrics

  return Method(init, step, lambda s: s['params'])


def adam_method(cfg: TrainConfig, model) -> Method:
  opt = optimizers.adam_optimizer(cfg.optim, cfg.total_steps)
  get = _cached(lambda p: steps.make_dense_step(model, loss_config(cfg), opt, _step_config(cfg, p)))

  def step(state, batch, prompt_len, t, budget):
    del t, budget
    params, opt_state, metrics = get(prompt_len)(None, state['params'], state['opt_state'], batch)
    return {'params': params, 'opt_state': opt_state}, metrics

  return Method(lambda params: {'params': params, 'opt_state': opt.init(params)}, step,
                lambda s: s['params'])


def lora_method(cfg: TrainConfig, model) -> Method:
  o = cfg.optim
  opt = optimizers.adam_optimizer(o, cfg.total_steps)
  scale = o.lora_alpha / o.lora_rank
  merge = lambda params, lora: optimizers.lora_merge(params, lora, scale)
  get = _cached(lambda p: steps.make_dense_step(model, loss_config(cfg), opt,
                                                _step_config(cfg, p), merge=merge))
  merged = jax.jit(merge)

  def init(params):
    lora = optimizers.init_lora(params, o.lora_rank, jax.random.key(cfg.seed + 1))
    return {'params': params, 'lora': lora, 'opt_state': opt.init(lora)}

  def step(state, batch, prompt_len, t, budget):
    del t, budget
    lora, opt_state, metrics = get(prompt_len)(state['params'], state['lora'],
                                               state['opt_state'], batch)
    return dict(state, lora=lora, opt_state=opt_state), metrics

  return Method(init, step, lambda s: merged(s['params'], s['lora']))


METHODS = {'logra': logra_method, 'adam': adam_method, 'lora': lora_method}


def get_method(cfg: TrainConfig, model) -> Method:
  return METHODS[cfg.optim.name](cfg, model)
