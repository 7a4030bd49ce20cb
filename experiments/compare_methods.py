r"""The parity study: named arms x seeds, each an ordinary, resumable train.py run (issue 23).

  python experiments/compare_methods.py --config=configs/compare_methods.py:tiny \
      --workdir=runs/compare_methods_tiny [--arms=A,B] [--seeds=0,1] [--max_runs=N] \
      [--jobs=N] [--prior=RESULTS_JSON] [--report_only]

The arms, seeds and held-out sets are the config's `ablation(TASK)`, fixed before any run.
Run (arm, seed) is `experiments/train.py --config=configs/compare_methods.py:TASK/ARM
--config.seed=SEED --workdir=WORKDIR/runs/ARM/seedSEED` in a subprocess; a run whose metrics
already hold the held-out evaluation of its last step is skipped, an unfinished one resumes
from its checkpoint, so a study grows across invocations (`--max_runs` bounds one). Runs go
seed by seed (every arm's seed 0, then every arm's seed 1, ...): a partial study is balanced.
`--arms=A,B` trains only those arms now, `--seeds=0,1` only those of the study's seeds (the
report still covers every finished run).
`--jobs=N` trains N runs at once, each its own process, in that order (a machine with more
cores than one run uses, or one GPU that several runs share: docs/gpu_study.md); a failed
run stops none of the others, and the invocation fails after all have ended.

A study can also grow across machines: `--prior=RESULTS_JSON` (an earlier invocation's
results.json of the same task, e.g. the copy in docs/runs/) counts its runs as finished
where this workdir holds none, but only for arms that ran what they run now: their whole
configs equal, where the prior records them (`resolved_configs`, written since session 17),
else their overrides (an arm whose definition changed is not imported; the log names it).
Imported runs keep their curves, wall time and command, and are marked `prior` in
results.json and results.md.

Writes WORKDIR/results.json, results.md and compare_methods.png (mean held-out pass@1 curves
with s.e. bands) from every finished run:
  per run:  the pass@1 curve, final (last step) and best (over steps > 0), wall time, command;
  per arm:  n seeds, mean and s.e. of final and best, the mean curve with its s.e., mean wall
            time, the paired difference of final pass@1 to the reference arm (the best-mean
            dense-AdamW learning rate, over the seeds both finished) with its s.e.; the
            optimizer state's and the gradient's bytes and the step's peak and temp memory
            from XLA's compiled memory analysis (`memory_plan.step_figures`, one device,
            memory_seq tokens per row);
  at each of the study's report_steps (if it names any): every arm's mean pass@1 and s.e.
            there and its paired difference to that step's best-mean AdamW lr (`at_steps`).
s.e. = sample standard deviation (ddof 1) / sqrt(n); None where n < 2.
"""
import concurrent.futures
import dataclasses
import json
import math
import os
import subprocess
import sys
import time

from absl import app, flags, logging
from ml_collections import config_flags

import ablation_io

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = 'compare_methods'


def define_flags():
  """The command line's flags (defined when run as a script, not when imported)."""
  config_flags.DEFINE_config_file('config', None, 'configs/compare_methods.py[:TASK]')
  flags.DEFINE_string('workdir', None, 'The study directory.')
  flags.DEFINE_integer('max_runs', 0, 'Train at most this many runs now (0: all).')
  flags.DEFINE_bool('report_only', False, 'Only aggregate the finished runs.')
  flags.DEFINE_list('arms', [], 'Train only these arms now (default: every arm).')
  flags.DEFINE_list('seeds', [], "Train only these of the study's seeds now (default: all).")
  flags.DEFINE_integer('jobs', 1, 'Runs trained at once, each its own process.')
  flags.DEFINE_string('prior', None, "An earlier results.json of the task: its runs count "
                      "as finished where the workdir has none (arms defined as now only).")
  flags.mark_flags_as_required(['config', 'workdir'])


# ------------------------------------------------------------------------------- statistics

