"""Where a SmolLM2 RL process's memory goes: XLA's memory analysis of each jitted function.

  python experiments/memory_breakdown.py                 # SmolLM2, bench_vs_trl's 4 x 4 x 64
  python experiments/memory_breakdown.py --model=tiny    # configs/tiny.py:paper (CI: seconds)
  python experiments/memory_breakdown.py --set=optim.micro_batches=8   # any config override

Compiles the trainer's own jitted functions on one device for one workload: the LoGRA step
and the dense-AdamW step (`analysis.memory_plan.logra_entry` / `dense_entry`: the trainer's
step builders and shardings, on the whole batch of prompts x samples rows in
optim.micro_batches micro-batches), the rollout sampler (`sampler.generate_arrays` for the
training rows) and the held-out evaluation's sampler (greedy, eval rows). For each: argument,
output, aliased and temp bytes and peak = argument + output − aliased + temp (what the
function needs at once), next to the bytes of one fp32 copy of the params and of one (rows,
completion, vocab) fp32 logits array. Then it runs each function once on zeros and records
``run_rss_gib``, how far the process's RSS rose above its level just before (Linux: the peak
is reset through /proc/self/clear_refs first). The process's running peak RSS after each
stage (imports, model load, each function compiled and run) is printed too.

The LAST line is one JSON object: {"functions": {name: {..., "peak_gib": x}}, "params_gib": p,
"peak_rss_gib": {stage: g}, "logits_gib": l, "workload": {...}}.
"""
import argparse
import contextlib
import json
import os
import resource
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

from logra_jax import parallel  # pylint: disable=g-import-not-at-top
from logra_jax.analysis import memory_plan  # pylint: disable=g-import-not-at-top
from logra_jax.models import sampler  # pylint: disable=g-import-not-at-top
from logra_jax.train import config as config_lib, tasks  # pylint: disable=g-import-not-at-top

GIB = 2**30


def peak_rss_gib() -> float:
  """This process's peak resident set so far (Linux: ru_maxrss in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2')
  p.add_argument('--prompts', type=int, default=4)
  p.add_argument('--samples', type=int, default=4)
  p.add_argument('--prompt_len', type=int, default=64, help='padded prompt tokens')
  p.add_argument('--new_tokens', type=int, default=64)
  p.add_argument('--eval_rows', type=int, default=128)
  p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                 help='a config override of both steps, e.g. optim.micro_batches=4')
  return p.parse_args(argv)


def apply_sets(cfg, sets):
  """``KEY=VALUE`` overrides of a ConfigDict, each parsed as the type of the value it replaces."""
  for item in sets:
    key, _, value = item.partition('=')
    *parents, leaf = key.split('.')
    node = cfg
    for part in parents:
      node = node[part]
    if leaf not in node:
      raise ValueError(f'--set {item!r}: unknown config key {key!r}')
    old = node[leaf]
    node[leaf] = (value.lower() in ('1', 'true') if isinstance(old, bool) else type(old)(value))
  return cfg


def make_config(args, method: str) -> config_lib.TrainConfig:
  from configs import smollm2_rg, tiny  # pylint: disable=g-import-not-at-top
  if args.model == 'smollm2':
    cfg = smollm2_rg.get_config('adam' if method == 'dense' else 'paper')
  else:  # the paper's LoGRA (no momentum), as configs/smollm2_rg.py:paper's
    cfg = tiny.get_config('paper')
  if method == 'dense' and cfg.optim.name != 'adam':
    config_lib.switch_method(cfg, 'adam')
  cfg.warm_start.steps = 0
  cfg.data.prompts_per_step, cfg.data.samples_per_prompt = args.prompts, args.samples
  cfg.rollout.max_new_tokens = args.new_tokens
  return config_lib.from_config_dict(apply_sets(cfg, args.set))


def abstract_model(cfg):
  """(model, abstract params) as the trainer builds them (SmolLM2: read from the GGUF)."""
  task = tasks.build_task(cfg) if not cfg.model.path else None
  model, _, params = tasks.build_model(cfg, task)
  return model, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)


def rss_status() -> tuple:
  """(current RSS, peak RSS since the last `reset_peak_rss`) of this process in GiB (Linux)."""
  with open('/proc/self/status') as f:
    kib = {l.split(':')[0]: int(l.split()[1]) for l in f if l.startswith(('VmRSS', 'VmHWM'))}
  return kib['VmRSS'] / 2**20, kib['VmHWM'] / 2**20


def reset_peak_rss():
  """Sets this process's peak RSS (VmHWM) back to its current RSS (Linux clear_refs 5)."""
  with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')


def concrete(args):
  """Zeros (masks all ones: every position counts) for abstract arguments, on their shardings."""
  def make(path, x):
    if x is None:
      return None
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      return jax.random.key(0)
    name = jax.tree_util.keystr(path)
    fill = 1 if 'mask' in name or x.dtype == jnp.bool_ else 0
    value = jnp.full(x.shape, fill, x.dtype)
    return value if x.sharding is None else jax.device_put(value, x.sharding)
  return jax.tree_util.tree_map_with_path(make, args, is_leaf=lambda x: x is None)


