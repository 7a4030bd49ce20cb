"""Prompt sources: reasoning-gym, JSONL/Parquet files, the tiny task; and prompt formatting.

Every source returns disjoint (train, heldout) lists of prompt records:
  {'id': str, 'question': str, 'answer': str, 'reference': what the verifier gets,
   'verifier': a name in logra_jax.rl.rewards.VERIFIERS}.
reasoning-gym records keep their dataset entry as 'reference' (the scorer needs it).
"""
import json
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np

from logra_jax.data import tiny_task

Splits = tuple[list[dict], list[dict]]


def _drop_overlap(train: list[dict], heldout: list[dict]) -> list[dict]:
  """Held-out records whose question is not also a training question."""
  seen = {r['question'] for r in train}
  return [r for r in heldout if r['question'] not in seen]


def reasoning_gym_source(dataset: str, size: int = 1000, seed: int = 0, heldout_size: int = 100,
                         **options) -> Splits:
  """Records of `reasoning_gym.create_dataset(dataset, size=..., seed=..., **options)`.

  reasoning-gym draws item i from Random(seed + i), so the held-out split uses seed + size:
  the items that would follow the training ones. It is stripped of any question (by chance)
  also in train.
  """
  import reasoning_gym  # pylint: disable=g-import-not-at-top

  def records(n, s, split):
    ds = reasoning_gym.create_dataset(dataset, size=n, seed=s, **options)
    return [{'id': f'{dataset}/{split}/{i}', 'question': e['question'], 'answer': str(e['answer']),
             'reference': e, 'verifier': 'reasoning_gym'} for i, e in enumerate(ds)]

  train = records(size, seed, 'train')
  return train, _drop_overlap(train, records(heldout_size, seed + size, 'heldout'))


def _file_record(row: Any, where: str, index: int) -> dict:
  if not isinstance(row, dict):
    raise ValueError(f'{where}: expected a JSON object, got {type(row).__name__}.')
  for field in ('problem', 'answer'):
    if row.get(field) is None:
      raise ValueError(f'{where}: missing field {field!r} (fields: {sorted(row)}).')
  return {'id': f'{where}', 'question': str(row['problem']), 'answer': str(row['answer']),
          'reference': str(row['answer']), 'verifier': 'math_verify', 'index': index}


def read_jsonl(path: str) -> list[dict]:
  """`problem`/`answer` records of a JSONL file; errors name the file and line."""
  out = []
  with open(path, encoding='utf-8') as f:
    for line_no, line in enumerate(f, start=1):
      if not line.strip():
        continue
      where = f'{path}:{line_no}'
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{where}: bad JSON ({e.msg}).') from e
      out.append(_file_record(row, where, len(out)))
  return out


def read_parquet(path: str) -> list[dict]:
  """`problem`/`answer` records of a Parquet file (needs pyarrow); errors name the row."""
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  rows = pq.read_table(path).to_pylist()
  return [_file_record(row, f'{path}:row {i}', i) for i, row in enumerate(rows)]


def read_problems(path: str) -> list[dict]:
  ext = os.path.splitext(path)[1].lower()
  if ext in ('.jsonl', '.json'):
    return read_jsonl(path)
  if ext in ('.parquet', '.pq'):
    return read_parquet(path)
  raise ValueError(f'{path}: unknown extension {ext!r}; use .jsonl or .parquet.')


def file_source(path: str, heldout_path: Optional[str] = None, heldout_fraction: float = 0.1,
                seed: int = 0) -> Splits:
  """Records of a JSONL/Parquet file with `problem` and `answer` fields (math-verify scored).

  Held-out: the records of `heldout_path` if given, else a seeded `heldout_fraction` of the
  file; either way stripped of questions also in train.
  """
  records = read_problems(path)
  if heldout_path is not None:
    return records, _drop_overlap(records, read_problems(heldout_path))
  order = np.random.default_rng(seed).permutation(len(records))
  n_heldout = int(round(heldout_fraction * len(records)))
  train = [records[i] for i in order[n_heldout:]]
  return train, _drop_overlap(train, [records[i] for i in order[:n_heldout]])


def tiny_addition_source(seed: int = 0, heldout_fraction: float = 0.1,
                         num_digits: int = 2) -> Splits:
  return tiny_task.addition_split(seed, heldout_fraction, num_digits)


SOURCES: dict[str, Callable[..., Splits]] = {
    'tiny_addition': tiny_addition_source,
    'reasoning_gym': reasoning_gym_source,
    'file': file_source,
}


def get_source(name: str, /, **kwargs) -> Splits:
  """(train, heldout) records of the source registered as `name`, built with `kwargs`.

  Example:
    >>> train, heldout = get_source('reasoning_gym', dataset='basic_arithmetic', size=64)
  """
  if name not in SOURCES:
    raise ValueError(f'unknown prompt source {name!r}; known: {sorted(SOURCES)}.')
  return SOURCES[name](**kwargs)


def format_prompt(question: str, tokenizer: Any = None, system_prompt: Optional[str] = None,
                  suffix: str = '') -> str:
  """The prompt text: the tokenizer's chat template where it has one, plain text otherwise.

  Chat: messages [system?, user: question + suffix] through
  `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`.
  Plain: `system_prompt + '\\n\\n' + question + suffix` (no system part when None).
  """
  user = question + suffix
  if getattr(tokenizer, 'chat_template', None):
    messages = ([{'role': 'system', 'content': system_prompt}] if system_prompt else [])
    messages.append({'role': 'user', 'content': user})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  return f'{system_prompt}\n\n{user}' if system_prompt else user


def with_prompts(records: Sequence[dict], tokenizer: Any = None, **format_kwargs) -> list[dict]:
  """Records with a 'prompt' field added by `format_prompt`."""
  return [dict(r, prompt=format_prompt(r['question'], tokenizer, **format_kwargs))
          for r in records]
