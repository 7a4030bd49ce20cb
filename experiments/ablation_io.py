"""Shared plumbing of the ablation scripts (experiments/ablate_*.py, compare_lora.py).

Each script runs as ``python experiments/<name>.py --config=configs/<name>.py[:tiny]
--workdir=DIR`` and writes DIR/results.md, DIR/results.json and DIR/<name>.png.

The config contract: ``configs/<name>.py`` has ``get_config(arg=None)`` returning the base
TrainConfig (the schema of `logra_jax.train.config`; so experiments/train.py can run it alone)
and may have ``ablation(arg=None) -> dict``: the script's own settings (the arms of the sweep,
steps to time, ...), which the schema does not hold. `settings` reads them.

API:
  settings(config_flag) -> dict            the config file's ``ablation(arg)`` ({} if none)
  train_config(cfg, overrides) -> TrainConfig   a ConfigDict with 'section.key' overrides
  run(cfg, workdir) -> RunResult           the library's trainer (`loop.train`) for
                                           cfg.total_steps; its metrics history, final eval
  markdown_table(rows, columns) -> str
  new_figure(ncols) -> (fig, axes)         matplotlib on the Agg backend
  write_results(workdir, name, results, markdown, fig) -> paths of the three files
"""
import dataclasses
import importlib.util
import json
import math
import os
import time
from typing import Any, Optional, Sequence

import matplotlib

matplotlib.use('Agg')  # before pyplot: the scripts run headless
import matplotlib.pyplot as plt  # noqa: E402  pylint: disable=g-import-not-at-top
from ml_collections import config_dict  # noqa: E402

from logra_jax.train import config as config_lib  # noqa: E402
from logra_jax.train import loop  # noqa: E402
from logra_jax.train.metrics import read_metrics  # noqa: E402


def settings(config_flag) -> dict:
  """The ``ablation(arg)`` dict of the file behind ``--config=PATH[:arg]`` ({} if it has none)."""
  path, _, arg = config_flag.config_filename.partition(':')
  spec = importlib.util.spec_from_file_location('_ablation_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, 'ablation'):
    return {}
  return dict(module.ablation(arg or None))


def train_config(cfg, overrides: Optional[dict] = None) -> config_lib.TrainConfig:
  """A validated TrainConfig from a ConfigDict with {'optim.name': 'lora', ...} applied.

  An override of ``optim.name`` to another method first resets every method section to its
  defaults (`config.switch_method`): the arm is that method's defaults plus its own keys."""
  values = (dataclasses.asdict(cfg) if isinstance(cfg, config_lib.TrainConfig) else
            cfg.to_dict() if isinstance(cfg, config_dict.ConfigDict) else dict(cfg))
  values = config_dict.ConfigDict(values)
  config_lib.apply_overrides(values, overrides or {})
  return config_lib.from_config_dict(values)


@dataclasses.dataclass
class RunResult:
  history: list        # metrics.jsonl rows (step 0: the starting policy's held-out eval)
  final: dict          # the last evaluated row: step, eval_accuracy (pass@1), eval_pass_at_k
  trainer: Any         # the closed `loop.Trainer` (its .state, .method, .model for analysis)
  wall_s: float


def run(cfg: config_lib.TrainConfig, workdir: str, log=print) -> RunResult:
  """Trains ``cfg`` in ``workdir`` (resuming a checkpoint there) with the library's loop."""
  start = time.perf_counter()
  trainer = loop.train(cfg, workdir, progress=False, log=log)
  wall = time.perf_counter() - start
  history = read_metrics(workdir)
  evals = [r for r in history if r.get('eval_accuracy') is not None]
  final = {k: evals[-1][k] for k in ('step', 'eval_accuracy', 'eval_pass_at_k')} if evals else {}
  return RunResult(history, final, trainer, wall)


def _cell(value) -> str:
  if isinstance(value, float):
    return 'nan' if not math.isfinite(value) else f'{value:.4g}'
  return str(value)


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """A GitHub markdown table of ``rows`` (dicts) over ``columns`` (missing cells: '')."""
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(_cell(r.get(c, '')) for c in columns) + ' |' for r in rows]
  return '\n'.join(lines)


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 4.0):
  """(fig, axes): one row of ``ncols`` axes (axes is a list even for one)."""
  fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
  return fig, list(axes[0])


def _jsonable(value):
  if isinstance(value, dict):
    return {str(k): _jsonable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_jsonable(v) for v in value]
  if hasattr(value, 'item'):  # numpy / jax scalars
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def write_results(workdir: str, name: str, results: dict, markdown: str, fig) -> dict:
  """DIR/results.json (``results``; NaN -> null), DIR/results.md, DIR/<name>.png; closes fig."""
  os.makedirs(workdir, exist_ok=True)
  paths = {k: os.path.join(workdir, f) for k, f in
           (('json', 'results.json'), ('md', 'results.md'), ('png', f'{name}.png'))}
  with open(paths['json'], 'w') as f:
    json.dump(_jsonable(results), f, indent=1)
  with open(paths['md'], 'w') as f:
    f.write(markdown.rstrip() + '\n')
  fig.savefig(paths['png'], dpi=110, bbox_inches='tight')
  plt.close(fig)
  return paths
