"""The KL-probe size study (issue 11): `logra_jax.analysis.probe_size` and
experiments/kl_probe_size.py end to end on the tiny config."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sketch
from logra_jax.analysis import probe_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_spread_rows_takes_distinct_prompts_first():
  rng = np.random.default_rng(0)
  for _ in range(50):
    rows = probe_size.spread_rows(4, 12, 3, rng)  # 3 prompts x 4 samples
    assert sorted(set(r // 4 for r in rows)) == [0, 1, 2]
    rows = probe_size.spread_rows(4, 12, 5, rng)
    assert len(set(rows)) == 5 and len(set(r // 4 for r in rows)) == 3
  assert sorted(probe_size.spread_rows(4, 12, 12, rng)) == list(range(12))
  with pytest.raises(ValueError, match='probe rows'):
    probe_size.spread_rows(4, 12, 13, rng)


def test_grouped_rows_take_k_prompts_and_s_samples_of_each():
  rng = np.random.default_rng(0)
  for _ in range(50):
    rows = probe_size.grouped_rows(4, 12, 2, 3, rng)  # 3 prompts x 4 samples; 2 x 3 of them
    groups = [r // 4 for r in rows]
    assert len(set(rows)) == 6 and len(set(groups)) == 2
    assert all(groups.count(g) == 3 for g in set(groups))
  assert sorted(probe_size.grouped_rows(4, 12, 3, 4, rng)) == list(range(12))
  with pytest.raises(ValueError, match='probe layout'):
    probe_size.grouped_rows(4, 12, 4, 1, rng)
  with pytest.raises(ValueError, match='probe layout'):
    probe_size.grouped_rows(4, 12, 1, 5, rng)


def test_packed_positions_count_the_prompt_once():
  # 2 prompts of 10 tokens, 3 completions of 5 each packed: 2 * (10 + 3 * 4); unpacked 2 * 15.
  assert probe_size.packed_positions(2, 3, 10, 5) == 44
  assert probe_size.packed_positions(2, 1, 10, 5) == 30


def test_layout_study_exact_on_homogeneous_positions_and_at_the_whole_batch():
  table = probe_size.layout_study(_batches(False, prompt_len=6), [(1, 1), (2, 2)], 10, 4)
  assert all(r['alpha_rms'] < 1e-12 for r in table)
  table = {(r['prompts'], r['per_prompt']): r
           for r in probe_size.layout_study(_batches(True, prompt_len=6), [(1, 1), (1, 4), (4, 4)],
                                            50, 4)}
  assert table[4, 4]['alpha_rms'] < 1e-12 and table[4, 4]['rows'] == 16  # the whole batch
  assert table[1, 1]['alpha_rms'] > table[1, 4]['alpha_rms'] > 0
  t = _batches(True)[0]['mask'].shape[1]
  assert table[1, 4]['positions'] == probe_size.packed_positions(1, 4, 6, t) == 6 + 4 * (t - 1)


def test_subset_mask_keeps_the_fraction_and_never_nothing():
  rng = np.random.default_rng(1)
  mask = np.ones((8, 100), np.float32)
  mask[:, 60:] = 0  # padding stays out
  full = probe_size.subset_mask(mask, np.array([1, 5]), 1.0, rng)
  assert full.sum() == 120 and full[[1, 5], :60].all() and not full[:, 60:].any()
  kept = [probe_size.subset_mask(mask, np.arange(8), 0.25, rng).sum() for _ in range(40)]
  # 480 valid positions at p = 0.25: mean 120, sd of the mean over 40 draws ~1.5
  assert abs(np.mean(kept) - 120) < 6 * np.sqrt(480 * 0.25 * 0.75 / 40)
  tiny = np.zeros((2, 3), np.float32)
  tiny[1, 2] = 1
  assert probe_size.subset_mask(tiny, np.array([1]), 1e-6, rng).sum() == 1
  with pytest.raises(ValueError, match='position fraction'):
    probe_size.subset_mask(mask, np.arange(2), 0.0, rng)


def test_predicted_is_the_trainers_kl_coefficient():
  k1, k2 = jax.random.split(jax.random.key(0))
  logits = jax.random.normal(k1, (3, 5, 11)) * 2
  tangents = jax.random.normal(k2, (3, 5, 11))
  mask = jnp.asarray(np.random.default_rng(2).random((3, 5)) < 0.6, jnp.float32)
  var = np.asarray(sketch.position_variance(logits, tangents, 0.7))
  q = sketch.kl_coefficient(logits, tangents, 0.7, mask)
  np.testing.assert_allclose(probe_size.predicted(var, np.asarray(mask), 0.7), q, rtol=1e-6)


def test_chosen_alpha_is_the_trainers_step_scale():
  rng = np.random.default_rng(3)
  for _ in range(50):
    alpha, budget, kl = rng.uniform(0.01, 2), rng.uniform(1e-4, 1e-2), rng.uniform(1e-5, 1e-1)
    q_u = kl / alpha**2  # q along U: the step α·U predicts α²·q(U)
    np.testing.assert_allclose(probe_size.chosen_alpha(kl, alpha, budget, 1.5),
                               sketch.step_scale(q_u, budget, 1.5), rtol=1e-5)
  assert probe_size.chosen_alpha(0.0, 0.3, 1e-3, 3.0) == 1.0


def _batches(heterogeneous: bool, n=6, prompt_len=None):
  rng = np.random.default_rng(4)
  out = []
  for _ in range(n):
    var = rng.gamma(0.5, 2.0, (16, 10)) if heterogeneous else np.full((16, 10), 0.8)
    # realised KL = the all-rows prediction (no expansion error): q = mean var / 2 at T = 1
    kl = np.full((16, 10), var.mean() / 2)
    out.append(dict(var=var, kl=kl, mask=np.ones((16, 10)), alpha=0.1, budget=1e-3,
                    alpha_max=100.0))
    if prompt_len is not None:
      out[-1]['prompt_len'] = prompt_len
  return out


def test_study_homogeneous_positions_give_exact_alphas():
  table = probe_size.study(_batches(False), [1, 4, 16], [1.0, 0.3], 10, 4)
  assert all(r['alpha_rms'] < 1e-12 and r['alpha_rms_vs_all'] < 1e-12 for r in table)
  assert probe_size.expansion_error(_batches(False)) < 1e-12


def test_study_error_shrinks_with_rows_and_is_zero_at_all_rows():
  table = {(r['rows'], r['fraction']): r
           for r in probe_size.study(_batches(True), [1, 4, 16], [1.0, 0.25], 50, 4)}
  assert table[16, 1.0]['alpha_rms'] < 1e-12  # every row, every position: the batch itself
  assert table[1, 1.0]['alpha_rms'] > table[4, 1.0]['alpha_rms'] > 0
  assert table[4, 0.25]['alpha_rms'] > table[4, 1.0]['alpha_rms']
  rows = [dict(rows=n, fraction=1.0, alpha_rms=e) for n, e in ((1, .5), (4, .12), (16, .01))]
  assert probe_size.recommend(rows, floor=0.03, tolerance=0.1) == 4
  assert probe_size.recommend(rows, floor=0.0, tolerance=0.001) is None


def test_kl_probe_size_tiny_end_to_end():
  """The study on real trainer steps: its per-position decomposition, taken on the trainer's
  own strided probe rows, reproduces the trainer's logged predicted KL (a different code
  path: the sketch-linear JVP along U at the probe rows only)."""
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, 'experiments', 'kl_probe_size.py'), '--model=tiny',
       '--batches=3', '--draws=20', '--rows=1,4,64', '--fractions=1,0.5',
       '--config=warm_start.steps=20', '--config=data.prompts_per_step=8'],
      capture_output=True, text=True, timeout=900, cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu'))
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(out.stdout.strip().splitlines()[-1])
  probe = result['trainer_probe']
  assert probe['rows'] == 8  # optim.kl_sequences (the default) of the 64 rows
  assert probe['max_gap_to_logged_predicted_kl'] < 1e-4, probe
  table = {(r['rows'], r['fraction']): r for r in result['table']}
  assert set(table) == {(n, f) for n in (1, 4, 64) for f in (1.0, 0.5)}
  assert table[64, 1.0]['alpha_rms_vs_all'] < 1e-12  # all 64 rows: the whole batch
  assert {(r['prompts'], r['per_prompt']) for r in result['layouts']} == {
      (8, 1), (4, 2), (2, 4), (8, 2), (4, 4)}
  assert result['workload'] == dict(model='tiny', batches=3, rows=64, group_size=8,
                                    new_tokens=4, draws=20, tolerance=0.1)
