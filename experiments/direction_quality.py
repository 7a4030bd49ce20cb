r"""Which update direction buys the most reward per unit of KL? A probe without long runs.

  python experiments/direction_quality.py --config=configs/tiny.py --workdir=runs/dq_tiny \
      [--from_workdir=runs/tiny] [--pairs=8]

From the policy of a real run (``--from_workdir``: its latest checkpoint, copied; else the
config's starting policy, after its warm start), the trainer draws 2 x ``pairs`` rollout
batches (`loop.Trainer.collect`: rollouts, rewards, advantages; the policy never moves). The
run may be of any method (an AdamW run's too): its checkpoint is restored under its own optim
section (`probe_config`), so the batches are those the run would draw next; the candidates
follow ``--config``. A pair with a batch without a non-zero advantage is skipped and counted
(`has_advantage`). For each pair (a, b) and each candidate update direction D built from
batch a:

  gain(D)  = −⟨∇L_b, D⟩          the first-order decrease of batch b's RL loss along D
  q(D)     = the predicted-KL coefficient of D on batch a's KL-probe rows (a JVP, as the
             LoGRA step computes it: KL(π ‖ π + αD) ≈ α² q)
  score(D) = gain(D) / √q(D)     first-order progress per √(predicted KL): what a step
                                 under a KL budget δ gains, divided by √δ (scale-free in D)

The candidates (each a dense tree like the params; zero where a method does not train):
  dense_gradient   −∇L_a
  adamw            one AdamW step from fresh moments (−g/(|g| + eps) elementwise)
  logra            the configured LoGRA update Aᵀ U: A drawn as the trainer draws it (rank,
                   projection, seed, step), U = the configured sketch optimizer (fresh state)
                   of the sketch S = A ∇L_a, i.e. what the trainer's step applies before α
  logra_rank_x4    the same with every rank 4x (capped at d_in)
  logra_orthogonal the same with orthogonal rows (block SRHT) instead of the configured kind
  sketched_gradient −∇L_a on LoGRA's kernels only (what any kernel-only method could reach)
  random           a Gaussian direction (the control: its score is 0 within its s.e.)
  own_step         the probed run's own update on batch a, θ' − θ: its method's step from
                   its restored state (AdamW's moments, the sketch momentum and A, the KL
                   budget), as its next step takes it; not in the default list. With
                   ``adamw`` (fresh moments) beside it, the paired difference is what the
                   optimizer's state carried over from earlier steps does to the direction
  own_momentum     (AdamW runs) −m̂: the run's first moment after batch a (its moments from
                   earlier steps, this batch's clipped gradient), without the per-coordinate
                   scale; beside dense_gradient it isolates the averaging over batches
  own_preconditioned (AdamW runs) −g/(√v̂ + ε): batch a's clipped gradient scaled by the run's
                   second moment after it, without the averaging; own_step ∝ −m̂/(√v̂ + ε)
  own_step_kernels own_step on LoGRA's sketched kernels only (zero elsewhere), and
  own_step_rest    own_step on the rest (embedding, norms); gains add up to own_step's

Writes WORKDIR/direction_quality.json and prints, per candidate, mean ± s.e. of score over
the pairs and the ratio of LoGRA's mean score to AdamW's. The LAST line is that JSON.

``--objective=form`` (reasoning-gym arithmetic only) scores the same candidates on another
objective: J_F(θ), the mean over the held-out problems of the log-likelihood (τ = 1, summed
over the completion's tokens and its stop token) of a correct answer written in form F
(`FORMS`: AdamW's terse "E equals C." and LoGRA's template "To calculate E, you simply add
them together: E = C."). gain_F(D) = ⟨∇J_F, D⟩ (∇J_F computed once), q(D) as above on each
rollout batch's probe rows, one batch per draw (``--pairs`` draws). It asks whether a
direction moves the answer's form per unit of KL, not the RL loss. ``--loglik_only`` prints
J_F of the policy and stops; ``--from_step`` picks a checkpoint of ``--from_workdir``;
``--from_steps=5,10,...`` (with ``--loglik_only``) prints J_F of each of those checkpoints,
read in place with the model built once, and writes WORKDIR/form_logliks.json.
``--mean_of=dense_gradient,...`` also scores each named candidate's mean over the scored
draws (gain on ∇J_F, q averaged over the draws' batches): what a momentum over those batches
would move at this policy, next to what each batch's direction moves alone.
"""
import dataclasses
import json
import math
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402  pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # noqa: E402  pylint: disable=g-import-not-at-top
import numpy as np  # noqa: E402  pylint: disable=g-import-not-at-top
import optax  # noqa: E402  pylint: disable=g-import-not-at-top
from absl import app, flags, logging  # noqa: E402  pylint: disable=g-import-not-at-top
from flax import traverse_util  # noqa: E402  pylint: disable=g-import-not-at-top
from ml_collections import config_flags  # noqa: E402  pylint: disable=g-import-not-at-top

