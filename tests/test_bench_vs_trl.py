"""experiments/bench_vs_trl.py: end to end on a tiny model, and its medians and ratios.

The SmolLM2 workload takes ~15 minutes here, so it is run by hand (the README's table has the
command and the figures). Tested here: the whole benchmark on ``--model=tiny`` (TRL's
GRPOTrainer in its venv, then our LoGRA and dense-AdamW runs, on a tiny HF checkpoint with
SmolLM2's tokenizer), the medians (steps after the warm-up; training = step − generation) and
the ratios of the last line.
"""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import bench_vs_trl  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
from logra_jax.train.metrics import read_metrics  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def test_summarize_medians_after_the_warm_up():
  result = {'step_s': [50.0, 20.0, 10.0, 12.0, 11.0], 'generate_s': [5.0, 4.0, 4.0, 6.0, 3.0],
            'peak_rss_gib': 2.5}
  s = bench_vs_trl.summarize(result, skip=2)
  assert s == {'step_s': 11.0, 'generate_s': 4.0, 'train_s': 6.0, 'peak_rss_gib': 2.5,
               'steps': 3}


def test_ratios_divide_ours_by_trl_and_logra_by_adam():
  ours = {'step_s': 10.0, 'peak_rss_gib': 2.0}
  trl = {'step_s': 20.0, 'peak_rss_gib': 5.0}
  adam = {'step_s': 25.0, 'peak_rss_gib': 8.0}
  r = bench_vs_trl.ratios(ours, trl, adam)
  assert (r['step_time_ratio'], r['peak_rss_ratio']) == (0.5, 0.4)
  assert (r['adam_step_time_ratio'], r['adam_peak_rss_ratio'], r['logra_over_adam']) == (
      1.25, 1.6, 0.4)
  assert 'adam_step_time_ratio' not in bench_vs_trl.ratios(ours, trl)


def _summary_ok(s, steps):
  assert s['steps'] == steps, s
  assert 0 < s['generate_s'] < s['step_s'], s
  assert math.isclose(s['train_s'], s['step_s'] - s['generate_s']), s
  # A process with a model and its compiled programs: far above 0.1 GiB, far below 24.
  assert 0.1 < s['peak_rss_gib'] < 24, s


@pytest.mark.slow
def test_tiny_end_to_end_trl_grpo_then_ours_then_our_dense_adam(tmp_path):
  """The whole benchmark on --model=tiny: TRL 1.16's GRPOTrainer in .venv-trl (`make envs`
  builds it; here it is built if missing), our LoGRA run and our dense-AdamW run of
  experiments/train.py, all on one tiny HF checkpoint with SmolLM2's tokenizer."""
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'bench_vs_trl.py'), '--model=tiny',
       f'--workdir={tmp_path}', f"--venv={os.path.join(ROOT, '.venv-trl')}", '--steps=3',
       '--skip_steps=1', '--prompts_per_step=4', '--samples=2', '--new_tokens=8',
       '--ours=data.eval_size=2'],
      capture_output=True, text=True, cwd=ROOT, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  last = json.loads(out.stdout.strip().splitlines()[-1])
  for side in ('ours', 'adam', 'trl'):
    _summary_ok(last[side], steps=2)
  assert last == bench_vs_trl.ratios(last['ours'], last['trl'], last['adam'])
  trl = json.load(open(tmp_path / 'trl.json'))
  assert trl['trl'] == bench_vs_trl.TRL_VERSION and len(trl['step_s']) == 3, trl
  # Both of our runs are train.py's on the tiny checkpoint: LoGRA, then dense AdamW.
  for name, method in (('ours', 'logra'), ('ours_adam', 'adam')):
    rows = read_metrics(str(tmp_path / name))
    assert [r['step'] for r in rows if r.get('step_time_s') is not None] == [1, 2, 3], name
    cfg = json.load(open(tmp_path / name / 'run_info.json'))['config']
    assert cfg['optim']['name'] == method and cfg['model']['path'].endswith('tiny_hf'), name
