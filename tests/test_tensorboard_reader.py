"""`analysis.tensorboard.read_scalars` reads back what `MetricWriter` wrote (via tensorboardX)."""
import glob
import os

import numpy as np
import pytest

from logra_jax.analysis.tensorboard import read_scalars
from logra_jax.train.metrics import MetricWriter, read_metrics


def _write_run(workdir):
  writer = MetricWriter(str(workdir))
  assert writer.tb is not None, 'tensorboardX is a dependency: MetricWriter must log to it'
  for step in range(5):
    # 0.1 is not a float32: TensorBoard stores float32, the JSONL file float64.
    metrics = {'reward_mean': 0.1 * step, 'alpha': 1.0 / (step + 1)}
    if step == 3:
      metrics['eval_accuracy'] = 0.25
    writer.write(step, metrics)
  writer.close()
  return os.path.join(str(workdir), 'tensorboard')


def test_scalars_match_the_jsonl_record(tmp_path):
  scalars = read_scalars(_write_run(tmp_path))
  assert set(scalars) == {'reward_mean', 'alpha', 'eval_accuracy'}
  assert scalars['eval_accuracy'] == [(3, 0.25)]
  rows = read_metrics(str(tmp_path))
  for tag in ('reward_mean', 'alpha'):
    assert [s for s, _ in scalars[tag]] == [r['step'] for r in rows]
    want = np.float32([r[tag] for r in rows])  # float32 rounding is the only difference
    np.testing.assert_array_equal(np.float32([v for _, v in scalars[tag]]), want)


def test_corrupt_or_missing_files_are_errors(tmp_path):
  logdir = _write_run(tmp_path)
  (path,) = glob.glob(os.path.join(logdir, 'events.out.tfevents.*'))
  data = bytearray(open(path, 'rb').read())
  data[-6] ^= 0x01  # a bit of the last record's payload
  open(path, 'wb').write(bytes(data))
  with pytest.raises(ValueError, match='bad data checksum'):
    read_scalars(logdir)
  open(path, 'wb').write(bytes(data[:-3]))
  with pytest.raises(ValueError, match='truncated record'):
    read_scalars(logdir)
  with pytest.raises(ValueError, match='no TensorBoard event file'):
    read_scalars(str(tmp_path / 'nowhere'))
