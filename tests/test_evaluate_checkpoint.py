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

from logra_jax.data import tiny_task
from logra_jax.train import loop, tasks
from logra_jax.train.metrics import read_metrics
from trainer_runs import (assert_trees_equal, format_reward, make_config,  # noqa: F401
                          train, trees_differ, xla_cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import direction_quality as dq  # noqa: E402  pylint: disable=g-import-not-at-top

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


def test_checkpoint_policies_reads_each_step_with_one_model(run, monkeypatch):
  """policy_at(step) is that checkpoint's policy (step 4's: the run's final one), the model is
  built once for both, and nothing in the run's folder changes."""
  cfg, workdir, _, final = run
  builds = []
  real = tasks.build_model
  monkeypatch.setattr(tasks, 'build_model', lambda *a, **k: builds.append(1) or real(*a, **k))
  before = files(workdir)
  with jax.enable_x64(False):
    assert loop.checkpoint_steps(str(workdir), [4, None, 2]) == [4, 4, 2]
    _, _, _, policy_at = loop.checkpoint_policies(cfg, str(workdir))
    at = {s: jax.device_get(policy_at(s)) for s in (2, 4)}
  assert files(workdir) == before and len(builds) == 1
  assert_trees_equal(at[4], final)
  assert trees_differ(at[2], final)


def test_form_logliks_in_place_equal_the_probes_from_a_copied_policy(run, monkeypatch,
                                                                    tmp_path):
  """direction_quality's --from_steps path (one model, checkpoints read in place) gives each
  step the J_F that --from_step's path (the policy copied, a Trainer resumed from it) gives,
  exactly. The tiny task is no arithmetic and its tokenizer knows digits and '+=-* ' only:
  the forms' answers here are 'C' and 'C = C', through the real form_batch."""
  cfg, workdir, _, _ = run
  texts = {'terse': '{c}', 'template': '{c} = {c}'}
  monkeypatch.setattr(dq, 'form_text', lambda form, ref: texts[form].format(c=ref))
  encode = tiny_task.CharTokenizer.encode
  monkeypatch.setattr(tiny_task.CharTokenizer, 'encode',  # the HF keyword form_batch passes
                      lambda self, text, add_special_tokens=False, **kw: encode(self, text, **kw))
  with jax.enable_x64(False):
    got = dq.form_logliks(cfg, str(workdir), [2, 4], chunk=4, log=lambda *_: None)
    for row in got:
      dq.copy_policy(str(workdir), str(tmp_path / str(row['step'])), row['step'])
      want = dq.form_probe(cfg, str(tmp_path / str(row['step'])), 0, loglik_only=True,
                           chunk=4, log=lambda *_: None)
      assert row == {'step': want['step'], 'loglik': want['loglik'], 'problems': 8}
  assert [r['step'] for r in got] == [2, 4]
  assert got[0]['loglik'] != got[1]['loglik']  # the two policies differ
  assert set(got[0]['loglik']) == set(dq.FORMS)


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
