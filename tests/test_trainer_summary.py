"""The end-of-run summary and the progress bar's held-out figure (logra_jax.train.summary)."""
import os

import pytest

from logra_jax.train import loop, summary
from logra_jax.train.metrics import read_metrics
from trainer_runs import format_reward, make_config, train, xla_cache  # noqa: F401

ROWS = [{'step': 0, 'eval_accuracy': 0.25}, {'step': 1, 'accuracy': 0.5},
        {'step': 2, 'accuracy': 0.4, 'eval_accuracy': 0.5},
        {'step': 3, 'eval_accuracy': 0.5}, {'step': 4, 'eval_accuracy': 0.375}]


def test_summary_lines_by_hand(tmp_path):
  lines = summary.summary_lines(ROWS, str(tmp_path), 75.4, 4, '/ck', None)
  text = '\n'.join(lines)
  # start, end, their difference, and the EARLIEST of the equal bests (steps 2 and 3).
  assert ('held-out pass@1: 0.250 at step 0 -> 0.375 at step 4 (+0.125); best 0.500 at step 2'
          in text), text
  assert 'wall time 1m15s for 4 RL step(s)' in text
  assert f"metrics      {tmp_path / 'metrics.jsonl'}" in text
  assert 'checkpoints  /ck' in text and 'tensorboard  none' in text
  assert f"experiments/plot_curves.py --out {tmp_path / 'curves.png'} {tmp_path}" in text
  no_eval = summary.summary_lines([{'step': 1}], str(tmp_path), 1.0, 1, '/ck', '/tb')
  assert any('no evaluation was logged' in line for line in no_eval)


def test_progress_bar_keeps_the_latest_evaluation():
  assert loop.progress_postfix({'accuracy': 0.5}, {}) == {'acc': '0.50'}
  assert loop.progress_postfix({'accuracy': 0.5}, {'eval_accuracy': 0.25}) == {
      'acc': '0.50', 'eval': '0.25'}


class _Bar:
  """Stands in for tqdm and records what the loop shows (the bar is display, not logic)."""
  postfixes = []

  def __init__(self, *args, **kwargs):
    del args, kwargs

  def update(self, n):
    del n

  def set_postfix(self, post):
    self.postfixes.append(dict(post))

  def close(self):
    pass


@pytest.mark.slow
def test_run_ends_with_a_summary_and_the_bar_never_shows_nan(tmp_path, monkeypatch):
  """3 steps, evaluations at 0, 2 and 3: the bar shows step 0's evaluation at step 1 (not
  nan) and the summary quotes the metrics file's first, last and best pass@1."""
  monkeypatch.setattr(loop, 'tqdm', _Bar)
  _Bar.postfixes = []
  logs = []
  train(make_config(total_steps=3, eval_every=2, checkpoint_every=3), tmp_path,
        log=logs.append)
  rows = read_metrics(tmp_path)
  evals = {r['step']: r['eval_accuracy'] for r in rows if r.get('eval_accuracy') is not None}
  assert sorted(evals) == [0, 2, 3]
  assert [p['eval'] for p in _Bar.postfixes] == [f'{evals[s]:.2f}' for s in (0, 2, 3)]
  text = logs[-1]
  assert text.startswith(f'run summary ({tmp_path}): step 3'), logs
  best = max(evals.values())
  best_step = min(s for s, a in evals.items() if a == best)
  assert (f'{evals[0]:.3f} at step 0 -> {evals[3]:.3f} at step 3' in text
          and f'best {best:.3f} at step {best_step}' in text), text
  assert 'for 3 RL step(s)' in text
  for name in ('metrics.jsonl', 'tensorboard', 'checkpoints'):
    path = os.path.join(tmp_path, name)
    assert os.path.exists(path) and path in text, (name, text)