from logra_jax import sketch  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.models.sampler import bucket_size  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.rl.types import GenerationResult  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.train import completion, methods, optimizers  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.train import config as config_lib  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.train.rollout import assemble_batch  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.train.steps import kl_probe, losses  # noqa: E402  pylint: disable=g-import-not-at-top


# ------------------------------------------------------------------------------ directions

def dense_gradient(model, loss_cfg, params, batch, prompt_len):
  """∇L of the step's RL loss on the whole ``batch`` (one micro-batch, weight 1)."""
  loss = losses.loss_fn(model, loss_cfg, prompt_len)
  return jax.grad(lambda p: loss({'params': p}, batch, 1.0)[0])(params)


def _zeros_except(params, flat_updates):
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict(
      {k: flat_updates.get(k, jnp.zeros_like(v)) for k, v in flat.items()})


def logra_direction(optim, params, grad, seed: int, step: int, rank_scale: int = 1,
                    projection: str = ''):
  """Aᵀ U of the configured LoGRA (``optim``: an OptimSection) for the dense gradient
  ``grad``: S = A G per sketched kernel, U from the sketch optimizer's fresh state, and with
  optim.logra.rest_learning_rate the unsketched leaves' Adam step (``rank_scale``,
  ``projection``: the same with ranks scaled, another kind of A)."""
  lg = optim.logra
  if lg.rest_learning_rate and lg.rest_step != 'budget':
    raise ValueError("the logra candidate scales the rest's step with the kernels' (α); with "
                     f"optim.logra.rest_step={lg.rest_step!r} the two have no common scale")
  if projection:
    lg = dataclasses.replace(lg, projection=projection)
  if rank_scale != 1:
    lg = dataclasses.replace(lg, rank=lg.rank * rank_scale, rank_rules=','.join(
        f'{p}={r * rank_scale}' for p, r in optimizers.parse_rank_rules(lg.rank_rules)))
  a = optimizers.projections_at(lg, params, seed, step)
  kernels = sketch.kernels_of(params, a)
  g = sketch.kernels_of(grad, a)
  s = jax.tree.map(lambda aa, gg: jnp.einsum('...rk,...kd->...rd', aa.astype(gg.dtype), gg),
                   a, g)
  opt = optimizers.logra_optimizer(dataclasses.replace(optim, logra=lg), 1)
  u, _ = opt.update(s, opt.init(s), kernels, projections=a)
  d = traverse_util.flatten_dict(jax.tree.map(
      lambda aa, uu, k: sketch.expand_update(aa, uu).astype(k.dtype), a, u, kernels))
  rest_opt = optimizers.rest_optimizer(optim, 1)
  if rest_opt is not None:  # the unsketched leaves' Adam step, as the trainer takes it
    rest = sketch.rest_of(params, a)
    v, _ = rest_opt.update(sketch.rest_of(grad, a), rest_opt.init(rest), rest)
    d.update(traverse_util.flatten_dict(v))
  return _zeros_except(params, d)


def adamw_direction(optim, params, grad):
  """One AdamW step from fresh moments (lr 1; the scale cancels in the score)."""
  s = optim.adam
  opt = optax.adamw(1.0, b1=s.b1, b2=s.b2, weight_decay=0.0)
  u, _ = opt.update(grad, opt.init(params), params)
  return u


CANDIDATES = ('dense_gradient', 'adamw', 'logra', 'logra_rank_x4', 'logra_orthogonal',
              'sketched_gradient', 'random')
OWN_STEP = 'own_step'  # built from the probe's trainer (`own_step`), not from a gradient
OWN_ADAM = ('own_momentum', 'own_preconditioned')  # from an AdamW run's restored moments
OWN_PARTS = ('own_step_kernels', 'own_step_rest')  # own_step on LoGRA's kernels / elsewhere
FROM_TRAINER = (OWN_STEP,) + OWN_ADAM + OWN_PARTS
ADAM_EPS = 1e-8  # optax.adamw's default, which `optimizers.adam_optimizer` keeps