def mean_se(values) -> tuple:
  """(mean, s.e. = sd (ddof 1) / sqrt(n)); s.e. None for n < 2, both None for n = 0."""
  v = [float(x) for x in values]
  if not v:
    return None, None
  m = sum(v) / len(v)
  if len(v) < 2:
    return m, None
  var = sum((x - m) ** 2 for x in v) / (len(v) - 1)
  return m, math.sqrt(var / len(v))


def run_summary(rows: list, total_steps: int) -> dict:
  """A run's held-out curve, final and best pass@1 from its metrics rows (None: unfinished)."""
  curve = sorted({int(r['step']): float(r['eval_accuracy']) for r in rows
                  if r.get('eval_accuracy') is not None}.items())
  if not curve or curve[-1][0] != total_steps:
    return None
  rl = [a for s, a in curve if s > 0]
  return {'curve': curve, 'final': curve[-1][1], 'best': max(rl) if rl else curve[-1][1],
          'start': curve[0][1] if curve[0][0] == 0 else None}


def arm_summary(runs: dict) -> dict:
  """{seed: run_summary} of one arm -> means and s.e.s, the mean curve over common steps."""
  seeds = sorted(runs)
  final = mean_se([runs[s]['final'] for s in seeds])
  best = mean_se([runs[s]['best'] for s in seeds])
  steps = sorted(set.intersection(*(set(dict(runs[s]['curve'])) for s in seeds))) if seeds else []
  curve = [(t, *mean_se([dict(runs[s]['curve'])[t] for s in seeds])) for t in steps]
  walls = [runs[s]['wall_s'] for s in seeds if runs[s].get('wall_s') is not None]
  return {'seeds': seeds, 'n': len(seeds), 'final_mean': final[0], 'final_se': final[1],
          'best_mean': best[0], 'best_se': best[1], 'curve': curve,
          'wall_s_mean': mean_se(walls)[0]}


def paired_difference(runs: dict, ref_runs: dict) -> dict:
  """Final pass@1 of the arm minus the reference's, seed by seed over the common seeds."""
  seeds = sorted(set(runs) & set(ref_runs))
  m, se = mean_se([runs[s]['final'] - ref_runs[s]['final'] for s in seeds])
  return {'seeds': seeds, 'mean': m, 'se': se}


BASE_ARM = 'logra'  # the task config's LoGRA: every other LoGRA arm is a lever on it


def aggregate(runs: dict, reference_arms) -> dict:
  """{arm: {seed: run}} -> {'arms': {arm: summary + paired}, 'reference': best adam arm}.

  Every arm gets ``vs_reference`` (final pass@1 minus the reference's, paired by seed); every
  LoGRA lever arm (``logra_*``) also ``vs_logra``, its effect over the base LoGRA arm."""
  arms = {a: arm_summary(r) for a, r in runs.items() if r}
  refs = [a for a in reference_arms if a in arms]
  reference = max(refs, key=lambda a: arms[a]['final_mean']) if refs else None
  for a, s in arms.items():
    if reference is not None:
      s['vs_reference'] = paired_difference(runs[a], runs[reference])
    if a.startswith(BASE_ARM + '_') and BASE_ARM in arms:
      s['vs_logra'] = paired_difference(runs[a], runs[BASE_ARM])
  return {'arms': arms, 'reference': reference}


