"""One training step of LoGRA, dense AdamW and LoRA on the same model and batch, side by side.

  python experiments/bench_step.py                 # SmolLM2-135M (the packaged GGUF), fp32
  python experiments/bench_step.py --model=tiny    # the tiny preset (CI: seconds)

The three methods are the trainer's own (`logra_jax.train.methods`, the config's defaults
with `--config` overrides), built in one process on one synthetic batch (random completions,
behaviour log-probs = the model's own), and run interleaved (the order rotates every
repetition) after one untimed compile step each; figures are medians. Then the gradient
programs alone on the same batch: the LoGRA sketch backward (`sketch_value_and_grad`), a plain
backward (the activations' backward only: gradients of the RMSNorm scales, no matmul weight
gradient) and the dense gradient of all params. The LAST line is one JSON object:
{"logra_over_adam": ..., "lora_over_adam": ..., "sketch_over_backward": ...,
 "dense_grad_over_backward": ..., "median_s": {...}, "workload": {...}}.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from flax import traverse_util  # pylint: disable=g-import-not-at-top

from logra_jax import sketch  # pylint: disable=g-import-not-at-top
from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
from logra_jax.train import methods, optimizers, steps, tasks  # pylint: disable=g-import-not-at-top
from logra_jax.train.steps import losses as step_losses  # pylint: disable=g-import-not-at-top

METHODS = ('logra', 'adam', 'lora')


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2')
  p.add_argument('--prompts', type=int, default=4)
  p.add_argument('--samples', type=int, default=4)
  p.add_argument('--prompt_len', type=int, default=64)
  p.add_argument('--new_tokens', type=int, default=64)
  p.add_argument('--reps', type=int, default=5, help='timed repetitions of each program')
  p.add_argument('--config', action='append', default=[],
                 help="extra overrides 'section.key=value' (JSON values), e.g. optim.logra.rank=16")
  return p.parse_args(argv)


def _override(cfg, text: str):
  key, _, value = text.partition('=')
  node = cfg
  *parents, leaf = key.split('.')
  for part in parents:
    node = node[part]
  try:
    node[leaf] = json.loads(value)
  except json.JSONDecodeError:
    node[leaf] = value


def make_config(args) -> config_lib.TrainConfig:
  """configs/smollm2_rg.py or configs/tiny.py with the benchmark's batch (and overrides)."""
  from configs import smollm2_rg, tiny  # pylint: disable=g-import-not-at-top
  # SmolLM2: the paper's rule (smollm2_rg.py's default when the recorded figures ran).
  cfg = smollm2_rg.get_config('paper') if args.model == 'smollm2' else tiny.get_config()
  cfg.warm_start.steps = 0
  cfg.data.prompts_per_step, cfg.data.samples_per_prompt = args.prompts, args.samples
  cfg.rollout.max_new_tokens = args.new_tokens
  for text in args.config:
    _override(cfg, text)
  return config_lib.from_config_dict(cfg)


def build_model(cfg):
  """(Transformer, params) as the trainer builds them (tiny: the task gives the vocabulary)."""
  task = tasks.build_task(cfg) if not cfg.model.path else None
  model, _, params = tasks.build_model(cfg, task)
  return model, params


def make_batch(model, params, n, p, t, seed=0, samples=1):
  """n rows of p prompt + t completion tokens (random ids; runs of ``samples`` rows share a
  prompt, as a step's samples do), advantages ~ N(0, 1), behaviour log-probs = the model's
  own (importance ratios 1)."""
  rng = np.random.default_rng(seed)
  vocab = model.config.vocab_size
  tokens = rng.integers(3, vocab, (n, p + t)).astype(np.int32)
  tokens[:, :p] = np.repeat(tokens[::samples, :p], samples, axis=0)
  batch = dict(tokens=tokens, mask=np.ones((n, p + t), bool), targets=tokens[:, p:],
               target_mask=np.ones((n, t), np.float32),
               advantages=rng.normal(size=n).astype(np.float32))
  logp = steps.make_ref_logp(model, p, 1.0)(params, batch)
  batch['behaviour_logp'] = np.asarray(logp, np.float32)
  return batch


def _block(tree):
  jax.block_until_ready(tree)
  return tree


