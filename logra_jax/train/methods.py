"""The three update methods behind one interface: LoGRA, dense AdamW, LoRA.

A method holds the run state as a dict of arrays (checkpointed as is) and exposes
``step(state, batch, prompt_len, step, budget) -> (state, metrics)`` and
``policy_params(state)`` (the weights the generator samples with).

Every array of the state lives in the sharding `logra_jax.parallel` derives from the
model's logical axes (params, optimizer states, adapters FSDP over 'fsdp'); ``init`` places
the params there, ``step`` places the host batch data-parallel (the LoGRA step draws its
projections on device, replicated), and every jitted step has explicit in/out shardings and
donated buffers.
"""
import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from logra_jax import parallel, sketch
from logra_jax.models import hf_io
from logra_jax.rl import losses as rl_losses
from logra_jax.train import lora, optimizers, rollout, steps
from logra_jax.train.config import TrainConfig


def loss_config(cfg: TrainConfig) -> rl_losses.LossConfig:
  hp = (('cap', cfg.rl.tis_cap),) if cfg.rl.loss == 'reinforce_tis' else (
      ('clip_eps', cfg.rl.clip_eps),)
  return rl_losses.LossConfig(policy=cfg.rl.loss, hparams=hp, entropy_coef=cfg.rl.entropy_coef,
                              kl_coef=cfg.rl.kl_coef, aggregation=cfg.rl.aggregation,
                              temperature=cfg.rollout.temperature)


def _step_config(cfg: TrainConfig, prompt_len: int) -> steps.StepConfig:
  o = cfg.optim
  lg = o.logra  # its defaults for the dense methods (no KL control, no mask: unused there)
  # The low-rank payload carries the sketched kernels only: with a dense-trained rest
  # (optim.logra.rest_learning_rate) the generators get full weights (`Method.last_update`).
  # An adaptive subspace's A, which no (seed, step) rebuilds, travels in the payload.
  low_rank_sync = cfg.rollout.engine == 'http' and not (
      o.name == 'logra' and lg.rest_learning_rate)
  return steps.StepConfig(prompt_len, o.micro_batches, o.kl_sequences, lg.kl_control,
                          lg.kl_probe, lg.alpha_max, lg.sparse_mask,
                          return_update=low_rank_sync,
                          telemetry_every=o.telemetry_every,
                          param_rounding=lg.param_rounding,
                          prompt_group=prompt_group(cfg),
                          rest_under_budget=lg.rest_step == 'budget')


def prompt_group(cfg: TrainConfig) -> int:
  """Rows per shared prompt in the steps (`steps.StepConfig.prompt_group`): a step's samples of
  one prompt, with optim.share_prompts; else 1."""
  return cfg.data.samples_per_prompt if cfg.optim.share_prompts else 1


@dataclasses.dataclass
class Method:
  init: Callable[[Any], dict]
  step: Callable
  policy_params: Callable[[dict], Any]
  placement: Optional['Placement'] = None
  # The last step's low-rank update for the generators, (α·U tree, seed, step, projection
  # kind[, A tree: sent in the payload, for an A no (seed, step) rebuilds]), or None: send
  # full weights (dense baselines, or an engine that needs none).
  last_update: Callable[[], Any] = lambda: None

  def put_batch(self, batch):
    """A host batch placed data-parallel (every process passes the same values)."""
    return self.placement.put_batch(batch)

  @property
  def ref_shardings(self) -> steps.StepShardings:
    """For `steps.make_ref_logp`: policy params FSDP, batch data-parallel."""
    pl = self.placement
    return pl.step_shardings(None, params=pl.params)


