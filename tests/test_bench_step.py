"""experiments/bench_step.py end to end on the tiny model (a CI-sized workload: no timings are
asserted, only that every program ran and the last line is the promised JSON)."""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = ('logra', 'adam', 'lora', 'sketch_backward', 'plain_backward', 'dense_grad')


def test_bench_step_tiny_ends_with_the_ratios_json():
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'bench_step.py'), '--model=tiny',
       '--prompts=2', '--samples=2', '--prompt_len=4', '--new_tokens=3', '--reps=2',
       '--config=optim.kl_sequences=2'],
      capture_output=True, text=True, timeout=900, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stdout.strip().splitlines()
  result = json.loads(lines[-1])
  med = result['median_s']
  assert set(med) == set(PROGRAMS)
  assert all(v > 0 and math.isfinite(v) for v in med.values()), med
  assert result['logra_over_adam'] == med['logra'] / med['adam']
  assert result['sketch_over_backward'] == med['sketch_backward'] / med['plain_backward']
  assert result['workload']['rows'] == 4 and result['workload']['model'] == 'tiny'
  for name in PROGRAMS:  # the human-readable table, one line per program, n = reps
    assert any(line.startswith(name) and '(n=2)' in line for line in lines), out.stdout