def measure(fn, args, mesh=None) -> dict:
  """XLA's memory analysis of ``fn`` compiled on ``args``, then one execution on zeros:
  ``run_rss_gib`` = the process's peak RSS while it ran minus its RSS just before (what
  running it really added at its peak: its buffers, the runtime's and the libraries')."""
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    compiled = fn.lower(*args).compile()
    out = memory_plan.memory(compiled)
    values = concrete(args)
    jax.block_until_ready(values)
    compile_peak = rss_status()[1]
    reset_peak_rss()
    before = rss_status()[0]
    jax.block_until_ready(compiled(*values))
    run_peak = rss_status()[1]
  out['run_rss_gib'] = run_peak - before
  out['process_peak_gib'] = max(compile_peak, run_peak)
  return out


def step_memory(cfg, model, method: str, seq, rows: int) -> dict:
  """The trainer's step: ``rows`` sequences in ``cfg.optim.micro_batches`` micro-batches."""
  layout = parallel.Layout(parallel.make_mesh(1, 1, jax.devices()[:1]),
                           parallel.parse_axis_rules(cfg.mesh.rules))
  make = memory_plan.logra_entry if method == 'logra' else memory_plan.dense_entry
  e = make(cfg, model, layout, seq, micro_batches=cfg.optim.micro_batches, rows=rows)
  out = measure(e.fn, e.args, layout.mesh)
  out['tokens_shape'] = list(e.args[e.names.index('batch')]['tokens'].shape)  # (rows, P + T)
  return out


def sampler_memory(model, params, rows: int, prompt_len: int, new_tokens: int,
                   temperature: float) -> dict:
  b = sampler.bucket_size(rows, 1)
  spec = jax.ShapeDtypeStruct
  decode = jax.eval_shape(lambda p: sampler.decode_copy(model.config, p), params)
  args = (params, decode, spec((b, prompt_len), jnp.int32), spec((b, prompt_len), jnp.bool_),
          spec((b,), jnp.uint32), spec((1,), jnp.int32))
  fn = jax.jit(lambda *a: sampler.generate_arrays(
      *a, config=model.config, max_new_tokens=new_tokens,
      sampling=sampler.SamplingParams(temperature, 1.0, 0)))
  out = measure(fn, args)  # the decode copy is an argument: made before, by its own program
  out['decode_copy_gib'] = memory_plan.global_bytes(decode) / 2**30
  return out


def main(argv=None):
  args = parse_args(argv)
  rows = args.prompts * args.samples
  seq = (args.prompt_len, args.new_tokens)
  functions, rss = {}, {'imports': peak_rss_gib()}

  def stage(name, measured):  # the running peak over compiles and runs
    functions[name] = measured
    rss[name] = max(max(rss.values()), measured.pop('process_peak_gib'))

  cfg = make_config(args, 'logra')
  model, params = abstract_model(cfg)
  rss['model_load'] = peak_rss_gib()
  stage('logra_step', step_memory(cfg, model, 'logra', seq, rows))
  stage('adam_step', step_memory(make_config(args, 'dense'), model, 'dense', seq, rows))
  stage('rollout_sampler', sampler_memory(model, params, rows, args.prompt_len,
                                          args.new_tokens, cfg.rollout.temperature))
  stage('eval_sampler', sampler_memory(model, params, args.eval_rows, args.prompt_len,
                                       args.new_tokens, 0.0))
  params_b = memory_plan.global_bytes(params)
  logits_b = rows * args.new_tokens * model.config.vocab_size * 4
  print(f'params (as loaded) {params_b / GIB:.3f} GiB; one ({rows}, {args.new_tokens}, '
        f'{model.config.vocab_size}) fp32 logits array {logits_b / GIB:.3f} GiB')
  print(f'{"function":<16} {"argument":>9} {"output":>9} {"aliased":>9} {"temp":>9} '
        f'{"peak":>9} {"run RSS":>9}  (GiB)')
  for name, m in functions.items():
    print(f'{name:<16} ' + ' '.join(f'{m[k] / GIB:>9.3f}' for k in
                                     ('argument', 'output', 'alias', 'temp', 'peak'))
          + f' {m["run_rss_gib"]:>9.3f}')
    m['peak_gib'] = m['peak'] / GIB
  print('process peak RSS after ' + ', '.join(f'{k} {v:.2f}' for k, v in rss.items()) + ' GiB')
  print(json.dumps(dict(functions=functions, params_gib=params_b / GIB, peak_rss_gib=rss,
                        logits_gib=logits_b / GIB,
                        workload=dict(model=args.model, rows=rows, prompt_len=args.prompt_len,
                                      new_tokens=args.new_tokens, eval_rows=args.eval_rows,
                                      kl_sequences=cfg.optim.kl_sequences, sets=args.set,
                                      micro_batches=cfg.optim.micro_batches))))


if __name__ == '__main__':
  main()
