"""The end-of-run summary: what a user reads last, and can act on.

Held-out pass@1 at the first and last evaluation, the best evaluation's step, the wall time of
this invocation, and where the metrics, TensorBoard logs and checkpoints are, with the command
that plots the curves (experiments/plot_curves.py).
"""
import os
import shlex
from typing import Optional, Sequence

EVAL_KEY = 'eval_accuracy'


def eval_points(rows: Sequence[dict]) -> list:
  """(step, pass@1) of every metrics row that holds a held-out evaluation, by step."""
  points = [(int(r['step']), float(r[EVAL_KEY])) for r in rows if r.get(EVAL_KEY) is not None]
  return sorted(points)


def _duration(seconds: float) -> str:
  minutes, s = divmod(int(round(seconds)), 60)
  h, m = divmod(minutes, 60)
  return f'{h}h{m:02d}m{s:02d}s' if h else (f'{m}m{s:02d}s' if m else f'{s}s')


def _eval_line(points: list) -> str:
  if not points:
    return 'held-out pass@1: no evaluation was logged'
  (s0, a0), (s1, a1) = points[0], points[-1]
  best_step, best = max(points, key=lambda p: (p[1], -p[0]))  # the earliest of equal bests
  return (f'held-out pass@1: {a0:.3f} at step {s0} -> {a1:.3f} at step {s1} '
          f'({a1 - a0:+.3f}); best {best:.3f} at step {best_step}')


def summary_lines(rows: Sequence[dict], workdir: str, wall_s: float, steps_run: int,
                  checkpoint_dir: str, tensorboard_dir: Optional[str]) -> list:
  """The summary as lines of text (a pure function of the run's rows and paths)."""
  workdir = os.path.abspath(workdir)
  curves = os.path.join(workdir, 'curves.png')
  tb = tensorboard_dir or 'none (tensorboardX is not installed)'
  last = max((int(r['step']) for r in rows), default=0)
  return [
      f'run summary ({workdir}): step {last}',
      '  ' + _eval_line(eval_points(rows)),
      f'  wall time {_duration(wall_s)} for {steps_run} RL step(s) in this invocation',
      f"  metrics      {os.path.join(workdir, 'metrics.jsonl')}",
      f'  tensorboard  {tb}',
      f'  checkpoints  {checkpoint_dir}',
      '  plot curves  python experiments/plot_curves.py '
      f'--out {shlex.quote(curves)} {shlex.quote(workdir)}',
  ]