def adam_state(opt_state) -> optax.ScaleByAdamState:
  """The one `optax.ScaleByAdamState` of an AdamW run's optimizer state."""
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(x)]
  if len(found) != 1:
    raise ValueError(f'{OWN_ADAM} need an AdamW run (one ScaleByAdamState in its optimizer '
                     f'state); this run has {len(found)}')
  return found[0]


def adam_moments(optim, opt_state, grad):
  """(m̂, v̂): an AdamW run's bias-corrected moments after one more gradient ``grad``, clipped
  as its optimizer clips (`optimizers.adam_optimizer`: global norm, then Adam's moments)."""
  s, st = optim.adam, adam_state(opt_state)
  if s.trainable != 'all':
    raise ValueError(f"{OWN_ADAM} need an AdamW run of every parameter (optim.adam.trainable="
                     f"'all'), not {s.trainable!r}")
  if s.max_grad_norm:
    grad, _ = optax.clip_by_global_norm(s.max_grad_norm).update(grad, optax.EmptyState())
  _, new = optax.scale_by_adam(s.b1, s.b2, ADAM_EPS).update(grad, st)  # optax's own moments
  m = jax.tree.map(lambda x: x / (1 - s.b1 ** new.count), new.mu)
  v = jax.tree.map(lambda x: x / (1 - s.b2 ** new.count), new.nu)
  return m, v, grad


def own_adam_directions(trainer, grad, names) -> dict:
  """`OWN_ADAM`'s candidates (those in ``names``) from the trainer's restored AdamW state."""
  m, v, g = adam_moments(trainer.cfg.optim, trainer.state['opt_state'], grad)
  build = {'own_momentum': lambda: jax.tree.map(jnp.negative, m),
           'own_preconditioned': lambda: jax.tree.map(
               lambda gg, vv: -gg / (jnp.sqrt(vv) + ADAM_EPS), g, v)}
  return {n: build[n]() for n in names if n in build}


def own_step(trainer, batch, prompt_len: int, t: int):
  """θ' − θ of the probed run's step ``t`` on ``batch``: its method's step (jitted, state
  donated) on a copy of the trainer's restored state, with the inputs its loop gives it
  (`Trainer.step_inputs`). The trainer's own state is left as it was."""
  state = jax.tree.map(lambda x: x.copy(), trainer.state)
  batch, budget = trainer.step_inputs(batch, prompt_len, t)
  after, _ = trainer.method.step(state, batch, prompt_len, t, budget)
  return jax.tree.map(jnp.subtract, trainer.method.policy_params(after),
                      trainer.method.policy_params(trainer.state))


def own_step_parts(params, own) -> dict:
  """`OWN_PARTS`: ``own`` (the run's own step) on LoGRA's sketched kernels only, and on the
  rest only (the embedding, norms, biases); their sum is ``own``."""
  targets = set(sketch.target_paths(params))
  flat = traverse_util.flatten_dict(own)
  return {'own_step_kernels': _zeros_except(params, {k: v for k, v in flat.items()
                                                     if k in targets}),
          'own_step_rest': _zeros_except(params, {k: v for k, v in flat.items()
                                                  if k not in targets})}


def directions(cfg, params, grad, step: int, key, names=CANDIDATES) -> dict:
  """The candidate updates (dense trees like ``params``) built from batch a's gradient;
  ``names``: which of `CANDIDATES` (each built only when asked for)."""
  targets = set(sketch.target_paths(params))
  leaves, tree = jax.tree.flatten(params)
  build = {
      'dense_gradient': lambda: jax.tree.map(jnp.negative, grad),
      'adamw': lambda: adamw_direction(cfg.optim, params, grad),
      'logra': lambda: logra_direction(cfg.optim, params, grad, cfg.seed, step),
      'logra_rank_x4': lambda: logra_direction(cfg.optim, params, grad, cfg.seed, step, 4),
      'logra_orthogonal': lambda: logra_direction(cfg.optim, params, grad, cfg.seed, step,
                                                  projection='orthogonal'),
      'sketched_gradient': lambda: _zeros_except(
          params, {k: -v for k, v in traverse_util.flatten_dict(grad).items() if k in targets}),
      'random': lambda: jax.tree.unflatten(tree, [
          jax.random.normal(k, x.shape, x.dtype)
          for k, x in zip(jax.random.split(key, len(leaves)), leaves)]),
  }
  unknown = set(names) - set(build) - set(FROM_TRAINER)
  if unknown:
    raise ValueError(f'unknown candidates {sorted(unknown)}; known: '
                     f'{list(CANDIDATES) + list(FROM_TRAINER)}')
  return {n: build[n]() for n in names if n not in FROM_TRAINER}


