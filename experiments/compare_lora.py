r"""LoGRA vs LoRA vs dense AdamW at the same rank: step memory, step time, pass@1 (Table 2).

  python experiments/compare_lora.py --config=configs/compare_lora.py:tiny \
      --workdir=runs/compare_lora_tiny

The arms are `ablation(arg)['arms']` of the config file (configs/compare_lora.py). For each:
  * memory: XLA's compiled memory analysis of the method's jitted training step (the library's
    `steps.make_logra_step` / `make_dense_step`, as the trainer builds them) on a batch of the
    run's shape (N = prompts x samples sequences, prompt bucket + max_new_tokens tokens):
    argument, output, temp and alias bytes; peak ~ argument + output + temp - alias;
  * step time: the median of `timing_steps` calls of that compiled step (after one warm-up),
    the arms interleaved call by call in one process: the training call only, no generation;
  * pass@1: a run of `total_steps` RL steps through the trainer (`loop.train`, in
    WORKDIR/runs/<arm>), its held-out eval at step 0 (after any warm start) and at the end.
Writes WORKDIR/results.md, WORKDIR/results.json, WORKDIR/compare_lora.png.
"""
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ablation_io  # noqa: E402  pylint: disable=g-import-not-at-top

from logra_jax import sketch  # noqa: E402
from logra_jax.models import hf_io  # noqa: E402
from logra_jax.train import lora, methods, optimizers, steps, tasks  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file('config', None, 'configs/compare_lora.py[:tiny]',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where results and the arms\' runs go.')
flags.mark_flags_as_required(['config', 'workdir'])

MEMORY_KEYS = ('argument_size_in_bytes', 'output_size_in_bytes', 'temp_size_in_bytes',
               'alias_size_in_bytes', 'generated_code_size_in_bytes')


def synthetic_batch(cfg, vocab: int, prompt_len: int) -> dict:
  """A batch of the run's shape: random tokens (a prompt's samples share it), every position
  real, advantages +-1."""
  g = cfg.data.samples_per_prompt
  n, t = cfg.data.prompts_per_step * g, cfg.rollout.max_new_tokens
  rng = np.random.default_rng(cfg.seed)
  tokens = rng.integers(1, vocab, (n, prompt_len + t)).astype(np.int32)
  tokens[:, :prompt_len] = np.repeat(tokens[::g, :prompt_len], g, axis=0)
  return {'tokens': tokens, 'mask': np.ones(tokens.shape, bool),
          'targets': tokens[:, prompt_len:], 'target_mask': np.ones((n, t), np.float32),
          'behaviour_logp': np.full((n, t), -np.log(vocab), np.float32),
          'advantages': np.where(np.arange(n) % 2, 1.0, -1.0).astype(np.float32)}


def method_step(cfg, model, params, batch, prompt_len):
  """(jitted step, its first args, feed(args, outputs) -> the next args) for cfg's method."""
  o, loss_cfg = cfg.optim, methods.loss_config(cfg)
  sc = methods._step_config(cfg, prompt_len)  # pylint: disable=protected-access
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  telemetry = np.asarray(True)  # the steps' last argument: log the realised KL, as the trainer
  if o.name == 'logra':
    opt = optimizers.logra_optimizer(o, cfg.total_steps)
    spec = optimizers.projection_spec(o.logra, 1, hf_io.projection_name_fn(model.config))
    a = jax.eval_shape(lambda: steps.draw_projections(params, 0, 0, spec))
    state = opt.init(sketch.zero_probes(params, a))
    step = steps.make_logra_step(model, loss_cfg, opt, sc, spec)
    args = (copy(params), state, batch, np.uint32(cfg.seed),
            np.uint32(optimizers.projection_step(o.logra, 1)),
            np.float32(o.logra.kl_budget_init),
            jax.random.key(0), telemetry)
    return step, args, lambda x, out: (out[0], out[1]) + x[2:]
  opt = optimizers.adam_optimizer(o, cfg.total_steps)
  if o.name == 'lora':
    train = lora.init(params, o.lora.rank, jax.random.key(cfg.seed + 1))
    step = steps.make_dense_step(model, loss_cfg, opt, sc, lora_scale=o.lora.alpha / o.lora.rank)
    args = (params, train, opt.init(train), batch, telemetry)
  else:
    step = steps.make_dense_step(model, loss_cfg, opt, sc)
    args = (None, copy(params), opt.init(params), batch, telemetry)
  return step, args, lambda x, out: (x[0], out[0], out[1]) + x[3:]


