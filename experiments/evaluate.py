"""The held-out evaluation of a run's checkpoint, read-only, under the run's config or another
eval section.

  python experiments/evaluate.py --config=configs/smollm2_rg.py --workdir=runs/smollm2 \
      [--step=50] [--config.eval.max_new_tokens=128] [--out=eval_128.json] \
      [--answers=answers_128.jsonl]

With the run's own config (the same overrides as its train.py command) it repeats the run's
logged evaluation of that step: the same policy, the same seeds. With another eval section it
asks a new question of the same policy, e.g. how much of a held-out score the completion
limit decides (eval.max_new_tokens; 0 = rollout.max_new_tokens). Nothing in WORKDIR is
written. Prints one JSON line: step, max_new_tokens, eval_accuracy (pass@1), eval_pass_at_k,
eval_truncation_rate (the share of held-out completions cut at the limit); --out also writes
it to a file, and --answers writes every held-out completion (problem, text, reference,
correct, finish_reason, tokens) to compare two policies problem by problem.
"""
import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'The run\'s config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'The run directory (its checkpoints/).')
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint\'s step (default: the latest).')
_OUT = flags.DEFINE_string('out', None, 'Also write the JSON line to this file.')
_ANSWERS = flags.DEFINE_string('answers', None, 'Write every held-out completion here (JSONL: '
                               'problem, completion, reference, correct, finish_reason, '
                               'tokens).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax  # pylint: disable=g-import-not-at-top
  from logra_jax import parallel  # pylint: disable=g-import-not-at-top
  from logra_jax.train.config import from_config_dict  # pylint: disable=g-import-not-at-top
  from logra_jax.train.loop import evaluate_checkpoint  # pylint: disable=g-import-not-at-top
  cfg = from_config_dict(_CONFIG.value)
  layout = parallel.layout_from_config(cfg.mesh)  # the run's mesh, as train.py builds it
  answers = [] if _ANSWERS.value else None
  with jax.set_mesh(layout.mesh):
    out = evaluate_checkpoint(cfg, _WORKDIR.value, _STEP.value, layout, answers=answers)
  if answers is not None:
    with open(_ANSWERS.value, 'w') as f:
      f.writelines(json.dumps(a, default=str) + '\n' for a in answers)
  line = json.dumps(out)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      f.write(line + '\n')
  print(line)


if __name__ == '__main__':
  from logra_jax.train.config import check_override_flags  # pylint: disable=g-import-not-at-top
  check_override_flags(sys.argv)
  app.run(main)
