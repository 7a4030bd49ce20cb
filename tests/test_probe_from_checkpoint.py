"""direction_quality's probes from a real run's checkpoint of another method (AdamW): the
checkpoint is restored under the run's own optim section (`probe_config`), so the probe's
policy is the checkpoint's and its batches are those the run drew next; the LoGRA candidates
follow --config. A draw whose batch has no non-zero advantage is skipped and counted, the
other draws unchanged. The own_step candidate is the run's own next step (an AdamW, a LoGRA
and an adaptive-subspace run), and an AdamW run's step splits into its moments' parts. The
runs are tests/trainer_runs.py's tiny one (format reward), every checkpoint kept."""
import dataclasses
import json
import math
import os
import sys

import jax
from flax import traverse_util
import numpy as np
import pytest

from logra_jax import parallel, sketch
from logra_jax.data import tiny_task
from logra_jax.train import loop, methods, steps
from logra_jax.train.metrics import read_metrics
from trainer_runs import (assert_trees_equal, format_reward, make_config,  # noqa: F401
                          train, xla_cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import direction_quality as dq  # noqa: E402  pylint: disable=g-import-not-at-top

quiet = lambda *_: None


def run_of(method: str, tmp_path_factory, **overrides):
  """4 steps of ``method``, every step's checkpoint kept, with its run_info.json as train.py
  writes it."""
  workdir = tmp_path_factory.mktemp(f'{method}_run')
  cfg = make_config(optim__name=method, checkpoint_every=1, keep_checkpoints=0, **overrides)
  train(cfg, workdir)
  with open(os.path.join(workdir, 'run_info.json'), 'w') as f:
    json.dump(parallel.run_info(parallel.layout_from_config(cfg.mesh),
                                dataclasses.asdict(cfg)), f)
  return cfg, str(workdir)


@pytest.fixture(scope='module')
def adam_run(tmp_path_factory):
  """With global-norm clipping that binds at every step and weight decay, so that
  `dq.adam_moments` is checked with both."""
  return run_of('adam', tmp_path_factory, optim__adam__max_grad_norm=1e-3,
                optim__adam__weight_decay=0.01)


@pytest.fixture(scope='module')
def logra_run(tmp_path_factory):
  return run_of('logra', tmp_path_factory)


@pytest.fixture(scope='module')
def adaptive_run(tmp_path_factory):
  """SmolLM2's default's kind: A rebuilt from the co-sketches every 2 steps (at step 2, used
  from step 3 on), the unsketched leaves trained by Adam."""
  return run_of('logra', tmp_path_factory, optim__logra__subspace='adaptive',
                optim__logra__subspace_random_rows=2, optim__logra__refresh_every=2,
                optim__logra__rest_learning_rate=1e-3)


def recorded_probe(monkeypatch, zero_advantages_at=()):
  """What the probe's directions are built from (params) and the rewards of each batch it
  collects; the batches collected at steps ``zero_advantages_at`` get zero advantages."""
  seen = {'params': [], 'rewards': {}}
  directions, collect = dq.directions, loop.Trainer.collect

  def recorded_directions(cfg, params, *args, **kwargs):
    seen['params'].append(jax.device_get(params))
    return directions(cfg, params, *args, **kwargs)

  def recorded_collect(self, t):
    out = collect(self, t)
    seen['rewards'][t] = float(np.mean(out[3].rewards))
    if t in zero_advantages_at:
      out = (dict(out[0], advantages=np.zeros_like(out[0]['advantages'])),) + out[1:]
    return out
  monkeypatch.setattr(dq, 'directions', recorded_directions)
  monkeypatch.setattr(loop.Trainer, 'collect', recorded_collect)
  return seen


@pytest.fixture(scope='module')
def probed(adam_run, tmp_path_factory):
  """The RL probe (2 pairs) of LoGRA's candidates from the AdamW run's step-2 checkpoint."""
  _, workdir = adam_run
  policy_dir = str(tmp_path_factory.mktemp('probe') / 'policy')
  dq.copy_policy(workdir, policy_dir, 2)
  with pytest.MonkeyPatch.context() as mp, jax.enable_x64(False):
    seen = recorded_probe(mp)
    out = dq.probe(make_config(), policy_dir, 2, log=quiet)
  return out, seen


def test_the_probe_starts_from_an_adamw_checkpoint(adam_run, probed):
  """Its policy is the AdamW checkpoint's (read as evaluate_checkpoint reads it), its step
  the checkpoint's, and its first batch the one the run drew at the next step (same reward)."""
  adam_cfg, workdir = adam_run
  out, seen = probed
  with jax.enable_x64(False):
    _, _, _, policy_at = loop.checkpoint_policies(adam_cfg, workdir)
    want = jax.device_get(policy_at(2))
  assert out['step'] == 2 and out['skipped_pairs'] == [] and len(out['pairs']) == 2
  for params in seen['params']:
    assert_trees_equal(params, want)
  logged = {r['step']: r for r in read_metrics(workdir) if 'reward_mean' in r}
  assert seen['rewards'][3] == pytest.approx(logged[3]['reward_mean'], rel=1e-6)
  for name in ('logra', 'adamw', 'dense_gradient'):
    assert math.isfinite(out['directions'][name]['score_mean'])


def test_a_config_unlike_the_run_where_batches_come_from_is_refused(adam_run, tmp_path):
  adam_cfg, workdir = adam_run
  dq.copy_policy(workdir, str(tmp_path / 'policy'), 2)
  other = dataclasses.replace(make_config(), seed=7)
  with pytest.raises(ValueError, match=r'seed=7 \(the run: 0\)'):
    dq.probe_config(other, str(tmp_path / 'policy'))
  # Another LoGRA section is no difference: the candidates follow --config.
  assert dq.probe_config(make_config(optim__logra__rank=2), str(tmp_path / 'policy')).optim \
      == adam_cfg.optim


def test_a_pair_without_advantages_is_skipped_and_counted(adam_run, probed, monkeypatch,
                                                          tmp_path):
  """Pair 0's first batch (step 3) with zero advantages: the pair is skipped, and the other
  pair is scored exactly as without the skip (its batches and seeds keep their steps)."""
  _, workdir = adam_run
  full, _ = probed
  dq.copy_policy(workdir, str(tmp_path / 'policy'), 2)
  recorded_probe(monkeypatch, zero_advantages_at=(3,))
  with jax.enable_x64(False):
    out = dq.probe(make_config(), str(tmp_path / 'policy'), 2, log=quiet)
  assert out['skipped_pairs'] == [0] and out['pairs'] == full['pairs'][1:]
  assert all(math.isfinite(d['score_mean']) for d in out['directions'].values())
  with jax.enable_x64(False), pytest.raises(ValueError, match='no pair of 1'):
    dq.probe(make_config(), str(tmp_path / 'policy'), 1, log=quiet)


def tiny_forms(monkeypatch):
  """The tiny task's forms: 'C' and 'C = C' (its tokenizer knows digits and '+=-* ')."""
  texts = {'terse': '{c}', 'template': '{c} = {c}'}
  monkeypatch.setattr(dq, 'form_text', lambda form, ref: texts[form].format(c=ref))
  encode = tiny_task.CharTokenizer.encode
  monkeypatch.setattr(tiny_task.CharTokenizer, 'encode',  # the HF keyword form_batch passes
                      lambda self, text, add_special_tokens=False, **kw: encode(self, text, **kw))


def test_a_form_draw_without_advantages_is_skipped_and_counted(adam_run, monkeypatch,
                                                               tmp_path):
  """The form probe skips draw 0 (zero advantages) and scores draw 1 as it would unskipped."""
  _, workdir = adam_run
  tiny_forms(monkeypatch)
  names = ('logra', 'adamw', 'dense_gradient', 'own_step')
  outs = []
  for zero in ((), (3,)):
    policy_dir = str(tmp_path / f'policy{len(zero)}')
    dq.copy_policy(workdir, policy_dir, 2)
    with pytest.MonkeyPatch.context() as mp, jax.enable_x64(False):
      recorded_probe(mp, zero_advantages_at=zero)
      outs.append(dq.form_probe(make_config(), policy_dir, 2, names, chunk=4, log=quiet))
  full, skipped = outs
  assert full['skipped_draws'] == [] and skipped['skipped_draws'] == [0]
  for form, o in skipped['objectives'].items():
    assert o['draws'] == full['objectives'][form]['draws'][1:]
    assert math.isfinite(o['directions']['logra']['score_mean'])


@pytest.mark.parametrize('run', ['adam_run', 'logra_run', 'adaptive_run'])
def test_own_step_is_the_step_the_run_took_next(run, request, tmp_path):
  """The own_step candidate from a run's step-2 checkpoint, on the batch the run drew at step
  3, is θ_3 − θ_2 of the run's own checkpoints, to the bit: the restored optimizer state
  (AdamW's moments; LoGRA's sketch momentum, the adaptive A and the rest's moments) and the
  step's inputs (the KL budget) are the run's. Built twice, it is the same: the probe's
  trainer keeps its state."""
  run_cfg, workdir = request.getfixturevalue(run)
  policy_dir = str(tmp_path / 'policy')
  dq.copy_policy(workdir, policy_dir, 2)
  with jax.enable_x64(False):
    trainer = loop.Trainer(dq.probe_config(make_config(), policy_dir), policy_dir, log=quiet)
    try:
      batch, p = trainer.collect(3)[:2]
      got = [jax.device_get(dq.own_step(trainer, batch, p, 3)) for _ in range(2)]
      params = trainer.method.policy_params(trainer.state)
      parts = jax.device_get(dq.candidates(make_config(), trainer, params, None, batch, p, 3,
                                           None, dq.OWN_PARTS))
      targets = set(sketch.target_paths(params))
    finally:
      trainer.close()
    _, _, _, policy_at = loop.checkpoint_policies(run_cfg, workdir)
    want = jax.tree.map(np.subtract, jax.device_get(policy_at(3)),
                        jax.device_get(policy_at(2)))
  assert_trees_equal(got[0], want)
  assert_trees_equal(got[1], want)
  assert max(float(np.abs(x).max()) for x in jax.tree.leaves(want)) > 0
  # own_step split by LoGRA's kernels: each part is own_step where it lives, zero elsewhere.
  flat_want = traverse_util.flatten_dict(want)
  for name, inside in (('own_step_kernels', True), ('own_step_rest', False)):
    for k, v in traverse_util.flatten_dict(parts[name]).items():
      np.testing.assert_array_equal(v, flat_want[k] if (k in targets) == inside else 0 * v,
                                    err_msg=f'{name} at {k}')
  assert targets and set(flat_want) - targets


def test_adamw_own_step_is_its_moments_parts(adam_run, tmp_path):
  """own_momentum (−m̂) and own_preconditioned (−g/(√v̂ + ε)) are the parts of the AdamW run's
  own step: −(m̂/(√v̂ + ε) + wd θ) from `dq.adam_moments` (the restored moments, one more
  clipped gradient) points where own_step does. Unit vectors within 1e-5: the step's gradient
  is a mean over micro-batches, the probe's one batch's, equal to float32 rounding."""
  _, workdir = adam_run
  policy_dir = str(tmp_path / 'policy')
  dq.copy_policy(workdir, policy_dir, 2)
  with jax.enable_x64(False):
    cfg = dq.probe_config(make_config(), policy_dir)
    trainer = loop.Trainer(cfg, policy_dir, log=quiet)
    try:
      batch, p = trainer.collect(3)[:2]
      params = trainer.method.policy_params(trainer.state)
      grad = dq.dense_gradient(trainer.model, methods.loss_config(cfg), params, batch, p)
      own = jax.device_get(dq.own_step(trainer, batch, p, 3))
      parts = jax.device_get(dq.own_adam_directions(trainer, grad, dq.OWN_ADAM))
      m, v, g = jax.device_get(dq.adam_moments(cfg.optim, trainer.state['opt_state'], grad))
      params = jax.device_get(params)
    finally:
      trainer.close()
  assert float(np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(grad)))) > 1e-3
  wd = cfg.optim.adam.weight_decay
  want = jax.tree.map(lambda mm, vv, w: -(mm / (np.sqrt(vv) + dq.ADAM_EPS) + wd * w), m, v,
                      params)
  unit = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) / np.sqrt(
      sum(np.sum(np.square(x, dtype=np.float64)) for x in jax.tree.leaves(t)))
  np.testing.assert_allclose(unit(own), unit(want), atol=1e-5)
  assert_trees_equal(parts['own_momentum'], jax.tree.map(np.negative, m))
  assert_trees_equal(parts['own_preconditioned'],
                     jax.tree.map(lambda gg, vv: -gg / (np.sqrt(vv) + np.float32(dq.ADAM_EPS)),
                                  g, v))
  with jax.enable_x64(False), pytest.raises(ValueError, match='need an AdamW run'):
    dq.adam_moments(cfg.optim, {'not': 'adam'}, grad)
  sketched = dataclasses.replace(cfg.optim, adam=dataclasses.replace(cfg.optim.adam,
                                                                     trainable='sketched'))
  with jax.enable_x64(False), pytest.raises(ValueError, match='of every parameter'):
    dq.adam_moments(sketched, trainer.state['opt_state'], grad)