def candidates(cfg, trainer, params, grad, batch, prompt_len: int, step: int, key,
               names=CANDIDATES) -> dict:
  """`directions` and, when ``names`` asks for them, the run's own step on ``batch`` and
  the parts of an AdamW run's (`OWN_ADAM`) and its split by kernels (`OWN_PARTS`), in
  ``names``' order."""
  ds = directions(cfg, params, grad, step, key, names)
  if {OWN_STEP, *OWN_PARTS} & set(names):
    ds[OWN_STEP] = own_step(trainer, batch, prompt_len, step)
  if set(OWN_PARTS) & set(names):
    ds.update(own_step_parts(params, ds[OWN_STEP]))
  if set(OWN_ADAM) & set(names):
    ds.update(own_adam_directions(trainer, grad, names))
  return {n: ds[n] for n in names}


# ------------------------------------------------------------------- the form objective

FORMS = {'terse': '{e} equals {c}.',
         'template': 'To calculate {e}, you simply add them together: {e} = {c}.'}


def form_text(form: str, reference) -> str:
  """A correct answer to a reasoning-gym arithmetic problem (``reference``: the task's
  reference, with metadata.expression and answer) written in ``form`` (`FORMS`)."""
  if not (isinstance(reference, dict) and 'expression' in reference.get('metadata', {})):
    raise ValueError('the form objective needs reasoning-gym arithmetic references '
                     f'(metadata.expression, answer); got {reference!r:.80}')
  return FORMS[form].format(e=reference['metadata']['expression'], c=reference['answer'])


def form_batch(task, form: str, records):
  """``records`` answered correctly in ``form``, as a training batch (`assemble_batch`;
  advantages 0, unused): (batch, prompt_len)."""
  results = []
  for i, r in enumerate(records):
    ids = list(task.tokenizer.encode(form_text(form, task.reference(r)),
                                     add_special_tokens=False)) + [task.stop_ids[0]]
    results.append(GenerationResult(str(i), 0, task.prompt_ids(r), ids, [0.0] * len(ids),
                                    'stop', 0))
  t = bucket_size(max(len(r.completion_token_ids) for r in results), 8)
  return assemble_batch(results, np.zeros(len(results)), t, task.pad_id, task.prompt_len)


def loglik(model, params, batch, prompt_len):
  """The mean over rows of each completion's log-likelihood (τ = 1, summed over tokens)."""
  out = completion.forward(model, {'params': params}, batch, prompt_len)
  lp = completion.logprobs(model, out, batch['targets'], 1.0)
  return jnp.mean(jnp.sum(lp * batch['target_mask'], axis=1))


def _chunks(batch, chunk: int):
  n = batch['tokens'].shape[0]
  if n % chunk:
    raise ValueError(f'{n} rows do not split into chunks of {chunk}')
  return [{name: x[i:i + chunk] for name, x in batch.items()} for i in range(0, n, chunk)]


def loglik_fn(model):
  """`loglik` jitted for ``model`` (prompt_len static): one compile for many policies."""
  return jax.jit(lambda p, b, prompt_len: loglik(model, p, b, prompt_len), static_argnums=2)


def chunked_loglik(model, params, batch, prompt_len, chunk: int, fn=None) -> float:
  """`loglik` over ``batch`` in row chunks of ``chunk`` (forward only); ``fn``: a
  `loglik_fn(model)` to reuse (default: a new one)."""
  fn = fn or loglik_fn(model)
  parts = _chunks(batch, chunk)
  return sum(float(fn(params, b, prompt_len)) for b in parts) / len(parts)


def chunked_loglik_and_grad(model, params, batch, prompt_len, chunk: int):
  """`loglik` and its gradient over ``batch`` in row chunks of ``chunk`` (rows % chunk == 0)."""
  fn = jax.jit(jax.value_and_grad(lambda p, b: loglik(model, p, b, prompt_len)))
  parts = _chunks(batch, chunk)
  value, grad = 0.0, jax.tree.map(jnp.zeros_like, params)
  for b in parts:
    v, g = fn(params, b)
    value = value + float(v) / len(parts)
    grad = jax.tree.map(lambda a, x: a + x / len(parts), grad, g)
  return float(value), grad


# ---------------------------------------------------------------------------------- scores

