"""experiments/memory_breakdown.py on the tiny config: every jitted function compiled, and the
figures are XLA's own (peak = argument + output − aliased + temp; the steps donate their
params and optimizer state, so those are aliased)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_memory_breakdown_tiny():
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'memory_breakdown.py'), '--model=tiny',
       '--prompt_len=8', '--new_tokens=4', '--eval_rows=16'],
      capture_output=True, text=True, timeout=900, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  f = result['functions']
  assert set(f) == {'logra_step', 'adam_step', 'rollout_sampler', 'eval_sampler'}
  for name, m in f.items():
    assert m['peak'] == m['argument'] + m['output'] - m['alias'] + m['temp'], name
    assert m['argument'] >= result['params_gib'] * 2**30, name  # every function takes params
  # Donation: the steps' params and optimizer state are updated in place (aliased); Adam's
  # arguments hold the params and two moments, LoGRA's the params and row-sized moments.
  for name in ('logra_step', 'adam_step'):
    assert f[name]['alias'] >= result['params_gib'] * 2**30, name
  assert f['adam_step']['argument'] > 2.5 * f['logra_step']['argument']
  assert f['rollout_sampler']['alias'] == 0  # generation never donates the served params
  for name in ('logra_step', 'adam_step'):  # the trainer's whole batch, as it runs it
    assert f[name]['tokens_shape'] == [16, 8 + 4], name
  for name, m in f.items():  # each function also ran once on zeros
    assert 0 <= m['run_rss_gib'] < 1, name
  rss = list(result['peak_rss_gib'].values())  # a running peak: never decreases
  assert list(result['peak_rss_gib']) == ['imports', 'model_load', *f] and rss == sorted(rss)
  assert result['workload'] == dict(model='tiny', rows=16, prompt_len=8, new_tokens=4,
                                    eval_rows=16, kl_sequences=8, sets=[], micro_batches=1)
