r"""Host time per LoGRA step for the projections A: the old numpy draw against the in-jit draw.

  python experiments/bench_projections.py [--preset=smollm2-135m] [--rank=32] [--repeats=3]

Before, every step drew all A with numpy on the host under the HF names
(`optimizers.projections_at`) and uploaded them replicated; now the jitted step draws them
itself from two uint32 scalars (`steps.draw_projections`), so the host's work per step is
two scalars. Measured here: the old host work (draw + upload), and the same draw jitted on
this machine's default device (what the step now spends on A; bits checked equal to numpy).
Last line: one JSON object.
"""
import json
import time

import jax
import numpy as np
from absl import app, flags

from logra_jax import parallel
from logra_jax.models import get_preset, hf_io
from logra_jax.train import optimizers, steps
from logra_jax.train.config import LograSection, MeshSection

_PRESET = flags.DEFINE_string('preset', 'smollm2-135m', 'Model shape (a preset name).')
_RANK = flags.DEFINE_integer('rank', 32, 'Projection rank of every sketched kernel.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed steps per path (the best is kept).')
SEED = 0


def best_seconds(fn, repeats: int) -> float:
  times = []
  for t in range(1, repeats + 1):
    start = time.perf_counter()
    jax.block_until_ready(fn(t))
    times.append(time.perf_counter() - start)
  return min(times)


def main(argv):
  del argv
  config = get_preset(_PRESET.value)
  abstract = parallel.abstract_params(config)
  names = hf_io.projection_name_fn(config)
  o = LograSection(rank=_RANK.value)
  replicated = parallel.layout_from_config(MeshSection()).replicated  # the trainer default

  def host(t):  # the old step's host work: numpy draw, then the replicated upload
    a = optimizers.projections_at(o, abstract, SEED, t, names)
    return parallel.put(a, jax.tree.map(lambda _: replicated, a))

  spec = optimizers.projection_spec(o, 0, names)
  draw = jax.jit(lambda seed, t: steps.draw_projections(abstract, seed, t, spec))
  device = lambda t: draw(np.uint32(SEED), np.uint32(t))
  for x, y in zip(jax.tree.leaves(device(7)), jax.tree.leaves(host(7))):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  a = jax.tree.leaves(device(0))
  out = {'preset': _PRESET.value, 'rank': _RANK.value, 'device': str(jax.devices()[0]),
         'elements': int(sum(x.size for x in a)),
         'a_bytes_in_step': int(sum(x.nbytes for x in a)),
         'a_dtypes': sorted({str(x.dtype) for x in a}),
         'host_numpy_draw_and_upload_s': best_seconds(host, _REPEATS.value),
         'in_jit_draw_s': best_seconds(device, _REPEATS.value)}
  print(f"{out['preset']} rank {out['rank']}: {out['elements']:.3g} elements of A; old host "
        f"draw + upload {out['host_numpy_draw_and_upload_s']:.3f} s per step, in-jit draw "
        f"{out['in_jit_draw_s']:.4f} s on {out['device']} (host: two uint32 scalars)")
  print(json.dumps(out))


if __name__ == '__main__':
  app.run(main)