def tree_dot(a, b):
  return sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def kl_coefficient(model, params, direction, batch, prompt_len, temperature, rows: int):
  """q(D) on ``rows`` strided rows of ``batch`` (`kl_probe.kl_subset`), by one JVP."""
  sub = kl_probe.kl_subset(batch, rows)
  fwd = lambda w: completion.forward(model, {'params': w}, sub, prompt_len)
  base, tangent = jax.jvp(fwd, (params,), (direction,))
  return sketch.kl_coefficient(base, tangent, temperature, sub['target_mask'])


def score(model, params, direction, grad_b, batch_a, prompt_len, temperature, rows) -> dict:
  """gain = −⟨∇L_b, D⟩, q(D) on batch a's probe rows, score = gain / √q."""
  gain = -tree_dot(grad_b, direction)
  q = kl_coefficient(model, params, direction, batch_a, prompt_len, temperature, rows)
  return {'gain': float(gain), 'q': float(q), 'score': float(gain / jnp.sqrt(q))}


def mean_se(values):
  v = np.asarray(values, np.float64)
  return float(v.mean()), (float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) > 1 else None)


def summarize(per_pair: list) -> dict:
  """[{name: score dict}] over pairs -> {name: {score_mean, score_se, ...}}, LoGRA/AdamW."""
  out = {}
  for name in per_pair[0]:
    m, se = mean_se([p[name]['score'] for p in per_pair])
    out[name] = {'score_mean': m, 'score_se': se,
                 'q_mean': mean_se([p[name]['q'] for p in per_pair])[0]}
  adam = out['adamw']['score_mean']
  ratio = out['logra']['score_mean'] / adam if adam else float('nan')
  ratios = [p['logra']['score'] / p['adamw']['score'] for p in per_pair]
  # Every candidate sees the same pairs: its score minus AdamW's, pair by pair, has a far
  # smaller s.e. than either score (batch b's gradient moves both alike).
  for name, o in out.items():
    o['minus_adamw_mean'], o['minus_adamw_se'] = mean_se(
        [p[name]['score'] - p['adamw']['score'] for p in per_pair])
  return {'directions': out, 'logra_over_adamw': ratio,
          'logra_over_adamw_per_pair': ratios}


# ------------------------------------------------------------------------------------ main

def define_flags():
  """The command line's flags (defined when run as a script, not when imported)."""
  config_flags.DEFINE_config_file('config', None, 'A training config (its LoGRA).')
  flags.DEFINE_string('workdir', None, 'Where the probe writes (and its policy runs).')
  flags.DEFINE_string('from_workdir', '', 'A run directory (any method): probe its latest '
                     'checkpoint.')
  flags.DEFINE_integer('pairs', 8, 'Batch pairs (2 x pairs rollout batches; --objective=form:'
                       ' pairs batches).')
  flags.DEFINE_integer('from_step', -1, "--from_workdir's checkpoint to probe (-1: latest).")
  flags.DEFINE_enum('objective', 'rl', ['rl', 'form'], "rl: another batch's RL loss; form: "
                    "the log-likelihood of correct held-out answers in each of FORMS' forms.")
  flags.DEFINE_list('candidates', list(CANDIDATES), 'Which candidate directions to score '
                    f'(and {list(FROM_TRAINER)}: the probed run\'s own next update and '
                    'the parts of an AdamW run\'s).')
  flags.DEFINE_bool('loglik_only', False, 'With --objective=form: print J_F and stop.')
  flags.DEFINE_list('mean_of', [], 'With --objective=form: candidates whose mean over the '
                    'draws is scored too (a momentum over those batches at this policy).')
  flags.DEFINE_list('from_steps', [], "With --loglik_only: J_F at each of these checkpoints of "
                    "--from_workdir, read in place (no copy; the model built once).")
  flags.mark_flags_as_required(['config', 'workdir'])


# The sections a probe's batches come from: --config's must be the probed run's.
COLLECTION_SECTIONS = ('model', 'data', 'rollout', 'reward', 'rl', 'warm_start', 'seed')


