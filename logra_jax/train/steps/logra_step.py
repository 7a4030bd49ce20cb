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
from flax import traverse_util

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

  ``coprojections`` (optional, B per kernel): the same backward also sums the co-sketches
  G Bᵀ, returned as a fourth output (`make_adaptive_logra_step`'s refresh), before α·U.

  ``rest_opt`` (optional; `optim.logra.rest_learning_rate`): the leaves LoGRA does not sketch
  (`sketch.rest_of`: embeddings, the head, norm scales) train densely with it, from the
  gradient the same backward gives them. ``opt_state`` is then (sketch state, rest state); the
  step's direction is (AᵀU, V) together: one JVP gives q along both, one α scales both. With
  ``sc.rest_under_budget`` False the rest takes V itself, and q and α are the kernels' alone
  (the rest's KL outside the budget).
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

  def update(params, opt_state, batch, projections, budget, key, telemetry=True,
             coprojections=None, **basis):
    mb_sharding = micro_batches.micro_batch_sharding_of(sh, batch, sc.micro_batches)
    mb_loss = functools.partial(loss, share=micro_batches.mb_share(sc, batch, sh))
    probes = sketch.zero_probes(params, projections)
    # The probe point and the direction of the step: the sketch's, and the rest's with rest_opt.
    point = (probes, sketch.rest_of(params, projections)) if rest else probes
    zeros = constrain(jax.tree.map(lambda x: jnp.zeros(x.shape, _acc(x.dtype)), point),
                      sh and sh.accum)
    if coprojections is None:
      grad_fn = lambda mb, w: sketch.sketch_value_and_grad(mb_loss, has_aux=True, rest=rest)(
          params, projections, mb, w)
    else:  # the co-sketches G Bᵀ too (an adaptive subspace's refresh), summed likewise
      grad_fn = lambda mb, w: _regroup(sketch.sketch_value_and_grad(
          mb_loss, has_aux=True, rest=rest, cosketch=True)(params, projections, coprojections,
                                                           mb, w), rest)
      zeros = (zeros, sketch.zero_coprobes(params, coprojections))
    grads, metrics = accumulate(grad_fn, zeros, batch, sc.micro_batches, loss_cfg.aggregation,
                                mb_sharding)
    grads, cosketches = grads if coprojections is not None else (grads, None)
    s, g_rest = grads if rest else (grads, None)
    if sc.sparse_mask:
      s = sketch.sparse_mask_tree(s, key, sc.sparse_mask)
    kernels = sketch.kernels_of(params, projections)
    sketch_state, rest_state = opt_state if rest else (opt_state, None)
    u, new_opt_state = opt.update(s, sketch_state, kernels, projections=projections, **basis)
    if rest:
      v, new_rest_state = rest_opt.update(g_rest, rest_state, point[1])
      new_opt_state = (new_opt_state, new_rest_state)
    direction, probe_point = ((u, v), point) if rest else (u, point)
    kl_batch, kl_share = kl_probe.kl_batch(batch, sc.kl_sequences, sh, sc.prompt_group)
    kl_mask = kl_batch['target_mask']
    out_fn = lambda p, m=linear: completion.forward(
        m, _variables(params, projections, p, rest), kl_batch, sc.prompt_len, kl_share)
    if rest and not sc.rest_under_budget:
      # The probe along the kernels' direction alone: the rest held at its values, outside the
      # JVP (a zero rest tangent instead gave NaN q on SmolLM2 in XLA:CPU's compiled step,
      # not in the same step run op by op).
      direction, probe_point, rest_now = u, point[0], point[1]
      out_fn = lambda p, m=linear: completion.forward(
          m, _variables(params, projections, (p, rest_now), True), kl_batch, sc.prompt_len,
          kl_share)
    probe = lambda: kl_probe.probe_kl(model, out_fn, fd_linear, probe_point, direction,
                                      sc.kl_probe, budget, temp, kl_mask)
    probed = probe() if sc.kl_control else None
    alpha = sketch.step_scale(probed[1], budget, sc.alpha_max) if probed else jnp.ones_like(budget)
    ok = all_finite(grads) & jnp.isfinite(metrics['loss']) & jnp.isfinite(alpha)

    def apply():
      rk = rounding_key(sc, key)
      new = sketch.apply_sketch_updates(params, u, projections, alpha, key=rk)
      if rest:  # the rest's rounding: a key of its own
        new = sketch.apply_dense_updates(new, v, alpha if sc.rest_under_budget else 1.0,
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
    out = (new_params, new_opt_state, metrics)
    if coprojections is not None:
      out += (cosketches,)
    if sc.return_update:
      out += (jax.tree.map(lambda x: jnp.where(ok, alpha * x, 0).astype(jnp.float32), u),)
    return out

  return update


def _regroup(out, rest):
  """(value, (s, c[, rest])) → (value, ((s[, rest]), c)): the accumulators' layout."""
  value, grads = out
  s, c = grads[0], grads[1]
  return value, (((s, grads[2]) if rest else s), c)


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


ADAPTIVE_SALT = 0x5A17  # the adaptive subspace's random rows: a stream apart from the rounding


def sketch_momentum_state(opt_state) -> sketch.SketchMomentumState:
  """The one `sketch.SketchMomentumState` anywhere in ``opt_state`` (its moments and basis)."""
  is_m = lambda x: isinstance(x, sketch.SketchMomentumState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_m) if is_m(x)]
  if len(found) != 1:
    raise ValueError('an adaptive subspace builds A from the sketch-space moment: the sketch '
                     f'optimizer must have one (optim.logra.momentum > 0), found {len(found)}')
  return found[0]


def make_adaptive_logra_step(model, loss_cfg, opt: optax.GradientTransformationExtraArgs,
                             sc: StepConfig, random_rows: int,
                             sh: Optional[StepShardings] = None,
                             rest_opt: Optional[optax.GradientTransformation] = None):
  """The LoGRA step with A carried in the state: an adaptive subspace (docs/method.md §13).

  Returns ``(step, refresh)``, both jitted, params and opt_state donated:
    ``step(params, opt_state, batch, a, a_prev, version, budget, key, telemetry=True)`` →
      ``(params, opt_state, metrics)``: the LoGRA step on the state's A. ``version`` (uint32)
      names A (the step that built it); when it differs from the optimizer state's basis, the
      moments move from ``a_prev``'s basis to ``a``'s (``basis_transfer(a, a_prev)``).
    ``refresh(params, opt_state, batch, a, a_prev, version, seed, t, budget, key,
      telemetry=True)`` → ``(params, opt_state, metrics, a_next)``: the same step, whose
      backward also sums the co-sketches C = G mᵀ (m: the sketch-space moment before this
      step, (…, R, D)), and the next A from them (`sketch.adaptive_projection`: R −
      ``random_rows`` rows from C, ``random_rows`` random ones keyed by (seed, t)). A
      skipped step, or a non-finite C, keeps A.
  With ``sc.return_update`` both also return α·U last, the applied update's factor on ``a``
  (not ``a_next``): no (seed, step) rebuilds such an A, so the low-rank payload carries it
  (`sync.lowrank_blob(..., a_tree=a)`).
  """
  update = logra_update_fn(model, loss_cfg, opt, sc, sh, rest_opt)
  basis = lambda a, a_prev, version: dict(
      basis=version, basis_change=lambda old: sketch.basis_transfer(a, a_prev))

  def step(params, opt_state, batch, a, a_prev, version, budget, key, telemetry):
    return update(params, opt_state, batch, a, budget, key, telemetry,
                  **basis(a, a_prev, version))

  def refresh(params, opt_state, batch, a, a_prev, version, seed, t, budget, key, telemetry):
    m = sketch_momentum_state(opt_state).mu  # (…, R, D); the rest's Adam has none
    out = update(params, opt_state, batch, a, budget, key, telemetry, coprojections=m,
                 **basis(a, a_prev, version))
    new_params, new_opt_state, metrics, c = out[:4]
    base = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), t), ADAPTIVE_SALT)
    flat_c, flat_a = traverse_util.flatten_dict(c), traverse_util.flatten_dict(a)
    nxt = {p: sketch.adaptive_projection(flat_c[p], jax.random.fold_in(base, i),
                                         flat_a[p].shape[-2], random_rows,
                                         dtype=flat_a[p].dtype)
           for i, p in enumerate(sorted(flat_c))}
    nxt = traverse_util.unflatten_dict(nxt)
    keep = (metrics['skipped'] == 0) & all_finite(nxt)
    nxt = jax.tree.map(lambda n, o: jnp.where(keep, n, o), nxt, a)
    return (new_params, new_opt_state, metrics, nxt) + out[4:]

  if sh is None:
    jit = lambda f: jax.jit(f, donate_argnums=(0, 1))
  else:
    r = sh.replicated
    applied = (sh.accum,) if sc.return_update else ()
    jit = lambda f, n_in, outs: jax.jit(
        f, donate_argnums=(0, 1), in_shardings=(sh.params, sh.opt_state, sh.batch) + (r,) * n_in,
        out_shardings=outs + applied)
    return (kl_probe.with_telemetry_flag(jit(step, 6, (sh.params, sh.opt_state, r))),
            kl_probe.with_telemetry_flag(jit(refresh, 8, (sh.params, sh.opt_state, r, r))))
  return (kl_probe.with_telemetry_flag(jit(step)), kl_probe.with_telemetry_flag(jit(refresh)))
