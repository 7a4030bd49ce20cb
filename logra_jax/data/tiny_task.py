"""The built-in tiny task for the CPU default: 2-digit addition with a character tokenizer.

"12+34=" -> "46". Prompts are plain text (no chat template). Shape key: N = sequences,
L = padded sequence length.
"""
import dataclasses
from typing import Sequence

import numpy as np

SPECIALS = ('<pad>', '<bos>', '<eos>')
CHARS = '0123456789+=-* '
TASK_NAME = 'tiny_addition'


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
  """One token per character: pad 0, bos 1, eos 2, then '0'-'9', '+', '=', '-', '*', ' '."""
  chars: str = CHARS

  def __post_init__(self):
    if len(set(self.chars)) != len(self.chars):
      raise ValueError(f'duplicate characters in the vocabulary {self.chars!r}.')

  @property
  def vocab_size(self) -> int:
    return len(SPECIALS) + len(self.chars)

  pad_id, bos_id, eos_id = 0, 1, 2
  chat_template = None  # Plain-text prompts.

  def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
    """Token ids of `text`; raises on a character outside the vocabulary."""
    bad = sorted(set(text) - set(self.chars))
    if bad:
      raise ValueError(f'characters {bad} are not in the vocabulary {self.chars!r}.')
    ids = [len(SPECIALS) + self.chars.index(c) for c in text]
    return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

  def decode(self, ids: Sequence[int]) -> str:
    """Text of `ids`, stopping at the first eos; pad and bos are skipped."""
    out = []
    for i in (int(i) for i in ids):
      if i == self.eos_id:
        break
      if i >= len(SPECIALS):
        out.append(self.chars[i - len(SPECIALS)])
    return ''.join(out)


def addition_record(a: int, b: int) -> dict:
  question = f'{a}+{b}='
  return {'id': f'{TASK_NAME}/{a}+{b}', 'question': question, 'answer': str(a + b),
          'reference': str(a + b), 'verifier': 'exact'}


def addition_split(seed: int = 0, heldout_fraction: float = 0.1,
                   num_digits: int = 2) -> tuple[list[dict], list[dict]]:
  """All a+b with a, b of exactly `num_digits` digits, split into disjoint train/held-out.

  Returns:
    (train_records, heldout_records); a seeded permutation decides, so the split is
    reproducible and no problem is in both.
  """
  if not 0 < heldout_fraction < 1:
    raise ValueError(f'heldout_fraction must be in (0, 1), got {heldout_fraction}.')
  lo, hi = 10 ** (num_digits - 1), 10 ** num_digits
  pairs = [(a, b) for a in range(lo, hi) for b in range(lo, hi)]
  order = np.random.default_rng(seed).permutation(len(pairs))
  n_heldout = max(1, int(round(heldout_fraction * len(pairs))))
  records = [addition_record(*pairs[i]) for i in order]
  return records[n_heldout:], records[:n_heldout]


def warm_start_batch(records: Sequence[dict], tokenizer: CharTokenizer,
                     max_len: int = 0) -> dict[str, np.ndarray]:
  """Supervised sequences `bos question answer eos`, right-padded with pad.

  Returns:
    {'tokens': int32 [N, L], 'loss_mask': float32 [N, L]}; loss_mask[n, t] = 1 where
    tokens[n, t] is an answer or eos token (a target predicted from position t - 1).
  """
  seqs, masks = [], []
  for r in records:
    prompt = tokenizer.encode(r['question'], add_bos=True)
    answer = tokenizer.encode(r['answer'], add_eos=True)
    seqs.append(prompt + answer)
    masks.append([0] * len(prompt) + [1] * len(answer))
  length = max(max_len, max(len(s) for s in seqs))
  tokens = np.full((len(seqs), length), tokenizer.pad_id, np.int32)
  loss_mask = np.zeros((len(seqs), length), np.float32)
  for n, (s, m) in enumerate(zip(seqs, masks)):
    tokens[n, :len(s)], loss_mask[n, :len(m)] = s, m
  return {'tokens': tokens, 'loss_mask': loss_mask}
