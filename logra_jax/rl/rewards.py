"""Answer extraction, verifiers by name, and a process-pool scorer with per-item timeouts.

A verifier is `fn(completion: str, reference) -> float` in [0, 1] (1 = correct); the
reference is the answer string, or for 'reasoning_gym' the dataset entry. `RewardScorer`
maps scores to rewards (authors: 1 for correct, -0.01 otherwise).

Timeouts: math-verify's own timeouts use SIGALRM, which breaks in threads. We switch them
off and run every verifier in a worker *process* (spawn), in that process's main thread,
under our own SIGALRM timer. A timed-out or failing item scores as incorrect and is counted.
A parent-side deadline backs this up: a worker that ignores the signal is killed.
"""
import concurrent.futures as cf
import dataclasses
import math
import multiprocessing
import re
import signal
import threading
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

_NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?|-?\.\d+')
_ANSWER_TAG = re.compile(r'<answer>(.*?)(?:</answer>|$)', re.DOTALL)


def extract_boxed(text: str) -> Optional[str]:
  """Content of the last `\\boxed{...}` (or `\\fbox{...}`), nested braces allowed."""
  start = max(text.rfind('\\boxed{'), text.rfind('\\fbox{'))
  if start < 0:
    return None
  i = text.index('{', start) + 1
  depth = 1
  for j in range(i, len(text)):
    depth += {'{': 1, '}': -1}.get(text[j], 0)
    if depth == 0:
      return text[i:j].strip()
  return None  # Unbalanced: no answer.


def extract_answer_tag(text: str) -> Optional[str]:
  """Content of the last `<answer>...</answer>` (an unclosed final tag runs to the end)."""
  found = _ANSWER_TAG.findall(text)
  return found[-1].strip() if found else None


def extract_last_number(text: str) -> Optional[str]:
  """The last number in the text, thousands separators removed ('1,234.5' -> '1234.5')."""
  found = _NUMBER.findall(text)
  return found[-1].replace(',', '') if found else None


def extract_answer(text: str, fallback: Optional[str] = 'last_number') -> Optional[str]:
  """`<answer>` tag, else `\\boxed{}`, else the fallback ('last_number' | 'text' | None)."""
  for found in (extract_answer_tag(text), extract_boxed(text)):
    if found is not None:
      return found
  if fallback == 'last_number':
    return extract_last_number(text)
  return text.strip() if fallback == 'text' else None


def normalize(answer: str) -> str:
  """Lower case, no surrounding `$`, spaces or final '.', single spaces, no thousands commas."""
  s = answer.strip().strip('$').strip().rstrip('.').lower()
  s = re.sub(r'(?<=\d),(?=\d{3}\b)', '', s)
  return re.sub(r'\s+', ' ', s)


def verify_exact(completion: str, reference: str) -> float:
  answer = extract_answer(completion, fallback='text')
  return float(answer is not None and normalize(answer) == normalize(str(reference)))


def verify_last_number(completion: str, reference: str) -> float:
  answer, gold = extract_last_number(completion), extract_last_number(str(reference))
  if answer is None or gold is None:
    return 0.0
  return float(math.isclose(float(answer), float(gold), rel_tol=1e-9, abs_tol=1e-9))


def verify_math(completion: str, reference: str) -> float:
  """math-verify with its own (signal) timeouts off; the caller enforces the timeout."""
  import math_verify  # pylint: disable=g-import-not-at-top
  parse = lambda s: math_verify.parse(s, parsing_timeout=None)
  gold = parse(str(reference)) or parse(f'${reference}$')
  tagged = extract_answer_tag(completion)
  pred = parse(completion if tagged is None else tagged)
  return float(bool(gold) and bool(pred) and math_verify.verify(gold, pred, timeout_seconds=None))


def verify_reasoning_gym(completion: str, entry: dict) -> float:
  """The entry's own dataset `score_answer(answer, entry)` on the extracted answer."""
  import reasoning_gym  # pylint: disable=g-import-not-at-top
  answer = extract_answer(completion, fallback='last_number')
  score_fn = reasoning_gym.get_score_answer_fn(entry['metadata']['source_dataset'])
  return float(score_fn(answer, entry))


VERIFIERS: dict[str, Callable[[str, Any], float]] = {
    'math_verify': verify_math,
    'reasoning_gym': verify_reasoning_gym,
    'exact': verify_exact,
    'last_number': verify_last_number,
}
_PRELOAD = {'math_verify': 'math_verify', 'reasoning_gym': 'reasoning_gym'}

Verifier = Union[str, Callable[[str, Any], float]]


def get_verifier(name: str) -> Callable[[str, Any], float]:
  if name not in VERIFIERS:
    raise ValueError(f'unknown verifier {name!r}; known: {sorted(VERIFIERS)}.')
  return VERIFIERS[name]


