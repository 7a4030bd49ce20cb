"""experiments/bench_vs_trl.py: the fair harness end to end on a tiny model, its medians and
ratios.

The SmolLM2 workload takes ~15 minutes a round here, so it is run by hand (docs/benchmarks.md
has the command). Tested here: the ratios over rounds against values worked out by hand, and
the whole harness on ``--model=tiny`` (TRL's GRPOTrainer in its venv without and with
gradient checkpointing, our trainer without and with remat, 2 interleaved rounds): that the
runs interleave round by round, that both sides record their tokens, and that every run
processed the same prompts, in the same order (by their ids in the prompts file). No timings
are asserted.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'experiments'))
import bench_vs_trl  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

STEPS, PROMPTS, SAMPLES, NEW_TOKENS, ROUNDS = 2, 4, 2, 8, 2


def test_summarize_medians_after_the_warm_up():
  result = {'step_s': [50.0, 20.0, 10.0, 12.0], 'generate_s': [5.0, 4.0, 4.0, 6.0],
            'score_s': [1.0, 0.5, 0.1, 0.3], 'train_s': [40.0, 15.0, 5.0, 5.0],
            'other_s': [4.0, 0.5, 0.9, 0.7], 'tokens_prompt': [9, 9, 9, 9],
            'tokens_generated': [30, 20, 40, 10], 'tokens_trained': [30, 20, 40, 10],
            'peak_rss_gib': 2.5, 'prompt_ids': [[0], [1], [2], [3]]}
  s = bench_vs_trl.summarize(result, skip=1)
  # Steps 2-4: step median of (20, 10, 12) = 12; generated tokens median of (20, 40, 10) = 20.
  assert (s['step_s'], s['generate_s'], s['score_s'], s['train_s'], s['other_s']) == (
      12.0, 4.0, 0.3, 5.0, 0.7)
  assert (s['tokens_generated'], s['tokens_per_s'], s['steps']) == (20.0, 20 / 12, 3)
  assert s['prompt_ids'] == [[0], [1], [2], [3]] and s['peak_rss_gib'] == 2.5


def _arm(step, rss, tokens=64.0, remat=None):
  out = {'step_s': step, 'peak_rss_gib': rss, 'tokens_per_s': tokens / step,
         'tokens_prompt': 100.0, 'tokens_generated': tokens, 'tokens_trained': tokens}
  return dict(out, remat_policy=remat) if remat else out


def test_ratios_take_ours_best_against_trls_fastest_and_smallest():
  # Round 1: TRL off 10 s / 8 GiB, on 14 s / 4 GiB; ours none 6 s / 3 GiB, full 7 s / 2 GiB.
  # Round 2: TRL off 20 s, on 4 GiB; ours none 8 s / 3 GiB, full 9 s / 3 GiB.
  # Fastest of ours by median step: none (7 s against 8 s); smallest by median RSS: full
  # (2.5 GiB against 3). Time ratios 6/10 and 8/20: median 0.5, range [0.4, 0.6]; RSS ratios
  # 2/4 and 3/4: median 0.625, range [0.5, 0.75]; tokens/s (64 each): 10/6 and 20/8.
  rounds = [{'trl_gc_off': _arm(10.0, 8.0), 'trl_gc_on': _arm(14.0, 4.0),
             'ours_remat_none': _arm(6.0, 3.0, remat='none'),
             'ours_remat_full': _arm(7.0, 2.0, remat='full'),
             'adam_remat_none': _arm(12.0, 6.0, remat='none')},
            {'trl_gc_off': _arm(20.0, 8.0), 'trl_gc_on': _arm(28.0, 4.0),
             'ours_remat_none': _arm(8.0, 3.0, remat='none'),
             'ours_remat_full': _arm(9.0, 3.0, remat='full'),
             'adam_remat_none': _arm(16.0, 6.0, remat='none')}]
  r = bench_vs_trl.ratios(rounds, ['ours_remat_none', 'ours_remat_full'], 'adam_remat_none')
  assert (r['ours_fastest'], r['ours_smallest']) == ('ours_remat_none', 'ours_remat_full')
  assert r['step_time_ratio'] == pytest.approx(0.5)
  assert r['step_time_ratio_range'] == pytest.approx([0.4, 0.6])
  assert r['peak_rss_ratio'] == pytest.approx(0.625)
  assert r['peak_rss_ratio_range'] == pytest.approx([0.5, 0.75])
  assert r['tokens_per_s_ratio'] == pytest.approx((10 / 6 + 20 / 8) / 2)
  # Adam: 12/10, 16/20 -> median 1.0; RSS 6/4 both rounds; LoGRA over adam 6/12, 8/16.
  assert (r['adam_step_time_ratio'], r['adam_peak_rss_ratio'], r['logra_over_adam']) == (
      pytest.approx(1.0), pytest.approx(1.5), pytest.approx(0.5))
  assert r['rounds'] == 2 and r['ours_remat'] == ['none', 'full']
  assert r['trl_gradient_checkpointing'] == [False, True]
  assert r['tokens_per_step']['ours'] == {'prompt': 100.0, 'generated': 64.0, 'trained': 64.0}


def test_a_setting_with_micro_batches_reaches_our_worker():
  """'none:2' is remat none with optim.micro_batches=2 (its own arm name); 'full' keeps the
  config's micro-batches (no flag)."""
  args = bench_vs_trl.parse_args(['--remat=none:2', '--remat=full', '--no-adam'])
  ours = [a for a in bench_vs_trl.arms(args) if a['side'] == 'ours']
  assert [(a['name'], a['remat_policy'], a['micro_batches']) for a in ours] == [
      ('ours_remat_none_mb2', 'none', 2), ('ours_remat_full', 'full', None)]
  flags = lambda arm: bench_vs_trl.ours_flags(
      args, '/run', 'p.jsonl', 'e.jsonl', arm['remat_policy'], bench_vs_trl.arm_overrides(arm))
  assert '--config.optim.micro_batches=2' in flags(ours[0])
  assert not any('micro_batches' in f for f in flags(ours[1]))


