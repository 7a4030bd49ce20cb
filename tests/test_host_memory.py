"""The trainer's host memory: what glibc's arenas keep goes back to the system
(logra_jax/train/host_memory), and the loop releases after each phase. (The checkpoint's host
copy dropped once placed: tests/test_param_dtype.py.)"""
import subprocess
import sys
import textwrap

import jax
import pytest

from logra_jax.train import host_memory, loop
from trainer_runs import format_reward, make_config, quiet  # noqa: F401  (autouse fixture)

GLIBC = host_memory._glibc() is not None  # pylint: disable=protected-access
needs_glibc = pytest.mark.skipif(not GLIBC, reason='malloc_trim is a glibc call; this C '
                                 'library has none, and host_memory does nothing here')

# A fresh process fragments glibc's arenas the way the sampler and the step do: a freed 16 MiB
# block raises the mmap threshold, then 1 MiB buffers come from the arenas and 9 of every 10
# are freed (the survivors keep the arena from shrinking at its top). Prints the RSS in MiB
# before the frees, after them and after `host_memory.release()`.
FRAGMENT = textwrap.dedent("""
    import numpy as np
    from logra_jax.train import host_memory
    def rss():
      with open('/proc/self/status') as f:
        return next(int(l.split()[1]) for l in f if l.startswith('VmRSS')) / 1024
    big = np.ones(16 << 20, np.uint8); del big
    bufs = [np.ones(1 << 20, np.uint8) for _ in range(400)]
    before = rss()
    keep = bufs[::10]; del bufs
    after_free = rss()
    host_memory.release()
    print(before, after_free, rss())
""")


def _fragment():
  out = subprocess.run([sys.executable, '-c', FRAGMENT], check=True, capture_output=True,
                       text=True).stdout
  return [float(x) for x in out.split()]


@needs_glibc
def test_release_returns_what_the_arenas_keep():
  before, after_free, released = _fragment()
  assert before - after_free < 40, (before, after_free)  # the freed 360 MiB stay resident
  assert after_free - released > 300, (after_free, released)


def test_the_loop_releases_after_generation_the_step_the_evaluation_and_the_save(
    tmp_path, monkeypatch):
  calls = []
  monkeypatch.setattr(host_memory, 'release', lambda: calls.append(1) or True)
  cfg = make_config(total_steps=2, eval_every=2, checkpoint_every=2)
  with jax.enable_x64(False):
    loop.train(cfg, str(tmp_path), progress=False, log=quiet)
  # After the step-0 evaluation; per step after the generation and after the step; after the
  # step-2 evaluation and the step-2 checkpoint.
  assert len(calls) == 1 + 2 * 2 + 2, calls