def step_costs(arms: dict, timing_steps: int, log=print) -> dict:
  """Per arm: compiled memory of its training step and the median of its step times."""
  first = next(iter(arms.values()))
  task = tasks.build_task(first)
  model, mc, params = tasks.build_model(first, task)
  batch = jax.device_put(synthetic_batch(first, mc.vocab_size, task.prompt_len))
  runs, out = {}, {}
  for name, cfg in arms.items():
    step, args, feed = method_step(cfg, model, params, batch, task.prompt_len)
    start = time.perf_counter()
    compiled = step.jitted.lower(*args).compile()
    mem = compiled.memory_analysis()
    out[name] = {'memory': {k: int(getattr(mem, k)) for k in MEMORY_KEYS},
                 'compile_s': time.perf_counter() - start, 'step_times_s': []}
    m = out[name]['memory']
    m['peak_bytes'] = (m['argument_size_in_bytes'] + m['output_size_in_bytes'] +
                       m['temp_size_in_bytes'] - m['alias_size_in_bytes'])
    args = feed(args, jax.block_until_ready(compiled(*args)))  # warm-up call
    runs[name] = [compiled, args, feed]
    log(f'{name}: compiled, memory {m}')
  for _ in range(timing_steps):  # interleaved: every arm sees the same machine load
    for name, run in runs.items():
      compiled, args, feed = run
      start = time.perf_counter()
      result = jax.block_until_ready(compiled(*args))
      out[name]['step_times_s'].append(time.perf_counter() - start)
      run[1] = feed(args, result)
  for v in out.values():
    v['step_time_s'] = statistics.median(v['step_times_s'])
  return out


def _evals(history):
  return [(r['step'], r['eval_accuracy']) for r in history if r.get('eval_accuracy') is not None]


def train_arms(arms: dict, workdir: str, log=print) -> dict:
  out = {}
  for name, cfg in arms.items():
    res = ablation_io.run(cfg, os.path.join(workdir, 'runs', name), log=log)
    evals = _evals(res.history)
    out[name] = {'pass_at_1_start': evals[0][1], 'pass_at_1': res.final['eval_accuracy'],
                 'pass_at_k': res.final['eval_pass_at_k'], 'eval_curve': evals,
                 'train_wall_s': res.wall_s}
    log(f'{name}: pass@1 {evals[0][1]:.3f} -> {res.final["eval_accuracy"]:.3f}')
  return out


COLUMNS = ('method', 'rank', 'arg MiB', 'temp MiB', 'out MiB', 'peak MiB', 'step ms',
           'pass@1 start', 'pass@1', 'pass@k')


def _row(name, cfg, r):
  mib = lambda k: r['memory'][k] / 2**20
  return {'method': name, 'rank': {'logra': cfg.optim.logra.rank, 'lora': cfg.optim.lora.rank}.get(
      name, 'full'), 'arg MiB': mib('argument_size_in_bytes'),
      'temp MiB': mib('temp_size_in_bytes'), 'out MiB': mib('output_size_in_bytes'),
      'peak MiB': mib('peak_bytes'), 'step ms': 1e3 * r['step_time_s'],
      'pass@1 start': r['pass_at_1_start'], 'pass@1': r['pass_at_1'], 'pass@k': r['pass_at_k']}


def plot(results: dict):
  fig, (ax_mem, ax_time, ax_acc) = ablation_io.new_figure(3)
  names = list(results)
  mib = lambda k: [results[n]['memory'][k] / 2**20 for n in names]
  arg, temp = mib('argument_size_in_bytes'), mib('temp_size_in_bytes')
  ax_mem.bar(names, arg, label='arguments')
  ax_mem.bar(names, temp, bottom=arg, label='temp')
  ax_mem.set(ylabel='MiB', title='training step: compiled memory')
  ax_mem.legend()
  ax_time.bar(names, [1e3 * results[n]['step_time_s'] for n in names])
  ax_time.set(ylabel='ms', title='training step time (median)')
  for n in names:
    steps_, acc = zip(*results[n]['eval_curve'])
    ax_acc.plot(steps_, acc, marker='o', label=n)
  ax_acc.set(xlabel='RL step', ylabel='held-out pass@1', title='pass@1')
  ax_acc.legend()
  return fig


def markdown(results, arms, command, machine) -> str:
  rows = [_row(n, arms[n], r) for n, r in results.items()]
  return '\n'.join([
      '# LoGRA vs LoRA vs dense AdamW', '', f'Command: `{command}`', '', f'Machine: {machine}',
      '', ablation_io.markdown_table(rows, COLUMNS), '',
      'Memory: XLA compiled memory analysis of each jitted training step (peak ~ arguments + '
      'outputs + temp - aliased). Step time: median of the compiled training call only '
      '(arms interleaved). pass@1: held-out eval at RL step 0 and at the last step.'])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  settings = ablation_io.settings(flags.FLAGS['config'])
  arms = {n: ablation_io.train_config(_CONFIG.value, o) for n, o in settings['arms'].items()}
  results = step_costs(arms, settings['timing_steps'])
  for name, r in train_arms(arms, _WORKDIR.value).items():
    results[name].update(r)
  machine = f'{platform.machine()} {jax.devices()[0].device_kind} x{jax.device_count()}'
  command = ' '.join(['python experiments/compare_lora.py'] + sys.argv[1:])
  paths = ablation_io.write_results(
      _WORKDIR.value, 'compare_lora',
      {'command': command, 'machine': machine, 'settings': settings, 'methods': results},
      markdown(results, arms, command, machine), plot(results))
  print(open(paths['md']).read())


if __name__ == '__main__':
  app.run(main)