def _interleaved(runners: dict, reps: int) -> dict:
  """{name: [seconds]}: one untimed call each, then `reps` rounds in a rotating order."""
  for run in runners.values():
    run()
  times = {name: [] for name in runners}
  names = list(runners)
  for r in range(reps):
    for name in names[r % len(names):] + names[:r % len(names)]:
      start = time.perf_counter()
      runners[name]()
      times[name].append(time.perf_counter() - start)
  return times


def method_runners(cfg, model, params, batch, p) -> dict:
  """{name: run one trainer step}; LoGRA and Adam own a copy of the params (their steps donate
  them); LoRA's step donates only the adapters, so it shares ``params``."""
  runners = {}
  for name in METHODS:
    mcfg = cfg if name == cfg.optim.name else config_lib.with_method(cfg, name)
    method = methods.get_method(mcfg, model)
    own = params if name == 'lora' else jax.tree.map(jnp.copy, params)
    box = {'state': method.init(own), 't': 0}

    def run(method=method, box=box):
      box['t'] += 1
      box['state'], metrics = method.step(box['state'], batch, p, box['t'],
                                          cfg.optim.logra.kl_budget_init)
      _block((box['state'], metrics))
    runners[name] = run
  return runners


def _is_scale(path) -> bool:
  return path[-1] == 'scale'


def gradient_runners(cfg, model, params, batch, p) -> dict:
  """The sketch backward, a plain backward (norm scales only) and all params' gradient."""
  loss = step_losses.loss_fn(model, methods.loss_config(cfg), p)
  a = optimizers.projections_at(cfg.optim.logra, params, cfg.seed, 1)
  flat = traverse_util.flatten_dict(params)
  scales = {k: v for k, v in flat.items() if _is_scale(k)}
  rest = {k: v for k, v in flat.items() if not _is_scale(k)}
  join = lambda rest, s: traverse_util.unflatten_dict({**rest, **s})
  fns = {
      'sketch_backward': jax.jit(lambda prm, a, b: sketch.sketch_value_and_grad(
          loss, has_aux=True)(prm, a, b, 1.0)),
      'plain_backward': jax.jit(lambda r, s, b: jax.value_and_grad(
          lambda s: loss({'params': join(r, s)}, b, 1.0), has_aux=True)(s)),
      'dense_grad': jax.jit(lambda prm, b: jax.value_and_grad(
          lambda q: loss({'params': q}, b, 1.0), has_aux=True)(prm)),
  }
  args = {'sketch_backward': (params, a, batch), 'plain_backward': (rest, scales, batch),
          'dense_grad': (params, batch)}
  return {k: (lambda k=k: _block(fns[k](*args[k]))) for k in fns}


def _median(xs):
  return float(statistics.median(xs))


def report(times: dict, workload: dict) -> dict:
  med = {k: _median(v) for k, v in times.items()}
  for k, v in times.items():
    print(f'{k:16s} median {med[k]:8.3f} s   min {min(v):8.3f}   max {max(v):8.3f}   '
          f'(n={len(v)})')
  return {'logra_over_adam': med['logra'] / med['adam'],
          'lora_over_adam': med['lora'] / med['adam'],
          'sketch_over_backward': med['sketch_backward'] / med['plain_backward'],
          'dense_grad_over_backward': med['dense_grad'] / med['plain_backward'],
          'median_s': med, 'workload': workload}


def main(argv=None):
  args = parse_args(argv)
  cfg = make_config(args)
  model, params = build_model(cfg)
  n, p, t = args.prompts * args.samples, args.prompt_len, args.new_tokens
  batch = make_batch(model, params, n, p, t, samples=args.samples)
  workload = dict(model=args.model, rows=n, prompt_len=p, new_tokens=t, reps=args.reps,
                  share_prompts=cfg.optim.share_prompts,
                  rank=cfg.optim.logra.rank, kl_control=cfg.optim.logra.kl_control,
                  telemetry_every=cfg.optim.telemetry_every, dtype=cfg.model.dtype,
                  backend=jax.default_backend(), devices=jax.device_count())
  print(f'workload: {workload}', flush=True)
  times = _interleaved(method_runners(cfg, model, params, batch, p), args.reps)
  times.update(_interleaved(gradient_runners(cfg, model, params, batch, p), args.reps))
  print(json.dumps(report(times, workload)))


if __name__ == '__main__':
  main()
