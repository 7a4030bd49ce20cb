"""experiments/profile_step.py: its variant parsing, the one-model rule, and a run on tiny.

No timing is asserted: the run checks that every variant was timed and that the last line's
differences are each variant's median minus the config's own.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import profile_step  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def test_parse_variant_reads_literals_and_strings():
  assert profile_step.parse_variant('no_probe:optim.logra.kl_control=False') == (
      'no_probe', {'optim.logra.kl_control': False})
  assert profile_step.parse_variant('x:model.remat_policy=full,optim.micro_batches=2') == (
      'x', {'model.remat_policy': 'full', 'optim.micro_batches': 2})


def test_variant_model_takes_compute_keys_and_refuses_other_model_keys():
  from logra_jax.models.presets import get_preset  # pylint: disable=g-import-not-at-top
  from logra_jax.models.transformer import Transformer  # pylint: disable=g-import-not-at-top
  from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top
  model = Transformer(get_preset('tiny', vocab_size=32))
  base = config_lib.default_config()
  cfg = config_lib.from_config_dict(base)
  assert profile_step.variant_model(model, cfg, cfg, 'same') is model
  base.model.remat_policy = 'full'
  remat = profile_step.variant_model(model, cfg, config_lib.from_config_dict(base), 'remat')
  assert remat.config.remat_policy == 'full' and model.config.remat_policy == 'none'
  base.model.dtype = 'bfloat16'  # the compute dtype: the same (param_dtype) weights
  bf16 = profile_step.variant_model(model, cfg, config_lib.from_config_dict(base), 'bf16')
  assert bf16.config.dtype == 'bfloat16' and bf16.config.param_dtype == 'float32'
  base.model.param_dtype = 'bfloat16'
  with pytest.raises(ValueError, match='model.param_dtype cannot vary'):
    profile_step.variant_model(model, cfg, config_lib.from_config_dict(base), 'weights')


@pytest.mark.slow
def test_profile_step_times_every_variant_on_tiny(tmp_path):
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'profile_step.py'),
       f'--config={os.path.join(ROOT, "configs", "tiny.py")}', f'--workdir={tmp_path}',
       '--batches=2', '--reps=1', '--config.data.prompts_per_step=4',
       '--config.data.samples_per_prompt=4', '--config.data.eval_size=4',
       '--config.optim.kl_sequences=4',
       '--variant=no_probe:optim.logra.kl_control=False',
       '--variant=remat:model.remat_policy=full,optim.micro_batches=2'],
      capture_output=True, text=True, timeout=600, cwd=ROOT)
  assert out.returncode == 0, out.stderr[-3000:]
  last = json.loads(out.stdout.strip().splitlines()[-1])
  assert set(last['step_s']) == {'full', 'no_probe', 'remat'}
  for name, t in last['step_s'].items():
    assert t > 0 and last['minus_full'][name] == pytest.approx(t - last['step_s']['full'])
  assert last['workload']['rows'] == 16 and last['workload']['batches'] == 2
