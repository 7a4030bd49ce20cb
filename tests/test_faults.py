"""Faults the trainer survives (issue 24, item 3): SIGTERM/SIGINT, multi-host on a fleet,
generation servers that die mid-run.

The runs are tests/trainer_runs.py's tiny runs (format reward: the policy gradient moves the
weights). The signal test runs experiments/train.py in a subprocess (the entry point and its
exit code are what is tested) with the format verifier registered first.
"""
import dataclasses
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from logra_jax.bridge import client
from logra_jax.rl.types import GenerationRequest, SamplingParams
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
    'optim.logra.kl_budget_final': 1e-4, 'optim.logra.rest_learning_rate': 0.0,
    # Steps after the first take well under a second here: enough of them that the signal,
    # sent once step 1 is written, lands mid-run.
    'total_steps': 12, 'eval_every': 4, 'checkpoint_every': 12,
}


def test_the_command_line_flags_are_the_loop_tests_config():
  """TINY_FLAGS on configs/tiny.py is `make_config` (the in-process reference of the resume
  checks) but for where the warm start is cached and where launched servers run."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  c = tiny.get_config()
  config_lib.apply_overrides(c, TINY_FLAGS)
  flags = config_lib.from_config_dict(c)
  ref = make_config(total_steps=12, eval_every=4, checkpoint_every=12)
  same = lambda cfg: dataclasses.replace(
      cfg, warm_start=dataclasses.replace(cfg.warm_start, cache_dir=''),
      rollout=dataclasses.replace(cfg.rollout, launch_platform=''))
  assert same(flags) == same(ref)


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
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_a_stop_signal_checkpoints_and_the_same_command_resumes_exactly(tmp_path,
                                                                      shared_xla_env, sig):
  """SIGTERM (or SIGINT) after step 1: the step in flight finishes, a checkpoint is written,
  the process says so and exits with 128 + the signal; the same command resumes, and its
  metrics are those of an uninterrupted run (timing keys apart)."""
  env = dict(os.environ, **shared_xla_env)
  workdir = tmp_path / 'run'
  rc, out = _run_until_signalled(workdir, env, sig, after_step=1)
  assert rc == 128 + sig, out
  stopped = Checkpointer(str(workdir)).latest_step()
  assert stopped is not None and 1 <= stopped < TINY_FLAGS['total_steps'], out
  assert f'{sig.name}: stopped after step {stopped}' in out, out
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


# ------------------------------------------------------------ generation servers that die


def _choice_response(token_ids=(5, 6)):
  return {'choices': [{'token_ids': list(token_ids), 'finish_reason': 'stop',
                       'logprobs': {'token_logprobs': [-0.5] * len(token_ids)},
                       'weight_version': '0'}]}


def _fleet_with(monkeypatch, answers: dict):
  """A Fleet over fake URLs: ``answers[url]`` is None (the server is gone: the client's
  transit error) or the completions response it gives."""
  def call(server, method, path, body=None, headers=None):
    del method, body, headers
    if answers[server.url] is None:
      raise client.BridgeError(server.url, 0, f'unreachable after {client.RETRIES} tries')
    return answers[server.url] if path.startswith('/v1/completions') else {}
  monkeypatch.setattr(client.ServerClient, 'call', call)
  return client.Fleet(list(answers), 'token')


def _requests(n):
  return [GenerationRequest((1, 2, 3), SamplingParams(max_new_tokens=2, seed=i),
                            request_id=str(i)) for i in range(n)]


def test_requests_of_a_dead_server_go_to_the_others_and_it_is_marked_down(monkeypatch):
  dead, alive = 'http://127.0.0.1:1', 'http://127.0.0.1:2'
  fleet = _fleet_with(monkeypatch, {dead: None, alive: _choice_response()})
  try:
    results = fleet.generate(_requests(4))
    assert [r.request_id for r in results] == ['0', '1', '2', '3']
    assert all(r.completion_token_ids == (5, 6) for r in results)
    assert fleet.servers_up == 1 and fleet.down() == [0]
    # The update goes to the server that is up; the down one is not asked.
    stats = fleet.push(b'blob', 1, full_blob=lambda: b'full')
    assert stats['fleet_servers_up'] == 1 and stats['sync_servers'] == 1
  finally:
    fleet.close()


def test_no_server_up_raises_naming_every_server(monkeypatch):
  urls = ['http://127.0.0.1:1', 'http://127.0.0.1:2']
  fleet = _fleet_with(monkeypatch, dict.fromkeys(urls))
  try:
    with pytest.raises(client.FleetDown) as e:
      fleet.generate(_requests(2))
    assert all(u in str(e.value) for u in urls) and sorted(e.value.servers) == urls
  finally:
    fleet.close()


class _FleetThatGoesDown:
  """The embedded generator as the 'http' engine, whose servers are all gone from the
  ``fail_call``-th generate call (phase 'generate') or step ``fail_step``'s update on."""

  def __init__(self, phase, at, *args):
    self.inner = loop.GENERATORS['embedded'](*args)
    self.phase, self.at, self.calls = phase, at, 0

  @property
  def weight_version(self):
    return self.inner.weight_version

  def _down(self):
    raise client.FleetDown({'http://gen-a:8000': 'killed', 'http://gen-b:8000': 'killed'})

  def generate(self, requests):
    self.calls += 1
    if self.phase == 'generate' and self.calls >= self.at:
      self._down()
    return self.inner.generate(requests)

  def update_weights(self, params, version, update=None):
    if self.phase == 'update' and version >= self.at:
      self._down()
    self.inner.update_weights(params, version, update)
    return {'fleet_servers_up': 2.0}


