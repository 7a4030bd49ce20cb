"""The dense-gradient baseline step: AdamW on all params, or on LoRA adapters, jitted once.

Micro-batch gradients are summed in fp32 (`micro_batches.accumulate`); the realised-KL
telemetry is `kl_probe`'s. The metric `grad_norm` is the global norm of the summed gradient (the
LoGRA step's `sketch_norm` is its sketch's).
"""
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from logra_jax.train import completion, lora
from logra_jax.train.steps import kl_probe, micro_batches
from logra_jax.train.steps.losses import loss_fn
from logra_jax.train.steps.micro_batches import accumulate, all_finite, constrain
from logra_jax.train.steps.step_config import StepConfig, StepShardings


def make_dense_step(model, loss_cfg, opt: optax.GradientTransformation, sc: StepConfig,
                    lora_scale: Optional[float] = None, sh: Optional[StepShardings] = None):
  """Dense-gradient step: AdamW on all params, or (``lora_scale`` = s) on LoRA adapters.

  ``step(params, train, opt_state, batch)`` → ``(new train, opt_state, metrics)``: for
  dense Adam ``train`` is the params themselves (pass params twice; the first is ignored);
  for LoRA ``train`` are the adapters (`logra_jax.train.lora`), computed in the layers as
  x W + s·(x a) b with the params frozen: no merged kernel, no kernel gradient.
  ``sh`` fixes every input's and output's sharding (the gradient accumulators too).
  """
  temp = loss_cfg.temperature
  if lora_scale is None:
    variables = lambda params, train: {'params': train}
  else:
    model = lora.layer_model(model)
    variables = functools.partial(lora.variables, scale=lora_scale)
  loss = loss_fn(model, loss_cfg, sc.prompt_len)

  def step(params, train, opt_state, batch, telemetry):
    mb_sharding = micro_batches.micro_batch_sharding_of(sh, batch, sc.micro_batches)
    share = micro_batches.mb_share(sc, batch, sh)
    grad_fn = lambda mb, w: jax.value_and_grad(
        lambda t: loss(variables(params, t), mb, w, share), has_aux=True)(train)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.promote_types(jnp.float32, x.dtype)),
                         train)
    zeros = constrain(zeros, sh and sh.accum)
    g, metrics = accumulate(grad_fn, zeros, batch, sc.micro_batches, loss_cfg.aggregation,
                            mb_sharding)
    updates, new_opt_state = opt.update(g, opt_state, train)
    ok = all_finite(g) & jnp.isfinite(metrics['loss'])
    new_train = jax.tree.map(lambda p, u: jnp.where(ok, p + u.astype(p.dtype), p), train, updates)
    new_opt_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_opt_state, opt_state)
    kl_batch, kl_share = kl_probe.kl_batch(batch, sc.kl_sequences, sh, sc.prompt_group)
    forward = lambda t: completion.forward(model, variables(params, t), kl_batch,
                                           sc.prompt_len, kl_share)
    realized = lambda: completion.mean_kl(model, forward(train), forward(new_train), temp,
                                          kl_batch['target_mask'])
    realized_kl = (kl_probe.when(telemetry, realized) if sc.telemetry_every
                   else jnp.float32(jnp.nan))
    metrics.update(realized_kl=realized_kl,
                   kl_telemetry=kl_probe.telemetry_metric(sc, telemetry),
                   grad_norm=optax.global_norm(g), skipped=1.0 - ok.astype(jnp.float32))
    return new_train, new_opt_state, metrics

  if sh is None:
    return kl_probe.with_telemetry_flag(jax.jit(step, donate_argnums=(1, 2)))
  return kl_probe.with_telemetry_flag(jax.jit(
      step, donate_argnums=(1, 2),
      in_shardings=(sh.params, sh.train, sh.opt_state, sh.batch, sh.replicated),
      out_shardings=(sh.train, sh.opt_state, sh.replicated)))
