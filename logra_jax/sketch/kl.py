"""Predicted KL of a candidate update and the step size it allows (docs/method.md §4).

mean_s KL(π_θ ‖ π_{θ+αD}) = α² q(D) + O(α³),
q(D) = 1/(2|P|T²) Σ_s Var_{v∼softmax(z_s/T)}[ż_v(s)],   α = min(α_max, sqrt(δ/q)).
"""
import math
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from logra_jax.sketch import vocab


def _acc(x):
  return x.astype(jnp.promote_types(jnp.float32, x.dtype))


def _mask_count(mask):
  return jnp.maximum(jnp.sum(mask), 1.0)


def _masked_mean(x, mask):
  mask = jnp.ones(x.shape, x.dtype) if mask is None else mask.astype(x.dtype)
  return jnp.sum(x * mask) / _mask_count(mask)


def position_variance(logits, logit_tangents, temperature=1.0):
  """Var_{v∼softmax(z_s/T)}[ż_v(s)] at every position s, (...): q is its masked mean / 2T²."""
  z, zdot = _acc(logits), _acc(logit_tangents)
  p = jax.nn.softmax(z / temperature, axis=-1)
  mean = jnp.sum(p * zdot, axis=-1, keepdims=True)
  return jnp.sum(p * jnp.square(zdot - mean), axis=-1)


def position_kl(logits_p, logits_q, temperature=1.0):
  """KL(softmax(z_p/T) ‖ softmax(z_q/T)) at every position, (...)."""
  lp = jax.nn.log_softmax(_acc(logits_p) / temperature, axis=-1)
  lq = jax.nn.log_softmax(_acc(logits_q) / temperature, axis=-1)
  return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


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
  var = position_variance(logits, logit_tangents, temperature)
  return _masked_mean(var, mask) / (2.0 * temperature**2)


def mean_kl(logits_p, logits_q, temperature=1.0, mask=None):
  """The true mean KL(softmax(z_p/T) ‖ softmax(z_q/T)) over the masked positions."""
  return _masked_mean(position_kl(logits_p, logits_q, temperature), mask)


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
                                     temperature=1.0, mask=None, kl=None):
  """q ≈ KL(π_θ ‖ π_{θ+εD}) / ε², the probe the 27B run used instead of the JVP.

  `kl(out_p, out_q, temperature, mask)` compares two outputs of `logits_fn` (default
  `mean_kl` of logits; e.g. a chunked KL when `logits_fn` returns hidden states).
  """
  kl = kl or mean_kl
  moved = jax.tree.map(lambda p, u: p + eps * u.astype(p.dtype), probes, updates)
  return kl(logits_fn(probes), logits_fn(moved), temperature, mask) / eps**2


def finite_difference_kl_at_budget(logits_fn, probes, updates, budget, temperature=1.0,
                                   mask=None, kl=None):
  """q ≈ KL(π_θ ‖ π_{θ+εD}) / ε² at the step the budget allows: the trainer's FD probe.

  A fixed small ε cannot work in finite precision: KL(εD) ≈ ε²q sinks below the rounding
  floor of the KL of two forwards (~1e-8 in fp32; a bf16 forward loses εD entirely), and q
  comes out as noise, 0 or negative. A pilot at the nominal step (ε = 1) sets
  ε = sqrt(budget / q₁), the α the budget allows; there KL ≈ budget, far above the floor,
  and the O(ε) error of q is the step's own second-order-expansion error.
  ``logits_fn`` should compute in at least fp32; ``kl`` as in
  `finite_difference_kl_coefficient`.
  """
  kl = kl or mean_kl
  base = logits_fn(probes)

  def q_at(eps):
    moved = jax.tree.map(lambda p, u: p + eps * u.astype(p.dtype), probes, updates)
    return kl(base, logits_fn(moved), temperature, mask) / eps**2

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


# ---------------------------------------------------------------- over vocabulary chunks
# The same quantities from final hidden states h (..., D) and a head weight w, logits
# z = h·w, computed chunk by chunk (`sketch.vocab`): no (..., V) array, forward or backward.


