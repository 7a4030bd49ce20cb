"""experiments/bench_vs_trl.py: the parts that run without TRL's venv.

The TRL side (building .venv-trl, the fp32 HF copy of SmolLM2, TRL's GRPOTrainer on it) needs a
package install and a SmolLM2 run: minutes, far over a unit test's budget, so it is run by hand
(the README's table has the command and the figures). Tested here: our side for real — the
peak-RSS wrapper around experiments/train.py and the metrics it reads back — on the tiny
config, and the medians (steps after the warm-up; training = step − generation).
"""
import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import bench_vs_trl  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def test_summarize_medians_after_the_warm_up():
  result = {'step_s': [50.0, 20.0, 10.0, 12.0, 11.0], 'generate_s': [5.0, 4.0, 4.0, 6.0, 3.0],
            'peak_rss_gib': 2.5}
  s = bench_vs_trl.summarize(result, skip=2)
  assert s == {'step_s': 11.0, 'generate_s': 4.0, 'train_s': 6.0, 'peak_rss_gib': 2.5,
               'steps': 3}


@pytest.mark.slow
def test_our_side_runs_train_py_and_reports_its_peak_rss(tmp_path):
  run_dir = tmp_path / 'ours'
  flags = [f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}", f'--workdir={run_dir}',
           '--config.warm_start.steps=0', '--config.data.prompts_per_step=2',
           '--config.data.samples_per_prompt=2', '--config.data.eval_size=2', '--config.eval.k=1',
           '--config.total_steps=2', '--config.eval_every=2', '--config.checkpoint_every=2',
           '--config.optim.kl_sequences=2', '--config.reward.workers=0']
  result = bench_vs_trl.run_ours(str(tmp_path), None, flags=flags)
  assert len(result['step_s']) == len(result['generate_s']) == 2
  assert all(0 < g < s for s, g in zip(result['step_s'], result['generate_s'])), result
  # A JAX process with a model and its compiled programs: far above 0.1 GiB, far below 24.
  assert 0.1 < result['peak_rss_gib'] < 24, result
  assert json.load(open(tmp_path / 'ours_rss.json'))['peak_rss_gib'] == result['peak_rss_gib']
  s = bench_vs_trl.summarize(result, skip=1)
  assert s['steps'] == 1 and math.isclose(s['train_s'], s['step_s'] - s['generate_s'])
