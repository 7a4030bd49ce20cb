"""RL post-training with LoGRA (or the dense-Adam / LoRA baselines) from an ml_collections config.

  python experiments/train.py --config=configs/tiny.py --workdir=runs/tiny \
      [--config.optim.name=adam] [--config.optim.rank=32 ...]

Rerunning with the same workdir resumes from its latest checkpoint.
"""
from absl import app, flags, logging
from ml_collections import config_flags

from logra_jax.train.config import from_config_dict
from logra_jax.train.loop import train

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (metrics, checkpoints).')
flags.mark_flags_as_required(['config', 'workdir'])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  train(from_config_dict(_CONFIG.value), _WORKDIR.value)


if __name__ == '__main__':
  app.run(main)