def test_the_mean_over_draws_is_scored(adam_run, monkeypatch, tmp_path):
  """--mean_of=dense_gradient: the mean of the draws' gradients, its gain the mean of their
  gains (the gain is linear in D; float32 sums of 3 draws: rtol 1e-5), its q the mean of its
  q on each draw's batch, its score gain / √q."""
  _, workdir = adam_run
  tiny_forms(monkeypatch)
  policy_dir = str(tmp_path / 'policy')
  dq.copy_policy(workdir, policy_dir, 2)
  with jax.enable_x64(False):
    out = dq.form_probe(make_config(), policy_dir, 3, ('logra', 'adamw', 'dense_gradient'),
                        chunk=4, log=quiet, mean_of=('dense_gradient',))
  assert out['skipped_draws'] == []
  for form, o in out['objectives'].items():
    mean = out['mean_over_draws']['dense_gradient'][form]
    gains = [d['dense_gradient']['gain'] for d in o['draws']]
    assert len(gains) == 3 and mean['gain'] == pytest.approx(np.mean(gains), rel=1e-5)
    assert mean['q'] > 0 and mean['score'] == pytest.approx(mean['gain'] / np.sqrt(mean['q']))
  with jax.enable_x64(False), pytest.raises(ValueError, match='not among the candidates'):
    dq.form_probe(make_config(), policy_dir, 1, ('logra', 'adamw'), chunk=4, log=quiet,
                  mean_of=('dense_gradient',))


