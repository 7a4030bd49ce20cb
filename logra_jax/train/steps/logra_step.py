"""The LoGRA step: sketches → optax → α from the predicted KL → kernel += α·AᵀU, jitted once
with the projections A drawn on device.

Micro-batch sketches are summed in fp32 (`micro_batches.accumulate`); the KL probe and the
realised-KL telemetry are `kl_probe`'s.
"""
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import optax

from logra_jax import sketch
from logra_jax.train import completion
from logra_jax.train.steps import kl_probe, micro_batches
from logra_jax.train.steps.losses import loss_fn
from logra_jax.train.steps.micro_batches import accumulate, all_finite, constrain
from logra_jax.train.steps.projections import ProjectionSpec, draw_projections
from logra_jax.train.steps.rounding import check_rounding, rounding_key
from logra_jax.train.steps.step_config import StepConfig, StepShardings


def _acc(dtype):
  """The accumulators' dtype: fp32, or wider for wider leaves."""
  return jnp.promote_types(jnp.float32, dtype)


def _variables(params, projections, point, rest: bool):
  """The sketching variables at a probe point: the probes, and the rest's leaves with rest."""
  if not rest:
    return sketch.sketch_variables(params, projections, point)
  return sketch.sketch_variables(sketch.with_rest(params, point[1]), projections, point[0])


def logra_update_fn(model, loss_cfg, opt: optax.GradientTransformationExtraArgs,
                    sc: StepConfig, sh: Optional[StepShardings] = None,
                    rest_opt: Optional[optax.GradientTransformation] = None):
  """The LoGRA step on given projections (unjitted); `make_logra_step` draws them itself.

  ``update(params, opt_state, batch, projections, budget, key, telemetry=True, **basis)``:
  sketches → optax → α from predicted KL → kernel += α·AᵀU (bf16 kernels stochastically
  rounded with a key folded from ``key``, `rounding.rounding_key`). ``basis`` (optional):
  ``basis=`` A's projection step and ``basis_change=`` old step → A_new A_old⁺, passed to the
  optimizer so that sketch-space momentum follows a redrawn A (`sketch.momentum`). Outputs as
  ``make_logra_step``'s step.

  ``rest_opt`` (optional; `optim.logra.rest_learning_rate`): the leaves LoGRA does not sketch
  (`sketch.rest_of`: embeddings, the head, norm scales) train densely with it, from the
  gradient the same backward gives them. ``opt_state`` is then (sketch state, rest state); the
  step's direction is (AᵀU, V) together: one JVP gives q along both, one α scales both.
  """
  linear = model.clone(sketch_mode='linear')
  fd_linear = kl_probe.fp32_compute(linear) if sc.kl_probe == 'fd' else None
  temp = loss_cfg.temperature
  loss = loss_fn(model, loss_cfg, sc.prompt_len)
  check_rounding(sc)
  rest = rest_opt is not None
  if rest and sc.return_update:
    raise ValueError('logra_update_fn: return_update with rest_opt: the low-rank payload (α·U) '
                     'cannot carry the densely trained rest; sync full weights instead')

  def update(params, opt_state, batch, projections, budget, key, telemetry=True, **basis):
    mb_sharding = micro_batches.micro_batch_sharding_of(sh, batch, sc.micro_batches)
    mb_loss = functools.partial(loss, share=micro_batches.mb_share(sc, batch, sh))
    grad_fn = lambda mb, w: sketch.sketch_value_and_grad(mb_loss, has_aux=True, rest=rest)(
        params, projections, mb, w)
    probes = sketch.zero_probes(params, projections)
    # The probe point and the direction of the step: the sketch's, and the rest's with rest_opt.
    point = (probes, sketch.rest_of(params, projections)) if rest else probes
    zeros = constrain(jax.tree.map(lambda x: jnp.zeros(x.shape, _acc(x.dtype)), point),
                      sh and sh.accum)
    grads, metrics = accumulate(grad_fn, zeros, batch, sc.micro_batches, loss_cfg.aggregation,
                                mb_sharding)
    s, g_rest = grads if rest else (grads, None)
    if sc.sparse_mask:
      s = sketch.sparse_mask_tree(s, key, sc.sparse_mask)
    kernels = sketch.kernels_of(params, projections)
    sketch_state, rest_state = opt_state if rest else (opt_state, None)
    u, new_opt_state = opt.update(s, sketch_state, kernels, projections=projections, **basis)
    if rest:
      v, new_rest_state = rest_opt.update(g_rest, rest_state, point[1])
      new_opt_state = (new_opt_state, new_rest_state)
    direction = (u, v) if rest else u
    kl_batch, kl_share = kl_probe.kl_batch(batch, sc.kl_sequences, sh, sc.prompt_group)
    kl_mask = kl_batch['target_mask']
    out_fn = lambda p, m=linear: completion.forward(
        m, _variables(params, projections, p, rest), kl_batch, sc.prompt_len, kl_share)
    probe = lambda: kl_probe.probe_kl(model, out_fn, fd_linear, point, direction, sc.kl_probe,
                                      budget, temp, kl_mask)
    probed = probe() if sc.kl_control else None
    alpha = sketch.step_scale(probed[1], budget, sc.alpha_max) if probed else jnp.ones_like(budget)
    ok = all_finite(grads) & jnp.isfinite(metrics['loss']) & jnp.isfinite(alpha)

    def apply():
      rk = rounding_key(sc, key)
      new = sketch.apply_sketch_updates(params, u, projections, alpha, key=rk)
      if rest:  # the rest's rounding: a key of its own
        new = sketch.apply_dense_updates(new, v, alpha,
                                         key=None if rk is None else jax.random.fold_in(rk, 1))
      return new
    new_params = jax.lax.cond(ok, apply, lambda: params)
    new_opt_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_opt_state, opt_state)
    realized = lambda base: completion.mean_kl(
        model, base, completion.forward(model, {'params': new_params}, kl_batch, sc.prompt_len,
                                        kl_share), temp, kl_mask)
    q, realized_kl = kl_probe.probe_telemetry(sc, probe, realized, probed, telemetry)
    metrics.update(
        predicted_kl=alpha**2 * q, kl_coefficient=q, alpha=alpha, kl_budget=budget,
        realized_kl=realized_kl, kl_telemetry=kl_probe.telemetry_metric(sc, telemetry),
        sketch_norm=optax.global_norm(s), skipped=1.0 - ok.astype(jnp.float32))
    if not sc.return_update:
      return new_params, new_opt_state, metrics
    applied = jax.tree.map(lambda x: jnp.where(ok, alpha * x, 0).astype(jnp.float32), u)
    return new_params, new_opt_state, metrics, applied

  return update


