"""The training process's host memory: give the pages XLA:CPU frees back to the system.

XLA:CPU takes every buffer from malloc. glibc serves a block above its mmap threshold with a
mapping of its own, unmapped when freed, and everything smaller from arenas whose freed pages
stay resident. The threshold starts at 128 KiB and rises, up to 32 MiB, to the size of every
mapped block that is freed; after the first generation the per-layer cache buffers, weight
copies and activations (1-32 MiB each on SmolLM2) come from the arenas. The sampler and the training
step allocate different shapes, so the arenas fragment and keep what each phase freed: on
SmolLM2, between RL steps, 2.9 GiB of RSS held 0.5 GiB of live arrays, and `malloc_trim(0)`
took it to 1.3 GiB (docs/benchmarks.md, "Peak RSS").

`Trainer` calls `release()` after each phase: what the arenas hold free goes back to the
system. It is glibc's own call (`malloc_trim`); where the C library is not glibc it does
nothing and returns False. (A fixed mmap threshold, `mallopt(M_MMAP_THRESHOLD, 256 KiB)`, gave
back about as much but made the training step 1.12x slower: docs/benchmarks.md.)
"""

import ctypes
import functools


@functools.cache
def _glibc():
  """The process's C library where it has glibc's malloc_trim, else None."""
  try:
    libc = ctypes.CDLL(None)
  except OSError:
    return None
  if not hasattr(libc, 'malloc_trim'):
    return None
  libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
  return libc


def release() -> bool:
  """Returns the free pages of every malloc arena to the system (`malloc_trim(0)`). True
  where glibc released some memory."""
  libc = _glibc()
  return bool(libc and libc.malloc_trim(0))