@pytest.fixture(scope='module')
def readers(adaptive_run, adam_run):
  """`loop.checkpoint_states`' readers of the adaptive and the AdamW run, built once."""
  with jax.enable_x64(False):
    return {name: loop.checkpoint_states(*run)[-1]
            for name, run in (('adaptive', adaptive_run), ('adam', adam_run))}


def test_momentum_retention_reads_a_refresh_checkpoint(adaptive_run, readers):
  """`momentum_retention.measure` at the adaptive run's refresh steps 2 and 4: per kernel, the
  share of Z = A_old⁺ m that the new A's row space holds, against Z and the projector formed
  densely (pinv in float64) from the restored state; a step that is not a refresh is refused."""
  import momentum_retention as mr  # pylint: disable=g-import-not-at-top
  run_cfg, workdir = adaptive_run
  state_at = readers['adaptive']
  with jax.enable_x64(False):
    out = mr.measure(run_cfg, workdir, [2, 4], log=quiet, state_at=state_at)
    states = {t: jax.device_get(state_at(t)) for t in (2, 4)}
    with pytest.raises(ValueError, match='not a refresh step'):
      mr.measure(run_cfg, workdir, [3], log=quiet, state_at=state_at)
  assert [r['step'] for r in out['steps']] == [2, 4]
  for r in out['steps']:
    state = states[r['step']]
    flat = lambda t: traverse_util.flatten_dict(t, sep='/')
    mu = flat(steps.sketch_momentum_state(state['opt_state']).mu)
    a_old, a_new = flat(state['prev_projections']), flat(state['projections'])
    assert set(r['kernels']) == set(mu) and mu
    energy = kept = 0.0
    for path, m in mu.items():
      shape = m.shape[-2:]
      pairs = zip(*(np.asarray(x, np.float64).reshape((-1,) + x.shape[-2:])
                    for x in (m, a_old[path], a_new[path])))
      e = k = 0.0
      for mm, ao, an in pairs:
        z = np.linalg.pinv(ao) @ mm
        p = np.linalg.pinv(an) @ an @ z
        e, k = e + np.sum(z * z), k + np.sum(p * p)
      assert not np.array_equal(a_old[path], a_new[path]), path  # A was rebuilt
      # Both sides in float64 from the same fp32 arrays: equal to the rounding of the
      # float64 solves (~1e-12); 1e-9 relative leaves room for Γ's conditioning.
      np.testing.assert_allclose(r['kernels'][path]['kept'], k / e, rtol=1e-9, err_msg=path)
      assert shape == (a_old[path].shape[-2], m.shape[-1])
      energy, kept = energy + e, kept + k
    np.testing.assert_allclose(r['kept'], kept / energy, rtol=1e-9)
    assert 0 < r['kept'] < 1


