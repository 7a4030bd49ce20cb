"""Supervised warm start: a few Adam steps of next-token cross-entropy on answers.

Used by the tiny CPU default only (and said so in its config and output): RL from a random
0.5M-parameter model never sees a reward.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax


def make_sft_step(model, opt):
  """One jitted Adam step on tokens_NxL with loss_mask_NxL on the target tokens."""
  def loss_fn(params, tokens, loss_mask):
    logits, _ = model.apply({'params': params}, tokens, attn_mask_BxL=tokens != 0)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), -1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * loss_mask[:, 1:]) / jnp.maximum(jnp.sum(loss_mask[:, 1:]), 1.0)

  @jax.jit
  def step(params, opt_state, tokens, loss_mask):
    loss, g = jax.value_and_grad(loss_fn)(params, tokens, loss_mask)
    updates, opt_state = opt.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def warm_start(model, params, batch, steps: int, learning_rate: float, batch_size: int,
               seed: int):
  """``steps`` SFT steps on random rows of ``batch`` ({'tokens', 'loss_mask'}, pad id 0)."""
  opt = optax.adam(learning_rate)
  opt_state = opt.init(params)
  step = make_sft_step(model, opt)
  rng = np.random.default_rng(seed)
  loss = float('nan')
  for _ in range(steps):
    idx = rng.integers(0, len(batch['tokens']), batch_size)
    params, opt_state, loss = step(params, opt_state, batch['tokens'][idx],
                                   batch['loss_mask'][idx])
  return params, float(loss)
