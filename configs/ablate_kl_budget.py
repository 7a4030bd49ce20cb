"""Predicted-KL budget ablation (the paper's Fig. 6): experiments/ablate_kl_budget.py.

  python experiments/ablate_kl_budget.py --config=configs/ablate_kl_budget.py:tiny \
      --workdir=runs/ablate_kl_budget

`get_config(arg)` is the base run every arm starts from; `ablation(arg)` the arms, each a set
of optim.* overrides of the base (optim.logra.kl_control, optim.logra.kl_budget_init / _final / _steps,
optim.logra.alpha_max: 1 makes the budget a ceiling, > 1 a target that also enlarges small steps).

Full (no arg; GPUs and weights): the paper's KL ablation on Qwen2.5-Math-1.5B with the SGD
sketch, 800 steps: no control, fixed 1.5e-3, fixed 1.5e-4, annealed 2e-4 -> 2e-5 (alpha_max 3,
the paper's), plus the ceiling rule at the fixed-small budget. The paper (docs/method.md §6,
Pass@1 at steps 700-800, 2 seeds): no control 70.30%, fixed 1.5e-3 63.43% (degrades), fixed
1.5e-4 71.03%, annealed 71.47%.

`:tiny` (this CPU, a few minutes): configs/tiny.py's task and warm start (the same start as
configs/ablate_rank.py:tiny). A step at alpha = 1 predicts ~0.04-0.1 KL there, so the budgets
are: large 1.0 (alpha hits alpha_max = 3), small 0.01 (alpha ~0.3), annealed 0.1 -> 0.01, and
the tiny default 0.1 as a target (alpha_max 3) and as a ceiling (alpha_max 1, configs/tiny.py).
What it should reach there: the realised KL per step following each budget (fixed small:
0.0105 against 0.01), the fixed large budget degrading pass@1 (0.246 -> 0.152 in 8 steps).
"""
import importlib.util
import os


def _sibling(name):
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'_configs_{name}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config(arg=None):
  if arg == 'tiny':
    cfg = _sibling('ablate_rank').tiny_base()
    cfg.total_steps = 8
    cfg.eval_every = 4
    return cfg
  if arg:
    raise ValueError(f"configs/ablate_kl_budget.py: unknown variant {arg!r} (use ':tiny' or none)")
  cfg = _sibling('qwen2_5_math_1_5b').get_config()
  cfg.optim.logra.sketch_optimizer = 'sgd'  # the paper's KL ablation used the SGD sketch
  cfg.total_steps = 800
  cfg.checkpoint_every = 100
  return cfg


def _fixed(budget, alpha_max):
  return {'optim.logra.kl_control': True, 'optim.logra.kl_budget_init': budget,
          'optim.logra.kl_budget_final': budget, 'optim.logra.alpha_max': alpha_max}


def _annealed(init, final, steps, alpha_max):
  return {'optim.logra.kl_control': True, 'optim.logra.kl_budget_init': init,
          'optim.logra.kl_budget_final': final, 'optim.logra.kl_budget_steps': steps,
          'optim.logra.alpha_max': alpha_max}


def ablation(arg=None):
  """arms: (name, overrides); target_vs_ceiling: the two arms of that comparison."""
  off = {'optim.logra.kl_control': False}
  if arg == 'tiny':
    steps = get_config('tiny').total_steps
    return dict(arms=(('no_control', off), ('fixed_large', _fixed(1.0, 3.0)),
                      ('fixed_small', _fixed(0.01, 3.0)),
                      ('annealed', _annealed(0.1, 0.01, steps, 3.0)),
                      ('target', _fixed(0.1, 3.0)), ('ceiling', _fixed(0.1, 1.0))),
                target_vs_ceiling=('target', 'ceiling'), small='fixed_small')
  return dict(arms=(('no_control', off), ('fixed_large', _fixed(1.5e-3, 3.0)),
                    ('fixed_small', _fixed(1.5e-4, 3.0)),
                    ('annealed', _annealed(2e-4, 2e-5, 300, 3.0)),
                    ('ceiling', _fixed(1.5e-4, 1.0))),
              target_vs_ceiling=('fixed_small', 'ceiling'), small='fixed_small')