def at_steps(runs: dict, reference_arms, steps) -> dict:
  """{str(step): {'reference', 'arms'}} at each of the study's ``report_steps`` (SmolLM2's
  goal is stated at steps 30 and 50, not only the last): every arm's mean pass@1 and s.e.
  over the seeds evaluated there; the reference, the dense-AdamW lr with the best mean at
  that step; each other arm's pass@1 minus the reference's there, paired by seed."""
  out = {}
  for t in steps:
    at = {a: {s: dict(map(tuple, r['curve'])).get(t) for s, r in rs.items()}
          for a, rs in runs.items()}
    at = {a: {s: v for s, v in by_seed.items() if v is not None} for a, by_seed in at.items()}
    arms = {}
    for a, by_seed in at.items():
      if by_seed:
        m, se = mean_se(by_seed.values())
        arms[a] = {'seeds': sorted(by_seed), 'n': len(by_seed), 'mean': m, 'se': se}
    refs = [a for a in reference_arms if a in arms]
    ref = max(refs, key=lambda a: arms[a]['mean']) if refs else None
    for a, s in arms.items():
      if ref is not None and a != ref:
        seeds = sorted(set(at[a]) & set(at[ref]))
        m, se = mean_se([at[a][k] - at[ref][k] for k in seeds])
        s['vs_reference'] = {'seeds': seeds, 'mean': m, 'se': se}
    out[str(t)] = {'reference': ref, 'arms': arms}
  return out


# ------------------------------------------------------------------------------------- runs

def config_arg(config_flag) -> tuple:
  """(path, task) of --config=PATH[:TASK]."""
  path, _, task = config_flag.config_filename.partition(':')
  return path, task or 'tiny'


def run_dir(workdir: str, arm: str, seed: int) -> str:
  return os.path.join(workdir, 'runs', arm, f'seed{seed}')


def command(path: str, task: str, arm: str, seed: int, workdir: str) -> list:
  """The run's train.py command; the arms of one seed share its warm start (the cache)."""
  return [sys.executable, os.path.join(ROOT, 'experiments', 'train.py'),
          f'--config={path}:{task}/{arm}', f'--config.seed={seed}',
          f'--workdir={run_dir(workdir, arm, seed)}',
          f"--config.warm_start.cache_dir={os.path.join(workdir, 'warm_start_cache')}"]


def _read_wall(directory: str) -> float:
  path = os.path.join(directory, 'compare_wall.json')
  return json.load(open(path))['wall_s'] if os.path.exists(path) else 0.0


def train_run(cmd: list, directory: str, xla_cache: str, log) -> None:
  """One train.py run (resuming its checkpoint); its wall time added to compare_wall.json."""
  os.makedirs(directory, exist_ok=True)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  env.setdefault('JAX_COMPILATION_CACHE_DIR', xla_cache)  # the arms compile the same steps
  log(' '.join(cmd))
  start = time.perf_counter()
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  wall = _read_wall(directory) + time.perf_counter() - start
  with open(os.path.join(directory, 'compare_wall.json'), 'w') as f:
    json.dump({'wall_s': wall}, f)
  with open(os.path.join(directory, 'train.log'), 'a') as f:
    f.write(out.stdout + out.stderr)
  if out.returncode:
    raise RuntimeError(f'train.py failed (exit {out.returncode}) in {directory}:\n'
                       f'{out.stderr[-3000:]}')


def finished_runs(workdir: str, study: dict, total_steps: dict, path: str, task: str) -> dict:
  """{arm: {seed: run_summary + wall_s + command}} of the runs that reached their last eval."""
  from logra_jax.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  out = {}
  for arm in study['arms']:
    out[arm] = {}
    for seed in study['seeds']:
      d = run_dir(workdir, arm, seed)
      rows = read_metrics(d) if os.path.exists(os.path.join(d, 'metrics.jsonl')) else []
      s = run_summary(rows, total_steps[arm])
      if s is not None:
        out[arm][seed] = dict(s, wall_s=_read_wall(d) or None,
                              command=' '.join(command(path, task, arm, seed, workdir)[1:])
                              .replace(ROOT + os.sep, '')  # relative to the repository
                              .replace(os.getcwd() + os.sep, ''))  # and to the invocation
  return out


def resolved_configs(cfgs: dict) -> dict:
  """{arm: its whole config as JSON values}: what an arm runs, base config included."""
  return {arm: json.loads(json.dumps(dataclasses.asdict(c), default=str))
          for arm, c in cfgs.items()}