def probe_config(cfg, workdir: str):
  """The config the probe's trainer restores ``workdir``'s policy under: ``cfg`` with the
  optim section of the run copied there (its run_info.json; without one, ``cfg``). So a probe
  starts from any method's checkpoint (an AdamW run's optimizer state is not LoGRA's) and
  draws the batches that run would draw next (its data order and advantage state); the
  candidates are built under ``cfg``. Every key of `COLLECTION_SECTIONS` must be the run's."""
  path = os.path.join(workdir, 'run_info.json')
  if not os.path.exists(path):
    return cfg
  with open(path) as f:
    ran = config_lib.recorded_config(json.load(f)['config'])
  flat = lambda c: traverse_util.flatten_dict(config_lib.machine_free(
      json.loads(json.dumps(dataclasses.asdict(c)))), sep='.')
  mine, theirs = flat(cfg), flat(ran)
  differ = [f'{k}={mine[k]!r} (the run: {theirs[k]!r})' for k in mine
            if k.split('.')[0] in COLLECTION_SECTIONS and mine[k] != theirs[k]]
  if differ:
    raise ValueError(f'--config differs from the probed run ({path}) where its batches come '
                     f"from: {', '.join(differ)}; pass the run's values (e.g. --config.seed)")
  return dataclasses.replace(cfg, optim=ran.optim)


def has_advantage(batch) -> bool:
  """Whether a rollout batch has a non-zero advantage. Without one the RL loss's policy term
  has no gradient: every RL direction built from the batch is zero (gain 0, q 0, score 0/0),
  and as the other batch of a pair its gain is 0 whatever the direction. The probes skip and
  count such draws: a rule fixed by the batch, before any score."""
  return bool(np.any(np.asarray(batch['advantages']) != 0))


def form_scores(model, params, direction, form_grads, batch_a, prompt_len, temperature,
                rows) -> dict:
  """{form: {gain, q, score}}: gain_F = ⟨∇J_F, D⟩, q(D) on batch a's probe rows (one JVP)."""
  q = kl_coefficient(model, params, direction, batch_a, prompt_len, temperature, rows)
  out = {}
  for form, g in form_grads.items():
    gain = tree_dot(g, direction)
    out[form] = {'gain': float(gain), 'q': float(q), 'score': float(gain / jnp.sqrt(q))}
  return out


def mean_form_scores(model, params, direction, form_grads, batches, temperature,
                     rows) -> dict:
  """`form_scores` of a direction averaged over draws: gain_F = ⟨∇J_F, D⟩, q = the mean of
  q(D) over the draws' batches' probe rows (``batches``: [(batch, prompt_len)])."""
  q = float(np.mean([kl_coefficient(model, params, direction, b, p, temperature, rows)
                     for b, p in batches]))
  gains = {form: float(tree_dot(g, direction)) for form, g in form_grads.items()}
  return {form: {'gain': gain, 'q': q, 'score': gain / math.sqrt(q)}
          for form, gain in gains.items()}


