"""Projections: E[AᵀA] = I, determinism, sensitivity, cross-process reproducibility."""
import decimal
import functools
import hashlib
import math
import struct
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

from logra_jax.sketch import projection as P
from logra_jax.sketch import projection_checksum, sample_projection

# Computed once from the documented derivation and committed: any drift of any bit fails.
# (seed, step, name, R, K) -> {kind: (float32 checksum, bfloat16 checksum)}.
_CASES = [(42, 7, 'layers/mlp/up_proj/kernel/2', 16, 24), (0, 0, 'w', 3, 7),
          (5, 123456, 'layers/attn/q_proj/kernel', 64, 576), (1, 2**40, 'x', 1, 1),
          (3, 9, 'o', 4, 16)]
PINNED = {
    'rademacher': [
        ('c492355cf4ce60227eff14835526bb07031cab74efe0058ac1015ede72a7c586',) * 2,
        ('5dd4bc9f0113a8b2bf8ae8e4632bb2ae899dbba8085bfd5d3e281f5402e5da93',
         '87607e41f2ef867da923582400c934cc29c2f7eed6446d94fd49a76e2181d78c'),
        ('56938195cc612f6a6c969d83570728f3ee6f996d025a812d240962d09fab131d',) * 2,
        ('5395e5770f93561e7695c5c510fbe9940de1acb222cdfef41ef5bcaba597312c',) * 2,
        None],
    'gaussian': [
        ('d32860f00f60aee1501768060b94c6836c9e8ec027b3b73fa9524b80d12073f5',
         '5b45ba22c7f30c38937a3edc5d95f3c76637e0ad17d31110916c202529f210ec'),
        ('d4d6f507c5b65871182fd53b1865dcf504d9c2f64c98c8786b09ec6c4b72a682',
         'aa537be1a9646846c13a3846b6ab2740bedda9b6dade875f496f08b3a0fc8bec'),
        ('b5462e0c4b18a80a377bce690c1e2fa90d9b9e416eec791a19f4d5c157d74723',
         'd486cbd0282636af25fc250ea5418f37b3a71013f6dc5189f4a4e06abca44234'),
        ('10700ebbe1046698cae1f7097cd72ad01552692198ccad01908f37f8d48a2bd0',
         '839471ba501b0d4296efb1992946f16d9d9b811ad7b27ffd947173dad26320c6'),
        None],
    'orthogonal': [
        ('a6975f5954d495c9f82deb742d2e0f6a00b785f89125bd23b62be4ed353b7e88',
         'bde2c68cd5d7b1810fdbf7a02a5548b0d9332d96190de4db45820a3229faec4e'),
        ('bf0f7542831eadfe87def73a23e44cae993354643ba6e3c81a849dccc50f53e8',
         '2e44e26525db0a6ad6a18e1bfa071947908d07b55dd17b9b8aa708e88d8cf59f'),
        ('9f7a37f59728969d58bfd28ea2cd3cc1a9b1ec2b4c62ccf17fd7346613fa97e3',
         '6bfebe138405f1e96cb06bcfa63f2fa3dbda01faa96defdb1b1b048ecc4882af'),
        ('5395e5770f93561e7695c5c510fbe9940de1acb222cdfef41ef5bcaba597312c',) * 2,
        ('b0fb23b6a998ceb98ff31fb0a5d3b9e3aec7ed7b0864f0b9f72ab8b3a66d5895',) * 2],
}


def pinned_cases():
  """(kind, case, f32 checksum, bf16 checksum) for every pinned matrix."""
  return [(kind, case, *sums) for kind, rows in PINNED.items()
          for case, sums in zip(_CASES, rows) if sums]


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


@pytest.mark.parametrize('kind', P.KINDS)
def test_pinned_checksums_every_kind_and_dtype(kind):
  """float32 and float64 A carry the same bits; bfloat16 A is the float32 A rounded, and
  equal to it exactly where ``exact_dtype`` says so."""
  for k, case, f32, bf16 in pinned_cases():
    if k != kind:
      continue
    assert projection_checksum(sample_projection(*case, kind)) == f32, case
    assert projection_checksum(sample_projection(*case, kind, np.float64)) == f32, case
    assert projection_checksum(sample_projection(*case, kind, ml_dtypes.bfloat16)) == bf16
    exact = P.exact_dtype(kind, case[3], case[4], ml_dtypes.bfloat16) == ml_dtypes.bfloat16
    assert exact == (bf16 == f32), case
  assert projection_checksum(np.zeros((1, 2))) == projection_checksum(np.zeros((1, 2), np.float64))
  assert projection_checksum(np.zeros((1, 2))) != projection_checksum(np.zeros((2, 1)))