def prior_runs(prior: dict, task: str, study: dict, resolved: dict | None = None,
               defaults: dict | None = None) -> tuple:
  """({arm: {seed: run}} of ``prior`` (a results.json) this study may count, [skipped arms]).

  Only arms that ran what this study's arm runs, and seeds of this study, are taken: where
  the prior records the arm's whole config (`resolved_configs`, since session 17) and
  ``resolved`` has it, the two must be equal (a changed base config counts, a re-spelt
  override does not); else its overrides must equal this study's (as JSON). Each run is
  marked ``prior: True``. A model file is compared by its name: its directory is the
  machine's (a virtual environment's site-packages), not the model. A key the prior's config
  lacks (added to the schema since) counts as its value in ``defaults``, where given."""
  from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  if prior.get('task') != task:
    raise ValueError(f'--prior: a results.json of task {prior.get("task")!r}, not {task!r}')
  canon = lambda o: json.dumps(o, sort_keys=True)
  then = {a: config_lib.machine_free(config_lib.with_defaults(c, defaults or {}))
          for a, c in prior.get('resolved_configs', {}).items()}
  now = {a: config_lib.machine_free(c) for a, c in (resolved or {}).items()}
  out, skipped = {}, []
  for arm, runs in prior.get('runs', {}).items():
    if arm not in study['arms']:
      continue
    same = (canon(then[arm]) == canon(now[arm]) if arm in then and arm in now else
            canon(prior['study']['arms'].get(arm)) == canon(study['arms'][arm]))
    if not same:
      skipped.append(arm)
      continue
    out[arm] = {int(s): dict(r, prior=True) for s, r in runs.items()
                if int(s) in study['seeds']}
  return out, skipped


def merge_runs(runs: dict, prior: dict) -> dict:
  """The workdir's finished runs, and the prior's where the workdir has none."""
  return {a: {**prior.get(a, {}), **rs} for a, rs in runs.items()}


def arms_to_train(study: dict, names) -> list:
  """The study's arms in its order, or only ``names`` (each must be one of them)."""
  unknown = [n for n in names if n not in study['arms']]
  if unknown:
    raise ValueError(f'--arms: unknown arm(s) {unknown} (arms: {list(study["arms"])})')
  return [a for a in study['arms'] if not names or a in names]


def seeds_to_train(study: dict, names) -> list:
  """The study's seeds in its order, or only ``names`` (each must be one of them)."""
  try:
    asked = [int(n) for n in names]
  except ValueError as e:
    raise ValueError(f'--seeds: integers, got {list(names)}') from e
  unknown = [n for n in asked if n not in study['seeds']]
  if unknown:
    raise ValueError(f'--seeds: not seeds of this study {unknown} (seeds: '
                     f'{list(study["seeds"])})')
  return [s for s in study['seeds'] if not asked or s in asked]


def pending_runs(study: dict, arms: list, is_done, max_runs: int = 0, seeds=None) -> list:
  """[(arm, seed)] still to train, seed by seed in the study's arm order, over ``seeds``
  (default: the study's), at most ``max_runs`` (0: all); ``is_done(arm, seed)`` says a run is
  finished (here or in a prior)."""
  seeds = study['seeds'] if seeds is None else seeds
  todo = [(arm, seed) for seed in seeds for arm in arms if not is_done(arm, seed)]
  return todo[:max_runs] if max_runs else todo


def train_runs(jobs: list, workers: int, train_one) -> None:
  """``train_one(arm, seed)`` for each of ``jobs``, ``workers`` at a time, in order; every
  run ends (a failure stops no other) before the failures, if any, are raised together."""
  if workers < 1:
    raise ValueError(f'--jobs must be >= 1, got {workers}')
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    futures = [(job, pool.submit(train_one, *job)) for job in jobs]
  failed = [(job, f.exception()) for job, f in futures if f.exception() is not None]
  if failed:
    raise RuntimeError(f'{len(failed)} of {len(jobs)} run(s) failed:\n' +
                       '\n'.join(f'{arm} seed {seed}: {e}' for (arm, seed), e in failed))


