"""A timer per phase of the trainer's step: which part of a step to make faster (issue 25).

  python experiments/profile_step.py --config=configs/smollm2_rg.py:paper --workdir=DIR \
      [--batches=3] [--reps=3] [--variant=NAME:KEY=VALUE,KEY=VALUE ...]

Builds `loop.Trainer` from the config (no warm start, no evaluation), collects `--batches`
step batches with the trainer's own rollouts (generation timed per batch), then times the
method's jitted step on those same batches under each variant of the config: `full` (the
config as it is) and every `--variant` (default: `no_probe`, optim.logra.kl_control=False,
so full − no_probe is the KL probe's cost; `telemetry`, the realised-KL forward every step;
and `mb4`, half the micro-batches). A variant may set model.remat_policy, attention,
attention_block, vocab_chunk or dtype (the compute dtype; the same weights); other model keys
are refused. Variants run interleaved, a rep each in turn, every one from its own copy of
the starting params, after one compile-and-warm-up step; a step's time is from the call
until its outputs are ready. Last line JSON: {"generate_s", "step_s": {variant: median},
"minus_full": {variant: median − full's}, "workload"}.
"""
import copy
import json
import statistics
import time

from absl import app, flags
from ml_collections import config_flags

FLAGS = flags.FLAGS


def define_flags():
  """The command line's flags (defined when run as a script, not when imported: a test
  process that imports this module and later runs another absl entry point would otherwise
  require --config and --workdir there)."""
  config_flags.DEFINE_config_file('config', None, 'Path to a config file.', lock_config=False)
  flags.DEFINE_string('workdir', None, 'Run directory (a fresh one).')
  flags.DEFINE_integer('batches', 3, 'Step batches collected and timed.')
  flags.DEFINE_integer('reps', 2, 'Passes over the batches per variant.')
  flags.DEFINE_multi_string(
      'variant', ['no_probe:optim.logra.kl_control=False', 'telemetry:optim.telemetry_every=1',
                  'mb4:optim.micro_batches=4'],
      'NAME:KEY=VALUE[,KEY=VALUE...] config overrides timed against the config as it is.')
  flags.mark_flags_as_required(['config', 'workdir'])


def parse_variant(text: str):
  """'NAME:K=V,K=V' -> (NAME, {K: V}) with V parsed as a Python literal where it is one."""
  import ast  # pylint: disable=g-import-not-at-top
  name, _, body = text.partition(':')
  out = {}
  for item in filter(None, body.split(',')):
    key, _, value = item.partition('=')
    try:
      out[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      out[key] = value
  return name, out


def main(argv):
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  from logra_jax.train.methods import get_method  # pylint: disable=g-import-not-at-top
  base = FLAGS.config
  base.warm_start.steps = 0
  cfg = config_lib.from_config_dict(base)
  trainer = loop.Trainer(cfg, FLAGS.workdir, log=lambda *a: None)
  params0 = jax.tree.map(jnp.copy, trainer.method.policy_params(trainer.state))
  batches, gen_s = [], []
  for t in range(1, FLAGS.batches + 1):
    start = time.perf_counter()
    batch, p, *_ = trainer.collect(t)
    gen_s.append(time.perf_counter() - start)
    batches.append((batch, p, t, float(trainer.budget(t - 1))))  # the run's budget at step t
  trainer.close()
  model = trainer.model

  variants = [('full', {})] + [parse_variant(v) for v in FLAGS.variant]
  methods = {}
  for name, overrides in variants:
    c = copy.deepcopy(base)
    config_lib.apply_overrides(c, overrides)
    c = config_lib.from_config_dict(c)
    methods[name] = [get_method(c, variant_model(model, cfg, c, name), trainer.layout), None]
  times = {name: [] for name, _ in variants}
  for name, (method, _) in methods.items():  # compile + warm up
    state = method.init(jax.tree.map(jnp.copy, params0))
    state, _ = method.step(state, *batches[0])
    jax.block_until_ready(state)
    methods[name][1] = state
  for _ in range(FLAGS.reps):
    for batch in batches:
      for name, entry in methods.items():
        method, state = entry
        start = time.perf_counter()
        state, metrics = method.step(state, *batch)
        jax.block_until_ready((state, metrics))
        times[name].append(time.perf_counter() - start)
        entry[1] = state
  med = {k: statistics.median(v) for k, v in times.items()}
  for name, _ in variants:
    print(f'{name:>12}: median {med[name]:.2f} s  (all: '
          f'{", ".join(f"{x:.2f}" for x in times[name])})')
  print(f'generation per batch: {", ".join(f"{x:.2f}" for x in gen_s)} s')
  print(json.dumps({'generate_s': statistics.median(gen_s), 'step_s': med,
                    'minus_full': {k: med[k] - med['full'] for k in med},
                    'workload': {'rows': cfg.data.prompts_per_step * cfg.data.samples_per_prompt,
                                 'max_new_tokens': cfg.rollout.max_new_tokens,
                                 'micro_batches': cfg.optim.micro_batches,
                                 'batches': FLAGS.batches, 'reps': FLAGS.reps}}))


def variant_model(model, cfg, variant_cfg, name):
  """The trainer's model with ``variant_cfg``'s compute keys (model.remat_policy, ...); any
  other model.* override is refused (the variants share one set of weights)."""
  from logra_jax.train.tasks import MODEL_MEMORY_KEYS  # pylint: disable=g-import-not-at-top
  keys = MODEL_MEMORY_KEYS + ('dtype',)  # and the compute dtype: the same param_dtype weights
  changed = {k: getattr(variant_cfg.model, k) for k in keys
             if getattr(variant_cfg.model, k) != getattr(cfg.model, k)}
  rest = [k for k in vars(cfg.model) if k not in keys
          and getattr(variant_cfg.model, k) != getattr(cfg.model, k)]
  if rest:
    raise ValueError(f'variant {name}: model.{rest[0]} cannot vary (one set of weights); '
                     f'only model.{{{", ".join(keys)}}} can')
  return model.clone(config=model.config.replace(**changed)) if changed else model


if __name__ == '__main__':
  define_flags()
  app.run(main)
