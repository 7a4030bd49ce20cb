"""Rank control: per-module ranks, a dynamic rank schedule, the rank heuristic.

From the second seed (docs/method.md §8). A rank change changes the projection shapes, so a
jitted step recompiles once per distinct rank; RowAdam state is per output unit and survives.
"""
import dataclasses
import math
import re
from typing import Optional, Sequence, Tuple


def heuristic_rank(d: int, cap: int = 64, frac: float = 0.15) -> int:
  """The rank heuristic ``min(cap, frac·sqrt(d))`` (at least 1)."""
  return max(1, min(cap, math.ceil(frac * math.sqrt(d))))


def dynamic_rank(step: int, base: int, delta: int, tau: float,
                 max_rank: Optional[int] = None) -> int:
  """``r_t = base + ceil(delta · tanh(step / tau))``, optionally capped at ``max_rank``."""
  if tau <= 0:
    raise ValueError(f'tau must be > 0, got {tau}')
  r = base + math.ceil(delta * math.tanh(step / tau))
  return min(r, max_rank) if max_rank else r


@dataclasses.dataclass(frozen=True)
class RankRules:
  """Per-module ranks: the first regex in ``rules`` that matches the path wins.

  ``default`` is an int, or 'heuristic' for ``heuristic_rank(min(d_in, d_out))``.
  Ranks are capped at min(d_in, d_out).
  """
  rules: Sequence[Tuple[str, int]] = ()
  default: object = 16

  def __post_init__(self):
    for pattern, rank in self.rules:
      re.compile(pattern)
      if int(rank) < 1:
        raise ValueError(f'rank for {pattern!r} must be >= 1, got {rank}')
    if self.default != 'heuristic' and int(self.default) < 1:
      raise ValueError(f"default rank must be >= 1 or 'heuristic', got {self.default!r}")

  def rank(self, path: str, d_in: int, d_out: int) -> int:
    for pattern, rank in self.rules:
      if re.search(pattern, path):
        return min(int(rank), d_in, d_out)
    if self.default == 'heuristic':
      return heuristic_rank(min(d_in, d_out))
    return min(int(self.default), d_in, d_out)

  def scaled(self, rank: int, base: int) -> 'RankRules':
    """These rules with every rank multiplied by rank/base (for a dynamic schedule)."""
    f = rank / base
    default = self.default if self.default == 'heuristic' else max(1, round(self.default * f))
    return RankRules(tuple((p, max(1, round(r * f))) for p, r in self.rules), default)
