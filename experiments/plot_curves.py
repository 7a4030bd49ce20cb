"""Held-out accuracy curves of several runs from their metrics.jsonl, as one PNG.

  python experiments/plot_curves.py --out docs/tiny_curves.png runs/tiny runs/tiny_adam
"""
import argparse
import os

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

from logra_jax.train.metrics import read_metrics


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument('workdirs', nargs='+')
  parser.add_argument('--out', required=True)
  parser.add_argument('--key', default='eval_accuracy')
  args = parser.parse_args()
  fig, ax = plt.subplots(figsize=(6, 4))
  for wd in args.workdirs:
    rows = [r for r in read_metrics(wd) if r.get(args.key) is not None]
    ax.plot([r['step'] for r in rows], [r[args.key] for r in rows], marker='o',
            label=os.path.basename(os.path.normpath(wd)))
    print(f'{wd}: ' + ' '.join(f"{r['step']}:{r[args.key]:.3f}" for r in rows))
  ax.set_xlabel('RL step')
  ax.set_ylabel(args.key.replace('_', ' '))
  ax.grid(alpha=0.3)
  ax.legend()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)


if __name__ == '__main__':
  main()
