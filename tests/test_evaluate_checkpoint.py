"""A run's checkpoint evaluated after the run (`loop.evaluate_checkpoint`,
`experiments/evaluate.py`): with the run's config it repeats the run's logged evaluation from
the restored policy, writing nothing in the run's directory; `eval.max_new_tokens` reaches the
generator. The run is tests/trainer_runs.py's (format reward: the weights move)."""
import json
import os
import subprocess
import sys

import jax
import pytest

from logra_jax.train import loop
from logra_jax.train.metrics import read_metrics
from trainer_runs import (assert_trees_equal, format_reward, make_config,  # noqa: F401
                          train, trees_differ, xla_cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL_KEYS = ('eval_accuracy', 'eval_pass_at_k', 'eval_truncation_rate')


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """4 LoGRA steps, evaluated and checkpointed at steps 2 and 4; the final policy."""
  workdir = tmp_path_factory.mktemp('evaluate_checkpoint')
  cfg = make_config()
  trainer = train(cfg, workdir)
  logged = {r['step']: r for r in read_metrics(str(workdir)) if 'eval_accuracy' in r}
  final = jax.device_get(trainer.method.policy_params(trainer.state))
  return cfg, workdir, logged, final


def recording_generators(monkeypatch):
  """The real embedded generator, with what it is built from and asked for recorded."""
  seen = {'params': [], 'limits': [], 'lengths': []}
  real = loop.GENERATORS['embedded']

  def build(cfg, workdir, model_config, params, version, pad_id):
    seen['params'].append(jax.device_get(params))
    gen = real(cfg, workdir, model_config, params, version, pad_id)
    generate = gen.generate

    def recorded(requests):
      seen['limits'] += [r.params.max_new_tokens for r in requests]
      results = generate(requests)
      seen['lengths'] += [len(r.completion_token_ids) for r in results]
      return results
    gen.generate = recorded
    return gen
  monkeypatch.setitem(loop.GENERATORS, 'embedded', build)
  return seen


def files(workdir):
  return {os.path.relpath(os.path.join(d, f), workdir): os.stat(os.path.join(d, f)).st_mtime_ns
          for d, _, names in os.walk(workdir) for f in names}


def test_it_repeats_the_logged_evaluation_from_the_restored_policy(run, monkeypatch):
  cfg, workdir, logged, final = run
  seen = recording_generators(monkeypatch)
  before = files(workdir)
  with jax.enable_x64(False):
    outs = {step: loop.evaluate_checkpoint(cfg, str(workdir), step) for step in (2, 4)}
    latest = loop.evaluate_checkpoint(cfg, str(workdir))
  assert files(workdir) == before  # read-only: no file written, touched or removed
  for step, out in outs.items():
    assert out['step'] == step and out['max_new_tokens'] == cfg.rollout.max_new_tokens
    assert {k: out[k] for k in EVAL_KEYS} == {k: logged[step][k] for k in EVAL_KEYS}, step
  assert latest == outs[4]
  # The generator got the checkpoint's policy: step 4's is the run's final one, step 2's not.
  assert_trees_equal(seen['params'][1], final)
  assert trees_differ(seen['params'][0], final)
  assert set(seen['limits']) == {cfg.rollout.max_new_tokens}


def test_eval_max_new_tokens_is_the_held_out_limit(run, monkeypatch):
  _, workdir, _, _ = run
  seen = recording_generators(monkeypatch)
  with jax.enable_x64(False):
    out = loop.evaluate_checkpoint(make_config(eval__max_new_tokens=2), str(workdir), 4)
  assert out['max_new_tokens'] == 2 and set(seen['limits']) == {2}
  assert max(seen['lengths']) == 2  # the run's limit is 4: some completions are cut at 2
  assert 0.0 < out['eval_truncation_rate'] <= 1.0


def test_a_missing_step_is_named_with_the_steps_there(run, tmp_path):
  cfg, workdir, _, _ = run
  with pytest.raises(ValueError, match=r'no checkpoint of step 3 .*\[2, 4\]'):
    loop.evaluate_checkpoint(cfg, str(workdir), 3)
  with pytest.raises(ValueError, match='no checkpoints/ in'):  # and creates none there
    loop.evaluate_checkpoint(cfg, str(tmp_path))
  assert not os.listdir(tmp_path)


def test_the_command_prints_and_writes_one_json_line(run, tmp_path):
  """experiments/evaluate.py on the same run: configs/tiny.py with the overrides that shape
  the held-out set and the checkpoint (the exact verifier: the format one is the tests')."""
  _, workdir, logged, _ = run
  out_file, answers_file = tmp_path / 'eval.json', tmp_path / 'answers.jsonl'
  cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'evaluate.py'),
         f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}", f'--workdir={workdir}',
         '--step=4', f'--out={out_file}', f'--answers={answers_file}',
         '--config.warm_start.steps=0',
         '--config.data.eval_size=8', '--config.eval.k=2',
         '--config.optim.logra.rest_learning_rate=0.0']
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=False)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  line = done.stdout.strip().splitlines()[-1]
  assert json.loads(line) == json.loads(out_file.read_text())
  out = json.loads(line)
  assert (out['step'], out['max_new_tokens']) == (4, 4)
  # Truncation does not depend on the verifier: the same completions as the run's evaluation.
  assert out['eval_truncation_rate'] == logged[4]['eval_truncation_rate']
  # Every held-out completion, in order (8 problems x k = 2), adding up to the line's figures.
  answers = [json.loads(a) for a in answers_file.read_text().splitlines()]
  assert [a['problem'] for a in answers] == [i // 2 for i in range(16)]
  assert sum(a['correct'] for a in answers) / 16 == out['eval_accuracy']
  assert sum(a['finish_reason'] == 'length' for a in answers) / 16 == out['eval_truncation_rate']
  assert all(a['tokens'] <= 4 and isinstance(a['completion'], str) for a in answers)