@pytest.mark.slow
@pytest.mark.parametrize('phase, at, last_step', [
    ('generate', 3, 1),  # calls: eval 0, step 1, step 2's rollouts: down before step 2
    ('update', 2, 2),    # step 2 trained, its update finds no server
])
def test_no_server_up_checkpoints_names_the_servers_and_resumes(tmp_path, monkeypatch, phase,
                                                                at, last_step):
  """The run stops with FleetDown naming the servers, after checkpointing its last finished
  step; the same run, servers back, resumes and repeats an uninterrupted one."""
  make = lambda: make_config(rollout__engine='http', rollout__launch=2, checkpoint_every=4)
  up = lambda *args: _FleetThatGoesDown('never', 0, *args)
  monkeypatch.setitem(loop.GENERATORS, 'http', up)
  full = train(make(), tmp_path / 'uninterrupted')
  monkeypatch.setitem(loop.GENERATORS, 'http',
                      lambda *args: _FleetThatGoesDown(phase, at, *args))
  logs = []
  with pytest.raises(client.FleetDown, match='http://gen-a:8000.*http://gen-b:8000'):
    train(make(), tmp_path / 'run', log=logs.append)
  assert Checkpointer(str(tmp_path / 'run')).latest_step() == last_step
  assert any(f'checkpointed step {last_step}' in line and 'http://gen-a:8000' in line
             for line in logs), logs
  rows = _rows(tmp_path / 'run')
  assert [r['step'] for r in rows] == list(range(last_step + 1))
  assert rows[-1].get('fleet_servers_up', 2.0) == (0.0 if phase == 'update' else 2.0)
  monkeypatch.setitem(loop.GENERATORS, 'http', up)
  train(make(), tmp_path / 'run')
  rows, full_rows = _rows(tmp_path / 'run'), _rows(full.workdir)
  assert [r['step'] for r in rows] == list(range(5))
  skip = ('fleet_servers_up',) + loop.TIMING_KEYS
  same = lambda r: {k: v for k, v in r.items() if k not in skip}
  # A step whose update found no server is not evaluated (the evaluation needs servers).
  assert [same(r) for r in rows if r['step'] != last_step] == [
      same(r) for r in full_rows if r['step'] != last_step]


def _wait_serving(generator, i, timeout_s=300):
  """Until relaunched server ``i`` of a FleetGenerator writes its URL and answers /health."""
  port_file = generator._starting[i]  # pylint: disable=protected-access
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(port_file):
    assert time.monotonic() < deadline, 'the relaunched server did not start'
    time.sleep(0.2)
  with open(port_file) as f:
    client.ServerClient(f.read().strip(), 'token').wait_healthy(timeout_s)


@pytest.mark.slow
def test_kill_9_of_a_launched_server_is_survived(tmp_path, monkeypatch):
  """One of 2 launched servers is killed (SIGKILL) before step 3: its requests go to the other
  (the same samples: a request's seed decides them), it is relaunched, and once it serves
  (waited for before step 5: a relaunch never holds the run up) it gets full weights and
  rejoins. The run completes with the embedded run's rollouts and evaluations."""
  make = lambda **kw: make_config(**{'total_steps': 6, 'eval_every': 3,
                                     'rollout__engine': 'http', 'rollout__launch': 2,
                                     'rollout__drift_check_every': 1, **kw})
  step, killed = loop.Trainer.train_step, []

  def train_step(self):
    procs = self.generator._procs  # pylint: disable=protected-access
    if self.step + 1 == 3:
      killed.append(procs[0].pid)
      os.kill(procs[0].pid, signal.SIGKILL)
      procs[0].wait()
    if self.step + 1 == 5:
      _wait_serving(self.generator, 0)
    return step(self)
  monkeypatch.setattr(loop.Trainer, 'train_step', train_step)
  trainer = train(make(), tmp_path / 'fleet')
  rows = read_metrics(tmp_path / 'fleet')
  assert [r['step'] for r in rows] == list(range(7))
  up = [r['fleet_servers_up'] for r in rows[1:]]
  assert up[:2] == [2.0, 2.0] and up[2] == 1.0 and up[4:] == [2.0, 2.0], up
  assert [r['fleet_rejoined'] for r in rows[1:]] == [0.0] * 4 + [1.0, 0.0]
  assert trainer.generator._procs[0].pid != killed[0]  # pylint: disable=protected-access
  # Both servers serve the trainer's weights again (the relaunched one got them in full).
  assert all(r['generator_drift'] < 1e-6 for r in rows[5:])
  monkeypatch.setattr(loop.Trainer, 'train_step', step)
  embedded = read_metrics(train(make(rollout__engine='embedded', rollout__launch=0),
                                tmp_path / 'embedded').workdir)
  for row, ref in zip(rows, embedded):
    for key in ('reward_mean', 'accuracy', 'response_length', 'eval_accuracy'):
      assert row.get(key) == ref.get(key), (row['step'], key)
