"""One jitted function per phase: the LoGRA step and the dense-Adam / LoRA baseline steps.

Shape key: N sequences in the step's batch, M micro-batches, P prompt length (left padded),
T completion length, L = P + T, V vocabulary.

A batch is a dict of arrays: tokens_NxL, mask_NxL (real tokens), targets_NxT (the sampled
completion), target_mask_NxT, behaviour_logp_NxT, advantages_N. Micro-batch losses are
weighted so that their sum equals the loss of the whole batch; the sketches (or gradients)
are summed over micro-batches in a `lax.scan`, in fp32.
"""
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from logra_jax import sketch
from logra_jax.rl import losses as rl_losses
from logra_jax.sketch import projection_jax
from logra_jax.train import completion, lora


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
  """`_loss_fn` over vocabulary chunks (`ModelConfig.vocab_chunk` > 0): no (N, T, V) logits."""
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


def _loss_fn(model, loss_cfg, prompt_len):
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


# Metrics aggregated like the loss (token or sequence mean); every other metric of
# `_loss_fn` is a masked token mean.
LOSS_LIKE_METRICS = ('loss', 'loss/policy')


def split_micro_batches(batch, m: int, aggregation: str):
  """(M, N/M, …) micro-batches, their loss weights (token or sequence share) and token shares."""
  mbs = jax.tree.map(lambda x: x.reshape((m, -1) + x.shape[1:]), batch)
  tokens = jnp.sum(mbs['target_mask'], axis=(1, 2))
  shares = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
  weights = shares if aggregation == 'token' else jnp.full((m,), 1.0 / m)
  return mbs, weights, shares


def _split_size(batch_sharding) -> int:
  """How many ways a batch sharding splits the leading axis (1: replicated or none)."""
  if batch_sharding is None or not batch_sharding.spec or batch_sharding.spec[0] is None:
    return 1
  axes = batch_sharding.spec[0]
  return int(np.prod([batch_sharding.mesh.shape[a]
                      for a in (axes if isinstance(axes, tuple) else (axes,))]))


