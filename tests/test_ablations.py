"""The paper's ablations, tiny variants, run as their command lines (experiments/compare_lora.py;
tests/test_ablate.py has the rank and KL-budget ablations)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARMS = ('logra', 'lora', 'adam')


@pytest.mark.slow
def test_compare_lora_tiny_writes_memory_time_and_pass_at_1(tmp_path, shared_xla_env):
  """LoRA and LoGRA steps hold no dense optimizer state and form no dense gradient: their
  compiled argument and temp bytes are below dense AdamW's (tiny: 0.45M params, rank 64)."""
  cmd = [sys.executable, os.path.join(ROOT, 'experiments', 'compare_lora.py'),
         f'--config={ROOT}/configs/compare_lora.py:tiny', f'--workdir={tmp_path}']
  env = dict(os.environ, **shared_xla_env,
             PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
  assert proc.returncode == 0, proc.stderr[-4000:]
  for name in ('results.md', 'results.json', 'compare_lora.png'):
    assert os.path.getsize(tmp_path / name) > 0, name
  with open(tmp_path / 'results.json') as f:
    methods = json.load(f)['methods']
  assert tuple(methods) == ARMS
  for name, r in methods.items():
    mem = r['memory']
    assert mem['argument_size_in_bytes'] > 0 and mem['peak_bytes'] > 0, name
    assert 0.0 <= r['pass_at_1_start'] <= 1.0 and 0.0 <= r['pass_at_1'] <= 1.0, name
    assert r['step_time_s'] > 0 and len(r['step_times_s']) >= 5, name
    assert r['eval_curve'][0][0] == 0 and r['eval_curve'][-1][0] > 0, name
  dense = methods['adam']['memory']
  for name in ('lora', 'logra'):
    for key in ('argument_size_in_bytes', 'temp_size_in_bytes'):
      assert methods[name]['memory'][key] < dense[key], (name, key, methods[name]['memory'])
  assert '| lora |' in (tmp_path / 'results.md').read_text()
