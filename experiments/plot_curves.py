"""Curves of several runs from their metrics.jsonl, as one PNG (one panel per --key).

  python experiments/plot_curves.py --out docs/tiny_curves.png runs/tiny runs/tiny_adam
  python experiments/plot_curves.py --out docs/smollm2_curves.png --key=eval_accuracy \
      --key=accuracy --smooth=10 runs/smollm2_rg
"""
import argparse
import os

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from logra_jax.train.metrics import read_metrics

LABELS = {'eval_accuracy': 'held-out pass@1 (eval_accuracy)',
          'accuracy': 'train accuracy (accuracy)'}


def points(rows, key, smooth=1):
  """(steps, values) of ``key``; every step's values (not evaluations) as a trailing mean over
  ``smooth`` logged points."""
  rows = [r for r in rows if r.get(key) is not None]
  steps = [r['step'] for r in rows]
  values = np.asarray([r[key] for r in rows], np.float64)
  if smooth > 1 and len(values):
    c = np.cumsum(np.insert(values, 0, 0.0))
    n = np.minimum(np.arange(1, len(values) + 1), smooth)
    values = (c[1:] - c[np.arange(1, len(values) + 1) - n]) / n
  return steps, values


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('workdirs', nargs='+')
  parser.add_argument('--out', required=True)
  parser.add_argument('--key', action='append', default=None,
                      help='metric to plot, one panel each (default: eval_accuracy)')
  parser.add_argument('--smooth', type=int, default=1,
                      help='trailing mean over this many points of per-step keys (not eval_*)')
  args = parser.parse_args()
  keys = args.key or ['eval_accuracy']
  fig, axes = plt.subplots(1, len(keys), figsize=(6 * len(keys), 4), squeeze=False)
  for ax, key in zip(axes[0], keys):
    smooth = 1 if key.startswith('eval_') else args.smooth
    for wd in args.workdirs:
      steps, values = points(read_metrics(wd), key, smooth)
      ax.plot(steps, values, marker='o' if smooth == 1 else None,
              label=os.path.basename(os.path.normpath(wd)))
      print(f'{wd} {key}: ' + ' '.join(f'{s}:{v:.3f}' for s, v in zip(steps, values)))
    ax.set_xlabel('RL step')
    label = LABELS.get(key, key.replace('_', ' '))
    ax.set_ylabel(label + (f', mean of {smooth} steps' if smooth > 1 else ''))
    ax.grid(alpha=0.3)
    ax.legend()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)


if __name__ == '__main__':
  main()