def test_pinned_checksums_in_another_process_without_jax():
  """A fresh interpreter that loads projection.py alone (numpy only) rebuilds every pinned A."""
  code = textwrap.dedent(f'''
      import importlib.util, sys
      spec = importlib.util.spec_from_file_location('proj', 'logra_jax/sketch/projection.py')
      mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
      assert 'jax' not in sys.modules
      for kind, case in {[(k, c) for k, c, *_ in pinned_cases()]!r}:
          print(mod.projection_checksum(mod.sample_projection(*case, kind)))
  ''')
  out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True,
                       cwd=__file__.rsplit('/tests/', 1)[0]).stdout.split()
  assert out == [f32 for _, _, f32, _ in pinned_cases()]


def test_exact_dtype():
  # 1/sqrt(R) is a dyadic rational only for R = 4**k; no other float32(1/sqrt(R)) happens to
  # fit bfloat16's 8-bit significand either (checked here for every R < 5000).
  bf16 = np.dtype(ml_dtypes.bfloat16)
  exact = [r for r in range(1, 5000) if P.exact_dtype('rademacher', r, 8, bf16) == bf16]
  assert exact == [4**k for k in range(7)]
  assert P.exact_dtype('gaussian', 16, 8, bf16) == np.float32
  assert P.exact_dtype('orthogonal', 4, 16, bf16) == bf16  # sqrt(16 / (4 * 16)) = 1/2
  assert P.exact_dtype('orthogonal', 4, 24, bf16) == np.float32  # blocks 16, 8: sqrt(3/8)
  assert P.exact_dtype('gaussian', 3, 8, np.float64) == np.float64


def _mix(z):
  m = (1 << 64) - 1
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
  return z ^ (z >> 31)


def _plain_key(seed, step, name):
  """The documented key with plain Python integers."""
  m = (1 << 64) - 1
  fnv = 0xCBF29CE484222325
  for byte in name.encode():
    fnv = ((fnv ^ byte) * 0x100000001B3) & m
  return _mix(_mix(_mix((seed + 0x9E3779B97F4A7C15) & m) ^ ((step * 0xD1B54A32D192ED03) & m))
              ^ fnv)


def _f32(x):
  """x rounded to float32 (nearest-even), as a Python float."""
  return struct.unpack('<f', struct.pack('<f', x))[0]


def test_rademacher_matches_documented_derivation():
  key = _plain_key(5, 9, 'x/3')
  signs = [1.0 - 2.0 * (_mix((key + i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)) >> 63)
           for i in range(1, 13)]
  np.testing.assert_array_equal(sample_projection(5, 9, 'x/3', 3, 4),
                                np.float32(np.reshape(signs, (3, 4)) / np.sqrt(3)))


