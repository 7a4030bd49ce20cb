"""Faults the trainer survives (issue 24, item 3): SIGTERM/SIGINT, multi-host on a fleet,
generation servers that die mid-run.

The runs are tests/trainer_runs.py's tiny runs (format reward: the policy gradient moves the
weights). The signal test runs experiments/train.py in a subprocess (the entry point and its
exit code are what is tested) with the format verifier registered first.
"""
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from logra_jax.train import loop
from logra_jax.train.checkpoint import Checkpointer
from logra_jax.train.metrics import read_metrics
from trainer_runs import (FORMAT_REWARD, format_reward, make_config, train,  # noqa: F401
                          without_timing, xla_cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, 'tests')

# experiments/train.py with trainer_runs' format verifier registered (the verifier lives in
# the tests, so the subprocess registers it before the entry point runs as __main__).
DRIVER = f"""
import runpy, sys
sys.path.insert(0, {TESTS!r})
import trainer_runs
from logra_jax.rl import rewards
rewards.VERIFIERS[trainer_runs.FORMAT_REWARD] = trainer_runs.starts_with_a_digit
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path({os.path.join(ROOT, 'experiments', 'train.py')!r}, run_name='__main__')
"""

# trainer_runs.make_config as command-line flags (the keys it sets, its values).
TINY_FLAGS = {
    'warm_start.steps': 0, 'data.prompts_per_step': 4, 'data.samples_per_prompt': 4,
    'data.eval_size': 8, 'eval.k': 2, 'reward.verifier': FORMAT_REWARD,
    'rl.entropy_coef': 0.0, 'optim.kl_sequences': 4, 'optim.logra.kl_budget_init': 1e-4,
    'optim.logra.kl_budget_final': 1e-4,
    # Steps after the first take well under a second here: enough of them that the signal,
    # sent once step 1 is written, lands mid-run.
    'total_steps': 12, 'eval_every': 4, 'checkpoint_every': 12,
}


def _command(workdir):
  return [sys.executable, '-c', DRIVER, f'--config={os.path.join(ROOT, "configs", "tiny.py")}',
          f'--workdir={workdir}'] + [f'--config.{k}={v}' for k, v in TINY_FLAGS.items()]


def _rows(workdir):
  path = os.path.join(workdir, 'metrics.jsonl')
  return read_metrics(workdir) if os.path.exists(path) else []


def _run_until_signalled(workdir, env, sig, after_step: int, timeout_s: float = 600):
  """Starts the run; sends ``sig`` once the metrics of ``after_step`` are written. Returns
  (return code, output)."""
  proc = subprocess.Popen(_command(workdir), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + timeout_s
    while not any(r['step'] >= after_step for r in _rows(workdir)):
      assert proc.poll() is None, proc.communicate()[0]
      assert time.monotonic() < deadline, 'the run wrote no step in time'
      time.sleep(0.2)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=timeout_s)
    return proc.returncode, out
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()


@pytest.mark.slow
def test_sigterm_checkpoints_and_the_same_command_resumes_exactly(tmp_path, shared_xla_env):
  """SIGTERM after step 1: the step in flight finishes, a checkpoint is written, the process
  says so and exits with 128 + SIGTERM; the same command resumes, and its metrics are those
  of an uninterrupted run (timing keys apart)."""
  env = dict(os.environ, **shared_xla_env)
  workdir = tmp_path / 'run'
  rc, out = _run_until_signalled(workdir, env, signal.SIGTERM, after_step=1)
  assert rc == 128 + signal.SIGTERM, out
  stopped = Checkpointer(str(workdir)).latest_step()
  assert stopped is not None and 1 <= stopped < TINY_FLAGS['total_steps'], out
  assert f'SIGTERM: stopped after step {stopped}' in out, out
  assert [r['step'] for r in _rows(workdir)] == list(range(stopped + 1))
  resumed = subprocess.run(_command(workdir), cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f'resumed from step {stopped}' in resumed.stdout + resumed.stderr
  full = train(make_config(total_steps=12, eval_every=4, checkpoint_every=12),
               tmp_path / 'uninterrupted')
  rows, full_rows = _rows(workdir), _rows(full.workdir)
  assert [r['step'] for r in rows] == list(range(TINY_FLAGS['total_steps'] + 1))
  assert [without_timing(r) for r in rows] == [without_timing(r) for r in full_rows]


# -------------------------------------------------------------- multi-host on a fleet


def test_a_fleet_with_several_processes_is_refused_naming_the_keys(tmp_path, monkeypatch):
  """Every process would pause and update the same servers: refused before any is built."""
  class Built(Exception):
    pass

  def fleet(*args):
    raise Built('a FleetGenerator was built')
  monkeypatch.setitem(loop.GENERATORS, 'http', fleet)
  monkeypatch.setattr(jax, 'process_count', lambda: 2)
  cfg = make_config(rollout__engine='http', rollout__launch=1)
  with pytest.raises(ValueError, match=r'rollout\.engine=http .*2 processes'):
    loop.Trainer(cfg, str(tmp_path), log=lambda *a: None)
