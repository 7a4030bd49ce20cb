"""Our side of bench_vs_trl: the trainer's own steps, timed by span; run by
experiments/bench_vs_trl.py, one fresh process per run.

  python experiments/bench_ours_worker.py --config=configs/smollm2_rg.py:paper --workdir=DIR \
      --out=RESULT.json [--config.KEY=VALUE ...]

Builds `loop.Trainer` from the config (bench_vs_trl points data.path at its prompts file) and
runs `total_steps` of `Trainer.train_step` (no evaluation, no checkpoint). Spans per step, the
same as the TRL worker's: generation = `Rollouts.take` (the rollouts only), scoring = the rest
of `Trainer.collect` (rewards, advantages, the batch), training = `Method.step` until its state
is ready (loss, backward, optimizer), other = what is left of the step (the generator's weight
update, host memory release). Also per step: the ids (line numbers of the prompts file) of the
prompts it processed, and its tokens (prompt, generated, trained = the loss's mask). RESULT.json
gets those lists and this process's peak RSS.
"""
import json
import resource
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (a fresh one).')
_OUT = flags.DEFINE_string('out', None, 'Where the result JSON goes.')
flags.mark_flags_as_required(['config', 'workdir', 'out'])


def _timed(record: dict, key: str, fn, block=None):
  """fn, with its wall time (after ``block`` on its result, if given) appended to record[key]."""
  def wrapped(*args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    if block is not None:
      block(out)
    record[key].append(time.perf_counter() - start)
    return out
  return wrapped


def instrument(trainer, rec: dict) -> None:
  """Wraps the trainer's rollouts, collect and method step to time and count each step."""
  import jax  # pylint: disable=g-import-not-at-top
  take, step = trainer.rollouts.take, trainer.method.step

  def take_and_count(t):
    records, results, stale = take(t)
    rec['prompt_ids'].append([int(r['index']) for r in records])
    rec['tokens_prompt'].append(sum(len(r.prompt_token_ids) for r in results))
    rec['tokens_generated'].append(sum(len(r.completion_token_ids) for r in results))
    return records, results, stale

  def step_and_count(state, batch, *args):
    rec['tokens_trained'].append(int(batch['target_mask'].sum()))
    return step(state, batch, *args)

  trainer.rollouts.take = _timed(rec, 'generate_s', take_and_count)
  trainer.collect = _timed(rec, 'collect_s', trainer.collect)
  trainer.method.step = _timed(rec, 'train_s', step_and_count, block=jax.block_until_ready)


def main(argv):
  del argv
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  from logra_jax.train.config import from_config_dict  # pylint: disable=g-import-not-at-top
  cfg = from_config_dict(_CONFIG.value)
  keys = ('step_s', 'generate_s', 'collect_s', 'train_s', 'prompt_ids', 'tokens_prompt',
          'tokens_generated', 'tokens_trained')
  rec = {k: [] for k in keys}
  trainer = loop.Trainer(cfg, _WORKDIR.value, log=lambda *a: None)
  instrument(trainer, rec)
  for _ in range(cfg.total_steps):
    rec['step_s'].append(trainer.train_step()['step_time_s'])
  trainer.close()
  rec['score_s'] = [c - g for c, g in zip(rec.pop('collect_s'), rec['generate_s'])]
  rec['other_s'] = [s - g - c - t for s, g, c, t in
                    zip(rec['step_s'], rec['generate_s'], rec['score_s'], rec['train_s'])]
  rec['peak_rss_gib'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB
  rec['remat_policy'] = cfg.model.remat_policy
  rec['micro_batches'] = cfg.optim.micro_batches
  rec['optim'] = cfg.optim.name
  with open(_OUT.value, 'w') as f:
    json.dump(rec, f)


if __name__ == '__main__':
  app.run(main)
