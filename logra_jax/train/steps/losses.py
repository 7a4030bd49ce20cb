"""What the steps differentiate: the RL loss of a micro-batch over the completion tokens, and
the reference log-probs of its KL penalty (`make_ref_logp`).

Shape key: N sequences, P prompt length (left padded), T completion length, L = P + T,
V vocabulary.

A batch is a dict of arrays: tokens_NxL, mask_NxL (real tokens), targets_NxT (the sampled
completion), target_mask_NxT, behaviour_logp_NxT, advantages_N.
"""
from typing import Optional

import jax
import jax.numpy as jnp

from logra_jax.rl import losses as rl_losses
from logra_jax.train import completion
from logra_jax.train.steps.micro_batches import prompt_share, rows_sharding, split_size
from logra_jax.train.steps.step_config import StepShardings


def completion_logits(model, variables, batch, prompt_len):
  """Logits predicting the T completion tokens: positions P−1 … P+T−2."""
  t = batch['targets'].shape[1]
  logits, _ = model.apply(variables, batch['tokens'], attn_mask_BxL=batch['mask'])
  return logits[:, prompt_len - 1:prompt_len - 1 + t]


def _mismatch_of_logp(logp, batch):
  """k3 estimate of KL(behaviour ‖ trainer) per token: the generator/trainer mismatch."""
  r = jax.lax.stop_gradient(logp) - batch['behaviour_logp']
  return rl_losses.aggregate(jnp.exp(r) - 1.0 - r, batch['target_mask'])


def _mismatch(logits, batch, temperature):
  return _mismatch_of_logp(rl_losses.token_logprobs(logits, batch['targets'], temperature), batch)


def _chunked_loss_fn(model, loss_cfg, prompt_len):
  """`loss_fn` over vocabulary chunks (`ModelConfig.vocab_chunk` > 0): no (N, T, V) logits."""
  def loss(variables, mb, weight, share=1):
    out = completion.forward(model, variables, mb, prompt_len, share)
    logp, entropy = completion.logprobs_and_entropy(model, out, mb['targets'],
                                                    loss_cfg.temperature)
    value, metrics = rl_losses.rl_loss_from_logprobs(
        loss_cfg, logp, mb['behaviour_logp'], mb['advantages'], mb['target_mask'],
        mb.get('ref_logp'), entropy)
    metrics = dict(metrics, mismatch=_mismatch_of_logp(logp, mb))
    metrics['entropy'] = rl_losses.aggregate(jax.lax.stop_gradient(entropy), mb['target_mask'])
    return value * weight, metrics
  return loss


def loss_fn(model, loss_cfg, prompt_len):
  """``loss(variables, mb, weight, share=1)`` -> (weighted loss, metrics); ``share``: rows in
  runs of that many sharing a prompt (`completion.forward`)."""
  if model.config.vocab_chunk:
    return _chunked_loss_fn(model, loss_cfg, prompt_len)

  def loss(variables, mb, weight, share=1):
    logits = completion.forward(model, variables, mb, prompt_len, share)
    value, metrics = rl_losses.rl_loss(loss_cfg, logits, mb['targets'], mb['behaviour_logp'],
                                       mb['advantages'], mb['target_mask'], mb.get('ref_logp'))
    metrics = dict(metrics, mismatch=_mismatch(logits, mb, loss_cfg.temperature))
    entropy = rl_losses.token_entropy(jax.lax.stop_gradient(logits), loss_cfg.temperature)
    metrics['entropy'] = rl_losses.aggregate(entropy, mb['target_mask'])
    return value * weight, metrics
  return loss


def make_ref_logp(model, prompt_len: int, temperature: float,
                  sh: Optional[StepShardings] = None, prompt_group: int = 1):
  """Jitted log-probs of the completion tokens under reference params (the KL penalty);
  ``prompt_group``: rows in runs of that many sharing a prompt (`StepConfig.prompt_group`)."""
  def ref_logp(ref_params, batch):
    n = jax.tree.leaves(batch)[0].shape[0]
    share = prompt_share(range(n), prompt_group, split_size(rows_sharding(sh and sh.batch, n)))
    out = completion.forward(model, {'params': ref_params}, batch, prompt_len, share)
    return completion.logprobs(model, out, batch['targets'], temperature)
  if sh is None:
    return jax.jit(ref_logp)
  return jax.jit(ref_logp, in_shardings=(sh.params, sh.batch), out_shardings=sh.replicated)
