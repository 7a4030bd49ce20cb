"""RL post-training with LoGRA (or the dense-Adam / LoRA baselines) from an ml_collections config.

  python experiments/train.py --config=configs/tiny.py[:adam] --workdir=runs/tiny \
      [--config.optim.logra.rank=32 ...] [--config.mesh.fsdp=4 ...]

Method keys live in optim.logra.* / optim.adam.* / optim.lora.*; a key of a method other than
optim.name is refused at load, and a flag naming a pre-split key (--config.optim.rank) is
refused with its new name.

Rerunning with the same workdir resumes from its latest checkpoint. Writes
WORKDIR/run_info.json first (devices, processes, mesh, JAX version, the whole config). The
progress bar shows the step's train accuracy and the latest held-out pass@1; the run ends with
a summary (held-out pass@1 at start, end and best step, wall time, where metrics.jsonl, the
TensorBoard logs and the checkpoints are, and the experiments/plot_curves.py command).

SIGTERM or SIGINT (a cluster's preemption, Ctrl-C) stops the run after the step in flight: it
writes a checkpoint, prints "SIGTERM: stopped after step T of N, checkpoint in DIR; ..." and
exits with code 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, as a shell reports
a process the signal ended; the run is not finished). The same command resumes exactly; a
second Ctrl-C stops at once (the previous checkpoint stays the latest). On a fleet
(rollout.engine=http) with no generation server left up, the run checkpoints its last finished
step, names the servers and exits with code 1; the same command resumes.

Multi-host: start the same command on every host with --coordinator_address=HOST:PORT
--num_processes=N --process_id=I (I = 0 … N−1); without them the run is one process.
"""
import dataclasses
import json
import os
import signal
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', None, 'Path to a config file.',
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory (metrics, checkpoints).')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None,
                                   'HOST:PORT of process 0 (multi-host runs only).')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Processes in a multi-host run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'This process (0 … num_processes-1).')
flags.mark_flags_as_required(['config', 'workdir'])


def _distributed():
  """jax.distributed.initialize when the three multi-host flags are given (all or none)."""
  given = [f.value is not None for f in (_COORDINATOR, _NUM_PROCESSES, _PROCESS_ID)]
  if not any(given):
    return
  if not all(given):
    raise app.UsageError('--coordinator_address, --num_processes and --process_id go together')
  import jax  # pylint: disable=g-import-not-at-top
  # CPU devices of several processes talk through gloo (JAX's CPU default has no
  # cross-process collectives); it does not affect GPU/TPU backends. Set before any backend.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(_COORDINATOR.value, num_processes=_NUM_PROCESSES.value,
                             process_id=_PROCESS_ID.value)


def write_run_info(workdir: str, layout, cfg) -> str:
  """WORKDIR/run_info.json (process 0 only): devices, processes, mesh, JAX version, config."""
  import jax  # pylint: disable=g-import-not-at-top
  from logra_jax import parallel  # pylint: disable=g-import-not-at-top
  path = os.path.join(workdir, 'run_info.json')
  if jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(path, 'w') as f:
      json.dump(parallel.run_info(layout, dataclasses.asdict(cfg)), f, indent=2)
  return path


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  _distributed()
  import jax  # pylint: disable=g-import-not-at-top
  from logra_jax import parallel  # pylint: disable=g-import-not-at-top
  from logra_jax.bridge.client import FleetDown  # pylint: disable=g-import-not-at-top
  from logra_jax.train.config import from_config_dict  # pylint: disable=g-import-not-at-top
  from logra_jax.train.loop import train  # pylint: disable=g-import-not-at-top
  cfg = from_config_dict(_CONFIG.value)
  layout = parallel.layout_from_config(cfg.mesh)
  write_run_info(_WORKDIR.value, layout, cfg)
  with jax.set_mesh(layout.mesh):
    try:
      trainer = train(cfg, _WORKDIR.value, progress=jax.process_index() == 0, layout=layout)
    except FleetDown as e:  # checkpointed and said so (`Trainer._stop_on_fleet_down`)
      sys.exit(f'stopped: {e}')
  if trainer.stopped_by:  # checkpointed after a stop signal (docstring: the exit code)
    sys.exit(128 + signal.Signals[trainer.stopped_by])


if __name__ == '__main__':
  from logra_jax.train.config import check_override_flags  # pylint: disable=g-import-not-at-top
  check_override_flags(sys.argv)
  app.run(main)
