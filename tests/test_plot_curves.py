"""experiments/plot_curves.py: the trailing mean of per-step keys, and a PNG per call."""
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import plot_curves  # pylint: disable=g-import-not-at-top,wrong-import-position


def test_points_trailing_mean_and_missing_values():
  rows = [dict(step=s, accuracy=float(s)) for s in range(1, 6)] + [dict(step=6)]
  steps, values = plot_curves.points(rows, 'accuracy', smooth=3)
  assert steps == [1, 2, 3, 4, 5]
  np.testing.assert_allclose(values, [1, 1.5, 2, 3, 4])  # the first points: the mean so far
  assert list(plot_curves.points(rows, 'accuracy')[1]) == [1, 2, 3, 4, 5]


def test_two_panels_written(tmp_path):
  with open(tmp_path / 'metrics.jsonl', 'w') as f:
    for s in range(4):
      f.write(f'{{"step": {s}, "accuracy": {0.1 * s}, "eval_accuracy": {0.2 + 0.01 * s}}}\n')
  out = tmp_path / 'c.png'
  proc = subprocess.run([sys.executable, os.path.join(ROOT, 'experiments', 'plot_curves.py'),
                         '--out', str(out), '--key=eval_accuracy', '--key=accuracy',
                         '--smooth=2', str(tmp_path)], capture_output=True, text=True,
                        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert 'accuracy: 0:0.000 1:0.050 2:0.150 3:0.250' in proc.stdout, proc.stdout
