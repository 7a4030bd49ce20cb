"""Does LoGRA learn as much per step as dense AdamW? The parity study's arms, seeds and
held-out sets, fixed here before any run (issue 23).

  python experiments/compare_methods.py --config=configs/compare_methods.py:tiny \
      --workdir=runs/compare_methods_tiny
  python experiments/compare_methods.py --config=configs/compare_methods.py:tiny_confirm \
      --workdir=runs/compare_methods_tiny_confirm
  python experiments/compare_methods.py --config=configs/compare_methods.py:smollm2 \
      --workdir=runs/compare_methods_smollm2
  python experiments/compare_methods.py --config=configs/compare_methods.py:smollm2_confirm \
      --workdir=runs/compare_methods_smollm2_confirm

Every run of the study is an ordinary `experiments/train.py` run of this file's
`get_config('TASK/ARM')` with `--config.seed=S` (so one run alone, resumed or re-run, is one
train.py command; results.json records it). The tasks:

  tiny     configs/tiny.py: 1,500 RL steps after its 300-step warm start, 256 held-out
           problems (pass@1 from eval.k = 4 samples at temperature 1), seeds 0, 1, 2.
  tiny_confirm  the same task on fresh seeds 3, 4, 5: the best LoGRA lever of `tiny`
           against the best AdamW lr there, a confirmation of a pick made on seeds 0-2.
  smollm2  configs/smollm2_rg.py: 50 steps, 256 held-out problems, greedy (eval.k = 1,
           temperature 0), evaluated every 10 steps, seeds 0, 1.
  smollm2_confirm  the same task on fresh seeds 2, 3 (and, since session 25, 4, 5): the
           smollm2 study's pick (the adaptive subspace refreshed every 10 steps,
           smollm2_rg.py's default since session 22) against the best AdamW lr there, a
           confirmation of a pick made on seeds 0-1.
  smoke    the tiny task cut to seconds (a 200-step warm start, 4 x 4 rollouts, 3 steps, 8
           held-out problems): the suite's check of the study's bookkeeping, not a result.

The arms: `logra` (the paper's LoGRA: A redrawn every step, no momentum; on tiny pinned to
the settings tiny.py had before session 14 made `logra_m0.95_T100` its default), dense AdamW
at three learning rates around the task config's (the sweep: the best of them is the
reference every arm is compared
with, paired by seed), and `adam_sketched`: AdamW on the kernels LoGRA sketches only
(optim.adam.trainable='sketched', the middle learning rate), which separates "fewer trained
parameters" from "sketch noise". Tiny also has the levers' arms: `logra_m0.9_T10` and
`logra_m0.9_T100`, LoGRA with A held for 10 / 100 steps and sketch-space momentum 0.9 carried
across its redraws (optim.logra.refresh_every, optim.logra.momentum; sketch/momentum.py),
`logra_m0.9_fixed` (A never redrawn, momentum 0.9; added after the first two had run), the
diagnostic `logra_exact` (rank = d_in, orthogonal rows: the exact gradient through
RowAdam and the budget, no sketch noise), and (session 14) `logra_m0.9_T100` at learning rates
2e-4 and 8e-4 and `logra_m0.95_T100`; (session 15) `logra_m0.95_T100_rest`, the default
with the unsketched leaves trained by Adam (optim.logra.rest_learning_rate); (session 16)
`logra_m0.95_T100_rest_adam` and `_adafactor`, the default with Adam's per-entry scaling in
sketch space or its row x column factorisation (optim.logra.sketch_optimizer), and
`logra_m0.95_T100_rest_adaptive`, the default with an adaptive subspace (optim.logra.subspace),
on seeds 0-2 and, in tiny_confirm, 3-5; (session 21) `logra_m0.95_T100_rest_exact`, the
default on the exact gradient (rank = d_in, orthogonal rows), a diagnostic; (session 22)
`logra_m0.95_T10_rest_adaptive`, SmolLM2's pick (below) on tiny. SmolLM2
(session 18): `logra_m0.95_T10_rest_adaptive`, the adaptive subspace at SmolLM2's small r/K
with A rebuilt every 10 steps (T100 never redraws A in a 50-step run), and
`logra_m0.95_T10_rest`, the same with a random A, its control; (session 19)
`logra_m0.95_T100_rest_kl2e-3`, the budget held at 2e-3; (session 23)
`logra_m0.95_T10_rest_adaptive_kl2e-3to5e-4`, the default with twice its budget early,
annealed to its level at step 50, and `logra_m0.95_T10_rest_adaptive_kl1.5e-3to1.5e-4`, the
default's total KL front-loaded; (session 24) `logra_m0.95_T5_rest_adaptive`, the default's
adaptive subspace rebuilt every 5 steps instead of 10, and `logra_m0.9_T10_rest_adaptive`, the
default with sketch-space momentum 0.9 instead of 0.95; (session 31)
`logra_m0.95_T10_rest_adaptive_restown`, the rest's Adam step at its own learning rate
(optim.logra.rest_step='own'); (session 32) `logra_m0.95_T10_rest_adaptive_ceil_lr{3e-06,
1e-05,3e-05}`, tiny's step rule on the default: an Adam-scale RowAdam step at a learning rate
(AdamW's three), the budget a ceiling (alpha_max 1) instead of a target.

Should reach (the issue's goals, held out): tiny: LoGRA's mean final pass@1 at least the best
dense-AdamW lr's (paired difference >= 0, with its s.e.); SmolLM2: LoGRA at least the best
dense-AdamW lr at steps 30 and 50 with optimizer state + gradient <= 0.25x AdamW's. What the
runs so far measured is in docs/parity.md and the README. One arm alone, e.g.:
  python experiments/train.py --config=configs/compare_methods.py:tiny/adam_sketched \
      --config.seed=0 --workdir=runs/one_arm
Variants (tasks): configs/compare_methods.py:tiny, configs/compare_methods.py:tiny_confirm,
configs/compare_methods.py:smollm2, configs/compare_methods.py:smollm2_confirm,
configs/compare_methods.py:smoke.
"""
import importlib.util
import os