class Placement:
  """The shardings of one run's trees: params from the model's logical axes, batch, etc."""

  def __init__(self, cfg: TrainConfig, model, layout: Optional[parallel.Layout]):
    self.layout = layout or parallel.layout_from_config(cfg.mesh)
    self.logical = parallel.param_logical(model.config)
    self.abstract = parallel.abstract_params(model.config)
    self.params = parallel.param_shardings(self.layout, model.config)
    n = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
    if n % self.layout.mesh.size:
      raise ValueError(
          f'a step batch of {n} rows (data.prompts_per_step × data.samples_per_prompt) does '
          f'not divide over the {self.layout.mesh.size} devices of the mesh: every device would '
          f'compute the whole batch; choose a multiple of {self.layout.mesh.size}')
    self.batch = self.layout.batch
    self.group = prompt_group(cfg)

  def step_shardings(self, opt_state, params=None, train=None, accum=None):
    return steps.StepShardings(params, opt_state, self.batch, self.layout.replicated,
                               train, accum)

  def put_batch(self, batch, prompt_len: Optional[int] = None):
    """The host batch placed data-parallel; with ``prompt_len``, for a step that shares prompts
    (`prompt_group`), first checked to hold each group's prompt in its rows (ValueError)."""
    if prompt_len is not None and self.group > 1:
      rollout.check_prompt_groups(jax.tree.map(np.asarray, batch), prompt_len, self.group)
    return parallel.put(batch, jax.tree.map(lambda _: self.batch, batch))


def _cached(make):
  """Builds (and jits) one step function per prompt length."""
  cache = {}
  def get(prompt_len):
    if prompt_len not in cache:
      cache[prompt_len] = make(prompt_len)
    return cache[prompt_len]
  return get


def _zeros(abstract):
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)


def _check_seed(seed: int):
  if not 0 <= seed < 1 << 32:
    raise ValueError(f'config key seed must lie in [0, 2**32) (the LoGRA step draws its '
                     f'projections on device from a uint32 seed), got {seed!r}')


class LograTrees(NamedTuple):
  """The LoGRA step's optimizers and the layout of its state and accumulators (A at step 0).

  opt: the sketch optimizer; rest_opt: the rest's (`optimizers.rest_optimizer`) or None;
  opt_abstract / opt_shardings: the optimizer state, a (sketch, rest) pair with rest_opt;
  accum_shardings: the accumulators' (the sketches, and the rest's gradient); init: the
  optimizer state's zero-argument initialiser.
  """
  opt: Any
  rest_opt: Any
  opt_abstract: Any
  opt_shardings: Any
  accum_shardings: Any
  init: Callable[[], Any]


def logra_trees(cfg: TrainConfig, pl: Placement, spec: steps.ProjectionSpec) -> LograTrees:
  """THE layout of a LoGRA step's state (the trainer's and the memory plan's)."""
  opt = optimizers.logra_optimizer(cfg.optim, cfg.total_steps)
  rest_opt = optimizers.rest_optimizer(cfg.optim, cfg.total_steps)
  a0 = jax.eval_shape(lambda: steps.draw_projections(pl.abstract, 0, 0, spec))
  probes = jax.eval_shape(sketch.zero_probes, pl.abstract, a0)
  probe_logical = parallel.probe_logical(pl.logical, sketch.target_paths(pl.abstract))
  # Sketch accumulators at rank r_0 (a dynamic rank changes R, not the sharded D axis).
  accum_sh = pl.layout.flat(probes, probe_logical)
  init = lambda: opt.init(_zeros(probes))
  if rest_opt is None:
    opt_abs = jax.eval_shape(init)
    return LograTrees(opt, None, opt_abs, pl.layout.state(opt_abs, probe_logical), accum_sh,
                      init)
  # The rest: (sketch, rest) pairs of state and accumulators.
  rest = sketch.rest_of(pl.abstract, a0)
  rest_logical = {k: pl.logical[k] for k in traverse_util.flatten_dict(rest)}
  rest_acc = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, jnp.promote_types(jnp.float32, x.dtype)), rest)
  init = lambda: (opt.init(_zeros(probes)), rest_opt.init(_zeros(rest)))
  opt_abs = jax.eval_shape(init)
  opt_sh = (pl.layout.state(opt_abs[0], probe_logical),
            pl.layout.state(opt_abs[1], rest_logical))
  return LograTrees(opt, rest_opt, opt_abs, opt_sh,
                    (accum_sh, pl.layout.flat(rest_acc, rest_logical)), init)