@functools.cache
def _plain_tables():
  """The docstring's coefficient tables, from their formulas."""
  ctx = decimal.Context(prec=60)
  ln2_q59 = int((ctx.ln(decimal.Decimal(2)) * 2**59).to_integral_value(decimal.ROUND_HALF_EVEN))
  log = [(2**32 + k) // (2 * k) for k in range(1, 28)]  # round(2**31 / k), never a tie
  # float64 is enough: every fractional part is >= 0.01 away from 1/2.
  trig = [round((math.pi / 2)**k / math.factorial(k) * 2**30) for k in range(1, 15)]
  return log, trig[0::2], trig[1::2], ln2_q59


def _plain_gaussian_z(h):
  """z (Q27) of one 64-bit element hash: the docstring's fixed-point Box–Muller, plain ints."""
  log, sin_q30, cos_q30, ln2_q59 = _plain_tables()
  w, v = h >> 32, h & 0xFFFFFFFF
  t = 0
  if w:
    y = 2**32 - w
    n = 32 - y.bit_length()
    f = 2**32 - (y << n)
    p = log[26]
    for k in range(25, -1, -1):
      p = log[k] + (p * f >> 32)
    t = n * ln2_q59 + (f * p >> 4)
  rad = math.isqrt(t)
  q, x = v >> 30, (v & (2**30 - 1)) << 2
  x2 = x * x >> 32
  c, s = cos_q30[6], sin_q30[6]
  for k in range(5, -1, -1):
    c, s = cos_q30[k] - (c * x2 >> 32), sin_q30[k] - (s * x2 >> 32)
  mag = (s * x >> 32) if q % 2 else 2**30 - min(c * x2 >> 32, 2**30)
  z = rad * mag >> 32
  return -z if q in (1, 2) else z


def _plain_gaussian_bits(seed, step, name, r, k):
  """float32 bit patterns of the Gaussian A (r, k), row-major, and its checksum."""
  key = _plain_key(seed, step, name)
  scale = _f32(1.0 / math.sqrt(r)) * 2.0**-27  # exact: a power-of-two rescaling
  bits = []
  for i in range(1, r * k + 1):
    z = _plain_gaussian_z(_mix((key + i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1)))
    a = _f32(_f32(float(z)) * scale)  # the float64 product of two float32s is exact
    bits.append(struct.unpack('<I', struct.pack('<f', a))[0])
  digest = hashlib.sha256(repr((r, k)).encode())
  digest.update(struct.pack(f'<{r * k}I', *bits))
  return bits, digest.hexdigest()


def test_gaussian_matches_plain_python_bit_for_bit():
  """Every bit of the Gaussian A, against a re-implementation with math/struct/hashlib."""
  log, sin_q30, cos_q30, ln2_q59 = _plain_tables()
  assert (tuple(log), tuple(sin_q30), tuple(cos_q30), ln2_q59) == (
      P.LOG_Q31, P.SIN_Q30, P.COS_Q30, P.LN2_Q59)
  for kind, case, f32, _ in pinned_cases():
    if kind == 'gaussian':
      bits, digest = _plain_gaussian_bits(*case)
      a = sample_projection(*case, 'gaussian')
      np.testing.assert_array_equal(a.view(np.uint32).ravel(), np.array(bits, np.uint32))
      assert digest == f32 == projection_checksum(a)
  # The edges: w = 0 (u1 = 1), w = 2**32 - 1 (u1 = 2**-32), every quadrant boundary of v.
  words = [0, 1, 2, 2**30 - 1, 2**30, 2**31 - 1, 2**31, 3 * 2**30, 2**32 - 2, 2**32 - 1]
  h = [w << 32 | v for w in words for v in words]
  np.testing.assert_array_equal(P.gaussian_q27(np.array(h, np.uint64)),
                                [_plain_gaussian_z(x) for x in h])


def test_one_ulp_in_one_gaussian_entry_is_caught():
  case = _CASES[0]
  a = sample_projection(*case, 'gaussian')
  a[3, 5] = np.nextafter(a[3, 5], np.float32(np.inf))
  bits, digest = _plain_gaussian_bits(*case)
  assert projection_checksum(a) != PINNED['gaussian'][0][0] and digest != projection_checksum(a)
  assert np.sum(a.view(np.uint32).ravel() != np.array(bits, np.uint32)) == 1


def test_fixed_point_gaussian_is_box_muller():
  """z against float64 Box–Muller of the same uniforms u1 = 1 - w 2**-32, u2 = v 2**-32.

  Error budget: cos/sin in Q30 within 4·2**-30 (Taylor remainder < 7e-10 plus 14 floored
  mulhi steps), times |rad| <= 6.67: 2.5e-8; rad = floor(sqrt(t)) within 2**-29 plus the
  relative error of t (Horner truncation and flooring, < 1e-8): < 4e-8; z floored to
  2**-27: 7.5e-9. Total < 1e-7 (measured 1.3e-8 over 2e5 draws).
  """
  h = P._element_hashes(np.uint64(12345), 100_000)
  z = P.gaussian_q27(h) * 2.0**-27
  w, v = (h >> np.uint64(32)).astype(np.float64), (h & np.uint64(P.MASK32)).astype(np.float64)
  ref = np.sqrt(-2 * np.log(1 - w * 2.0**-32)) * np.cos(2 * np.pi * v * 2.0**-32)
  np.testing.assert_allclose(z, ref, rtol=0, atol=1e-7)


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