def chunked_mean_kl(hidden_p, w_p, hidden_q, w_q, temperature=1.0, mask=None, *,
                    vocab_axis: int, chunk: int):
  """`mean_kl` of the logits h_p·w_p and h_q·w_q, over vocabulary chunks of `chunk`.

  Per position, with running maxima m_p, m_q and u = z/T:
    s_p = Σ e^{u_p−m_p},  s_q = Σ e^{u_q−m_q},  a = Σ e^{u_p−m_p}(u_p − u_q),
    KL = a/s_p − (m_p + log s_p) + (m_q + log s_q).
  """
  hp, lead = vocab.flatten_tokens(hidden_p)
  hq, _ = vocab.flatten_tokens(hidden_q)
  acc = vocab.acc_dtype(hp.dtype)
  zeros = jnp.zeros(hp.shape[:1], acc)
  neg = jnp.full(hp.shape[:1], vocab.NEG, acc)

  def body(carry, w_chunks, ids_C, fresh_C):
    del ids_C
    m_p, s_p, a, m_q, s_q = carry
    u_p = vocab.chunk_logits(hp, w_chunks[0], vocab_axis, temperature)
    u_q = vocab.chunk_logits(hq, w_chunks[1], vocab_axis, temperature)
    mp_new, mq_new = vocab.fold_max(m_p, u_p, fresh_C), vocab.fold_max(m_q, u_q, fresh_C)
    e_p = vocab.shifted_exp(u_p, mp_new, fresh_C)
    r_p, r_q = jnp.exp(m_p - mp_new), jnp.exp(m_q - mq_new)
    return (mp_new, r_p * s_p + jnp.sum(e_p, -1), r_p * a + jnp.sum(e_p * (u_p - u_q), -1),
            mq_new, r_q * s_q + jnp.sum(vocab.shifted_exp(u_q, mq_new, fresh_C), -1))

  m_p, s_p, a, m_q, s_q = vocab.scan_vocab(body, (neg, zeros, zeros, neg, zeros),
                                           (w_p, w_q), vocab_axis, chunk)
  kl = a / s_p - (m_p + jnp.log(s_p)) + (m_q + jnp.log(s_q))
  return _masked_mean(kl.reshape(lead), mask)


def _merge_moments(run, chunk_stats):
  """Chan et al.'s pairwise merge of weighted (max, weight, mean, M2) under a shared shift."""
  m, w, mu, m2 = run
  m_c, w_c, mu_c, m2_c = chunk_stats
  m_new = jnp.maximum(m, m_c)
  wa, wb = jnp.exp(m - m_new) * w, jnp.exp(m_c - m_new) * w_c
  w_new = wa + wb
  delta = mu_c - mu
  m2_new = jnp.exp(m - m_new) * m2 + jnp.exp(m_c - m_new) * m2_c + delta**2 * wa * wb / w_new
  return m_new, w_new, mu + delta * wb / w_new, m2_new


def chunked_kl_coefficient(hidden, hidden_tangent, w, temperature=1.0, mask=None, *,
                           vocab_axis: int, chunk: int):
  """`kl_coefficient` with z = h·w and ż = ḣ·w (the head fixed), over vocabulary chunks.

  Each chunk's softmax-weighted mean and centred second moment of ż (weights e^{u−m_c},
  its own max) are merged into the running ones (Chan et al.): no E[ż²] − E[ż]²
  cancellation. Var = M2 / W at the end.
  """
  h, lead = vocab.flatten_tokens(hidden)
  hdot, _ = vocab.flatten_tokens(hidden_tangent)
  acc = vocab.acc_dtype(h.dtype)
  zeros = jnp.zeros(h.shape[:1], acc)

  def body(carry, w_chunks, ids_C, fresh_C):
    del ids_C
    u = vocab.chunk_logits(h, w_chunks[0], vocab_axis, temperature)
    zdot = vocab.chunk_logits(hdot, w_chunks[0], vocab_axis).astype(acc)
    m_c = vocab.chunk_max(u, fresh_C)
    e = vocab.shifted_exp(u, m_c, fresh_C)
    w_c = jnp.sum(e, -1)
    mu_c = jnp.sum(e * zdot, -1) / w_c
    m2_c = jnp.sum(e * jnp.square(zdot - mu_c[:, None]), -1)
    return _merge_moments(carry, (m_c, w_c, mu_c, m2_c))

  init = (jnp.full(h.shape[:1], vocab.NEG, acc), zeros, zeros, zeros)
  _, w_tot, _, m2 = vocab.scan_vocab(body, init, (w,), vocab_axis, chunk)
  return _masked_mean((m2 / w_tot).reshape(lead), mask) / (2.0 * temperature**2)