def micro_batch_sharding(batch_sharding, n: int, m: int):
  """(M, N/M, …) micro-batches split over the batch's devices along N/M, or None.

  The batch arrives split along N; reshaped to (M, N/M) that split falls on M (whole
  micro-batches per device), and every device would compute each micro-batch in full.
  """
  size = _split_size(batch_sharding)
  if size == 1 or (n // m) % size:
    return None
  return NamedSharding(batch_sharding.mesh, P(None, batch_sharding.spec[0]))


def rows_sharding(batch_sharding, n: int):
  """``batch_sharding`` for a batch of n rows if they split evenly over it, else None."""
  size = _split_size(batch_sharding)
  return None if size == 1 or n % size else batch_sharding


def accumulate(grad_fn: Callable, zeros, batch, m: int, aggregation: str, mb_sharding=None):
  """Σ over micro-batches of grad_fn(mb, weight) -> ((loss, metrics), grads), in a scan.

  Micro-batch metrics are combined into whole-batch values: token means by token share,
  `LOSS_LIKE_METRICS` by the loss weights (so they do not depend on ``m``). ``mb_sharding``
  (`micro_batch_sharding`) places each micro-batch's rows over the devices.
  """
  mbs, weights, shares = split_micro_batches(batch, m, aggregation)
  if mb_sharding is not None:
    mbs = jax.lax.with_sharding_constraint(mbs, jax.tree.map(lambda _: mb_sharding, mbs))

  def body(acc, xs):
    mb, w, share = xs
    (loss, metrics), g = grad_fn(mb, w)
    acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
    metrics = {k: v * (w if k in LOSS_LIKE_METRICS else share) for k, v in metrics.items()}
    return acc, (loss, metrics)

  total, (losses, metrics) = jax.lax.scan(body, zeros, (mbs, weights, shares))
  metrics = jax.tree.map(jnp.sum, metrics)
  metrics['loss'] = jnp.sum(losses)
  return total, metrics


class StepShardings(NamedTuple):
  """Explicit placements of a step's trees (`logra_jax.parallel`); None: plain jit.

  params: the model params (frozen ones for LoRA, None for dense Adam); train: what dense /
  LoRA steps update; accum: the sketch (LoGRA) or gradient accumulators; replicated: for
  projections, scalars, keys and metrics.
  """
  params: Any
  opt_state: Any
  batch: Any
  replicated: Any
  train: Any = None
  accum: Any = None


def _mb_sharding(sh, batch, m):
  n = jax.tree.leaves(batch)[0].shape[0]
  return micro_batch_sharding(sh and sh.batch, n, m)


def prompt_share(rows, group: int, split: int = 1, divides: Optional[int] = None) -> int:
  """How many consecutive ``rows`` (batch row indices) one packed row can hold: the largest s
  whose runs rows[k·s : (k+1)·s] each lie in one prompt group (rows g·group … g·group +
  group − 1 share a prompt), s dividing ``divides`` (the rows of one call: a micro-batch; else
  all of them), and that call's packed rows a multiple of ``split`` (the devices its rows are
  split over stay busy). 1: no sharing.
  """
  n = len(rows)
  per_call = divides or n
  for s in range(min(group, n), 1, -1):
    if n % s or per_call % s or (per_call // s) % split:
      continue
    if all(len({r // group for r in rows[k:k + s]}) == 1 for k in range(0, n, s)):
      return s
  return 1


def _kl_batch(batch, n, sh, group=1):
  """(`_kl_subset`, its `prompt_share`), its rows split over the devices (else every device
  probes all n)."""
  total = jax.tree.leaves(batch)[0].shape[0]
  kl_batch = _kl_subset(batch, n)
  rows = rows_sharding(sh and sh.batch, jax.tree.leaves(kl_batch)[0].shape[0])
  share = prompt_share(kl_rows(total, n), group, _split_size(rows))
  return (kl_batch if rows is None else jax.lax.with_sharding_constraint(
      kl_batch, jax.tree.map(lambda _: rows, kl_batch))), share


def _mb_share(sc, batch, sh) -> int:
  """`prompt_share` of the micro-batches' rows: N/M each, split over the batch's devices
  where `micro_batch_sharding` splits them (its spec splits axis 1, the rows)."""
  n = jax.tree.leaves(batch)[0].shape[0]
  split = _split_size(sh.batch) if _mb_sharding(sh, batch, sc.micro_batches) else 1
  return prompt_share(range(n), sc.prompt_group, split, divides=n // sc.micro_batches)


def _constrain(tree, shardings):
  return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def make_ref_logp(model, prompt_len: int, temperature: float,
                  sh: Optional[StepShardings] = None, prompt_group: int = 1):
  """Jitted log-probs of the completion tokens under reference params (the KL penalty);
  ``prompt_group``: rows in runs of that many sharing a prompt (`StepConfig.prompt_group`)."""
  def ref_logp(ref_params, batch):
    n = jax.tree.leaves(batch)[0].shape[0]
    share = prompt_share(range(n), prompt_group, _split_size(rows_sharding(sh and sh.batch, n)))
    out = completion.forward(model, {'params': ref_params}, batch, prompt_len, share)
    return completion.logprobs(model, out, batch['targets'], temperature)
  if sh is None:
    return jax.jit(ref_logp)
  return jax.jit(ref_logp, in_shardings=(sh.params, sh.batch), out_shardings=sh.replicated)


def _all_finite(tree):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def kl_rows(total: int, n: int) -> list:
  """The KL probe's n of ``total`` rows, spread over the batch: rows i·N//n (all if n >= N).

  A prompt's G completions are contiguous, so the first n rows would be one or two prompts'
  groups; strided rows reach min(n, N/G) prompts.
  """
  return list(range(total)) if n >= total else [i * total // n for i in range(n)]


def _kl_subset(batch, n):
  """`kl_rows` of the batch."""
  total = jax.tree.leaves(batch)[0].shape[0]
  if n >= total:
    return batch
  rows = jnp.asarray(kl_rows(total, n))
  return jax.tree.map(lambda x: x[rows], batch)


def _kl_probe(model, out_fn, fd_model, probes, u, kind, budget, temperature, mask):
  """(the forward at the probes, q along U) by a JVP ('jvp') or a finite difference ('fd',
  at the step the budget allows, on ``fd_model``: the forward in at least fp32)."""
  if kind == 'jvp':
    base, tangent = sketch.logits_and_tangents(out_fn, probes, u)
    return base, completion.kl_coefficient(model, base, tangent, temperature, mask)
  kl = functools.partial(completion.mean_kl, model)
  q = sketch.finite_difference_kl_at_budget(lambda p: out_fn(p, fd_model), probes, u, budget,
                                            temperature, mask, kl=kl)
  return out_fn(probes), q


class StepConfig(NamedTuple):
  """Static settings of a step function (hashable)."""
  prompt_len: int
  micro_batches: int
  kl_sequences: int
  kl_control: bool
  kl_probe: str
  alpha_max: float
  sparse_mask: float
  return_update: bool = False  # also return α·U (zeros when skipped), for the generator sync
  # The realised-KL telemetry runs at steps where the caller passes telemetry=True; 0: never
  # compiled (and with kl_control=False, no KL probe at all: no JVP, no extra forward).
  telemetry_every: int = 1
  # How a bf16 kernel stores W + α·AᵀU: 'stochastic' (unbiased, keyed by the step's key) or
  # 'nearest'. fp32 kernels are exact either way (config key optim.param_rounding).
  param_rounding: str = 'stochastic'
  # Rows come in runs of this many sharing one prompt (the trainer: data.samples_per_prompt
  # with optim.share_prompts): each run's prompt is computed once (`completion.forward`,
  # `prompt_share`). 1: every row computes its own prompt.
  prompt_group: int = 1


def telemetry_at(telemetry_every: int, t: int) -> bool:
  """Whether step t (1-based) logs the realised KL: every `telemetry_every` steps (0: never)."""
  return telemetry_every > 0 and t % telemetry_every == 0


def _nan_like(fn):
  """NaNs shaped like ``fn()``'s outputs: the branch of a `lax.cond` that skips ``fn``."""
  return lambda: jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), jax.eval_shape(fn))


def _when(flag, fn):
  """``fn()`` where the traced ``flag`` holds, else NaNs (one compiled program, one branch run)."""
  return jax.lax.cond(flag, fn, _nan_like(fn))


def _probe_telemetry(sc, probe, realized, probed, telemetry):
  """(q, realised KL) after the update: the probe only where the step size or telemetry needs it.

  ``probe()`` -> (forward at the probes, q); ``probed``: its result (kl_control) or None;
  ``realized(base)``: KL(π_old ‖ π_new) at the probe rows, the updated params closed over.
  kl_control=False with telemetry_every=0 traces no probe at all: no JVP, no extra forward.
  """
  if probed is not None:
    base, q = probed
    return q, _when(telemetry, lambda: realized(base))
  if not sc.telemetry_every:
    nan = jnp.float32(jnp.nan)
    return nan, nan
  return _when(telemetry, lambda: (lambda base, q: (q, realized(base)))(*probe()))


def _telemetry_metric(sc, telemetry):
  """1.0 where this step computed the realised KL (the `kl_telemetry` metric), else 0.0."""
  on = jnp.asarray(telemetry) if sc.telemetry_every else jnp.asarray(False)
  return on.astype(jnp.float32)


def _with_telemetry_flag(jitted):
  """``jitted(*args, flag)`` as ``call(*args, telemetry=True)`` (the trainer passes
  `telemetry_at(...)`; a direct call logs the realised KL as before)."""
  @functools.wraps(jitted)
  def call(*args, telemetry=True):
    return jitted(*args, np.asarray(bool(telemetry)))
  call.jitted = jitted
  return call


def _fp32_compute(model):
  """``model`` computing in at least fp32: the FD KL probe differences two forwards."""
  c = model.config
  return model.clone(config=c.replace(dtype=jnp.promote_types(jnp.float32, c.dtype).name))


class ProjectionSpec(NamedTuple):
  """How a LoGRA step draws its projections A on device (static, hashable).

  ranks: an int or a ``sketch.RankRules``; kind: 'rademacher' | 'gaussian' | 'orthogonal';
  name_fn: the names that seed A (the trainer: ``hf_io.projection_name_fn``); dtype: A's
  dtype where ``projection.exact_dtype`` allows it, float32 elsewhere.
  """
  ranks: Any
  kind: str = 'rademacher'
  name_fn: Callable = sketch.stacked_name
  dtype: Any = jnp.bfloat16


def draw_projections(params, seed, step, proj: ProjectionSpec):
  """A for every sketched kernel: ``projection.py``'s bits, drawn on device (jittable).

  ``seed``/``step`` may be traced uint32 scalars; ``params`` may be abstract.
  """
  return projection_jax.make_projections_jax(params, seed, step, proj.ranks, proj.kind,
                                             dtype=proj.dtype, name_fn=proj.name_fn)


# Folded into the step's key for the stochastic rounding of the apply: independent of the
# key's other use (the sparse mask), and as reproducible as the key (a function of the step).
ROUNDING_KEY_SALT = 0x53520001
PARAM_ROUNDINGS = ('stochastic', 'nearest')


def _check_rounding(sc: StepConfig):
  if sc.param_rounding not in PARAM_ROUNDINGS:
    raise ValueError(f'StepConfig.param_rounding={sc.param_rounding!r} must be one of '
                     f'{PARAM_ROUNDINGS} (config key optim.param_rounding)')


def rounding_key(sc: StepConfig, key):
  """The apply's stochastic-rounding key (``sketch.apply_sketch_updates``), or None."""
  _check_rounding(sc)
  if sc.param_rounding == 'nearest':
    return None
  return jax.random.fold_in(key, ROUNDING_KEY_SALT)


def logra_update_fn(model, loss_cfg, opt: optax.GradientTransformationExtraArgs,
                    sc: StepConfig, sh: Optional[StepShardings] = None):
  """The LoGRA step on given projections (unjitted); `make_logra_step` draws them itself.

  ``update(params, opt_state, batch, projections, budget, key, telemetry=True)``: sketches →
  optax → α from predicted KL → kernel += α·AᵀU (bf16 kernels stochastically rounded with a
  key folded from ``key``, `rounding_key`). Outputs as ``make_logra_step``'s step.
  """
  linear = model.clone(sketch_mode='linear')
  fd_linear = _fp32_compute(linear) if sc.kl_probe == 'fd' else None
  temp = loss_cfg.temperature
  loss = _loss_fn(model, loss_cfg, sc.prompt_len)
  _check_rounding(sc)

  def update(params, opt_state, batch, projections, budget, key, telemetry=True):
    mb_sharding = _mb_sharding(sh, batch, sc.micro_batches)
    mb_loss = functools.partial(loss, share=_mb_share(sc, batch, sh))
    grad_fn = lambda mb, w: sketch.sketch_value_and_grad(mb_loss, has_aux=True)(
        params, projections, mb, w)
    probes = _constrain(sketch.zero_probes(params, projections), sh and sh.accum)
    s, metrics = accumulate(grad_fn, probes, batch, sc.micro_batches, loss_cfg.aggregation,
                            mb_sharding)
    if sc.sparse_mask:
      s = sketch.sparse_mask_tree(s, key, sc.sparse_mask)
    kernels = sketch.kernels_of(params, projections)
    u, new_opt_state = opt.update(s, opt_state, kernels, projections=projections)
    kl_batch, kl_share = _kl_batch(batch, sc.kl_sequences, sh, sc.prompt_group)
    kl_mask = kl_batch['target_mask']
    out_fn = lambda p, m=linear: completion.forward(
        m, sketch.sketch_variables(params, projections, p), kl_batch, sc.prompt_len, kl_share)
    probe = lambda: _kl_probe(model, out_fn, fd_linear, probes, u, sc.kl_probe, budget, temp,
                              kl_mask)
    probed = probe() if sc.kl_control else None
    alpha = sketch.step_scale(probed[1], budget, sc.alpha_max) if probed else jnp.ones_like(budget)
    ok = _all_finite(s) & jnp.isfinite(metrics['loss']) & jnp.isfinite(alpha)
    apply = lambda: sketch.apply_sketch_updates(params, u, projections, alpha,
                                                key=rounding_key(sc, key))
    new_params = jax.lax.cond(ok, apply, lambda: params)
    new_opt_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_opt_state, opt_state)
    realized = lambda base: completion.mean_kl(
        model, base, completion.forward(model, {'params': new_params}, kl_batch, sc.prompt_len,
                                        kl_share), temp, kl_mask)
    q, realized_kl = _probe_telemetry(sc, probe, realized, probed, telemetry)
    metrics.update(
        predicted_kl=alpha**2 * q, kl_coefficient=q, alpha=alpha, kl_budget=budget,
        realized_kl=realized_kl, kl_telemetry=_telemetry_metric(sc, telemetry),
        sketch_norm=optax.global_norm(s), skipped=1.0 - ok.astype(jnp.float32))
    if not sc.return_update:
      return new_params, new_opt_state, metrics
    applied = jax.tree.map(lambda x: jnp.where(ok, alpha * x, 0).astype(jnp.float32), u)
    return new_params, new_opt_state, metrics, applied

  return update


def make_logra_step(model, loss_cfg, opt: optax.GradientTransformationExtraArgs, sc: StepConfig,
                    proj: ProjectionSpec, sh: Optional[StepShardings] = None):
  """The jitted LoGRA step, drawing its projections A on device from (seed, step).

  Returns ``step(params, opt_state, batch, seed, step, budget, key, telemetry=True)`` →
  ``(params, opt_state, metrics)`` (and α·U, the applied update's factor, when
  ``sc.return_update``); seed and step are uint32 scalars in [0, 2**32) (pass the
  projection step: 0 for fixed A), traced, so one compile serves every step; A is
  ``draw_projections(params, seed, step, proj)``, bit-identical to ``projection.py``, and
  only ever exists inside the step. params and opt_state are donated. A non-finite sketch,
  loss or step size skips the update (weights and optimizer state untouched, `skipped` = 1).
  ``sh`` fixes every input's and output's sharding (the sketch accumulators too; A is
  replicated).
  """
  if not isinstance(proj, ProjectionSpec):
    raise TypeError(f'make_logra_step: proj must be a steps.ProjectionSpec, got {proj!r}')
  update = logra_update_fn(model, loss_cfg, opt, sc, sh)

  def step(params, opt_state, batch, seed, proj_step, budget, key, telemetry):
    a = draw_projections(params, seed, proj_step, proj)
    a = _constrain(a, sh and jax.tree.map(lambda _: sh.replicated, a))
    return update(params, opt_state, batch, a, budget, key, telemetry)

  if sh is None:
    return _with_telemetry_flag(jax.jit(step, donate_argnums=(0, 1)))
  r = sh.replicated
  outs = (sh.params, sh.opt_state, r) + ((sh.accum,) if sc.return_update else ())
  return _with_telemetry_flag(jax.jit(step, donate_argnums=(0, 1),
                                      in_shardings=(sh.params, sh.opt_state, sh.batch) + (r,) * 5,
                                      out_shardings=outs))


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
  loss = _loss_fn(model, loss_cfg, sc.prompt_len)

  def step(params, train, opt_state, batch, telemetry):
    mb_sharding = _mb_sharding(sh, batch, sc.micro_batches)
    share = _mb_share(sc, batch, sh)
    grad_fn = lambda mb, w: jax.value_and_grad(
        lambda t: loss(variables(params, t), mb, w, share), has_aux=True)(train)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.promote_types(jnp.float32, x.dtype)),
                         train)
    zeros = _constrain(zeros, sh and sh.accum)
    g, metrics = accumulate(grad_fn, zeros, batch, sc.micro_batches, loss_cfg.aggregation,
                            mb_sharding)
    updates, new_opt_state = opt.update(g, opt_state, train)
    ok = _all_finite(g) & jnp.isfinite(metrics['loss'])
    new_train = jax.tree.map(lambda p, u: jnp.where(ok, p + u.astype(p.dtype), p), train, updates)
    new_opt_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_opt_state, opt_state)
    kl_batch, kl_share = _kl_batch(batch, sc.kl_sequences, sh, sc.prompt_group)
    forward = lambda t: completion.forward(model, variables(params, t), kl_batch,
                                           sc.prompt_len, kl_share)
    realized = lambda: completion.mean_kl(model, forward(train), forward(new_train), temp,
                                          kl_batch['target_mask'])
    realized_kl = _when(telemetry, realized) if sc.telemetry_every else jnp.float32(jnp.nan)
    metrics.update(realized_kl=realized_kl,
                   kl_telemetry=_telemetry_metric(sc, telemetry),
                   sketch_norm=optax.global_norm(g), skipped=1.0 - ok.astype(jnp.float32))
    return new_train, new_opt_state, metrics

  if sh is None:
    return _with_telemetry_flag(jax.jit(step, donate_argnums=(1, 2)))
  return _with_telemetry_flag(jax.jit(
      step, donate_argnums=(1, 2),
      in_shardings=(sh.params, sh.train, sh.opt_state, sh.batch, sh.replicated),
      out_shardings=(sh.train, sh.opt_state, sh.replicated)))
