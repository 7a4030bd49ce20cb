"""Projections: E[AᵀA] = I, determinism, sensitivity, cross-process reproducibility."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from logra_jax.sketch import projection_checksum, sample_projection


@pytest.mark.parametrize('kind', ['rademacher', 'gaussian'])
def test_expectation_of_ata_is_identity(kind):
  # Average AᵀA over n independent draws (steps). Entry (i, j) of AᵀA is Σ_r A_ri A_rj with
  # A_ri of variance 1/R: off-diagonal entries have mean 0 and variance R·(1/R)² = 1/R; the
  # diagonal is exactly 1 (Rademacher) or has variance 2/R (Gaussian: Σ of R χ²₁/R). The mean
  # over n draws has std ≤ sqrt(2/(R n)); 6 std bounds every one of the K² entries with
  # failure odds < 1e-6.
  r, k, n = 8, 6, 2000
  m = sum(sample_projection(3, t, 'w', r, k, kind).astype(np.float64).T
          @ sample_projection(3, t, 'w', r, k, kind) for t in range(n)) / n
  assert np.max(np.abs(m - np.eye(k))) < 6 * np.sqrt(2 / (r * n))
  a = sample_projection(0, 0, 'w', 64, 64, kind)
  assert abs(a.std() - 1 / 8) < 0.01 and a.dtype == np.float32
  if kind == 'rademacher':
    assert set(np.unique(a)) == {np.float32(-1 / 8), np.float32(1 / 8)}


def test_deterministic_and_sensitive_to_seed_step_name():
  a = sample_projection(1, 2, 'layers/attn/q_proj/kernel/0', 4, 32)
  np.testing.assert_array_equal(a, sample_projection(1, 2, 'layers/attn/q_proj/kernel/0', 4, 32))
  for other in [(2, 2, 'layers/attn/q_proj/kernel/0'), (1, 3, 'layers/attn/q_proj/kernel/0'),
                (1, 2, 'layers/attn/q_proj/kernel/1')]:
    b = sample_projection(*other, 4, 32)
    assert np.mean(a == b) < 0.75  # independent signs agree half the time


def test_known_values_and_bit_identical_in_another_process():
  """A fresh interpreter without JAX rebuilds A bit for bit; pinned checksums catch drift."""
  code = textwrap.dedent('''
      import importlib.util, sys
      # projection.py needs numpy only: load the file alone, as a generator without JAX would.
      spec = importlib.util.spec_from_file_location('proj', 'logra_jax/sketch/projection.py')
      mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
      sample_projection, projection_checksum = mod.sample_projection, mod.projection_checksum
      assert 'jax' not in sys.modules
      for kind in ('rademacher', 'gaussian', 'orthogonal'):
          print(projection_checksum(sample_projection(42, 7, 'layers/mlp/up_proj/kernel/2', 16, 24, kind)))
  ''')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       cwd=__file__.rsplit('/tests/', 1)[0]).stdout.split()
  here = [projection_checksum(sample_projection(42, 7, 'layers/mlp/up_proj/kernel/2', 16, 24, k))
          for k in ('rademacher', 'gaussian', 'orthogonal')]
  assert out == here
  # The documented derivation, re-implemented here with plain Python integers.
  m = (1 << 64) - 1
  def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)
  fnv = 0xCBF29CE484222325
  for byte in 'x/3'.encode():
    fnv = ((fnv ^ byte) * 0x100000001B3) & m
  key = mix(mix(mix((5 + 0x9E3779B97F4A7C15) & m) ^ ((9 * 0xD1B54A32D192ED03) & m)) ^ fnv)
  signs = [1.0 - 2.0 * (mix((key + i * 0x9E3779B97F4A7C15) & m) >> 63) for i in range(1, 13)]
  np.testing.assert_array_equal(sample_projection(5, 9, 'x/3', 3, 4),
                                np.float32(np.reshape(signs, (3, 4)) / np.sqrt(3)))
  assert projection_checksum(np.zeros((1, 2))) == projection_checksum(np.zeros((1, 2), np.float64))
  assert projection_checksum(np.zeros((1, 2))) != projection_checksum(np.zeros((2, 1)))


def test_orthogonal_rows_and_exact_at_full_rank():
  # Float32 values of sqrt(K/(R·n_b)): A Aᵀ = (K/R) I up to their rounding (2⁻²⁴ relative).
  for r, k in [(64, 128), (5, 576), (3, 7), (12, 12)]:
    a = sample_projection(0, 1, 'w', r, k, 'orthogonal').astype(np.float64)
    np.testing.assert_allclose(a @ a.T, k / r * np.eye(r), atol=4 * k / r * 2.0**-24)
  a = sample_projection(2, 3, 'w', 12, 12, 'orthogonal').astype(np.float64)
  np.testing.assert_allclose(a.T @ a, np.eye(12), atol=4 * 2.0**-24)
  # E[AᵀA] = I: for a power-of-two K every entry of AᵀA is a sum of R terms ±1/R (off the
  # diagonal, with independent random column signs), so the mean over n draws has std
  # ≤ 1/sqrt(R n), the same 6σ bound as the i.i.d. kinds.
  r, k, n = 4, 8, 2000
  m = sum(sample_projection(3, t, 'w', r, k, 'orthogonal').astype(np.float64).T
          @ sample_projection(3, t, 'w', r, k, 'orthogonal') for t in range(n)) / n
  assert np.max(np.abs(m - np.eye(k))) < 6 * np.sqrt(2 / (r * n))
  with pytest.raises(ValueError, match='rank <= dim'):
    sample_projection(0, 0, 'w', 9, 8, 'orthogonal')


def test_orthogonal_matches_documented_derivation():
  """The module docstring's block-SRHT recipe, re-implemented with plain Python integers."""
  m = (1 << 64) - 1
  def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)
  from logra_jax.sketch.projection import projection_key
  seed, step, name, r, k = 4, 2, 'q/0', 5, 6  # K = 6: blocks of 4 (offset 0) and 2 (offset 4)
  key = projection_key(seed, step, name)
  golden = 0x9E3779B97F4A7C15
  signs = [1 - 2 * (mix((key + (j + 1) * golden) & m) >> 63) for j in range(k)]
  salted = key ^ 0x2545F4914F6CDD1D
  order = sorted(range(k), key=lambda g: (mix((salted + (g + 1) * golden) & m), g))[:r]
  want = np.zeros((r, k))
  for i, g in enumerate(order):
    offset, size = (0, 4) if g < 4 else (4, 2)
    for c in range(size):
      parity = bin((g - offset) & c).count('1') % 2
      want[i, offset + c] = signs[offset + c] * (-1) ** parity * np.sqrt(k / (r * size))
  np.testing.assert_array_equal(sample_projection(seed, step, name, r, k, 'orthogonal'),
                                want.astype(np.float32))


def test_bad_arguments():
  with pytest.raises(ValueError, match='kind'):
    sample_projection(0, 0, 'w', 2, 2, 'uniform')
  with pytest.raises(ValueError, match='seed'):
    sample_projection(-1, 0, 'w', 2, 2)
  with pytest.raises(ValueError, match='rank'):
    sample_projection(0, 0, 'w', 0, 2)
