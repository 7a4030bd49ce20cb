r"""The memory plan's steps run for real on one device: compiled memory, measured peak, time.

For each method (LoGRA, dense AdamW) of ``--model`` on the first device: builds the same
jitted step as `experiments/memory_plan.py` (`logra_jax.analysis.memory_plan`), records
XLA's compiled memory analysis, and, when that fits the device, fills the inputs with random
values (weights ~ N(0, 0.02²), Rademacher A, random tokens), runs ``--steps`` steps (the
first compiles) and records the device's peak_bytes_in_use and the median step time.
A method whose plan exceeds the device is recorded as not run (dense 7B on one device).

  python experiments/gpu_measure.py --model=7b --out=/tmp/gpu_measure.json   # a GPU
  python experiments/gpu_measure.py --tiny --out=/tmp/gpu_tiny.json           # CPU check
"""
import json
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.analysis import memory_plan as mp

FLAGS = flags.FLAGS
flags.DEFINE_string('model', '7b', 'Plan row model: 1.5b, 7b, 27b.')
flags.DEFINE_bool('tiny', False, 'The tiny model (a CPU check of this code path).')
flags.DEFINE_list('methods', ['logra', 'dense'], 'Methods to run.')
flags.DEFINE_integer('micro_batches', 8, 'Micro-batches of one sequence (>= kl_sequences).')
flags.DEFINE_integer('steps', 4, 'Steps run (the first compiles; the median of the rest).')
flags.DEFINE_string('out', None, 'Where to write the JSON.')


def _random(x, key):
  """A random array like the abstract ``x`` (in its sharding)."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    make = lambda k: (0.02 * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
  elif x.dtype == jnp.bool_:
    make = lambda k: jnp.ones(x.shape, jnp.bool_)
  elif jnp.issubdtype(x.dtype, jnp.integer):
    make = lambda k: jnp.zeros(x.shape, x.dtype)
  else:  # a PRNG key
    return jax.random.key(0)
  return jax.jit(make, out_shardings=x.sharding)(key)


def materialize(entry, vocab: int):
  """Random inputs for an `Entry`: params, zero optimizer state, tokens (A is drawn in-step)."""
  key = jax.random.key(0)
  out = []
  for name, tree in zip(entry.names, entry.args):
    if tree is None:
      out.append(None)
      continue
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.fold_in(key, len(out)), len(leaves))
    if name == 'opt_state':
      vals = [jax.jit(lambda x=x: jnp.zeros(x.shape, x.dtype), out_shardings=x.sharding)()
              for x in leaves]
    elif name == 'budget':
      vals = [jnp.float32(2e-4)]
    else:
      vals = [_random(x, k) for x, k in zip(leaves, keys)]
    tree = jax.tree.unflatten(treedef, vals)
    if name == 'batch':
      tree = dict(tree, tokens=jax.jit(lambda k, x=tree['tokens']: jax.random.randint(
          k, x.shape, 0, vocab, jnp.int32), out_shardings=tree['tokens'].sharding)(key))
      tree['targets'] = jax.jit(lambda t: t[:, -tree['targets'].shape[1]:],
                                out_shardings=tree['targets'].sharding)(tree['tokens'])
      tree['target_mask'] = jnp.ones_like(tree['target_mask'])
      tree['behaviour_logp'] = jnp.full_like(tree['behaviour_logp'], -np.log(vocab))
    out.append(tree)
  return out


def run_method(model_key: str, method: str, micro_batches: int, steps: int) -> dict:
  cfg = mp.load_config(model_key, method)
  e = mp.entry(model_key, method, 1, micro_batches=micro_batches)
  t0 = time.time()
  compiled = e.fn.lower(*e.args).compile()
  row = dict(method=method, plan=mp.memory(compiled), compile_s=round(time.time() - t0, 1),
             micro_batches=micro_batches)
  dev = jax.devices()[0]
  limit = (dev.memory_stats() or {}).get('bytes_limit')
  row['bytes_limit'] = limit
  if limit and row['plan']['peak'] > limit:
    row['run'] = 'not run: the compiled plan exceeds the device'
    return row
  args = materialize(e, mp.make_model(cfg).config.vocab_size)
  times = []
  for _ in range(steps):
    t = time.time()
    out = compiled(*args)  # the plan's executable: no second compile
    jax.block_until_ready(out)
    times.append(time.time() - t)
    if method == 'logra':
      args[0], args[1] = out[0], out[1]
    else:
      args[1], args[2] = out[0], out[1]
  stats = dev.memory_stats() or {}
  row.update(run='ok', peak_bytes_in_use=stats.get('peak_bytes_in_use'),
             step_s_median=statistics.median(times[1:]) if steps > 1 else None,
             first_step_s=times[0],
             tokens_per_step=int(np.prod(args[e.names.index('batch')]['tokens'].shape)))
  del args, out
  return row


def main(argv):
  del argv
  model_key = 'tiny' if FLAGS.tiny else FLAGS.model
  result = dict(model=model_key, device=str(jax.devices()[0]), jax_version=jax.__version__,
                rows=[])
  for method in FLAGS.methods:  # LoGRA first: its measured peak is not mixed with dense's
    try:
      result['rows'].append(run_method(model_key, method, FLAGS.micro_batches, FLAGS.steps))
    except Exception as e:  # pylint: disable=broad-except  (an OOM is a result here)
      result['rows'].append(dict(method=method, run=f'failed: {type(e).__name__}: {e}'[:2000]))
    print(json.dumps(result['rows'][-1]), flush=True)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == '__main__':
  app.run(main)