def test_adam_moment_in_logra_subspace_reads_both_runs(adaptive_run, adam_run, readers):
  """M2 from the tiny runs' checkpoints (same task and seed): at steps 2 and 4, per kernel,
  the share of AdamW's first moment in the row space of the adaptive run's A, against the
  projector formed densely (pinv, float64); the overlap of the A built at 2 and at 4."""
  import momentum_retention as mr  # pylint: disable=g-import-not-at-top
  run_cfg, logra_dir = adaptive_run
  _, adam_dir = adam_run
  logra_at, adam_at = readers['adaptive'], readers['adam']
  with jax.enable_x64(False):
    out = mr.adam_in_subspace(run_cfg, logra_dir, adam_dir, [2, 4], log=quiet,
                              logra_at=logra_at, adam_at=adam_at)
    a = {t: traverse_util.flatten_dict(jax.device_get(logra_at(t)['projections']), sep='/')
         for t in (2, 4)}
    mu = {t: traverse_util.flatten_dict(jax.device_get(adam_at(t)['opt_state'])[1][0].mu,
                                        sep='/') for t in (2, 4)}
  assert [r['step'] for r in out['steps']] == [2, 4]
  for r in out['steps']:
    t = r['step']
    for path, share in r['first_moment']['kernels'].items():
      x = np.asarray(mu[t][path], np.float64).reshape((-1,) + mu[t][path].shape[-2:])
      aa = np.asarray(a[t][path], np.float64).reshape((-1,) + a[t][path].shape[-2:])
      p = [np.linalg.pinv(m) @ m @ y for m, y in zip(aa, x)]
      want = sum(np.sum(q * q) for q in p) / np.sum(x * x)
      np.testing.assert_allclose(share['in_subspace'], want, rtol=1e-9, err_msg=path)
  drift, = out['subspace_overlap']
  assert drift['steps'] == [2, 4] and 0 < drift['overlap'] < 1
