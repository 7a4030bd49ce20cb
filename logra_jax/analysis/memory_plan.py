"""The memory plan's building blocks: the trainer's own jitted steps on abstract inputs.

Every input is a `jax.ShapeDtypeStruct` carrying the NamedSharding the trainer gives that
array (`train.methods.Placement`, `parallel.Layout`), so `jit(...).lower(*args).compile()`
sees the real program per device and nothing is allocated. `experiments/memory_plan.py`
prints the figures; `experiments/gpu_measure.py` runs the same steps on real arrays.
"""
import importlib.util
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax import parallel, sketch
from logra_jax.models import hf_io
from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer
from logra_jax.train import methods, optimizers, steps
from logra_jax.parallel import parse_axis_rules
from logra_jax.train.config import TrainConfig, from_config_dict, switch_method

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GIB = 2**30
# model key -> (config file, its dense-AdamW variant argument or None, its LoGRA variant
# argument or None). tiny's LoGRA row is the paper's rule (tiny.py:paper, no momentum), as
# the paper configs' rows are.
CONFIGS = {'tiny': ('tiny.py', None, 'paper'), '1.5b': ('qwen2_5_math_1_5b.py', 'adam', None),
           '7b': ('qwen2_5_math_7b.py', 'adam', None),
           '27b': ('paper_27b_reasoning_gym.py', None, None)}
# docs/method.md Table 1: GiB per training GPU (average, peak) on 4 GPUs; None: OOM.
PAPER = {'1.5b': {'dense': (9.18, 9.19), 'logra': (7.18, 8.66)},
         '7b': {'dense': (31.82, 31.85), 'logra': (17.29, 22.26)},
         '27b': {'dense': None, 'logra': (51.54, 53.88)}}
# (prompt, completion) tokens of one sequence: 4,096 (tiny: 64).
SEQUENCE = {'tiny': (16, 48)}
DEFAULT_SEQUENCE = (512, 3584)


class Entry(NamedTuple):
  """One compiled step: the jitted function, its abstract arguments and their names.

  Lower it under ``jax.set_mesh(mesh)``, as `experiments/train.py` runs the trainer (the
  model's activation constraints, `transformer.constrain_batch`, read that mesh).
  """
  fn: Any
  args: tuple
  names: tuple
  mesh: Any = None


