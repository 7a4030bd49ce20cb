"""The trainer on a fleet (`rollout.engine='http'`): launched JAX-engine servers over HTTP.

The fleet samples with the same per-request seeds as the embedded sampler, and its weights
are the trainer's (a full sync at start, then low-rank blobs rebuilt from the seed), so the
run is the embedded run: the same rollouts, rewards and evaluations, step for step, and the
loss to float32 rounding (rtol 1e-5; 1e-6 seen: the generators' weights are the trainer's to
~1e-9, so their behaviour log-probs differ in the last bits).
"""
import jax
import numpy as np
import pytest

from trainer_runs import (format_reward, make_config, read_metrics,  # noqa: F401
                          run_and_resume, train, xla_cache)


@pytest.mark.slow
def test_fleet_run_equals_the_embedded_run_and_resumes(tmp_path):
  make = lambda **kw: make_config(**{'total_steps': 3, 'eval_every': 1,
                                     'rollout__engine': 'http', 'rollout__launch': 2, **kw})
  embedded = train(make(rollout__engine='embedded', rollout__launch=0), tmp_path / 'embedded')
  full, full_rows, resumed, rows = run_and_resume(make, tmp_path, stop_at=1)
  emb_rows = read_metrics(tmp_path / 'embedded')
  # Same rollouts and evaluations as in process (weights equal to ~1e-9, same seeds).
  for fleet_row, emb_row in zip(full_rows, emb_rows):
    for key in ('reward_mean', 'accuracy', 'response_length', 'eval_accuracy'):
      assert fleet_row.get(key) == emb_row.get(key), (fleet_row['step'], key)
    if fleet_row['step']:
      np.testing.assert_allclose(fleet_row['loss'], emb_row['loss'], rtol=1e-5)
  # Every step after the first sent a low-rank update (never full weights) and the generators
  # hold the trainer's weights to fp32 rounding.
  assert all(r['sync_full'] == 0.0 and r['sync_servers'] == 2 for r in full_rows[1:])
  assert all(r['sync_drift'] < 1e-6 for r in full_rows[1:])
  # The resumed run repeats the uninterrupted one: the same rollouts, rewards and evaluations
  # exactly. The resumed generators restart from the trainer's exact weights (a full sync)
  # where the uninterrupted ones hold them to ~1e-9 (sync_drift), so behaviour log-probs, and
  # with them the loss and the update, agree to float32 rounding rather than bit for bit.
  for row, ref in zip(rows, full_rows):
    for key in ('reward_mean', 'accuracy', 'response_length', 'eval_accuracy'):
      assert row.get(key) == ref.get(key), (row['step'], key)
    if row['step']:
      np.testing.assert_allclose(row['loss'], ref['loss'], rtol=1e-5)
  for x, y in zip(jax.tree.leaves(resumed.state['params']), jax.tree.leaves(full.state['params'])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
  del embedded  # its rows are what was compared
