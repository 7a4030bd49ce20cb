"""An opt-in on-disk cache of supervised warm starts (docs/warm_start_cache.md).

With the config key warm_start.cache_dir=DIR, `warm_start` keeps each warm-started policy in
DIR/<key>.npz, the key a SHA-256 of everything the warm start reads: the model config, the
initial parameters (values, dtypes, shapes, shardings), the supervised batch, the warm-start
steps, learning rate, batch size and seed, the devices and what they are (platform, device
kind, the CPU's features), XLA_FLAGS, the x64 and matmul-precision settings, and the code (this
package's sources; the JAX, jaxlib, Flax and optax versions). A later run with the same key
loads the saved parameters (bit-identical to recomputing them, placed with the computed ones'
partition specs) instead of repeating the SFT steps. With '' (the default), on more than one
process, or for parameters that are not all NamedSharding arrays on one mesh, it is not used.
"""
import dataclasses
import functools
import glob
import hashlib
import json
import os
import platform
import tempfile

import flax
import jax
import jaxlib
import numpy as np
import optax
from jax.extend import backend as jax_backend
from jax.sharding import NamedSharding, PartitionSpec

from logra_jax import data
from logra_jax.train import tasks
from logra_jax.train import warm_start as sft

KEY = 'warm_start.cache_dir'  # the config key that turns the cache on


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
  """SHA-256 of this package's Python sources and the versions of the libraries it runs on."""
  versions = (jax.__version__, jaxlib.__version__, flax.__version__, optax.__version__)
  h = hashlib.sha256(repr(versions).encode())
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  for path in sorted(glob.glob(os.path.join(root, 'logra_jax', '**', '*.py'), recursive=True)):
    h.update(os.path.relpath(path, root).encode())
    with open(path, 'rb') as f:
      h.update(f.read())
  return h.hexdigest()


def cpu_features() -> str:
  """The host CPU's feature flags (what XLA's CPU code generation targets)."""
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        name, _, value = line.partition(':')
        if name.strip() in ('flags', 'Features'):  # x86, ARM
          return ' '.join(sorted(value.split()))
  except OSError:
    pass
  return f'{platform.machine()} {platform.processor()}'


def device_description() -> tuple:
  """What the warm start runs on: the backend, its version, every device's kind, the CPU."""
  backend = jax_backend.get_backend()
  return (jax.default_backend(), backend.platform_version,
          [(str(d), d.device_kind) for d in jax.devices()], cpu_features())


def cache_key(cfg, model, params, batch: dict) -> str:
  """SHA-256 over the warm start's inputs (a changed value gives another key)."""
  h = hashlib.sha256(code_digest().encode())
  w = cfg.warm_start
  for part in (repr(dataclasses.asdict(cfg.model)), repr(getattr(model, 'config', None)),
               w.steps, w.learning_rate, w.batch_size, cfg.seed, device_description(),
               os.environ.get('XLA_FLAGS', ''),
               jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision):
    h.update(repr(part).encode())
  leaves, treedef = jax.tree_util.tree_flatten(params)
  h.update(repr(treedef).encode())
  for leaf in leaves:
    h.update(repr((leaf.shape, str(leaf.dtype), str(getattr(leaf, 'sharding', '')))).encode())
    h.update(np.ascontiguousarray(jax.device_get(leaf)).tobytes())
  for name in sorted(batch):
    h.update(name.encode() + repr(batch[name].shape).encode())
    h.update(np.ascontiguousarray(batch[name]).tobytes())
  return h.hexdigest()


def _spec(sharding):
  """A NamedSharding's partition spec as JSON (None, a mesh axis or a list of axes each)."""
  return [list(e) if isinstance(e, tuple) else e for e in sharding.spec]


def load(path: str, params):
  """(params like ``params`` with the saved values and shardings, loss) or None if absent."""
  if not os.path.exists(path):
    return None
  leaves, treedef = jax.tree_util.tree_flatten(params)
  with np.load(path) as f:
    specs, dtypes = json.loads(str(f['specs'])), json.loads(str(f['dtypes']))
    if len(specs) != len(leaves):
      raise ValueError(f'{path}: {len(specs)} arrays, the model has {len(leaves)}')
    # npz keeps bfloat16 as raw 2-byte records: view them as the saved dtype again.
    saved = [f[f'leaf_{i}'].view(np.dtype(d)) for i, d in enumerate(dtypes)]
    loss = float(f['loss'])
  out = [jax.device_put(s, NamedSharding(l.sharding.mesh, PartitionSpec(*[
      tuple(e) if isinstance(e, list) else e for e in spec])))
         for s, l, spec in zip(saved, leaves, specs)]
  return jax.tree_util.tree_unflatten(treedef, out), loss


def cacheable(params, out) -> bool:
  """Every leaf in and out is a NamedSharding on one mesh (what `load` can rebuild)."""
  pairs = zip(jax.tree.leaves(params), jax.tree.leaves(out))
  return all(isinstance(a.sharding, NamedSharding) and isinstance(b.sharding, NamedSharding)
             and a.sharding.mesh == b.sharding.mesh for a, b in pairs)


def save(path: str, params, loss: float):
  """Writes ``params`` (values, partition specs) and ``loss`` to ``path`` atomically."""
  leaves = jax.tree_util.tree_leaves(params)
  arrays = {f'leaf_{i}': np.asarray(jax.device_get(l)) for i, l in enumerate(leaves)}
  specs = json.dumps([_spec(l.sharding) for l in leaves])
  dtypes = json.dumps([str(l.dtype) for l in leaves])
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix='.tmp.npz')
  os.close(fd)
  np.savez(tmp, loss=np.float64(loss), specs=np.asarray(specs), dtypes=np.asarray(dtypes),
           **arrays)
  os.replace(tmp, path)  # concurrent writers of one key write the same bytes: either wins


def warm_start(cfg, task, model, params, log=print):
  """`tasks.warm_start`, through the cache in warm_start.cache_dir when it is set."""
  directory = cfg.warm_start.cache_dir
  if not directory or jax.process_count() > 1:
    return tasks.warm_start(cfg, task, model, params, log)
  w = cfg.warm_start
  batch = data.warm_start_batch(task.train_records, task.tokenizer)
  path = os.path.join(directory, cache_key(cfg, model, params, batch) + '.npz')
  hit = load(path, params)
  if hit is not None:
    log(tasks.warm_start_line(w.steps, hit[1], f'; loaded from {KEY}={directory}'))
    return hit[0]
  out, loss = sft.warm_start(model, params, batch, w.steps, w.learning_rate, w.batch_size,
                             cfg.seed)
  if cacheable(params, out):
    os.makedirs(directory, exist_ok=True)
    save(path, out, loss)
  log(tasks.warm_start_line(w.steps, loss))
  return out
