import signal
import time

import numpy as np
import pytest
import reasoning_gym

from logra_jax.rl import rewards


def sleepy_verifier(completion, reference):
  """Correct unless the completion asks it to sleep (for the timeout test)."""
  if completion == 'sleep':
    time.sleep(30)
  return float(completion == reference)


def stubborn_verifier(completion, reference):
  """Blocks SIGALRM, then sleeps: only the parent-side deadline can stop it."""
  signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
  time.sleep(30)
  return 1.0


def test_extraction():
  assert rewards.extract_boxed(r'so \boxed{\frac{1}{2}} or \boxed{x^{2}+1}') == 'x^{2}+1'
  assert rewards.extract_boxed(r'\boxed{a{b{c}}d} end') == 'a{b{c}}d'
  assert rewards.extract_boxed(r'\boxed{unclosed {') is None
  assert rewards.extract_answer_tag('<answer>1</answer> <answer> 42 </answer>') == '42'
  assert rewards.extract_answer_tag('<answer>7, then') == '7, then'
  assert rewards.extract_last_number('pay 1,234.50 then -3 apples.') == '-3'
  assert rewards.extract_last_number('total 1,234.5') == '1234.5'
  assert rewards.extract_last_number('none') is None
  # Priority: tag, then boxed, then the fallback.
  assert rewards.extract_answer(r'\boxed{3} <answer>4</answer>') == '4'
  assert rewards.extract_answer(r'7 then \boxed{3}') == '3'
  assert rewards.extract_answer('it is 5 or 6') == '6'
  assert rewards.extract_answer('it is five', fallback='text') == 'it is five'


def test_local_verifiers():
  assert rewards.verify_exact('<answer> Paris. </answer>', 'paris') == 1.0
  assert rewards.verify_exact('The answer: 1,000', '1000') == 0.0  # Whole text: no match.
  assert rewards.verify_exact('1,000', '1000') == 1.0
  assert rewards.verify_last_number('so 12 + 34 = 46.0', '46') == 1.0
  assert rewards.verify_last_number('so 46 then 47', '46') == 0.0
  with pytest.raises(ValueError, match=r"unknown verifier 'nope'.*math_verify"):
    rewards.get_verifier('nope')


def test_math_verify_real():
  assert rewards.verify_math(r'Thus \boxed{\frac{1}{2}}', '0.5') == 1.0
  assert rewards.verify_math('<answer>46</answer>', '46') == 1.0
  assert rewards.verify_math(r'\boxed{45}', '46') == 0.0
  assert rewards.verify_math('no answer here', r'\frac{1}{2}') == 0.0


def test_reasoning_gym_real():
  ds = reasoning_gym.create_dataset('basic_arithmetic', size=3, seed=1)
  entry = ds[0]  # 'Calculate 5 - 3 - 6.' -> '-4'
  good = f"Let me compute.\n<answer>{entry['answer']}</answer>"
  assert rewards.verify_reasoning_gym(good, entry) == 1.0
  assert rewards.verify_reasoning_gym('<answer>12345</answer>', entry) == 0.0
  # No tags: the last number is the answer.
  assert rewards.verify_reasoning_gym(f"I think it is {entry['answer']}", entry) == 1.0


def test_scorer_in_process_rewards():
  scorer = rewards.RewardScorer('math_verify', num_workers=0, incorrect=-0.01)
  out = scorer.score([r'\boxed{46}', r'\boxed{45}', 'nothing'], ['46', '46', '46'])
  np.testing.assert_allclose(out.rewards, [1.0, -0.01, -0.01])
  assert out.correct.tolist() == [True, False, False] and out.timed_out == 0


def test_scorer_in_process_timeout():
  # In the main thread the SIGALRM timer interrupts the sleeping verifier after 0.2 s.
  scorer = rewards.RewardScorer(sleepy_verifier, num_workers=0, timeout_s=0.2)
  start = time.monotonic()
  out = scorer.score(['sleep', 'a'], ['a', 'a'])
  assert time.monotonic() - start < 5
  assert out.timed_out == 1 and out.correct.tolist() == [False, True]


def test_process_pool_slow_item_does_not_stall_the_batch():
  with rewards.RewardScorer(sleepy_verifier, num_workers=2, timeout_s=0.5) as scorer:
    scorer.score(['a'], ['a'])  # Warm the pool (spawn start-up is not a verifier timeout).
    start = time.monotonic()
    out = scorer.score(['sleep', 'a', 'b', 'sleep', 'c'], ['a', 'a', 'x', 'a', 'c'])
    elapsed = time.monotonic() - start
  # Two sleeping items each stop after 0.5 s instead of 30 s.
  assert elapsed < 10, elapsed
  assert out.timed_out == 2 and out.errors == 0
  assert out.correct.tolist() == [False, True, False, False, True]
  np.testing.assert_allclose(out.rewards, [-0.01, 1.0, -0.01, -0.01, 1.0])


def test_process_pool_real_verifiers():
  ds = reasoning_gym.create_dataset('leg_counting', size=2, seed=3)
  completions = [f"<answer>{ds[0]['answer']}</answer>", '<answer>0</answer>']
  with rewards.RewardScorer('reasoning_gym', num_workers=1, timeout_s=5.0) as scorer:
    out = scorer.score(completions, [ds[0], ds[1]])
  assert out.correct.tolist() == [True, False]


def test_process_pool_kills_a_worker_that_ignores_the_timer():
  scorer = rewards.RewardScorer(sleepy_verifier, num_workers=1, timeout_s=0.3)
  scorer.score(['a'], ['a'])  # Warm the pool with the default (60 s) start-up grace.
  scorer.verifier, scorer.startup_grace_s = stubborn_verifier, 1.0
  start = time.monotonic()
  # Deadline = grace 1 s + 2 * 0.3 s * 2 rounds = 2.2 s; both items count as timed out.
  out = scorer.score(['x', 'y'], ['a', 'a'])
  assert time.monotonic() - start < 6
  assert out.timed_out == 2
  scorer.verifier, scorer.startup_grace_s = sleepy_verifier, 60.0  # A fresh pool next.
  assert scorer.score(['a'], ['a']).correct.tolist() == [True]
  scorer.close()
