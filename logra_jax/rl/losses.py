"""Policy-gradient losses: small pure functions over token arrays, composed by `rl_loss`.

Shape key: B = completions, T = completion tokens (padded), V = vocabulary.
`logp_BxT` are log-probs of the sampled tokens under the current policy, `behaviour_logp_BxT`
under the policy that generated them (from the generator), `mask_BxT` is 1 on completion
tokens and 0 on padding, `advantages_B` one value per completion.

A per-token policy loss `fn(logp_BxT, behaviour_logp_BxT, advantages_B, **hp)` returns
`(loss_BxT, metrics)` with per-token metric arrays; `aggregate` reduces them under the mask.
"""
import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

AGGREGATIONS = ('token', 'sequence')


def token_logprobs(logits_BxTxV, targets_BxT, temperature: float = 1.0):
  """Log-probs of the targets under softmax(logits / temperature).

    logp_bt = log softmax(z_bt / τ)[y_bt].

  Returns:
    logp_BxT in the logits' dtype.
  """
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV / temperature, axis=-1)
  return jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]


def token_entropy(logits_BxTxV, temperature: float = 1.0):
  """Entropy of softmax(logits / temperature) at each position.

    H_bt = -Σ_v p_btv log p_btv.

  Returns:
    entropy_BxT.
  """
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV / temperature, axis=-1)
  return -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)


