"""Tiny RL runs for the trainer tests (tests/test_trainer*.py): config, reward, run, compare.

Every run is tiny (4 prompts x 4 samples, 1-4 steps, no warm start). A random model answers
no sum correctly, so the runs are rewarded for the FORMAT of the answer instead: 1 when the
completion starts with a digit (a random model does so about half the time), else -0.01.
Rewards then vary inside GRPO groups, the advantages are non-zero and the policy gradient is
what moves the weights (`rl.entropy_coef` = 0: no other term). The runs use the trainer's
real dtypes (x64 off), whatever other test modules set, and share a persistent XLA cache
(each Trainer re-jits the same programs).
"""
import jax
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache

from configs import tiny
from logra_jax.rl import rewards
from logra_jax.train import config as config_lib
from logra_jax.train import loop
from logra_jax.train.checkpoint import Checkpointer
from logra_jax.train.metrics import read_metrics

FORMAT_REWARD = 'starts_with_a_digit'
# warm_start.cache_dir of every make_config: the session's (tests/conftest.py sets it).
WARM_START_CACHE_DIR = ''


def starts_with_a_digit(completion: str, reference) -> float:
  """1 when the answer starts with a digit: a format reward a random tiny model often earns."""
  del reference
  return float(completion[:1].isdigit())


@pytest.fixture(scope='module', autouse=True)
def format_reward():
  """The runs' verifier, registered under FORMAT_REWARD (RewardScorer looks verifiers up)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setitem(rewards.VERIFIERS, FORMAT_REWARD, starts_with_a_digit)
    yield


@pytest.fixture(scope='module', autouse=True)
def xla_cache(tmp_path_factory):
  """Every run compiles the same few programs: a persistent cache (one per session, shared by
  the trainer test modules) compiles each once."""
  old = (jax.config.jax_compilation_cache_dir,
         jax.config.jax_persistent_cache_min_compile_time_secs)
  compilation_cache.set_cache_dir(str(tmp_path_factory.getbasetemp() / 'xla_cache'))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  compilation_cache.reset_cache()
  yield
  jax.config.update('jax_compilation_cache_dir', old[0])
  jax.config.update('jax_persistent_cache_min_compile_time_secs', old[1])
  compilation_cache.reset_cache()


def make_config(**overrides) -> config_lib.TrainConfig:
  """configs/tiny.py shrunk to seconds; ``overrides`` as section__key=value (optim__name=...)."""
  c = tiny.get_config()
  c.warm_start.steps = 0
  c.warm_start.cache_dir = WARM_START_CACHE_DIR
  c.data.prompts_per_step = 4
  c.data.samples_per_prompt = 4
  c.data.eval_size = 8
  c.eval.k = 2
  c.reward.verifier = FORMAT_REWARD
  c.rollout.launch_platform = 'cpu'  # launched servers (rollout.launch) on the CPU
  c.rl.entropy_coef = 0.0
  c.optim.kl_sequences = 4
  # A budget this small keeps α = sqrt(δ/q) below α_max = 1 (q ~ 2e-2 here), so the KL
  # control is what sets the LoGRA step size.
  c.optim.logra.kl_budget_init = c.optim.logra.kl_budget_final = 1e-4
  # The unsketched leaves frozen: the fleet's and the faults' runs sync the low-rank payload,
  # which carries the kernels only (the rest's own path: test_trainer_paths' logra_rest).
  c.optim.logra.rest_learning_rate = 0.0
  c.total_steps = 4
  c.eval_every = 2
  c.checkpoint_every = 2
  name = overrides.pop('optim__name', 'logra')
  if name != 'logra':  # the method's own defaults (a config sets only its method's keys)
    config_lib.switch_method(c, name)
  for key, value in overrides.items():
    *parents, leaf = key.split('__')
    node = c
    for p in parents:
      node = node[p]
    node[leaf] = value
  return config_lib.from_config_dict(c)


def quiet(*args, **kwargs):
  del args, kwargs


def train(cfg, workdir, log=quiet):
  with jax.enable_x64(False):
    return loop.train(cfg, str(workdir), progress=False, log=log)


def leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(leaves(a), leaves(b)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(x, y)


def trees_differ(a, b) -> bool:
  return any(np.any(x != y) for x, y in zip(leaves(a), leaves(b)))


def without_timing(row):
  return {k: v for k, v in row.items() if k not in loop.TIMING_KEYS}


def run_and_resume(make, workdir, stop_at: int):
  """An uninterrupted run of ``make()`` and one stopped after ``stop_at`` steps, resumed.

  Returns (uninterrupted, its rows, resumed, its rows); the interrupted run is checkpointed
  at ``stop_at`` (its last step), the resume is logged. A run evaluates at its last step, so
  ``stop_at`` must be an evaluation step of the uninterrupted run for the rows to agree.
  """
  assert stop_at % make().eval_every == 0, 'stop at an evaluation step'
  full_dir, part_dir = workdir / 'uninterrupted', workdir / 'resumed'
  full = train(make(), full_dir)
  first = train(make(total_steps=stop_at), part_dir)
  assert first.step == stop_at and Checkpointer(str(part_dir)).latest_step() == stop_at
  logs = []
  resumed = train(make(), part_dir, log=logs.append)
  assert resumed.resumed and any(f'resumed from step {stop_at}' in line for line in logs)
  return full, read_metrics(full_dir), resumed, read_metrics(part_dir)


def assert_same_run(full, full_rows, resumed, rows):
  """The resumed run repeats the uninterrupted one exactly: metrics and the whole state."""
  assert [r['step'] for r in rows] == list(range(full.cfg.total_steps + 1))
  assert [without_timing(r) for r in rows] == [without_timing(r) for r in full_rows]
  assert_trees_equal(resumed.state, full.state)
  assert_trees_equal(resumed.adv_state, full.adv_state)
  assert_trees_equal(resumed.ref, full.ref)
  assert resumed.mismatch == full.mismatch
