"""Predicted KL of a candidate update and the step size it allows (docs/method.md §4).

mean_s KL(π_θ ‖ π_{θ+αD}) = α² q(D) + O(α³),
q(D) = 1/(2|P|T²) Σ_s Var_{v∼softmax(z_s/T)}[ż_v(s)],   α = min(α_max, sqrt(δ/q)).
"""
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax


def _acc(x):
  return x.astype(jnp.promote_types(jnp.float32, x.dtype))


def _mask_count(mask):
  return jnp.maximum(jnp.sum(mask), 1.0)


def kl_coefficient(logits, logit_tangents, temperature=1.0, mask=None):
  """q = 1/(2|P|T²) Σ_{s∈P} Var_{v∼softmax(z_s/T)}[ż_v(s)].

  Args:
    logits: z, (..., V).
    logit_tangents: ż, the JVP of the logits along the update, (..., V).
    temperature: T.
    mask: (...) selects the positions P (all positions when None).

  Returns:
    The scalar q (fp32, or fp64 under x64 with fp64 inputs).
  """
  z, zdot = _acc(logits), _acc(logit_tangents)
  p = jax.nn.softmax(z / temperature, axis=-1)
  mean = jnp.sum(p * zdot, axis=-1, keepdims=True)
  var = jnp.sum(p * jnp.square(zdot - mean), axis=-1)
  mask = jnp.ones(var.shape, var.dtype) if mask is None else mask.astype(var.dtype)
  return jnp.sum(var * mask) / (2.0 * _mask_count(mask) * temperature**2)


def mean_kl(logits_p, logits_q, temperature=1.0, mask=None):
  """The true mean KL(softmax(z_p/T) ‖ softmax(z_q/T)) over the masked positions."""
  lp = jax.nn.log_softmax(_acc(logits_p) / temperature, axis=-1)
  lq = jax.nn.log_softmax(_acc(logits_q) / temperature, axis=-1)
  kl = jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)
  mask = jnp.ones(kl.shape, kl.dtype) if mask is None else mask.astype(kl.dtype)
  return jnp.sum(kl * mask) / _mask_count(mask)


def logits_and_tangents(logits_fn: Callable, probes, updates):
  """One ``jax.jvp`` of ``logits_fn(probes)`` along the probe tangent U.

  ``logits_fn`` must run the model with SketchDense in 'linear' mode; the tangent along
  probe U equals the tangent along the kernel update Aᵀ U.
  """
  tangents = jax.tree.map(lambda p, u: u.astype(p.dtype), probes, updates)
  return jax.jvp(logits_fn, (probes,), (tangents,))


def predicted_kl_coefficient(logits_fn, probes, updates, temperature=1.0, mask=None):
  """q(D) along D = Aᵀ U by one forward-mode pass."""
  logits, tangents = logits_and_tangents(logits_fn, probes, updates)
  return kl_coefficient(logits, tangents, temperature, mask)


def finite_difference_kl_coefficient(logits_fn, probes, updates, eps=1e-3,
                                     temperature=1.0, mask=None):
  """q ≈ KL(π_θ ‖ π_{θ+εD}) / ε², the probe the 27B run used instead of the JVP."""
  moved = jax.tree.map(lambda p, u: p + eps * u.astype(p.dtype), probes, updates)
  return mean_kl(logits_fn(probes), logits_fn(moved), temperature, mask) / eps**2


def finite_difference_kl_at_budget(logits_fn, probes, updates, budget, temperature=1.0,
                                   mask=None):
  """q ≈ KL(π_θ ‖ π_{θ+εD}) / ε² at the step the budget allows: the trainer's FD probe.

  A fixed small ε cannot work in finite precision: KL(εD) ≈ ε²q sinks below the rounding
  floor of the KL of two forwards (~1e-8 in fp32; a bf16 forward loses εD entirely), and q
  comes out as noise, 0 or negative. A pilot at the nominal step (ε = 1) sets
  ε = sqrt(budget / q₁), the α the budget allows; there KL ≈ budget, far above the floor,
  and the O(ε) error of q is the step's own second-order-expansion error.
  ``logits_fn`` should compute in at least fp32.
  """
  base = logits_fn(probes)

  def q_at(eps):
    moved = jax.tree.map(lambda p, u: p + eps * u.astype(p.dtype), probes, updates)
    return mean_kl(base, logits_fn(moved), temperature, mask) / eps**2

  q1 = q_at(1.0)
  ok = (q1 > 0) & (budget > 0)
  return q_at(jnp.where(ok, jnp.sqrt(budget / jnp.where(ok, q1, 1.0)), 1.0))


def step_scale(q, budget, alpha_max=3.0):
  """α = min(α_max, sqrt(budget / q)); 1.0 when q == 0 (as the authors).

  Concrete inputs: a NaN or negative q raises ValueError. Traced inputs (inside jit): such
  a q yields NaN, which the trainer's non-finite guard turns into a skipped step.
  """
  if not isinstance(q, jax.core.Tracer) and not isinstance(budget, jax.core.Tracer):
    qf = float(q)
    if math.isnan(qf) or qf < 0:
      raise ValueError(f'predicted KL coefficient q must be finite and >= 0, got {qf}')
    if float(budget) < 0:
      raise ValueError(f'KL budget must be >= 0, got {float(budget)}')
  q = jnp.asarray(q)
  safe_q = jnp.where(q > 0, q, 1.0)
  alpha = jnp.minimum(alpha_max, jnp.sqrt(budget / safe_q))
  alpha = jnp.where(q > 0, alpha, 1.0)
  return jnp.where(jnp.isnan(q) | (q < 0), jnp.nan, alpha)


def kl_budget_schedule(init_value=2e-4, end_value=2e-5, decay_steps=300) -> optax.Schedule:
  """Cosine-annealed predicted-KL budget δ_t (the paper: 2e-4 → 2e-5 over 300 steps)."""
  if init_value <= 0 or end_value < 0:
    raise ValueError(f'budgets must be positive, got {init_value}, {end_value}')
  return optax.cosine_decay_schedule(init_value, decay_steps, alpha=end_value / init_value)


def effective_budget(budget, mismatch_ema, floor=0.5):
  """The authors' mismatch subtraction: max(δ_t − EMA(mismatch), floor · δ_t)."""
  return jnp.maximum(budget - mismatch_ema, floor * budget)