def aggregate(x_BxT, mask_BxT, mode: str = 'token'):
  """Masked mean of a per-token quantity.

    token:    Σ_bt m x / Σ_bt m            (every valid token weighs the same)
    sequence: mean_b (Σ_t m x / Σ_t m)     (every completion weighs the same)

  A completion with no valid token contributes 0 (and counts in the `sequence` mean).
  """
  mask = mask_BxT.astype(x_BxT.dtype)
  if mode == 'token':
    return jnp.sum(x_BxT * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  if mode == 'sequence':
    per_seq = jnp.sum(x_BxT * mask, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
    return jnp.mean(per_seq)
  raise ValueError(f'unknown aggregation {mode!r}; known: {AGGREGATIONS}.')


def reinforce_tis(logp_BxT, behaviour_logp_BxT, advantages_B, cap: float = 2.0):
  """Token-level REINFORCE with truncated importance sampling (the authors' loss).

    ρ_bt = sg(min(exp(logp_bt - logp^β_bt), cap)),   ℓ_bt = -ρ_bt A_b logp_bt,
    so ∇ℓ_bt = -ρ_bt A_b ∇logp_bt.

  Args:
    logp_BxT: current-policy log-probs of the sampled tokens (differentiated).
    behaviour_logp_BxT: the generator's log-probs of the same tokens.
    advantages_B: one advantage per completion.
    cap: the truncation of the importance ratio (authors: 2.0); None for no cap.

  Returns:
    (loss_BxT, metrics): metrics['is_ratio'], metrics['is_capped'] per token.
  """
  raw = jnp.exp(jax.lax.stop_gradient(logp_BxT) - behaviour_logp_BxT)
  ratio = raw if cap is None else jnp.minimum(raw, cap)
  loss = -ratio * advantages_B[:, None] * logp_BxT
  capped = jnp.zeros_like(raw) if cap is None else (raw > cap).astype(raw.dtype)
  return loss, {'is_ratio': raw, 'is_capped': capped}


def ppo_clip(logp_BxT, behaviour_logp_BxT, advantages_B, clip_eps: float = 0.2,
             clip_eps_high: Optional[float] = None):
  """PPO's clipped surrogate against the behaviour policy.

    ρ = exp(logp - logp^β),  ℓ = -min(ρ A, clip(ρ, 1 - ε, 1 + ε_high) A),  ε_high = ε if None.

  Returns:
    (loss_BxT, metrics): metrics['is_ratio'], metrics['ppo_clipped'] per token.
  """
  high = clip_eps if clip_eps_high is None else clip_eps_high
  adv = advantages_B[:, None]
  ratio = jnp.exp(logp_BxT - behaviour_logp_BxT)
  unclipped = ratio * adv
  clipped = jnp.clip(ratio, 1.0 - clip_eps, 1.0 + high) * adv
  loss = -jnp.minimum(unclipped, clipped)
  was_clipped = (clipped < unclipped).astype(ratio.dtype)
  return loss, {'is_ratio': jax.lax.stop_gradient(ratio), 'ppo_clipped': was_clipped}


def kl_k3(logp_BxT, ref_logp_BxT):
  """Schulman's k3 estimator of KL(π || π_ref) per sampled token (unbiased, >= 0).

    k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1.
  """
  d = ref_logp_BxT - logp_BxT
  return jnp.exp(d) - d - 1.0


POLICY_LOSSES: dict[str, Callable] = {'reinforce_tis': reinforce_tis, 'ppo_clip': ppo_clip}


def get_policy_loss(name: str) -> Callable:
  """The per-token policy loss registered as `name` ('reinforce_tis' | 'ppo_clip')."""
  if name not in POLICY_LOSSES:
    raise ValueError(f'unknown policy loss {name!r}; known: {sorted(POLICY_LOSSES)}.')
  return POLICY_LOSSES[name]


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """policy: registered policy loss. hparams: its keyword arguments (e.g. (('cap', 2.0),)).
  entropy_coef: bonus weight (loss -= coef·H). kl_coef: k3-to-reference weight (needs
  reference log-probs). aggregation: 'token' | 'sequence'. temperature: of the sampler."""
  policy: str = 'reinforce_tis'
  hparams: tuple[tuple[str, float], ...] = (('cap', 2.0),)
  entropy_coef: float = 0.0
  kl_coef: float = 0.0
  aggregation: str = 'token'
  temperature: float = 1.0

  def __post_init__(self):
    get_policy_loss(self.policy)
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f'unknown aggregation {self.aggregation!r}; known: {AGGREGATIONS}.')
    if self.temperature <= 0:
      raise ValueError(f'temperature must be > 0, got {self.temperature}.')


def rl_loss(config: LossConfig, logits_BxTxV, targets_BxT, behaviour_logp_BxT, advantages_B,
            mask_BxT, ref_logp_BxT=None):
  """Policy loss + kl_coef·k3 − entropy_coef·H, aggregated under the mask.

  Args:
    config: a `LossConfig`.
    logits_BxTxV: current-policy logits predicting targets_BxT.
    targets_BxT: the sampled completion tokens.
    behaviour_logp_BxT, advantages_B, mask_BxT: see the module docstring.
    ref_logp_BxT: reference-policy log-probs; required when config.kl_coef > 0.

  Returns:
    (loss, metrics): a scalar and a dict of scalars (masked token means).
  """
  logp = token_logprobs(logits_BxTxV, targets_BxT, config.temperature)
  entropy = (token_entropy(logits_BxTxV, config.temperature) if config.entropy_coef
             else None)
  return rl_loss_from_logprobs(config, logp, behaviour_logp_BxT, advantages_B, mask_BxT,
                               ref_logp_BxT, entropy)


def rl_loss_from_logprobs(config: LossConfig, logp_BxT, behaviour_logp_BxT, advantages_B,
                          mask_BxT, ref_logp_BxT=None, entropy_BxT=None):
  """`rl_loss` from the targets' log-probs (and entropies, needed when entropy_coef > 0),
  however they were computed (full logits, or `blockwise` over vocabulary chunks)."""
  logp = logp_BxT
  per_token, token_metrics = get_policy_loss(config.policy)(
      logp, behaviour_logp_BxT, advantages_B, **dict(config.hparams))
  metrics = {'loss/policy': aggregate(per_token, mask_BxT, config.aggregation)}
  if config.kl_coef:
    if ref_logp_BxT is None:
      raise ValueError('kl_coef > 0 needs ref_logp_BxT.')
    kl = kl_k3(logp, ref_logp_BxT)
    per_token = per_token + config.kl_coef * kl
    metrics['kl_ref'] = aggregate(jax.lax.stop_gradient(kl), mask_BxT)
  if config.entropy_coef:
    if entropy_BxT is None:
      raise ValueError('entropy_coef > 0 needs entropy_BxT.')
    per_token = per_token - config.entropy_coef * entropy_BxT
    metrics['entropy'] = aggregate(jax.lax.stop_gradient(entropy_BxT), mask_BxT)
  loss = aggregate(per_token, mask_BxT, config.aggregation)
  metrics['loss'] = loss
  metrics['logp_mismatch'] = aggregate(
      jax.lax.stop_gradient(jnp.abs(logp - behaviour_logp_BxT)), mask_BxT)
  for k, v in token_metrics.items():
    metrics[k] = aggregate(v, mask_BxT)
  return loss, metrics