@pytest.fixture(scope='module')
def tiny_bench(tmp_path_factory):
  """The whole harness on --model=tiny: 2 rounds of TRL 1.16's GRPOTrainer in .venv-trl
  (`make envs` builds it; here it is built if missing) off and on gradient checkpointing, then
  our trainer at remat none and full, all on one tiny HF checkpoint with SmolLM2's tokenizer."""
  work = tmp_path_factory.mktemp('bench_vs_trl')
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'bench_vs_trl.py'), '--model=tiny',
       f'--workdir={work}', f"--venv={os.path.join(ROOT, '.venv-trl')}", f'--steps={STEPS}',
       '--skip_steps=1', f'--prompts_per_step={PROMPTS}', f'--samples={SAMPLES}',
       f'--new_tokens={NEW_TOKENS}', f'--rounds={ROUNDS}', '--no-adam'],
      capture_output=True, text=True, cwd=ROOT, check=False)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  last = json.loads(out.stdout.strip().splitlines()[-1])
  runs = json.load(open(work / 'runs.json'))
  raw = {(e['round'], e['arm']): json.load(open(work / f"round{e['round']}_{e['arm']}.json"))
         for e in runs['order']}
  return {'last': last, 'runs': runs, 'raw': raw, 'order': json.load(open(work / 'order.json'))}


ARMS = ['trl_gc_off', 'trl_gc_on', 'ours_remat_none', 'ours_remat_full']


@pytest.mark.slow
def test_tiny_runs_interleave_round_by_round(tiny_bench):
  order = [(e['round'], e['arm']) for e in tiny_bench['runs']['order']]
  assert order == [(r, a) for r in range(ROUNDS) for a in ARMS], order


@pytest.mark.slow
def test_tiny_both_sides_processed_the_same_prompts_in_order(tiny_bench):
  ids = tiny_bench['order']
  assert sorted(ids) == list(range(STEPS * PROMPTS)), ids  # every prompt of the file, once
  per_step = [ids[i * PROMPTS:(i + 1) * PROMPTS] for i in range(STEPS)]
  for key, result in tiny_bench['raw'].items():
    assert result['prompt_ids'] == per_step, key


@pytest.mark.slow
def test_tiny_both_sides_record_their_tokens(tiny_bench):
  prompt_tokens = set()
  for key, result in tiny_bench['raw'].items():
    gen, trained = result['tokens_generated'], result['tokens_trained']
    assert len(gen) == len(trained) == len(result['step_s']) == STEPS, key
    # Each of the PROMPTS x SAMPLES rows generates 1..NEW_TOKENS tokens, all of them trained.
    assert all(PROMPTS * SAMPLES <= g <= PROMPTS * SAMPLES * NEW_TOKENS for g in gen), key
    assert all(0 < t <= g for t, g in zip(trained, gen)), key
    prompt_tokens.add(tuple(result['tokens_prompt']))
  # The same prompts under the same chat template: the same prompt tokens on both sides.
  assert len(prompt_tokens) == 1, prompt_tokens
  last = tiny_bench['last']['tokens_per_step']
  assert last['trl']['prompt'] == last['ours']['prompt'] > 0, last


@pytest.mark.slow
def test_tiny_last_line_names_each_sides_settings(tiny_bench):
  last, raw = tiny_bench['last'], tiny_bench['raw']
  for key in ('step_time_ratio', 'peak_rss_ratio', 'tokens_per_s_ratio', 'rounds',
              'step_time_ratio_range', 'peak_rss_ratio_range', 'tokens_per_step',
              'trl_gradient_checkpointing', 'ours_remat'):
    assert key in last, key
  assert last['rounds'] == ROUNDS and last['ours_remat'] == ['none', 'full']
  assert last['trl_gradient_checkpointing'] == [False, True]
  for r in range(ROUNDS):
    assert [raw[r, a]['gradient_checkpointing'] for a in ARMS[:2]] == [False, True]
    assert [raw[r, a]['remat_policy'] for a in ARMS[2:]] == ['none', 'full']
  lo, hi = last['step_time_ratio_range']
  assert lo <= last['step_time_ratio'] <= hi