def memory_figures(cfgs: dict, seq) -> dict:
  """`memory_plan.step_figures` of each arm's config (one device, compiled, never run) on
  its step's batch of prompts x samples rows of ``seq`` tokens."""
  from logra_jax.analysis import memory_plan  # pylint: disable=g-import-not-at-top
  from logra_jax.train import tasks  # pylint: disable=g-import-not-at-top
  out, models = {}, {}
  for arm, cfg in cfgs.items():
    key = (cfg.model, cfg.data)
    if key not in models:  # the task's model (its vocabulary), loaded once per task
      task = None if cfg.model.path else tasks.build_task(cfg)
      models[key] = tasks.build_model(cfg, task)[0]
    rows = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
    out[arm] = memory_plan.step_figures(cfg, models[key], seq, rows)
  return out


# ----------------------------------------------------------------------------------- report

def markdown(results: dict) -> str:
  ref = results['reference']
  rows = []
  for arm, s in results['arms'].items():
    d = s.get('vs_reference') or {}
    m = results['memory'].get(arm, {})
    rows.append({
        'arm': arm, 'seeds': s['n'], 'final pass@1': _pm(s['final_mean'], s['final_se']),
        'best pass@1': _pm(s['best_mean'], s['best_se']),
        f'final − {ref}': _pm(d.get('mean'), d.get('se')) if ref and arm != ref else '',
        f'final − {BASE_ARM}': _pm(s['vs_logra']['mean'], s['vs_logra']['se'])
                               if 'vs_logra' in s else '',
        'opt state MiB': _mib(m.get('opt_state_bytes')), 'grad MiB': _mib(m.get('grad_bytes')),
        'step peak MiB': _mib(m.get('step_peak_bytes')),
        'wall min': f"{s['wall_s_mean'] / 60:.1f}" if s.get('wall_s_mean') else '',
        'runs from --prior': sum(1 for r in results['runs'][arm].values() if r.get('prior'))})
  cols = list(rows[0]) if rows else ['arm']
  return (f"# compare_methods: {results['task']}\n\nReference (best-mean dense-AdamW lr): "
          f"{ref}. ± is one s.e. over seeds (paired by seed for the difference).\n\n"
          + ablation_io.markdown_table(rows, cols) + '\n' + _at_steps_markdown(results))


def _at_steps_markdown(results: dict) -> str:
  """The table of `at_steps`: an arm a row, each step its pass@1 and its difference to that
  step's reference (named in the header)."""
  at = results.get('at_steps') or {}
  if not at:
    return ''
  rows = []
  for arm in results['arms']:
    row = {'arm': arm}
    for t, step in at.items():
      s = step['arms'].get(arm, {})
      d = s.get('vs_reference') or {}
      row[f'step {t}: pass@1'] = _pm(s.get('mean'), s.get('se'))
      row[f"step {t}: − {step['reference']}"] = _pm(d.get('mean'), d.get('se'))
    rows.append(row)
  return ('\nAt the study\'s report steps (the reference at each: the dense-AdamW lr with the '
          'best mean there; differences paired by seed):\n\n'
          + ablation_io.markdown_table(rows, list(rows[0])) + '\n')


def _pm(m, se) -> str:
  if m is None:
    return ''
  return f'{m:.3f}' + (f' ± {se:.3f}' if se is not None else '')


def _mib(b) -> str:
  return '' if b is None else f'{b / 2**20:.2f}'


