"""The sketch-fidelity and compressor-cost demos at tiny size (library + entry points)."""
import importlib.util
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.analysis import fidelity
from logra_jax.sketch.projection import sample_projection

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tolerance(r, k, n):
  """Relative tolerance on the mean of n cosines: |bias| + 4 standard errors, worst case.

  The worst case is a rank-1 G = u vᵀ (any G of higher rank averages over directions and
  fluctuates less). For Gaussian A, with y = Au: ‖y‖² ~ χ²_R/R and AᵀAu = u‖y‖² + w,
  ‖w‖² = ‖y‖² c (K−1)/R with c ~ χ²_{K−1}/(K−1), so cos = (1 + β t)^{-1/2}, β = (K−1)/R,
  t = c/‖y‖². t has E[t] − 1 ≈ 2/(R−2) and relative variance v ≈ 2/R + 2/(K−1). The delta
  method with b = β/(1+β) gives std(cos)/cos ≈ (b/2)·sqrt(v) and bias/cos ≈ −b/(R−2) +
  (3/8)·b²·v. The n draws (matrices × layers × seeds) have independent A, hence /sqrt(n).
  """
  b = (k - 1) / r / (1 + (k - 1) / r)
  v = 2 / r + 2 / (k - 1)
  return abs(-b / (r - 2) + 3 / 8 * b**2 * v) + 4 * (b / 2) * np.sqrt(v) / np.sqrt(n)


def test_unstructured_gradient_matches_wishart_prediction(x64):
  # Isotropic G, one draw of A per (kind, rank): the cosine is sqrt(R/(R+K±1)), not 1 at R=K.
  k, d = 64, 48
  g = jnp.asarray(np.random.default_rng(0).normal(size=(k, d)))
  for kind in ('rademacher', 'gaussian'):
    for r in (8, 32, 64):
      a = jnp.asarray(sample_projection(0, 0, 'w', r, k, kind, np.float64))
      cos = float(fidelity.reconstruction_cosine(a, a @ g, g))
      want = fidelity.predicted_cosine(r, k, kind)
      assert abs(cos / want - 1) < _tolerance(r, k, 1), (kind, r, cos, want)
  assert abs(fidelity.predicted_cosine(64, 64, 'gaussian') - np.sqrt(64 / 129)) < 1e-12


@pytest.fixture(scope='module')
def sweep():
  # d=32, f=64: q/k/v/o and gate/up have K=32, down has K=64; every rank below ≤ min(K, D).
  with jax.enable_x64(True):  # float64: the orthogonal kind at R = K is checked to 1e-6
    problem = fidelity.tiny_problem(vocab=32, d=32, f=64, layers=2, batch=2, length=16,
                                    dtype=jnp.float64)
    return fidelity.fidelity_sweep(problem, ranks=(4, 16, 32), seeds=(0, 1, 2),
                                   kinds=('rademacher', 'gaussian', 'orthogonal'))


def test_cosine_rises_with_rank(sweep):
  for kind in ('rademacher', 'gaussian', 'orthogonal'):
    cos = [r['cos_mean'] for r in sweep if r['kind'] == kind]
    assert len(cos) == 3 and all(a < b for a, b in zip(cos, cos[1:])), (kind, cos)


@pytest.mark.parametrize('rank', [16, 32])
def test_cosine_matches_theory_and_is_not_one_at_full_rank(sweep, rank):
  # At R = K = 32 for 6 of the 7 matrices the cosine is ≈ 1/√2 (0.57 for down_proj, K=64).
  # At R=4 the rank-1 bound's Jensen term (1/χ²_R tail) is too loose to be a useful test.
  for row in (r for r in sweep if r['rank'] == rank):
    assert row['n'] == 7 * 2 * 3
    tol = max(_tolerance(rank, k, row['n']) for k in (32, 64))
    assert abs(row['cos_mean'] / row['predicted'] - 1) < tol, (row, tol)
    if rank == 32 and row['kind'] == 'orthogonal':
      # Orthogonal rows at R = K: AᵀA = I, the sketch loses nothing (down_proj: sqrt(1/2)).
      for module, cos in row['by_module'].items():
        want = np.sqrt(0.5) if module == 'down_proj' else 1.0
        assert abs(cos - want) < (0.05 if module == 'down_proj' else 1e-6), (module, cos)
    elif rank == 32:
      assert 0.6 < row['cos_mean'] < 0.75
      low = next(r for r in sweep if r['kind'] == row['kind'] and r['rank'] == 4)
      assert row['cos_mean'] > 1.8 * low['cos_mean']  # predicted ratio 0.68/0.33 ≈ 2.1


def test_compressor_cost_entry_point(tmp_path):
  # A subprocess: its OPENBLAS_NUM_THREADS=1 must be set before OpenBLAS loads (see the script).
  flags = ['--d=32', '--f=64', '--vocab=32', '--batch=2', '--length=8', '--rank=8',
           '--repeats=1', f'--out_dir={tmp_path}']
  subprocess.run([sys.executable, os.path.join(ROOT, 'experiments', 'compressor_cost.py'),
                  *flags], check=True, cwd=ROOT, timeout=300,
                 env=dict(os.environ, PYTHONPATH=ROOT, OPENBLAS_NUM_THREADS='1'))
  with open(tmp_path / 'compressor_cost.json') as f:
    cost = json.load(f)
  sketch, dense, masked = cost['sketch'], cost['dense_rsvd'], cost['masked_sketch']
  # The dense path's outputs are only the factors, so every kernel gradient lives in temp.
  assert dense['temp'] >= cost['sizes']['dense_kernel_grads'] > 0
  assert dense['temp'] > sketch['temp']
  # The mask adds at most one copy of the sketches (and a key's worth of bits).
  assert masked['temp'] <= sketch['temp'] + cost['sizes']['sketches']


def test_sketch_fidelity_entry_point(tmp_path):
  spec = importlib.util.spec_from_file_location(
      'sketch_fidelity', os.path.join(ROOT, 'experiments', 'sketch_fidelity.py'))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  script.FLAGS(['sketch_fidelity', '--d=16', '--f=32', '--vocab=16', '--batch=1',
                '--length=8', '--ranks=2,4', '--num_seeds=1', f'--out_dir={tmp_path}'])
  script.main([])
  with open(tmp_path / 'sketch_fidelity.json') as f:
    rows = json.load(f)['rows']
  assert [(r['kind'], r['rank']) for r in rows] == [
      ('rademacher', 2), ('rademacher', 4), ('gaussian', 2), ('gaussian', 4),
      ('orthogonal', 2), ('orthogonal', 4)]
  assert (tmp_path / 'sketch_fidelity.png').stat().st_size > 0
