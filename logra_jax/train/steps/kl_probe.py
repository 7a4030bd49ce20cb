"""The KL probe of a step: the rows it reads, q along the update, and the realised-KL
telemetry (computed where the trainer asks, NaN on the branch that skips it).

Shape key: N sequences in the step's batch, n probed rows (`StepConfig.kl_sequences`).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import sketch
from logra_jax.train import completion
from logra_jax.train.steps.micro_batches import prompt_share, rows_sharding, split_size


def kl_rows(total: int, n: int) -> list:
  """The KL probe's n of ``total`` rows, spread over the batch: rows i·N//n (all if n >= N).

  A prompt's G completions are contiguous, so the first n rows would be one or two prompts'
  groups; strided rows reach min(n, N/G) prompts.
  """
  return list(range(total)) if n >= total else [i * total // n for i in range(n)]


def kl_subset(batch, n):
  """`kl_rows` of the batch."""
  total = jax.tree.leaves(batch)[0].shape[0]
  if n >= total:
    return batch
  rows = jnp.asarray(kl_rows(total, n))
  return jax.tree.map(lambda x: x[rows], batch)


def kl_batch(batch, n, sh, group=1):
  """(`kl_subset`, its `prompt_share`), its rows split over the devices (else every device
  probes all n)."""
  total = jax.tree.leaves(batch)[0].shape[0]
  sub = kl_subset(batch, n)
  rows = rows_sharding(sh and sh.batch, jax.tree.leaves(sub)[0].shape[0])
  share = prompt_share(kl_rows(total, n), group, split_size(rows))
  return (sub if rows is None else jax.lax.with_sharding_constraint(
      sub, jax.tree.map(lambda _: rows, sub))), share


def probe_kl(model, out_fn, fd_model, probes, u, kind, budget, temperature, mask):
  """(the forward at the probes, q along U) by a JVP ('jvp') or a finite difference ('fd',
  at the step the budget allows, on ``fd_model``: the forward in at least fp32)."""
  if kind == 'jvp':
    base, tangent = sketch.logits_and_tangents(out_fn, probes, u)
    return base, completion.kl_coefficient(model, base, tangent, temperature, mask)
  kl = functools.partial(completion.mean_kl, model)
  q = sketch.finite_difference_kl_at_budget(lambda p: out_fn(p, fd_model), probes, u, budget,
                                            temperature, mask, kl=kl)
  return out_fn(probes), q


def fp32_compute(model):
  """``model`` computing in at least fp32: the FD KL probe differences two forwards."""
  c = model.config
  return model.clone(config=c.replace(dtype=jnp.promote_types(jnp.float32, c.dtype).name))


def telemetry_at(telemetry_every: int, t: int) -> bool:
  """Whether step t (1-based) logs the realised KL: every `telemetry_every` steps (0: never)."""
  return telemetry_every > 0 and t % telemetry_every == 0


def _nan_like(fn):
  """NaNs shaped like ``fn()``'s outputs: the branch of a `lax.cond` that skips ``fn``."""
  return lambda: jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), jax.eval_shape(fn))


def when(flag, fn):
  """``fn()`` where the traced ``flag`` holds, else NaNs (one compiled program, one branch run)."""
  return jax.lax.cond(flag, fn, _nan_like(fn))


def probe_telemetry(sc, probe, realized, probed, telemetry):
  """(q, realised KL) after the update: the probe only where the step size or telemetry needs it.

  ``probe()`` -> (forward at the probes, q); ``probed``: its result (kl_control) or None;
  ``realized(base)``: KL(π_old ‖ π_new) at the probe rows, the updated params closed over.
  kl_control=False with telemetry_every=0 traces no probe at all: no JVP, no extra forward.
  """
  if probed is not None:
    base, q = probed
    return q, when(telemetry, lambda: realized(base))
  if not sc.telemetry_every:
    nan = jnp.float32(jnp.nan)
    return nan, nan
  return when(telemetry, lambda: (lambda base, q: (q, realized(base)))(*probe()))


def telemetry_metric(sc, telemetry):
  """1.0 where this step computed the realised KL (the `kl_telemetry` metric), else 0.0."""
  on = jnp.asarray(telemetry) if sc.telemetry_every else jnp.asarray(False)
  return on.astype(jnp.float32)


def with_telemetry_flag(jitted):
  """``jitted(*args, flag)`` as ``call(*args, telemetry=True)`` (the trainer passes
  `telemetry_at(...)`; a direct call logs the realised KL as before)."""
  @functools.wraps(jitted)
  def call(*args, telemetry=True):
    return jitted(*args, np.asarray(bool(telemetry)))
  call.jitted = jitted
  return call
