"""The ablations' shared start (experiments/ablate_*.py): one warm start, one compile cache.

Every arm of an ablation starts from the same policy: the base config's model after its
supervised warm start, at step 0. `make_start` builds it once with the library's Trainer and
saves it as a step-0 checkpoint in START_DIR; `seed_workdir` copies that checkpoint into an
arm's workdir, where `loop.train` resumes from it (a resumed run repeats an uninterrupted one
exactly, logra_jax/train/loop.py), so no arm repeats the warm start. An arm may change
anything but the keys of `START_KEYS` (their values are stored in START_DIR/start.json and
checked) and the optimizer-state shapes (RowAdam keeps one moment per output row, so rank,
projection kind and KL settings are all free).

XLA's persistent compilation cache (`enable_compile_cache`) makes the arms that share a step
program (same rank; same KL-control switch and alpha_max) compile it once.

`define_flags` and `started` are the scripts' common command line and main() prelude.
"""
import contextlib
import dataclasses
import json
import os
import platform
import shutil
import time

from absl import flags, logging
import jax
from ml_collections import config_flags

import ablation_io
from logra_jax import parallel
from logra_jax.train import loop
from logra_jax.train.config import TrainConfig

START_KEYS = ('model', 'data', 'warm_start', 'seed', 'rl.kl_coef')


def start_signature(cfg: TrainConfig) -> dict:
  """The config values that decide the step-0 state (JSON-normalised)."""
  values = dataclasses.asdict(cfg)
  out = {}
  for key in START_KEYS:
    node = values
    for part in key.split('.'):
      node = node[part]
    out[key] = node
  return json.loads(json.dumps(out))


def make_start(cfg: TrainConfig, start_dir: str, log=print) -> str:
  """START_DIR/checkpoints/0: the policy every arm of ``cfg``'s ablation starts from."""
  path = os.path.join(start_dir, 'start.json')
  want = start_signature(cfg)
  if os.path.exists(path):
    with open(path) as f:
      have = json.load(f)
    diff = sorted(k for k in set(want) | set(have) if want.get(k) != have.get(k))
    if diff:
      raise ValueError(f'--start_dir={start_dir} holds the start of another config (it '
                       f'differs in config keys {diff}): pass a fresh directory')
    return start_dir
  trainer = loop.Trainer(cfg, start_dir, log)
  try:
    if trainer.step != 0:
      raise ValueError(f'--start_dir={start_dir} holds a run at step {trainer.step}, not a '
                       'start: pass a fresh directory')
    trainer.save()
  finally:
    trainer.close()
  with open(path, 'w') as f:
    json.dump(want, f, indent=1)
  return start_dir


def check_arm(base: TrainConfig, arm: TrainConfig, name: str):
  """An arm must share the base config's start (`START_KEYS`)."""
  a, b = start_signature(base), start_signature(arm)
  diff = sorted(k for k in a if a[k] != b[k])
  if diff:
    raise ValueError(f'ablation arm {name!r} changes config keys {diff}, which decide the '
                     'shared starting policy; vary them in separate ablations')


def seed_workdir(start_dir: str, workdir: str) -> bool:
  """Copies the start checkpoint into ``workdir`` unless it has checkpoints (then it resumes)."""
  target = os.path.join(workdir, 'checkpoints')
  if os.path.isdir(target) and os.listdir(target):
    return False
  shutil.rmtree(target, ignore_errors=True)
  shutil.copytree(os.path.join(start_dir, 'checkpoints'), target)
  return True


def enable_compile_cache(directory: str):
  """XLA's persistent compilation cache in ``directory`` ('' leaves JAX's setting alone)."""
  if directory:
    os.makedirs(directory, exist_ok=True)
    jax.config.update('jax_compilation_cache_dir', directory)


def compile_cache_dir(flag_value, workdir: str) -> str:
  """--compile_cache: None -> $JAX_COMPILATION_CACHE_DIR or WORKDIR/jax_cache; '' -> off."""
  if flag_value is not None:
    return flag_value
  return os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(workdir, 'jax_cache')


def run_arm(base: TrainConfig, name: str, overrides: dict, workdir: str, start_dir: str,
            log=print) -> ablation_io.RunResult:
  """``base`` with ``overrides``, trained from the shared start in WORKDIR/arms/NAME."""
  cfg = ablation_io.train_config(base, overrides)
  check_arm(base, cfg, name)
  arm_dir = os.path.join(workdir, 'arms', name)
  seed_workdir(start_dir, arm_dir)
  return ablation_io.run(cfg, arm_dir, log)


def machine() -> str:
  """The devices and host, for the results' provenance line."""
  return (f'{jax.devices()[0].device_kind} x{jax.device_count()} ({jax.default_backend()}), '
          f'{os.cpu_count()} CPU cores, {platform.machine()}, JAX {jax.__version__}')


def define_flags(name: str) -> dict:
  """--config, --workdir, --start_dir, --compile_cache of experiments/<name>.py."""
  holders = dict(
      config=config_flags.DEFINE_config_file('config', None, f'configs/{name}.py[:tiny]',
                                             lock_config=True),
      workdir=flags.DEFINE_string('workdir', None, 'Output directory (arms, results).'),
      start_dir=flags.DEFINE_string('start_dir', None,
                                    'The shared step-0 start (default WORKDIR/start).'),
      compile_cache=flags.DEFINE_string('compile_cache', None, "XLA cache dir (default "
                                        "$JAX_COMPILATION_CACHE_DIR or WORKDIR/jax_cache; '' "
                                        'off).'))
  flags.mark_flags_as_required(['config', 'workdir'])
  return holders


@dataclasses.dataclass
class Ablation:
  settings: dict      # the config file's ablation(arg)
  base: TrainConfig   # the base run every arm starts from
  workdir: str
  start_dir: str
  command: str        # the script's command line, for the results
  started: float      # time.perf_counter() at the start of main


@contextlib.contextmanager
def started(name: str, holders: dict, log=logging.warning):
  """An `Ablation` from the flags, inside the base config's mesh, its shared start made."""
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  begin, workdir = time.perf_counter(), holders['workdir'].value
  enable_compile_cache(compile_cache_dir(holders['compile_cache'].value, workdir))
  config_file = flags.FLAGS['config'].config_filename
  ab = Ablation(settings=ablation_io.settings(flags.FLAGS['config']),
                base=ablation_io.train_config(holders['config'].value), workdir=workdir,
                start_dir=holders['start_dir'].value or os.path.join(workdir, 'start'),
                command=f'python experiments/{name}.py --config={config_file} '
                        f'--workdir={workdir}', started=begin)
  with jax.set_mesh(parallel.layout_from_config(ab.base.mesh).mesh):
    make_start(ab.base, ab.start_dir, log)
    yield ab