from logra_jax.train.config import apply_overrides

_DIR = os.path.dirname(os.path.abspath(__file__))
TASKS = ('tiny', 'tiny_confirm', 'smollm2', 'smollm2_confirm', 'smoke')


def _sibling(name):
  """A config file next to this one, loaded by path (configs/ is no package)."""
  spec = importlib.util.spec_from_file_location(f'_{name}_config', os.path.join(_DIR, f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _adam(lr: float, trainable: str = 'all') -> dict:
  return {'optim.name': 'adam', 'optim.adam.learning_rate': lr, 'optim.adam.trainable': trainable}


def ablation(arg=None) -> dict:
  """The study: {arms: {name: overrides}, seeds, reference_arms, memory_seq (prompt,
  completion) tokens of the step whose memory XLA analyses}."""
  task = _task(arg)
  smollm2 = task in ('smollm2', 'smollm2_confirm')
  if smollm2:  # smollm2_rg.py:adam's lr is 1e-5 (it moved the policy ~LoGRA's KL)
    lrs, seeds, seq = (3e-6, 1e-5, 3e-5), (0, 1), (128, 48)
  else:                  # tiny.py:adam's lr is 2e-4 (the best of 1e-4 / 2e-4 / 4e-4 once)
    lrs, seeds, seq = (1e-4, 2e-4, 4e-4), (0, 1, 2), (16, 4)
  # `logra` is the paper's LoGRA (A redrawn every step, no momentum), pinned: tiny.py's default
  # became logra_m0.95_T100 after this study (session 14), and every arm below keeps the
  # settings it ran with.
  base = dict(_sibling('tiny').PAPER_LOGRA) if not smollm2 else {}
  arms = {'logra': base}
  arms.update({f'adam_lr{lr:g}': _adam(lr) for lr in lrs})
  arms['adam_sketched'] = _adam(lrs[1], 'sketched')
  if task in ('tiny', 'tiny_confirm'):  # the levers (issue 23, item 4), fixed before their runs
    # Every lever arm before session 15's ran with the rest frozen (tiny.py's default then).
    frozen = _sibling('tiny').FROZEN_REST
    for every in (10, 100):  # A held `every` steps, momentum carried across redraws
      arms[f'logra_m0.9_T{every}'] = {'optim.logra.momentum': 0.9,
                                      'optim.logra.refresh_every': every, **frozen}
    # The limit of holding A (never redrawn), fixed after T10/T100 ran, before its own runs.
    arms['logra_m0.9_fixed'] = {'optim.logra.momentum': 0.9, 'optim.logra.refresh': False,
                                **frozen}
    # A diagnostic, not a candidate: rank = d_in with orthogonal rows makes AᵀA = I, so the
    # sketch is the exact gradient; what is left of the gap is RowAdam + the budget.
    arms['logra_exact'] = dict(base, **{'optim.logra.projection': 'orthogonal',
                                        'optim.logra.rank': 128,
                                        'optim.logra.rank_rules': 'down_proj=256'})
    # Session 14, fixed before their runs: momentum made the steps ~15x smaller in KL
    # (realised 0.004-0.006 a step against 0.03-0.07 without it; the ceiling never binds), so
    # the learning rate tuned without momentum (4e-4) is swept again around it, as AdamW's is;
    # and a longer memory (beta 0.95) at the same lr.
    for lr in (2e-4, 8e-4):
      arms[f'logra_m0.9_T100_lr{lr:g}'] = {'optim.logra.momentum': 0.9,
                                           'optim.logra.refresh_every': 100,
                                           'optim.logra.learning_rate': lr, **frozen}
    arms['logra_m0.95_T100'] = {'optim.logra.momentum': 0.95, 'optim.logra.refresh_every': 100,
                                **frozen}
    # Session 14, after the three above, before its own runs: their two levers together.
    arms['logra_m0.95_T100_lr0.0008'] = dict(arms['logra_m0.95_T100'],
                                             **{'optim.logra.learning_rate': 8e-4})
    # Session 15, before its runs: AdamW on LoGRA's kernels only lost 0.021 +- 0.019 to dense
    # AdamW, and logra_m0.95_T100 is above that arm: what is left may be the frozen rest. So
    # the default with the unsketched leaves (embeddings, head, norm scales; 1% of tiny's
    # params) trained by Adam at the best dense AdamW's lr, 2e-4.
    arms['logra_m0.95_T100_rest'] = dict(arms['logra_m0.95_T100'],
                                         **{'optim.logra.rest_learning_rate': 2e-4})
    # (tiny.py's default since, with these settings)
    # Session 16, before its runs, on seeds 0-2 here and 3-5 in tiny_confirm: Adam's
    # per-coordinate scaling in sketch space (one second moment per entry of S, GaLore's rule
    # in A's held subspace; RowAdam keeps one per output unit), the default otherwise.
    # And its Adafactor factorisation (a scale per rank direction x one per output unit).
    for name in ('adam', 'adafactor'):
      arms[f'logra_m0.95_T100_rest_{name}'] = dict(arms['logra_m0.95_T100_rest'],
                                                   **{'optim.logra.sketch_optimizer': name})
    # Session 16, after those two were fixed (before any of their results), before its own
    # runs: an adaptive subspace (docs/method.md section 13): at each refresh A is rebuilt from
    # the co-sketch G m^T of the refresh step, 8 of its 64 rows kept random.
    arms['logra_m0.95_T100_rest_adaptive'] = dict(
        arms['logra_m0.95_T100_rest'], **{'optim.logra.subspace': 'adaptive',
                                          'optim.logra.subspace_random_rows': 8})
    # Session 21, before its runs, on seeds 0-2 here and 3-5 in tiny_confirm: a diagnostic,
    # not a candidate. The default on the exact gradient (rank = d_in, orthogonal rows, so
    # A^T A = I with A held 100 steps): what is left of its gap to AdamW is then RowAdam's
    # (one scale per output unit) and the budget's, not the rank-64 subspace's. logra_exact
    # made that split without momentum or the rest.
    arms['logra_m0.95_T100_rest_exact'] = dict(
        arms['logra_m0.95_T100_rest'], **{'optim.logra.projection': 'orthogonal',
                                          'optim.logra.rank': 128,
                                          'optim.logra.rank_rules': 'down_proj=256'})
    # Session 22, before its runs, on seeds 0-2 here and 3-5 in tiny_confirm: SmolLM2's pick
    # (smollm2_rg.py's default since session 22: A rebuilt from G m^T every 10 steps, not 100)
    # on tiny, 8 of 64 rows random as in _adaptive. Does one rule serve both tasks? (The exact
    # arm put what is left of tiny's gap in the rank-64 subspace.)
    arms['logra_m0.95_T10_rest_adaptive'] = dict(arms['logra_m0.95_T100_rest_adaptive'],
                                                 **{'optim.logra.refresh_every': 10})
  if smollm2:  # tiny's best lever (tiny.py's default since session 14), before any run
    arms['logra_m0.95_T100'] = {'optim.logra.momentum': 0.95, 'optim.logra.refresh_every': 100}
    # Session 15, before its runs: with the unsketched leaves (the tied embedding, norm scales)
    # trained by Adam at the config's dense lr, 1e-5 (tiny.py's default since): optimizer
    # state + gradient ~0.24x AdamW's, under the 0.25x.
    arms['logra_m0.95_T100_rest'] = dict(arms['logra_m0.95_T100'],
                                         **{'optim.logra.rest_learning_rate': 1e-5})
    # Session 18, before any of their runs: the adaptive subspace where r/K is small (32 of
    # 576; tiny's 64 of 128 gained nothing), A rebuilt from G m^T every 10 steps with 4 of its
    # 32 rows random (tiny's 1/8); T100 holds A for the whole 50-step run, so T10 with a
    # random A is its control.
    t10 = dict(arms['logra_m0.95_T100_rest'], **{'optim.logra.refresh_every': 10})
    arms['logra_m0.95_T10_rest_adaptive'] = dict(t10, **{'optim.logra.subspace': 'adaptive',
                                                        'optim.logra.subspace_random_rows': 4})
    arms['logra_m0.95_T10_rest'] = t10
    # Session 19, before any of its runs: the budget's level and schedule. On SmolLM2 the
    # budget sets every LoGRA step (alpha 0.01-0.04 against alpha_max 3), annealed 1e-3 ->
    # ~5.6e-4 by step 50, while adam_lr1e-05's realised KL per step (its telemetry steps,
    # seeds 0-1) was 1.7e-4 to 2.4e-3, mean 1.0e-3. The default's rule held constant at
    # 2e-3, the top of that range: is LoGRA held back by its budget?
    arms['logra_m0.95_T100_rest_kl2e-3'] = dict(
        arms['logra_m0.95_T100_rest'], **{'optim.logra.kl_budget_init': 2e-3,
                                          'optim.logra.kl_budget_final': 2e-3})
    # Session 23, before its runs, on seeds 0-1: the budget's schedule on the default. Over
    # four seeds the default is level with AdamW at step 50 and below it at 20 (-0.045) and 30
    # (-0.020); the constant 2e-3 arm climbed faster to step 20, then fell back on seed 0. So
    # twice the default's budget early, annealed to the default's level at step 50: cosine
    # 2e-3 -> 5e-4 over the run's 50 steps (the default: 1e-3 -> 5.5e-4 by step 50).
    arms['logra_m0.95_T10_rest_adaptive_kl2e-3to5e-4'] = dict(
        arms['logra_m0.95_T10_rest_adaptive'], **{'optim.logra.kl_budget_init': 2e-3,
                                                  'optim.logra.kl_budget_final': 5e-4,
                                                  'optim.logra.kl_budget_steps': 50})
    # Session 23, after that arm's results, before its own runs, on seeds 0-1: it led the
    # default at steps 10-30 and fell at 50, having spent 0.063 of predicted KL against the
    # default's 0.042. The same total as the default, front-loaded: cosine 1.5e-3 -> 1.5e-4
    # over the 50 steps (0.0419 in all; 0.035 by step 30 against the default's 0.028).
    arms['logra_m0.95_T10_rest_adaptive_kl1.5e-3to1.5e-4'] = dict(
        arms['logra_m0.95_T10_rest_adaptive'], **{'optim.logra.kl_budget_init': 1.5e-3,
                                                  'optim.logra.kl_budget_final': 1.5e-4,
                                                  'optim.logra.kl_budget_steps': 50})
    # Session 24, before its runs and before the arm above had reported past step 10, on
    # seeds 0-1: the default climbs slower than AdamW early (-0.045 at step 20 over seeds
    # 0-3), and its A stays random until the first rebuild at step 10. The adaptive subspace
    # rebuilt every 5 steps instead of 10: does a subspace that tracks G m^T sooner climb
    # sooner? (Tiny: rebuilding every 10 steps rather than 100 gained +0.013 +- 0.007.)
    arms['logra_m0.95_T5_rest_adaptive'] = dict(arms['logra_m0.95_T10_rest_adaptive'],
                                                **{'optim.logra.refresh_every': 5})
    # Session 24, after the two arms above had reported, before its own runs, on seeds 0-1:
    # the default's sketch-space momentum 0.95 averages ~20 steps, 40% of a 50-step run, and
    # its value was never varied on SmolLM2. Momentum 0.9 (~10 steps) on the default: does a
    # shorter moment follow the policy sooner?
    arms['logra_m0.9_T10_rest_adaptive'] = dict(arms['logra_m0.95_T10_rest_adaptive'],
                                                **{'optim.logra.momentum': 0.9})
    # Session 31, before any of its runs: with rest_learning_rate the rest's Adam step is
    # scaled by the step's alpha (0.005-0.075 on SmolLM2), so the tied embedding moved at
    # ~1e-7 where AdamW's moves at 1e-5 (its KL share in LoGRA's step was 5e-8, measured from
    # seed 5's step-25 checkpoint). The default with the rest at its own learning rate
    # (optim.logra.rest_step='own'; alpha from the kernels alone).
    arms['logra_m0.95_T10_rest_adaptive_restown'] = dict(
        arms['logra_m0.95_T10_rest_adaptive'], **{'optim.logra.rest_step': 'own'})
    # Session 32, before any of their runs: tiny's step rule, never run here. Every SmolLM2
    # arm so far normalises RowAdam's step to a fixed relative size (update_ratio 1e-3) and
    # then sets alpha so that each step spends the whole KL budget (a target): the step's
    # size says nothing of how far the batches agree. On tiny that rule ended 15 points below
    # dense Adam, and the budget as a ceiling over an Adam-scale step (preserve_norm off, a
    # learning rate, alpha_max 1) closed it (README). Here the same: RowAdam's entries ~1 as
    # Adam's (A's rows of norm sqrt(K/R), so A^T U has entries ~1 too), a learning rate, and
    # the default's budget (1e-3 -> 1e-4) as a ceiling; the lr swept over AdamW's three.
    for lr in lrs:
      arms[f'logra_m0.95_T10_rest_adaptive_ceil_lr{lr:g}'] = dict(
          arms['logra_m0.95_T10_rest_adaptive'], **{
              'optim.logra.preserve_norm': False, 'optim.logra.update_ratio': 0.0,
              'optim.logra.learning_rate': lr, 'optim.logra.alpha_max': 1.0})
    arms['adam_sketched'] = arms.pop('adam_sketched')  # last: a seed's runs reach the goal's
                                                       # arms first (~40 min a run on the CPU)
  if task == 'smoke':
    arms = {'logra': base, f'adam_lr{lrs[1]:g}': _adam(lrs[1])}
    seeds = (0, 1)
  if task == 'tiny_confirm':
    # Session 15, fixed before its runs: logra_m0.95_T100_rest was the best of the tiny
    # study's 8 LoGRA lever arms on seeds 0-2 (an optimistic pick, as is the reference: the
    # best of 3 AdamW lrs there). Confirmed, or not, on 3 fresh seeds against that AdamW lr.
    arms = {'logra_m0.95_T100_rest': arms['logra_m0.95_T100_rest'],
            f'adam_lr{lrs[1]:g}': arms[f'adam_lr{lrs[1]:g}'],
            **{a: arms[a] for a in ('logra_m0.95_T100_rest_adam',      # session 16
                                    'logra_m0.95_T100_rest_adafactor',
                                    'logra_m0.95_T100_rest_adaptive',
                                    'logra_m0.95_T100_rest_exact',    # session 21
                                    'logra_m0.95_T10_rest_adaptive')}}  # session 22
    seeds = (3, 4, 5)
  if task == 'smollm2_confirm':
    # Session 22, fixed before its runs: logra_m0.95_T10_rest_adaptive had the best step-50
    # mean of the smollm2 study's 4 LoGRA arms on seeds 0-1 (a rule written before their
    # results; smollm2_rg.py's default since), and adam_lr1e-05 was the best AdamW lr at both
    # report steps. Both optimistic picks, confirmed or not on fresh seeds 2 and 3.
    # Session 25, fixed before their runs: seeds 4 and 5 added, so that the default's frontier
    # against that lr rests on six seeds (0-1 of smollm2, 2-5 here); no arm added.
    # Session 31, before its runs: the rest at its own learning rate (the smollm2 arm of that
    # session), on these seeds as well. Session 32, before their runs: the ceiling arms, so
    # that they can be screened here (seed 5) and confirmed on these seeds.
    arms = {a: arms[a] for a in ('logra_m0.95_T10_rest_adaptive', f'adam_lr{lrs[1]:g}',
                                 'logra_m0.95_T10_rest_adaptive_restown',
                                 *(f'logra_m0.95_T10_rest_adaptive_ceil_lr{lr:g}'
                                   for lr in lrs))}
    seeds = (2, 3, 4, 5)
  # Issue 23 states the SmolLM2 goal at steps 30 and 50; tiny's at the last step (final).
  report_steps = {'smollm2': (30, 50), 'smollm2_confirm': (30, 50),
                  'smoke': (2,)}.get(task, ())
  return {'arms': arms, 'seeds': seeds,
          'reference_arms': [a for a in arms if a.startswith('adam_lr')],
          'memory_seq': seq, 'report_steps': report_steps}


def _task(arg):
  task = (arg or 'tiny').partition('/')[0]
  if task not in TASKS:
    raise ValueError(f'configs/compare_methods.py: unknown variant (task) {task!r} (use one of '
                     f"{TASKS}, optionally '/ARM')")
  return task


def _base(task):
  if task in ('smollm2', 'smollm2_confirm'):
    # The paper's rule, smollm2_rg.py's default when the arms were fixed: every arm keeps the
    # settings it ran with now that the default is the study's pick (session 22).
    cfg = _sibling('smollm2_rg').get_config('paper')
    cfg.data.eval_size = 256
    cfg.eval.k, cfg.eval.temperature = 1, 0.0  # greedy
    cfg.total_steps, cfg.eval_every, cfg.checkpoint_every = 50, 10, 10
    return cfg
  cfg = _sibling('tiny').get_config()
  if task == 'smoke':
    cfg.warm_start.steps = 200  # held-out pass@1 off 0, so the bookkeeping has numbers
    cfg.data.prompts_per_step, cfg.data.samples_per_prompt = 4, 4
    cfg.data.eval_size, cfg.eval.k = 8, 2
    cfg.optim.kl_sequences = 4
    cfg.total_steps, cfg.eval_every, cfg.checkpoint_every = 3, 1, 3
  return cfg


def get_config(arg=None):
  """`arg` = 'TASK' (the task's LoGRA arm) or 'TASK/ARM' (one arm of `ablation(TASK)`)."""
  task, _, arm = (arg or 'tiny').partition('/')
  _task(task)
  cfg = _base(task)
  arms = ablation(task)['arms']
  if arm and arm not in arms:
    raise ValueError(f'configs/compare_methods.py: unknown arm {arm!r} of task {task!r} '
                     f'(arms: {list(arms)})')
  apply_overrides(cfg, arms[arm or next(iter(arms))])  # default: the task's first (LoGRA) arm
  return cfg
