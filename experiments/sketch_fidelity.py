r"""Sketch fidelity vs rank: cos(Aᵀ(A G), G) per projection kind (the paper's Fig. 5b).

For one batch of a small model, the sketch S = A G of every sketched kernel comes from the
probe gradient (`sketch_value_and_grad`); it is expanded to Ĝ = Aᵀ S and compared with the
dense gradient G. The mean cosine over the sketched matrices and a few projection seeds rises
with rank. Theory (see `logra_jax.analysis.fidelity`): for a random A, E‖AG‖² = ‖G‖² and
E‖AᵀAG‖² = ‖G‖² (R+K±1)/R for any G (i.i.d. entries), so cos ≈ sqrt(R/(R+K±1)) ≈
sqrt(R/K) when R ≪ K; structure in G does not raise it, and at R = K it is ≈ 1/√2, not 1
(AᵀA = I only in expectation; the orthogonal kind, AᵀA = (K/R)·P, reaches 1 there).
The table prints the measured cosine beside that prediction and beside sqrt(R/K).

  python experiments/sketch_fidelity.py --out_dir=runs/sketch_fidelity

Expected (default TinyLM d=256 f=1024, 2 layers, ~10 s on CPU): rank 4/16/64/256 → cos ≈
0.11/0.22/0.42/0.67 for rademacher and gaussian, 0.12/0.23/0.47/0.93 = sqrt(R/K) for
orthogonal (rows orthogonal: AᵀA = (K/R)·P), each within ~1 sem of the prediction. Writes
sketch_fidelity.png (cosine vs rank, log x, one line per kind) and sketch_fidelity.json.
"""
import json
import os

from absl import app, flags

from logra_jax.analysis import fidelity

FLAGS = flags.FLAGS
flags.DEFINE_string('out_dir', 'runs/sketch_fidelity', 'Where to write the PNG and JSON.')
flags.DEFINE_integer('seed', 0, 'Model/token seed; projection seeds are seed..seed+num_seeds-1.')
flags.DEFINE_integer('num_seeds', 3, 'Projection draws per (kind, rank).')
flags.DEFINE_list('ranks', ['4', '16', '64', '256'], 'Ranks (capped per matrix at min(K, D)).')
flags.DEFINE_list('kinds', ['rademacher', 'gaussian', 'orthogonal'], 'Projection kinds.')
flags.DEFINE_integer('d', 256, 'TinyLM width.')
flags.DEFINE_integer('f', 1024, 'TinyLM MLP width.')
flags.DEFINE_integer('layers', 2, 'TinyLM layers.')
flags.DEFINE_integer('vocab', 64, 'TinyLM vocabulary.')
flags.DEFINE_integer('batch', 4, 'Sequences in the batch (random tokens).')
flags.DEFINE_integer('length', 32, 'Tokens per sequence.')


def main(argv):
  del argv
  problem = fidelity.tiny_problem(FLAGS.vocab, FLAGS.d, FLAGS.f, FLAGS.layers, FLAGS.batch,
                                  FLAGS.length, FLAGS.seed)
  seeds = range(FLAGS.seed, FLAGS.seed + FLAGS.num_seeds)
  rows = fidelity.fidelity_sweep(problem, [int(r) for r in FLAGS.ranks], FLAGS.kinds, seeds)
  print(fidelity.format_fidelity_table(rows))
  os.makedirs(FLAGS.out_dir, exist_ok=True)
  fidelity.plot_fidelity(rows, os.path.join(FLAGS.out_dir, 'sketch_fidelity.png'))
  with open(os.path.join(FLAGS.out_dir, 'sketch_fidelity.json'), 'w') as f:
    json.dump({'flags': FLAGS.flag_values_dict(), 'rows': rows}, f, indent=1)
  print(f'wrote {FLAGS.out_dir}/sketch_fidelity.{{png,json}}')


if __name__ == '__main__':
  app.run(main)
