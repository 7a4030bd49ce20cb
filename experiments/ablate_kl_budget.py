r"""Predicted-KL budget ablation (the paper's Fig. 6) with the library's trainer.

  python experiments/ablate_kl_budget.py --config=configs/ablate_kl_budget.py:tiny \
      --workdir=runs/ablate_kl_budget

Arms (the config's `ablation(arg)`): no KL control (alpha = 1), a fixed large and a fixed
small budget, an annealed budget, and the target (alpha_max > 1: every step is scaled to the
budget) against the ceiling rule (alpha_max = 1: only steps predicted above the budget
shrink). Each arm is the base config with its optim.* overrides, trained by `loop.train`
from one shared step-0 start (experiments/ablation_start.py) in WORKDIR/arms/NAME.

Per step, from each arm's metrics.jsonl: held-out pass@1 (every eval_every steps), mean
response length, the predicted KL alpha²q, the realised KL of the applied step on the probe
sequences, alpha and the effective budget. Writes WORKDIR/results.md, results.json and
ablate_kl_budget.png (pass@1, response length, realised KL and alpha against steps).
"""
import time

from absl import app, logging
import numpy as np

import ablation_io
import ablation_start

NAME = 'ablate_kl_budget'
_FLAGS = ablation_start.define_flags(NAME)

CURVES = ('response_length', 'realized_kl', 'predicted_kl', 'alpha', 'kl_budget', 'accuracy')


def _mean(values):
  values = [v for v in values if v is not None]
  return float(np.mean(values)) if values else None


def summarize(name: str, overrides: dict, cfg, res: ablation_io.RunResult) -> dict:
  """One arm: its settings, final pass@1, per-step curves and their means over the RL steps."""
  rl = [r for r in res.history if r['step'] > 0]
  o = cfg.optim.logra
  budget = f'{o.kl_budget_init:g}' + (f'->{o.kl_budget_final:g}'
                                      if o.kl_budget_final != o.kl_budget_init else '')
  return dict(
      name=name, overrides=overrides, kl_control=o.kl_control,
      budget=budget if o.kl_control else 'off (alpha = 1)',
      alpha_max=o.alpha_max if o.kl_control else None, pass_at_1=res.final.get('eval_accuracy'),
      pass_at_k=res.final.get('eval_pass_at_k'), final_step=res.final.get('step'),
      eval_curve=[(r['step'], r['eval_accuracy']) for r in res.history
                  if r.get('eval_accuracy') is not None],
      curves={k: [r.get(k) for r in rl] for k in CURVES}, steps=[r['step'] for r in rl],
      **{f'{k}_mean': _mean([r.get(k) for r in rl]) for k in CURVES}, wall_s=res.wall_s)


def run_arms(base, s: dict, workdir: str, start_dir: str, log) -> list:
  rows = []
  for name, overrides in s['arms']:
    overrides = dict(overrides)
    res = ablation_start.run_arm(base, name, overrides, workdir, start_dir, log)
    rows.append(summarize(name, overrides, ablation_io.train_config(base, overrides), res))
  return rows


def markdown(rows: list, s: dict, meta: dict) -> str:
  cols = ['name', 'kl_control', 'budget', 'alpha_max', 'pass_at_1', 'response_length_mean',
          'realized_kl_mean', 'predicted_kl_mean', 'alpha_mean']
  steps = [st for st, _ in rows[0]['eval_curve']]
  curve = [dict(name=r['name'], **{f'step {st}': a for st, a in r['eval_curve']}) for r in rows]
  t, c = (next(r for r in rows if r['name'] == n) for n in s['target_vs_ceiling'])
  return '\n'.join([
      f'# {NAME}: predicted-KL budget (Fig. 6)', '',
      f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}; {meta['wall_s']:.0f} s.",
      '', f"## Arms after {rows[0]['final_step']} RL steps (means over the RL steps)", '',
      ablation_io.markdown_table(rows, cols), '',
      '## Held-out pass@1 against steps (Fig. 6, left)', '',
      ablation_io.markdown_table(curve, ['name'] + [f'step {st}' for st in steps]), '',
      f"## Target vs ceiling at budget {t['budget']}", '',
      f"target ({t['name']}, alpha_max {t['alpha_max']:g}): pass@1 {t['pass_at_1']:.4g}, mean "
      f"alpha {t['alpha_mean']:.3g}; ceiling ({c['name']}, alpha_max {c['alpha_max']:g}): "
      f"pass@1 {c['pass_at_1']:.4g}, mean alpha {c['alpha_mean']:.3g}."])


def figure(rows: list):
  fig, axes = ablation_io.new_figure(4, width=4.2, height=3.6)
  for r in rows:
    line, = axes[0].plot(*zip(*r['eval_curve']), 'o-', label=r['name'])
    nan = lambda k: [np.nan if v is None else v for v in r['curves'][k]]
    axes[1].plot(r['steps'], nan('response_length'), color=line.get_color())
    axes[2].plot(r['steps'], nan('realized_kl'), color=line.get_color())
    if r['kl_control']:
      axes[2].plot(r['steps'], nan('kl_budget'), ':', color=line.get_color(), alpha=0.7)
    axes[3].plot(r['steps'], nan('alpha'), color=line.get_color())
  axes[0].set(xlabel='step', ylabel='held-out pass@1', title='(a) pass@1')
  axes[0].legend(fontsize=7)
  axes[1].set(xlabel='step', ylabel='mean response tokens', title='(b) response length')
  axes[2].set(xlabel='step', ylabel='KL per step', yscale='log',
              title='(c) realised KL (dotted: budget)')
  axes[3].set(xlabel='step', ylabel='alpha', title='(d) step scale alpha')
  return fig


def main(argv):
  del argv
  with ablation_start.started(NAME, _FLAGS) as ab:
    rows = run_arms(ab.base, ab.settings, ab.workdir, ab.start_dir, logging.warning)
  s = ab.settings
  meta = dict(command=ab.command, machine=ablation_start.machine(),
              wall_s=time.perf_counter() - ab.started)
  results = dict(name=NAME, meta=meta, settings=s, arms=rows)
  paths = ablation_io.write_results(ab.workdir, NAME, results, markdown(rows, s, meta),
                                    figure(rows))
  print(open(paths['md']).read())


if __name__ == '__main__':
  app.run(main)
