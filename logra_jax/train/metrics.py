"""Per-step metrics to `workdir/metrics.jsonl` (one JSON object per line) and TensorBoard.

With several processes (multi-host) only process 0 writes; the others' writers do nothing.
"""
import json
import math
import os

import jax
import numpy as np


def _clean(value):
  value = float(np.asarray(value))
  return value if math.isfinite(value) else None


class MetricWriter:
  """Appends to metrics.jsonl; on resume, drops lines of steps after the restored step."""

  def __init__(self, workdir: str, resume_step: int = -1):
    self.path = os.path.join(workdir, 'metrics.jsonl')
    self.active, self.tb = jax.process_index() == 0, None
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    if os.path.exists(self.path):
      keep = [line for line in open(self.path) if line.strip()
              and json.loads(line)['step'] <= resume_step]
      with open(self.path, 'w') as f:
        f.writelines(keep)
    try:
      from tensorboardX import SummaryWriter
      self.tb = SummaryWriter(os.path.join(workdir, 'tensorboard'))
    except ImportError:  # TensorBoard output is optional; the JSONL file is the record.
      self.tb = None

  def write(self, step: int, metrics: dict):
    if not self.active:
      return
    row = {'step': int(step)}
    row.update({k: _clean(v) for k, v in sorted(metrics.items())})
    with open(self.path, 'a') as f:
      f.write(json.dumps(row) + '\n')
    if self.tb is not None:
      for k, v in row.items():
        if k != 'step' and v is not None:
          self.tb.add_scalar(k, v, step)

  def close(self):
    if self.tb is not None:
      self.tb.close()


def read_metrics(workdir: str) -> list:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]
