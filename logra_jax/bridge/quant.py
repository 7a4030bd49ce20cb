"""How U travels in a `logra-update/1` blob: fp32, bf16, fp8-e4m3 or int4 (docs/bridge.md).

numpy only and no other module of ours: `wire.py` loads this file by path where the `logra_jax`
package cannot be imported (vLLM's environment). bf16 is stored as uint16 bit patterns (round to
nearest even); fp8-e4m3 (e4m3fn: no infinities, NaN = 0x7f/0xff) and int4 (two values per byte,
low nibble first, offset 8) carry a float32 scale per row: U = q · scale.
"""
from typing import Optional

import numpy as np

U_DTYPES = ('fp32', 'bf16', 'fp8-e4m3', 'int4')


def _bf16_bits(x):
  """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
  bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
  rounded = bits + 0x7FFF + ((bits >> 16) & 1)
  return (rounded >> 16).astype(np.uint16)


def _e4m3_table():
  """The 126 finite non-negative float8 e4m3fn values (bits 0 … 0x7E), ascending."""
  bits = np.arange(0x7F)
  exp, man = bits >> 3, bits & 7
  return np.where(exp == 0, man / 8 * 2.0**-6, (1 + man / 8) * 2.0**(exp - 7)).astype(np.float32)


_E4M3 = _e4m3_table()
E4M3_NAN = 0x7F  # S.1111.111: e4m3fn's only NaN code (no infinities)
_E4M3_DECODE = np.append(_E4M3, np.float32(np.nan))  # all 128 magnitude codes


def _to_e4m3(x):
  """float32 in [-448, 448] -> e4m3fn bytes (nearest value; ties to the lower magnitude)."""
  mag = np.abs(x)
  hi = np.clip(np.searchsorted(_E4M3, mag), 1, len(_E4M3) - 1)
  lo = hi - 1
  idx = np.where(mag - _E4M3[lo] <= _E4M3[hi] - mag, lo, hi).astype(np.uint8)
  return idx | np.where(x < 0, 0x80, 0).astype(np.uint8)


def _row_scales(u, top):
  peak = np.max(np.abs(u), axis=1)
  return np.where(peak > 0, peak / top, 1.0).astype(np.float32)


def quantize_u(u, u_dtype: str) -> dict:
  """{'': stored U, '.scale': per-row scales if any} for ``<name>.U``."""
  u = np.asarray(u, np.float32)
  if u_dtype == 'fp32':
    return {'': u}
  if u_dtype == 'bf16':
    return {'': _bf16_bits(u)}
  if u_dtype == 'fp8-e4m3':
    scale = _row_scales(u, 448.0)
    return {'': _to_e4m3(u / scale[:, None]), '.scale': scale}
  if u_dtype == 'int4':
    scale = _row_scales(u, 7.0)
    q = (np.clip(np.rint(u / scale[:, None]), -7, 7).astype(np.int8) + 8).astype(np.uint8)
    if q.shape[1] % 2:
      q = np.pad(q, ((0, 0), (0, 1)), constant_values=8)
    return {'': q[:, 0::2] | (q[:, 1::2] << 4), '.scale': scale}
  raise ValueError(f'u_dtype must be one of {U_DTYPES}, got {u_dtype!r}')


def dequantize_u(stored, scale, u_dtype: str, rank: Optional[int] = None):
  """Inverse of `quantize_u` (``rank`` = r for int4, whose rows are packed two per byte)."""
  if u_dtype == 'fp32':
    return np.asarray(stored, np.float32)
  if u_dtype == 'bf16':
    return (stored.astype(np.uint32) << 16).view(np.float32)
  if u_dtype == 'fp8-e4m3':
    mag = _E4M3_DECODE[stored & 0x7F]  # the NaN code decodes to NaN (refused by `parse`)
    return np.where(stored & 0x80, -mag, mag) * scale[:, None]
  q = np.stack([stored & 0xF, stored >> 4], axis=-1).reshape(stored.shape[0], -1)
  return (q[:, :rank].astype(np.float32) - 8) * scale[:, None]


STORED_DTYPE = {'fp32': np.float32, 'bf16': np.uint16, 'fp8-e4m3': np.uint8, 'int4': np.uint8}