class _Timeout(Exception):
  pass


def _raise_timeout(signum, frame):
  raise _Timeout()


def score_one(verifier: Verifier, completion: str, reference: Any,
              timeout_s: Optional[float]) -> tuple[float, str]:
  """Runs one verifier; returns (score, status), status in {'ok', 'timeout', 'error'}.

  The SIGALRM timer is used only in a main thread; elsewhere there is no timeout here.
  """
  fn = get_verifier(verifier) if isinstance(verifier, str) else verifier
  use_alarm = bool(timeout_s) and threading.current_thread() is threading.main_thread()
  if use_alarm:
    old = signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
  try:
    return float(fn(completion, reference)), 'ok'
  except _Timeout:
    return 0.0, 'timeout'
  except Exception:  # pylint: disable=broad-except
    return 0.0, 'error'
  finally:
    if use_alarm:
      signal.setitimer(signal.ITIMER_REAL, 0)
      signal.signal(signal.SIGALRM, old)


def _outcome(future: cf.Future) -> tuple[float, str]:
  return (0.0, 'error') if future.exception() is not None else future.result()


def _worker_init(modules: tuple[str, ...]):
  """Imports heavy verifier dependencies before any timed call."""
  for m in modules:
    __import__(m)


@dataclasses.dataclass
class ScoreResult:
  """rewards/scores/correct: one per completion. timed_out/errors: counts."""
  rewards: np.ndarray
  scores: np.ndarray
  correct: np.ndarray
  timed_out: int
  errors: int


class RewardScorer:
  """Scores completions in a pool of worker processes; a slow item never stalls the batch.

  Example:
    >>> with RewardScorer('math_verify', timeout_s=5.0) as scorer:
    ...   scorer.score(['\\\\boxed{46}'], ['46']).rewards   # array([1.])
  """

  def __init__(self, verifier: Verifier, *, correct: float = 1.0, incorrect: float = -0.01,
               timeout_s: float = 5.0, num_workers: int = 2, startup_grace_s: float = 60.0,
               mp_context: str = 'spawn'):
    if isinstance(verifier, str):
      get_verifier(verifier)
    if timeout_s <= 0 or num_workers < 0:
      raise ValueError(f'need timeout_s > 0 and num_workers >= 0; got {timeout_s}, '
                       f'{num_workers}.')
    self.verifier, self.timeout_s, self.num_workers = verifier, timeout_s, num_workers
    self.correct, self.incorrect, self.startup_grace_s = correct, incorrect, startup_grace_s
    self._context = multiprocessing.get_context(mp_context)
    self._pool: Optional[cf.ProcessPoolExecutor] = None

  def _get_pool(self) -> cf.ProcessPoolExecutor:
    if self._pool is None:
      preload = (_PRELOAD[self.verifier],) if self.verifier in _PRELOAD else ()
      self._pool = cf.ProcessPoolExecutor(self.num_workers, mp_context=self._context,
                                          initializer=_worker_init, initargs=(preload,))
    return self._pool

  def _run(self, completions, references) -> list[tuple[float, str]]:
    if self.num_workers == 0:
      return [score_one(self.verifier, c, r, self.timeout_s)
              for c, r in zip(completions, references)]
    pool = self._get_pool()
    futures = [pool.submit(score_one, self.verifier, c, r, self.timeout_s)
               for c, r in zip(completions, references)]
    rounds = math.ceil(len(futures) / self.num_workers)
    done, _ = cf.wait(futures, timeout=self.startup_grace_s + 2 * self.timeout_s * rounds)
    out = [_outcome(f) if f in done else (0.0, 'timeout') for f in futures]
    if len(done) < len(futures):
      self._kill_pool()  # A worker ignored SIGALRM: start afresh next time.
    return out

  def score(self, completions: Sequence[str], references: Sequence[Any]) -> ScoreResult:
    """Rewards for completions against their references (same length)."""
    if len(completions) != len(references):
      raise ValueError(f'{len(completions)} completions for {len(references)} references.')
    results = self._run(list(completions), list(references))
    scores = np.array([s for s, _ in results], dtype=np.float64)
    correct = scores >= 1.0 - 1e-9
    rewards = np.where(correct, self.correct, self.incorrect)
    status = [st for _, st in results]
    return ScoreResult(rewards, scores, correct, status.count('timeout'), status.count('error'))

  def _kill_pool(self):
    pool, self._pool = self._pool, None
    if pool is None:
      return
    procs = list(getattr(pool, '_processes', {}).values())  # No public API before 3.14.
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
      p.kill()

  def close(self):
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._pool = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
