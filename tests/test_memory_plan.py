"""experiments/memory_plan.py --tiny: the trainer's steps compiled on 4 simulated devices.

One subprocess run (the plan starts its own 4-device worker) checks the printed contract
(the issue's JSON last line, peak = arg + out - alias + temp) and that the plan measures the
step's real per-device inputs: the FSDP quarter of the params, dense AdamW's two fp32 moments
per fp32 master weight, LoGRA's optimizer state a small fraction of that. Byte counts are
exact integers: no tolerance except the pruned PRNG key (below).
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# jit drops inputs the step never reads; the LoGRA step reads its PRNG key (8 bytes) even
# with sparse_mask off: the stochastic rounding of its bf16 apply. Nothing is dropped.
PRUNED_BYTES = 0


@pytest.fixture(scope='module')
def plan():
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, os.path.join(ROOT, 'experiments', 'memory_plan.py'),
                        '--tiny'], env=env, capture_output=True, text=True, timeout=900,
                       cwd=ROOT, check=False)
  assert out.returncode == 0, out.stderr[-4000:]
  lines = out.stdout.strip().splitlines()
  rows = next(json.loads(l[5:]) for l in lines if l.startswith('ROWS '))
  return json.loads(lines[-1]), {r['method']: r for r in rows}, out.stdout


def test_last_line_is_the_issue_json(plan):
  summary, rows, stdout = plan
  assert set(summary) == {'tiny'} and set(summary['tiny']) == {'dense_peak_gib',
                                                               'logra_peak_gib'}
  for method in ('dense', 'logra'):
    assert summary['tiny'][f'{method}_peak_gib'] == round(rows[method]['peak'] / 2**30, 3)
  assert 'UPPER BOUNDS' in stdout


def test_peak_is_arguments_plus_outputs_minus_aliased_plus_temp(plan):
  _, rows, _ = plan
  for r in rows.values():
    assert r['devices'] == 4
    assert r['peak'] == r['argument'] + r['output'] - r['alias'] + r['temp'], r
    assert r['temp'] > 0 and 0 < r['alias'] <= r['output'], r  # params/state donated


def test_arguments_are_the_steps_per_device_inputs(plan):
  _, rows, _ = plan
  for r in rows.values():
    parts = sum(r['parts'].values())
    pruned = PRUNED_BYTES if r['method'] == 'logra' else 0
    assert r['argument'] == parts - pruned, (r['method'], r['argument'], r['parts'])
    # FSDP over 4: every tiny param dimension that is sharded divides by 4 (norms: 128).
    assert r['parts']['params'] * 4 == r['parts_global']['params'], r
    assert r['parts']['batch'] * 4 == r['parts_global']['batch'], r  # data-parallel


def test_optimizer_state_dense_two_fp32_moments_logra_a_small_fraction(plan):
  _, rows, _ = plan
  dense, logra = rows['dense']['parts'], rows['logra']['parts']
  # AdamW: mu and nu in fp32 per fp32 master weight (+ a few int32 counts).
  assert 0 <= dense['opt_state'] - 2 * dense['params'] <= 16, dense
  # LoGRA (bf16 params, RowAdam): one fp32 moment per output unit of each sketched matrix.
  assert logra['params'] * 2 == dense['params'], (logra, dense)
  assert logra['opt_state'] < dense['opt_state'] / 50, (logra, dense)


def _plan_module():
  spec = importlib.util.spec_from_file_location(
      '_memory_plan_cli', os.path.join(ROOT, 'experiments', 'memory_plan.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_only_selects_one_row_and_names_an_unknown_one():
  cli = _plan_module()
  rows = cli.rows_for(['1.5b', '7b', '27b'])
  assert len({cli.row_name(r) for r in rows}) == len(rows) == 8
  assert cli.select_rows(rows, ['7b_logra_4dev']) == [('7b', 'logra', 4, 'logra_peak_gib')]
  assert cli.select_rows(rows, None) == rows
  with pytest.raises(cli.app.UsageError, match=r"'7b_logra_3dev'.*7b_logra_1dev"):
    cli.select_rows(rows, ['7b_logra_3dev'])


def test_step_figures_count_the_rest_s_adam_state_and_gradient():
  """optim.logra.rest_learning_rate adds Adam's two fp32 moments of the unsketched leaves (and
  two int32 counts: Adam's and the lr schedule's) to the optimizer state, and their dense
  gradient to the gradient."""
  import jax  # pylint: disable=g-import-not-at-top
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from logra_jax import sketch  # pylint: disable=g-import-not-at-top
  from logra_jax.analysis import memory_plan  # pylint: disable=g-import-not-at-top
  from logra_jax.models.presets import get_preset  # pylint: disable=g-import-not-at-top
  from logra_jax.models.transformer import Transformer, init_params  # pylint: disable=g-import-not-at-top
  from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  model = Transformer(get_preset('tiny', vocab_size=16))
  figures = {}
  for lr in (0.0, 1e-3):
    c = tiny.get_config()
    c.optim.logra.rest_learning_rate = lr
    figures[lr] = memory_plan.step_figures(config_lib.from_config_dict(c), model, (8, 4), 8)
  params = jax.eval_shape(lambda: init_params(model.config, jax.random.key(0)))
  a = sketch.make_projections(params, 0, 0, ranks=4)
  rest = sum(x.size * 4 for x in jax.tree.leaves(sketch.rest_of(params, a)))  # fp32
  assert rest > 0
  assert figures[1e-3]['opt_state_bytes'] - figures[0.0]['opt_state_bytes'] == 2 * rest + 2 * 4
  assert figures[1e-3]['grad_bytes'] - figures[0.0]['grad_bytes'] == rest
  assert figures[1e-3]['param_bytes'] == figures[0.0]['param_bytes']