def load_config(model_key: str, method: str) -> TrainConfig:
  """The paper config of ``model_key`` for ``method`` ('logra' or 'dense')."""
  if model_key not in CONFIGS:
    raise ValueError(f'unknown model {model_key!r}; known: {sorted(CONFIGS)}')
  if method not in ('logra', 'dense'):
    raise ValueError(f"method must be 'logra' or 'dense', got {method!r}")
  name, dense_arg, logra_arg = CONFIGS[model_key]
  spec = importlib.util.spec_from_file_location(f'_plan_{model_key}',
                                                os.path.join(ROOT, 'configs', name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  arg = dense_arg if method == 'dense' else logra_arg
  cfg = module.get_config(arg) if arg else module.get_config()
  if method == 'dense':  # the dense recipe: fp32 master weights (the :adam variants set it)
    if cfg.optim.name != 'adam':
      switch_method(cfg, 'adam')
    cfg.model.param_dtype = 'float32'
  if model_key == 'tiny':  # the paper configs' memory settings, at the tiny shape
    cfg.model.dtype, cfg.model.remat_policy = 'bfloat16', 'full'
    cfg.model.param_dtype = 'float32' if method == 'dense' else 'bfloat16'
    cfg.model.attention, cfg.model.attention_block, cfg.model.vocab_chunk = 'blockwise', 16, 8
  return from_config_dict(cfg)


def make_model(cfg: TrainConfig) -> Transformer:
  """The config's model; params stored in `model.param_dtype`, as `tasks.build_model` does."""
  m = cfg.model
  return Transformer(get_preset(
      m.preset, dtype=m.dtype, param_dtype=m.param_dtype,
      remat_policy=m.remat_policy, attention=m.attention, attention_block=m.attention_block,
      vocab_chunk=m.vocab_chunk))


def with_shardings(abstract, shardings):
  """ShapeDtypeStructs carrying ``shardings`` (same tree structure)."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      abstract, shardings)


def abstract_batch(n: int, prompt_len: int, completion_len: int, sharding):
  """The trainer's batch (rollout.assemble_batch) as abstract arrays of N sequences."""
  l, t = prompt_len + completion_len, completion_len
  shapes = dict(tokens=((n, l), jnp.int32), mask=((n, l), jnp.bool_),
                targets=((n, t), jnp.int32), target_mask=((n, t), jnp.float32),
                behaviour_logp=((n, t), jnp.float32), advantages=((n,), jnp.float32))
  return {k: jax.ShapeDtypeStruct(s, d, sharding=sharding) for k, (s, d) in shapes.items()}


def plan_step_config(cfg: TrainConfig, devices: int, prompt_len: int,
                     micro_batches: int = 0) -> steps.StepConfig:
  """The trainer's StepConfig with one sequence per device per micro-batch.

  ``micro_batches`` (0: the config's whole batch, N / devices) sets the scan length.
  """
  m = micro_batches or cfg.data.prompts_per_step * cfg.data.samples_per_prompt // devices
  o, lg = cfg.optim, cfg.optim.logra
  return steps.StepConfig(prompt_len, m, o.kl_sequences, lg.kl_control, lg.kl_probe,
                          lg.alpha_max, lg.sparse_mask)


def telemetry_flag(sharding):
  """The steps' traced last argument: whether this step logs the realised KL (the plan: yes)."""
  return jax.ShapeDtypeStruct((), jnp.bool_, sharding=sharding)


def build_logra_step(model, cfg: TrainConfig, lt: 'methods.LograTrees', sc, sh):
  """THE place the plan builds the LoGRA step: A drawn inside it, as in the trainer."""
  spec = optimizers.projection_spec(cfg.optim.logra, 0, hf_io.projection_name_fn(model.config))
  return steps.make_logra_step(model, methods.loss_config(cfg), lt.opt, sc, spec, sh,
                               lt.rest_opt)


def _rows(sc: steps.StepConfig, layout, rows: int) -> int:
  """The batch's sequences: ``rows``, or (0) one per device per micro-batch (the plan)."""
  return rows or sc.micro_batches * layout.mesh.size


def logra_entry(cfg: TrainConfig, model, layout, seq, micro_batches=0, rows=0) -> Entry:
  """`methods.logra_method`'s step and shardings, on abstract inputs.

  A batch of ``rows`` sequences (0: one per device per micro-batch) of ``seq`` = (prompt,
  completion) tokens in ``micro_batches`` micro-batches (0: the plan's, see
  `plan_step_config`); the trainer's step is ``rows`` = prompts x samples in
  ``cfg.optim.micro_batches``.
  """
  pl = methods.Placement(cfg, model, layout)
  spec = optimizers.projection_spec(cfg.optim.logra, 0, hf_io.projection_name_fn(model.config))
  lt = methods.logra_trees(cfg, pl, spec)  # A is drawn in-step
  opt_abs, opt_sh = lt.opt_abstract, lt.opt_shardings
  sh = pl.step_shardings(opt_sh, params=pl.params, accum=lt.accum_shardings)
  sc = plan_step_config(cfg, layout.mesh.size, seq[0], micro_batches)
  fn = build_logra_step(model, cfg, lt, sc, sh).jitted  # its last argument: the telemetry flag
  rep = layout.replicated
  key = jax.eval_shape(lambda: jax.random.key(0))
  args = (with_shardings(pl.abstract, pl.params), with_shardings(opt_abs, opt_sh),
          abstract_batch(_rows(sc, layout, rows), *seq, pl.batch),
          jax.ShapeDtypeStruct((), jnp.uint32, sharding=rep),
          jax.ShapeDtypeStruct((), jnp.uint32, sharding=rep),
          jax.ShapeDtypeStruct((), jnp.float32, sharding=rep),
          jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep), telemetry_flag(rep))
  return Entry(fn, args, ('params', 'opt_state', 'batch', 'seed', 'step', 'budget', 'key',
                          'telemetry'))


def dense_entry(cfg: TrainConfig, model, layout, seq, micro_batches=0, rows=0) -> Entry:
  """`methods.adam_method`'s step and shardings, on abstract inputs (batch: `logra_entry`)."""
  pl = methods.Placement(cfg, model, layout)
  trainable = (methods.sketched_mask(pl.abstract) if cfg.optim.adam.trainable == 'sketched'
               else None)
  opt = optimizers.adam_optimizer(cfg.optim, cfg.total_steps, trainable)
  opt_abs = jax.eval_shape(opt.init, pl.abstract)
  opt_sh = layout.state(opt_abs, pl.logical)
  sh = pl.step_shardings(opt_sh, train=pl.params, accum=pl.params)
  sc = plan_step_config(cfg, layout.mesh.size, seq[0], micro_batches)
  fn = steps.make_dense_step(model, methods.loss_config(cfg), opt, sc, sh=sh).jitted
  args = (None, with_shardings(pl.abstract, pl.params), with_shardings(opt_abs, opt_sh),
          abstract_batch(_rows(sc, layout, rows), *seq, pl.batch),
          telemetry_flag(layout.replicated))
  return Entry(fn, args, ('unused', 'params', 'opt_state', 'batch', 'telemetry'))


def entry(model_key: str, method: str, devices: int, micro_batches: int = 0) -> Entry:
  """The compiled-to-be step of one plan row on the first ``devices`` devices."""
  cfg = load_config(model_key, method)
  layout = parallel.Layout(parallel.make_mesh(1, devices, jax.devices()[:devices]),
                           parse_axis_rules(cfg.mesh.rules))
  seq = SEQUENCE.get(model_key, DEFAULT_SEQUENCE)
  make = logra_entry if method == 'logra' else dense_entry
  return make(cfg, make_model(cfg), layout, seq, micro_batches)._replace(
      mesh=layout.mesh)


def bytes_per_device(tree) -> int:
  """Bytes of one device's shards of an abstract tree (the largest shard per leaf)."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += int(np.prod(shape, dtype=np.int64)) * x.dtype.itemsize
  return total


def global_bytes(tree) -> int:
  """Bytes of an abstract tree's whole arrays (all devices' shards together, unreplicated)."""
  return sum(int(np.prod(x.shape, dtype=np.int64)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def memory(compiled) -> dict:
  """Per-device bytes of a compiled step; peak = arguments + outputs − aliased + temp."""
  m = compiled.memory_analysis()
  out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes,
             alias=m.alias_size_in_bytes, temp=m.temp_size_in_bytes)
  out['peak'] = out['argument'] + out['output'] - out['alias'] + out['temp']
  return out



def step_figures(cfg: TrainConfig, model, seq, rows: int) -> dict:
  """The trainer's step of ``cfg`` (LoGRA or dense AdamW) on one device, compiled on abstract
  inputs of ``rows`` sequences of ``seq`` = (prompt, completion) tokens in the config's
  micro-batches: the optimizer state's and the gradient's bytes (LoGRA: the sketches it
  accumulates; AdamW: the dense gradient) and XLA's per-step memory (`memory`)."""
  layout = parallel.Layout(parallel.make_mesh(1, 1, jax.devices()[:1]),
                           parse_axis_rules(cfg.mesh.rules))
  make = logra_entry if cfg.optim.name == 'logra' else dense_entry
  e = make(cfg, model, layout, seq, micro_batches=cfg.optim.micro_batches, rows=rows)
  with jax.set_mesh(layout.mesh):
    mem = memory(e.fn.lower(*e.args).compile())
  params = e.args[e.names.index('params')]
  if cfg.optim.name == 'logra':
    spec = optimizers.projection_spec(cfg.optim.logra, 0, hf_io.projection_name_fn(model.config))
    a = jax.eval_shape(lambda: steps.draw_projections(params, 0, 0, spec))
    grad = jax.eval_shape(sketch.zero_probes, params, a)
    if cfg.optim.logra.rest_learning_rate:  # and the rest's dense gradient
      grad = (grad, sketch.rest_of(params, a))
  else:
    grad = params
  return dict(opt_state_bytes=global_bytes(e.args[e.names.index('opt_state')]),
              grad_bytes=global_bytes(grad), param_bytes=global_bytes(params),
              step_peak_bytes=mem['peak'], step_temp_bytes=mem['temp'])