def figure(results: dict):
  """Left: each arm's mean held-out curve with its s.e. band (AdamW arms dashed; 20 colours,
  so a dozen arms stay apart). Right: each arm's final pass@1 ± s.e., sorted, the reference
  arm's mean as a vertical line."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  fig, (ax, bars) = ablation_io.new_figure(2, width=6.5, height=4.5)
  tab20 = matplotlib.colormaps['tab20'].colors  # dark shades for the first ten, then light
  colour_of = lambda i: tab20[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]
  arms = list(results['arms'].items())
  for i, (arm, s) in enumerate(arms):
    steps = [c[0] for c in s['curve']]
    mean = [c[1] for c in s['curve']]
    se = [c[2] or 0.0 for c in s['curve']]
    style = '--' if arm.startswith('adam') else '-'
    colour = colour_of(i)
    ax.plot(steps, mean, style, color=colour, label=f"{arm} (n={s['n']})")
    ax.fill_between(steps, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)],
                    color=colour, alpha=0.08)
  ax.set_xlabel('RL step')
  ax.set_ylabel('held-out pass@1 (mean ± s.e. over seeds)')
  ax.set_title(f"compare_methods: {results['task']}")
  ax.legend(fontsize=7)
  final = sorted((s['final_mean'], s['final_se'] or 0.0, arm, i)
                 for i, (arm, s) in enumerate(arms) if s.get('final_mean') is not None)
  for y, (m, e, arm, i) in enumerate(final):
    bars.errorbar([m], [y], xerr=[e], fmt='o', color=colour_of(i), capsize=3)
  bars.set_yticks(range(len(final)), [f[2] for f in final], fontsize=7)
  ref = results.get('reference')
  if ref in results['arms'] and results['arms'][ref].get('final_mean') is not None:
    bars.axvline(results['arms'][ref]['final_mean'], color='grey', lw=0.8, ls=':')
  bars.set_xlabel(f'final pass@1 (mean ± s.e.; dotted: {ref})')
  fig.tight_layout()
  return fig


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  path, task = config_arg(flags.FLAGS['config'])
  study = ablation_io.settings(flags.FLAGS['config'])
  workdir = os.path.abspath(flags.FLAGS.workdir)
  max_runs, report_only = flags.FLAGS.max_runs, flags.FLAGS.report_only
  train_arms = arms_to_train(study, flags.FLAGS.arms)
  train_seeds = seeds_to_train(study, flags.FLAGS.seeds)
  from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  module = _load(path)
  cfgs = {arm: config_lib.from_config_dict(module.get_config(f'{task}/{arm}'))
          for arm in study['arms']}
  resolved = resolved_configs(cfgs)
  prior, skipped = ({}, [])
  if flags.FLAGS.prior:
    defaults = resolved_configs({'': config_lib.TrainConfig()})['']
    prior, skipped = prior_runs(json.load(open(flags.FLAGS.prior)), task, study, resolved,
                                defaults)
    if skipped:
      print(f'--prior: not imported (defined otherwise there): {skipped}')
  total = {arm: c.total_steps for arm, c in cfgs.items()}
  done = 0
  if not report_only:
    is_done = lambda arm, seed: bool(seed in prior.get(arm, {}) or finished_runs(
        workdir, {'arms': [arm], 'seeds': [seed]}, total, path, task)[arm])
    todo = pending_runs(study, train_arms, is_done, max_runs, train_seeds)
    train_runs(todo, flags.FLAGS.jobs, lambda arm, seed: train_run(
        command(path, task, arm, seed, workdir), run_dir(workdir, arm, seed),
        os.path.join(workdir, 'xla_cache'), print))
    done = len(todo)
  runs = merge_runs(finished_runs(workdir, study, total, path, task), prior)
  results = aggregate(runs, study['reference_arms'])
  results['at_steps'] = at_steps(runs, study['reference_arms'], study.get('report_steps', ()))
  results.update(task=task, study={k: v for k, v in study.items()},
                 runs={a: {str(s): r for s, r in rs.items()} for a, rs in runs.items()},
                 trained_now=done, resolved_configs=resolved)
  results['memory'] = memory_figures(cfgs, tuple(study['memory_seq']))
  paths = ablation_io.write_results(workdir, NAME, results, markdown(results), figure(results))
  print(open(paths['md']).read())
  print(json.dumps({'results': paths['json'], 'reference': results['reference'],
                    'arms': {a: {'n': s['n'], 'final_mean': s['final_mean'],
                                 'final_se': s['final_se']}
                             for a, s in results['arms'].items()}}))


def _load(path):
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location('_compare_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


if __name__ == '__main__':
  define_flags()
  app.run(main)