def make_logra_step(model, loss_cfg, opt: optax.GradientTransformationExtraArgs, sc: StepConfig,
                    proj: ProjectionSpec, sh: Optional[StepShardings] = None,
                    rest_opt: Optional[optax.GradientTransformation] = None):
  """The jitted LoGRA step, drawing its projections A on device from (seed, step).

  Returns ``step(params, opt_state, batch, seed, step, budget, key, telemetry=True)`` →
  ``(params, opt_state, metrics)`` (and α·U, the applied update's factor, when
  ``sc.return_update``); seed and step are uint32 scalars in [0, 2**32) (pass the
  projection step: 0 for fixed A), traced, so one compile serves every step; A is
  ``draw_projections(params, seed, step, proj)``, bit-identical to ``projection.py``, and
  only ever exists inside the step. params and opt_state are donated. A non-finite sketch,
  loss or step size skips the update (weights and optimizer state untouched, `skipped` = 1).
  ``sh`` fixes every input's and output's sharding (the sketch accumulators too; A is
  replicated). The metric `sketch_norm` is the global norm of the summed sketch. ``rest_opt``:
  the rest's dense optimizer (`logra_update_fn`); ``opt_state`` is then a pair.
  """
  if not isinstance(proj, ProjectionSpec):
    raise TypeError(f'make_logra_step: proj must be a steps.ProjectionSpec, got {proj!r}')
  update = logra_update_fn(model, loss_cfg, opt, sc, sh, rest_opt)

  def draw(params, seed, proj_step):
    a = draw_projections(params, seed, proj_step, proj)
    return constrain(a, sh and jax.tree.map(lambda _: sh.replicated, a))

  def step(params, opt_state, batch, seed, proj_step, budget, key, telemetry):
    a = draw(params, seed, proj_step)
    # Sketch-space momentum follows A when it is redrawn: M = A A_old⁺, drawn only then.
    change = lambda old: sketch.basis_transfer(a, draw(params, seed, old))
    return update(params, opt_state, batch, a, budget, key, telemetry, basis=proj_step,
                  basis_change=change)

  if sh is None:
    return kl_probe.with_telemetry_flag(jax.jit(step, donate_argnums=(0, 1)))
  r = sh.replicated
  outs = (sh.params, sh.opt_state, r) + ((sh.accum,) if sc.return_update else ())
  return kl_probe.with_telemetry_flag(jax.jit(
      step, donate_argnums=(0, 1), in_shardings=(sh.params, sh.opt_state, sh.batch) + (r,) * 5,
      out_shardings=outs))
