r"""Memory and time of the sketch path vs dense gradient + randomized SVD, one model/batch.

The randomized-SVD compressor (docs/method.md §8) needs the dense gradient of every kernel, so
it saves no gradient memory; the sketch never forms it. This compiles, for one batch:
  (a) the sketch path: grad w.r.t. the probes (`sketch_value_and_grad`),
  (a') the same plus `sparse_mask_tree` (its extra cost should be negligible),
  (b) dense kernel gradients + `randomized_svd_compress` per matrix,
and prints XLA's compiled memory analysis (temp/argument/output, peak = their sum − alias),
the median wall time after warm-up, and the ratios dense-rsvd / sketch.

  python experiments/compressor_cost.py --out_dir=runs/compressor_cost

Default (TinyLM d=256 f=1024, 2 layers, 4×32 tokens, r=64, CPU): dense-rsvd/sketch temp
≈ 2x, peak ≈ 1.5x; masked/sketch ≈ 1.0x.
"""
import os

# OpenBLAS's own threads inside XLA's concurrent LAPACK calls (QR/SVD) stall a busy CPU for
# minutes; one BLAS thread per call is the fix. Must be set before numpy/jax load OpenBLAS.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

import json  # pylint: disable=g-import-not-at-top

from absl import app, flags

from logra_jax.analysis import fidelity

FLAGS = flags.FLAGS
flags.DEFINE_string('out_dir', None, 'Where to write compressor_cost.json (none if unset).')
flags.DEFINE_integer('seed', 0, 'Model, token and projection seed.')
flags.DEFINE_integer('rank', 64, 'Sketch / rSVD rank (capped per matrix at min(K, D)).')
flags.DEFINE_float('mask_fraction', 0.5, 'Sparse-mask drop fraction p for path (a\').')
flags.DEFINE_integer('repeats', 5, 'Timed runs after warm-up (median reported).')
flags.DEFINE_integer('d', 256, 'TinyLM width.')
flags.DEFINE_integer('f', 1024, 'TinyLM MLP width.')
flags.DEFINE_integer('layers', 2, 'TinyLM layers.')
flags.DEFINE_integer('vocab', 64, 'TinyLM vocabulary.')
flags.DEFINE_integer('batch', 4, 'Sequences in the batch.')
flags.DEFINE_integer('length', 32, 'Tokens per sequence.')


def main(argv):
  del argv
  problem = fidelity.tiny_problem(FLAGS.vocab, FLAGS.d, FLAGS.f, FLAGS.layers, FLAGS.batch,
                                  FLAGS.length, FLAGS.seed)
  cost = fidelity.compressor_cost(problem, FLAGS.rank, FLAGS.mask_fraction, FLAGS.repeats,
                                  FLAGS.seed)
  print(fidelity.format_cost_table(cost))
  if FLAGS.out_dir:
    os.makedirs(FLAGS.out_dir, exist_ok=True)
    with open(os.path.join(FLAGS.out_dir, 'compressor_cost.json'), 'w') as f:
      json.dump({'flags': FLAGS.flag_values_dict(), **cost}, f, indent=1)


if __name__ == '__main__':
  app.run(main)
