"""The warm-start cache (logra_jax/train/warm_start_cache.py): a hit is the computed warm start,
bit for bit and placed alike, and every input of the warm start is in the key."""
import dataclasses
import os

import jax
import numpy as np
import pytest

from configs import tiny
from logra_jax import data
from logra_jax.train import config as config_lib
from logra_jax.train import tasks
from logra_jax.train import warm_start_cache as cache
from trainer_runs import make_config, xla_cache  # noqa: F401  (xla_cache: one program for both)


def _config(**warm):
  c = tiny.get_config()
  c.data.eval_size = 8
  c.warm_start.steps, c.warm_start.batch_size = 3, 8
  for key, value in warm.items():
    c.warm_start[key] = value
  return config_lib.from_config_dict(c)


@pytest.fixture(scope='module')
def setup():
  cfg = _config()
  task = tasks.build_task(cfg)
  model, _, params = tasks.build_model(cfg, task)
  return cfg, task, model, params


class _OtherKind:
  """A device that prints as ``device`` but is of another kind."""

  def __init__(self, device):
    self.device = device
    self.device_kind = device.device_kind + ' (another model)'

  def __str__(self):
    return str(self.device)


def _equal(a, b) -> bool:
  return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _cached(cfg, directory):
  return dataclasses.replace(cfg, warm_start=dataclasses.replace(cfg.warm_start,
                                                                 cache_dir=directory))


def test_a_hit_is_the_computed_warm_start_bit_for_bit(setup, tmp_path, monkeypatch):
  cfg, task, model, params = setup
  cfg = _cached(cfg, str(tmp_path / 'cache'))
  lines = []
  computed = cache.warm_start(cfg, task, model, params, lines.append)
  assert len(list(tmp_path.glob('cache/*.npz'))) == 1 and 'loaded from' not in lines[-1], lines
  loaded = cache.warm_start(cfg, task, model, params, lines.append)
  assert lines[-1].startswith('supervised warm start:'), lines
  assert f'loaded from warm_start.cache_dir={tmp_path}/cache' in lines[-1], lines
  # The final loss in the line is the computed run's, read back from the cache file.
  assert lines[-1].split('(final loss ')[1][:5] == lines[-2].split('(final loss ')[1][:5]
  assert not _equal(computed, params)  # the warm start moved the weights
  assert _equal(loaded, computed)
  assert all(a.dtype == b.dtype and a.sharding == b.sharding
             for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(computed)))
  # With cache_dir='', the warm start runs (no file is read or written): the same weights.
  # The environment switch it replaced does nothing.
  monkeypatch.setenv('LOGRA_WARM_START_CACHE', str(tmp_path / 'env'))
  assert _equal(cache.warm_start(_cached(cfg, ''), task, model, params, lines.append), computed)
  assert [p.name for p in tmp_path.iterdir()] == ['cache'], list(tmp_path.iterdir())
  assert len(list(tmp_path.glob('cache/*.npz'))) == 1 and 'loaded from' not in lines[-1], lines


def test_every_input_of_the_warm_start_is_in_the_key(setup, monkeypatch):
  cfg, task, model, params = setup
  batch = data.warm_start_batch(task.train_records, task.tokenizer)
  key = cache.cache_key(cfg, model, params, batch)
  assert cache.cache_key(cfg, model, params, dict(batch)) == key  # deterministic
  other_batch = dict(batch, loss_mask=batch['loss_mask'].copy())
  other_batch['loss_mask'][0, -1] = 1 - other_batch['loss_mask'][0, -1]
  leaves, treedef = jax.tree_util.tree_flatten(params)
  other_params = jax.tree_util.tree_unflatten(treedef, [leaves[0] + 1] + leaves[1:])
  changed = {
      'steps': cache.cache_key(_config(steps=4), model, params, batch),
      'learning_rate': cache.cache_key(_config(learning_rate=2e-3), model, params, batch),
      'batch_size': cache.cache_key(_config(batch_size=16), model, params, batch),
      'seed': cache.cache_key(dataclasses.replace(cfg, seed=cfg.seed + 1), model, params, batch),
      'model': cache.cache_key(dataclasses.replace(cfg, model=dataclasses.replace(
          cfg.model, dtype='bfloat16')), model, params, batch),
      'params': cache.cache_key(cfg, model, other_params, batch),
      'batch': cache.cache_key(cfg, model, params, other_batch),
  }
  with monkeypatch.context() as mp:
    mp.setattr(cache, 'code_digest', lambda: 'other sources')
    changed['code'] = cache.cache_key(cfg, model, params, batch)
  with monkeypatch.context() as mp:  # XLA_FLAGS change the compiled SFT program
    mp.setenv('XLA_FLAGS', os.environ.get('XLA_FLAGS', '') + ' --xla_cpu_enable_fast_math=true')
    changed['XLA_FLAGS'] = cache.cache_key(cfg, model, params, batch)
  with monkeypatch.context() as mp:  # another CPU: other instructions, other rounding
    mp.setattr(cache, 'cpu_features', lambda: 'sse2')
    changed['cpu'] = cache.cache_key(cfg, model, params, batch)
  device = jax.devices()[0]
  with monkeypatch.context() as mp:  # another accelerator of the same platform
    mp.setattr(jax, 'devices', lambda *a: [_OtherKind(device)])
    changed['device_kind'] = cache.cache_key(cfg, model, params, batch)
  changed['cache_dir (not an input)'] = cache.cache_key(_cached(cfg, '/elsewhere'), model,
                                                          params, batch)
  same = [name for name, k in changed.items() if k == key]
  assert same == ['cache_dir (not an input)'], f'the key ignores {same}'
  with jax.enable_x64(True):
    assert cache.cache_key(cfg, model, params, batch) != key  # x64 changes the SFT program


def test_the_suites_runs_get_the_session_cache_through_the_config_key(warm_start_cache_dir):
  """tests/conftest.py's one directory per session reaches trainer_runs.make_config's runs as
  the config key (the trainer reads no environment switch)."""
  assert warm_start_cache_dir and make_config().warm_start.cache_dir == warm_start_cache_dir