def form_probe(cfg, workdir: str, draws: int, names=CANDIDATES, loglik_only=False,
               chunk: int = 32, log=print, mean_of=()) -> dict:
  """The form objective's probe (module docstring) from the policy in ``workdir``.
  ``mean_of``: candidates whose mean over the scored draws is scored too (`mean_form_scores`:
  what averaging them over batches, as a momentum does, would move at this policy)."""
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  trainer = loop.Trainer(probe_config(cfg, workdir), workdir, log=lambda *_: None)
  try:
    params = trainer.method.policy_params(trainer.state)
    model, loss_cfg, task = trainer.model, methods.loss_config(cfg), trainer.task
    records = task.eval_records[:len(task.eval_records) // chunk * chunk]
    loglik_of, form_grads = {}, {}
    for form in FORMS:
      batch, p = form_batch(task, form, records)
      if loglik_only:  # forward only
        loglik_of[form] = chunked_loglik(model, params, batch, p, chunk)
      else:
        loglik_of[form], form_grads[form] = chunked_loglik_and_grad(model, params, batch, p,
                                                                    chunk)
      log(f'J_{form} = {loglik_of[form]:.4f} over {len(records)} held-out problems')
    out = {'step': int(trainer.step), 'loglik': loglik_of, 'problems': len(records)}
    if loglik_only:
      return out
    form_grads['terse_minus_template'] = jax.tree.map(jnp.subtract, form_grads['terse'],
                                                      form_grads['template'])
    temp, rows = cfg.rollout.temperature, cfg.optim.kl_sequences
    grad = jax.jit(lambda p, b, pl: dense_gradient(model, loss_cfg, p, b, pl),
                   static_argnums=2)
    per_draw, t0, skipped = {f: [] for f in form_grads}, trainer.step, []
    unknown = set(mean_of) - set(names)
    if unknown:
      raise ValueError(f'--mean_of {sorted(unknown)}: not among the candidates {list(names)}')
    sums, scored_batches = {n: None for n in mean_of}, []
    for i in range(draws):
      ba, pa = trainer.collect(t0 + i + 1)[:2]
      if not has_advantage(ba):
        skipped.append(i)
        log(f'draw {i}: skipped (no non-zero advantage in its batch)')
        continue
      ds = candidates(cfg, trainer, params, grad(params, ba, pa), ba, pa, t0 + i + 1,
                      jax.random.key(1000 + i), names)
      scored_batches.append((ba, pa))
      for n in mean_of:
        sums[n] = ds[n] if sums[n] is None else jax.tree.map(jnp.add, sums[n], ds[n])
      scored = {n: form_scores(model, params, d, form_grads, ba, pa, temp, rows)
                for n, d in ds.items()}
      for f in form_grads:
        per_draw[f].append({n: s[f] for n, s in scored.items()})
      log(f'draw {i}: ' + ', '.join(f"{n} {s['terse_minus_template']['score']:.4g}"
                                    for n, s in scored.items()))
    if len(skipped) == draws:
      raise ValueError(f'no draw of {draws} had a batch with a non-zero advantage: nothing '
                       'to score (more --pairs)')
    means = {}
    for n, total in sums.items():
      mean = jax.tree.map(lambda x: x / len(scored_batches), total)
      means[n] = mean_form_scores(model, params, mean, form_grads, scored_batches, temp, rows)
      log(f"mean of {n} over {len(scored_batches)} draws: "
          f"{means[n]['terse_minus_template']['score']:.4g}")
  finally:
    trainer.close()
  return dict(out, objectives={f: dict(summarize(v), draws=v) for f, v in per_draw.items()},
              skipped_draws=skipped, rank=cfg.optim.logra.rank,
              projection=cfg.optim.logra.projection, mean_over_draws=means)


def form_logliks(cfg, run_dir: str, steps, chunk: int = 32, log=print) -> list:
  """J_F (every form of `FORMS`) of the policy in each of ``steps``' checkpoints of
  ``run_dir``, read in place (nothing copied or written there; the model built and the
  forward compiled once): [{'step', 'loglik': {form: J_F}, 'problems'}], in ``steps``' order."""
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  steps = loop.checkpoint_steps(run_dir, steps)
  task, model, _, policy_at = loop.checkpoint_policies(cfg, run_dir)
  records = task.eval_records[:len(task.eval_records) // chunk * chunk]
  batches = {form: form_batch(task, form, records) for form in FORMS}
  fn, out = loglik_fn(model), []
  for step in steps:
    params = policy_at(step)
    ll = {form: chunked_loglik(model, params, b, p, chunk, fn)
          for form, (b, p) in batches.items()}
    log(f'step {step}: ' + ', '.join(f'J_{f} = {v:.4f}' for f, v in ll.items()) +
        f' over {len(records)} held-out problems')
    out.append({'step': int(step), 'loglik': ll, 'problems': len(records)})
  return out


def probe(cfg, workdir: str, pairs: int, names=CANDIDATES, log=print) -> dict:
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  trainer = loop.Trainer(probe_config(cfg, workdir), workdir, log=lambda *_: None)
  try:
    params = trainer.method.policy_params(trainer.state)
    model, loss_cfg = trainer.model, methods.loss_config(cfg)
    temp, rows = cfg.rollout.temperature, cfg.optim.kl_sequences
    grad = jax.jit(lambda p, b, pl: dense_gradient(model, loss_cfg, p, b, pl),
                   static_argnums=2)
    per_pair, t0, skipped = [], trainer.step, []
    for i in range(pairs):
      (ba, pa), (bb, pb) = (trainer.collect(t0 + 2 * i + j + 1)[:2] for j in (0, 1))
      if not (has_advantage(ba) and has_advantage(bb)):
        skipped.append(i)
        log(f'pair {i}: skipped (a batch without a non-zero advantage)')
        continue
      if pa != pb:  # both batches' prompts in one bucket: one gradient program per length
        log(f'pair {i}: prompt lengths {pa} != {pb}; b padded to {max(pa, pb)}')
      ga, gb = grad(params, ba, pa), grad(params, bb, pb)
      ds = candidates(cfg, trainer, params, ga, ba, pa, t0 + 2 * i + 1,
                      jax.random.key(1000 + i), names)
      per_pair.append({n: score(model, params, d, gb, ba, pa, temp, rows)
                       for n, d in ds.items()})
      log(f"pair {i}: " + ', '.join(f"{n} {s['score']:.4g}" for n, s in per_pair[-1].items()))
  finally:
    trainer.close()
  if not per_pair:
    raise ValueError(f'no pair of {pairs} had two batches with a non-zero advantage: nothing '
                     'to score (more --pairs)')
  return dict(summarize(per_pair), pairs=per_pair, skipped_pairs=skipped, step=int(t0),
              rank=cfg.optim.logra.rank, projection=cfg.optim.logra.projection,
              sketch_optimizer=cfg.optim.logra.sketch_optimizer)


def print_scores(summary: dict, label: str = ''):
  """Per candidate: mean ± s.e. of its score, minus AdamW's (paired), its mean q."""
  nan = float('nan')
  for name, s in summary['directions'].items():
    print(f"{label}{name:18s} score {s['score_mean']:.4g} ± {s['score_se'] or nan:.2g}  "
          f"minus AdamW's (paired) {s['minus_adamw_mean']:.3g} ± "
          f"{s['minus_adamw_se'] or nan:.2g}  q {s['q_mean']:.3g}")
  print(f"{label}LoGRA / AdamW score: {summary['logra_over_adamw']:.3f}")


def copy_policy(run_dir: str, policy_dir: str, step: int = -1):
  """A copy of ``run_dir`` (metrics left out) to probe from; ``step`` ≥ 0 keeps only that
  checkpoint (the trainer resumes from the latest it finds)."""
  ckpts = os.path.join(run_dir, 'checkpoints')
  if step >= 0 and not os.path.isdir(os.path.join(ckpts, str(step))):
    have = sorted(os.listdir(ckpts)) if os.path.isdir(ckpts) else []
    raise app.UsageError(f'{run_dir} has no checkpoint {step} (it has {have})')

  def ignore(directory, names):
    drop = set(shutil.ignore_patterns('*.jsonl', 'events*')(directory, names))
    if step >= 0 and os.path.abspath(directory) == os.path.abspath(ckpts):
      drop |= {n for n in names if n.isdigit() and int(n) != step}
    return drop
  shutil.copytree(run_dir, policy_dir, ignore=ignore)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from logra_jax.train.config import from_config_dict  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  cfg = from_config_dict(f.config)
  if cfg.optim.name != 'logra' and not (f.objective == 'form' and f.loglik_only):
    raise app.UsageError('direction_quality.py probes a LoGRA config (optim.name=logra)')
  if f.loglik_only and f.objective != 'form':
    raise app.UsageError('--loglik_only is a mode of --objective=form')
  if f.from_step >= 0 and not f.from_workdir:
    raise app.UsageError('--from_step picks a checkpoint of --from_workdir, which is not set')
  if not {'logra', 'adamw'} <= set(f.candidates):
    raise app.UsageError('--candidates must include logra and adamw (scores are compared)')
  if f.from_steps:
    if not (f.loglik_only and f.from_workdir) or f.from_step >= 0:
      raise app.UsageError('--from_steps is a mode of --loglik_only with --from_workdir '
                           '(and without --from_step)')
    out = form_logliks(cfg, f.from_workdir, [int(s) for s in f.from_steps])
    os.makedirs(f.workdir, exist_ok=True)
    with open(os.path.join(f.workdir, 'form_logliks.json'), 'w') as fh:
      json.dump(out, fh, indent=1)
    print(json.dumps(out))
    return
  policy_dir = os.path.join(f.workdir, 'policy')
  if f.from_workdir and not os.path.exists(policy_dir):
    copy_policy(f.from_workdir, policy_dir, f.from_step)
  if f.objective == 'form':
    out = form_probe(cfg, policy_dir, f.pairs, f.candidates, f.loglik_only,
                     mean_of=f.mean_of)
    for form, summary in out.get('objectives', {}).items():
      print_scores(summary, f'{form}: ')
    last = {k: v for k, v in out.items() if k != 'objectives'}  # mean_over_draws too
    last['logra_over_adamw'] = {form: o['logra_over_adamw']
                                for form, o in out.get('objectives', {}).items()}
  else:
    out = probe(cfg, policy_dir, f.pairs, f.candidates)
    print_scores(out)
    last = {k: out[k] for k in ('logra_over_adamw', 'directions', 'step', 'rank',
                                'skipped_pairs')}
  with open(os.path.join(f.workdir, 'direction_quality.json'), 'w') as fh:
    json.dump(out, fh, indent=1)
  print(json.dumps(last))


if __name__ == '__main__':
  define_flags()
  app.run(main)