def logra_method(cfg: TrainConfig, model, layout: Optional[parallel.Layout] = None) -> Method:
  o = cfg.optim.logra
  _check_seed(cfg.seed)
  pl = Placement(cfg, model, layout)
  names = hf_io.projection_name_fn(model.config)  # generators rebuild A from HF names
  spec_at = lambda t: optimizers.projection_spec(o, t, names)
  lt = logra_trees(cfg, pl, spec_at(0))
  opt, rest_opt = lt.opt, lt.rest_opt
  sh = pl.step_shardings(lt.opt_shardings, params=pl.params, accum=lt.accum_shardings)
  # One compile per prompt length and rank set (a dynamic rank changes A's shapes).
  get = functools.cache(lambda p, spec: steps.make_logra_step(
      model, loss_config(cfg), opt, _step_config(cfg, p), spec, sh, rest_opt))
  opt_init = jax.jit(lt.init, out_shardings=lt.opt_shardings)

  def init(params):
    return {'params': parallel.put(params, pl.params), 'opt_state': opt_init()}

  def step(state, batch, prompt_len, t, budget):
    key = jax.random.fold_in(jax.random.key(cfg.seed), t)
    a_step = optimizers.projection_step(o, t)
    out = get(prompt_len, spec_at(t))(state['params'], state['opt_state'],
                                      pl.put_batch(batch, prompt_len),
                                      np.uint32(cfg.seed), np.uint32(a_step),
                                      np.float32(budget), key,
                                      telemetry=steps.telemetry_at(cfg.optim.telemetry_every, t))
    params, opt_state, metrics = out[:3]
    if len(out) == 4:
      last[0] = (out[3], cfg.seed, a_step, o.projection)
    return {'params': params, 'opt_state': opt_state}, metrics

  last = [None]
  if o.subspace == 'adaptive':
    return _adaptive_logra_method(cfg, model, pl, lt, sh, spec_at(0))
  return Method(init, step, lambda s: s['params'], pl, last_update=lambda: last[0])


ADAPTIVE_KIND = 'adaptive'  # the payload's projection kind for an A sent, never derived


def active_version(o, t: int) -> int:
  """An adaptive subspace's A at step t: the one built at the last refresh before t (A is
  built at steps T, 2T, … and used from the next step on; 0: the seed's A)."""
  return (max(t - 1, 0) // o.refresh_every) * o.refresh_every


def _adaptive_logra_method(cfg: TrainConfig, model, pl: Placement, lt: LograTrees, sh, spec0):
  """LoGRA with A in the state (`optim.logra.subspace='adaptive'`, docs/method.md §13): the
  seed's A at first, then at every refresh step t (t % T = 0) the A built from that step's
  co-sketches, used from t + 1; ``a_prev`` (the A before) lets the moments follow it."""
  o = cfg.optim.logra
  get = functools.cache(lambda p: steps.make_adaptive_logra_step(
      model, loss_config(cfg), lt.opt, _step_config(cfg, p), o.subspace_random_rows, sh,
      lt.rest_opt))
  opt_init = jax.jit(lt.init, out_shardings=lt.opt_shardings)
  a_sh = lambda a: jax.tree.map(lambda _: pl.layout.replicated, a)
  draw = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(jnp.float32),
                                        steps.draw_projections(p, cfg.seed, 0, spec0)))

  def init(params):
    params = parallel.put(params, pl.params)
    a = draw(params)
    a = parallel.put(a, a_sh(a))
    return {'params': params, 'opt_state': opt_init(), 'projections': a,
            'prev_projections': a}

  def step(state, batch, prompt_len, t, budget):
    key = jax.random.fold_in(jax.random.key(cfg.seed), t)
    version = np.uint32(active_version(o, t))
    args = (state['params'], state['opt_state'], pl.put_batch(batch, prompt_len),
            state['projections'], state['prev_projections'], version)
    telemetry = steps.telemetry_at(cfg.optim.telemetry_every, t)
    step_fn, refresh_fn = get(prompt_len)
    a = state['projections']  # what this step applies (not donated)
    if t % o.refresh_every:
      out = step_fn(*args, np.float32(budget), key, telemetry=telemetry)
      new = dict(state, params=out[0], opt_state=out[1])
    else:
      out = refresh_fn(*args, np.uint32(cfg.seed), np.uint32(t), np.float32(budget), key,
                       telemetry=telemetry)
      out, a_next = out[:3] + out[4:], out[3]
      new = {'params': out[0], 'opt_state': out[1], 'projections': a_next,
             'prev_projections': a}
    if len(out) == 4:  # α·U on a: the generators' low-rank payload carries a with it
      last[0] = (out[3], cfg.seed, int(version), ADAPTIVE_KIND, a)
    return new, out[2]

  last = [None]
  return Method(init, step, lambda s: s['params'], pl, last_update=lambda: last[0])


def sketched_mask(abstract_params):
  """True at the kernels LoGRA sketches (`sketch.target_paths`), False elsewhere."""
  paths = set(sketch.target_paths(abstract_params))
  flat = traverse_util.flatten_dict(abstract_params)
  return traverse_util.unflatten_dict({k: k in paths for k in flat})


def adam_method(cfg: TrainConfig, model, layout: Optional[parallel.Layout] = None) -> Method:
  """Dense AdamW; ``optim.adam.trainable='sketched'`` trains only LoGRA's kernels."""
  pl = Placement(cfg, model, layout)
  trainable = sketched_mask(pl.abstract) if cfg.optim.adam.trainable == 'sketched' else None
  opt = optimizers.adam_optimizer(cfg.optim, cfg.total_steps, trainable)
  opt_sh = pl.layout.state(jax.eval_shape(opt.init, pl.abstract), pl.logical)
  sh = pl.step_shardings(opt_sh, train=pl.params, accum=pl.params)
  get = _cached(lambda p: steps.make_dense_step(model, loss_config(cfg), opt,
                                                _step_config(cfg, p), sh=sh))
  opt_init = jax.jit(opt.init, in_shardings=(pl.params,), out_shardings=opt_sh)

  def init(params):
    params = parallel.put(params, pl.params)
    return {'params': params, 'opt_state': opt_init(params)}

  def step(state, batch, prompt_len, t, budget):
    del budget
    params, opt_state, metrics = get(prompt_len)(
        None, state['params'], state['opt_state'], pl.put_batch(batch, prompt_len),
        telemetry=steps.telemetry_at(cfg.optim.telemetry_every, t))
    return {'params': params, 'opt_state': opt_state}, metrics

  return Method(init, step, lambda s: s['params'], pl)


def lora_method(cfg: TrainConfig, model, layout: Optional[parallel.Layout] = None) -> Method:
  """AdamW on LoRA adapters computed in the layers (`logra_jax.train.lora`); the generator
  samples with the merged weights W + s·a b."""
  o = cfg.optim.lora
  opt = optimizers.adam_optimizer(cfg.optim, cfg.total_steps)
  scale = o.alpha / o.rank
  pl = Placement(cfg, model, layout)
  new_lora = lambda: lora.init(pl.abstract, o.rank, jax.random.key(cfg.seed + 1))
  lora_abs = jax.eval_shape(new_lora)
  lora_logical = parallel.lora_logical(pl.logical, sketch.target_paths(pl.abstract))
  lora_sh = pl.layout.flat(lora_abs, lora_logical)
  opt_sh = pl.layout.state(jax.eval_shape(opt.init, lora_abs), lora_logical)
  sh = pl.step_shardings(opt_sh, params=pl.params, train=lora_sh, accum=lora_sh)
  get = _cached(lambda p: steps.make_dense_step(model, loss_config(cfg), opt,
                                                _step_config(cfg, p), lora_scale=scale, sh=sh))
  merged = jax.jit(lambda params, ab: lora.merge(params, ab, scale),
                   in_shardings=(pl.params, lora_sh), out_shardings=pl.params)
  lora_init = jax.jit(lambda: (lambda l: (l, opt.init(l)))(new_lora()),
                      out_shardings=(lora_sh, opt_sh))

  def init(params):
    ab, opt_state = lora_init()
    return {'params': parallel.put(params, pl.params), 'lora': ab, 'opt_state': opt_state}

  def step(state, batch, prompt_len, t, budget):
    del budget
    ab, opt_state, metrics = get(prompt_len)(state['params'], state['lora'],
                                             state['opt_state'], pl.put_batch(batch, prompt_len),
                                             telemetry=steps.telemetry_at(
                                                 cfg.optim.telemetry_every, t))
    return dict(state, lora=ab, opt_state=opt_state), metrics

  return Method(init, step, lambda s: merged(s['params'], s['lora']), pl)


METHODS = {'logra': logra_method, 'adam': adam_method, 'lora': lora_method}


def get_method(cfg: TrainConfig, model, layout: Optional[parallel.Layout] = None) -> Method:
  """The configured method; ``layout`` defaults to the mesh of ``cfg.mesh`` on jax.devices()."""
  return METHODS[cfg.optim.name](cfg, model, layout)
