"""Random projections A (R×K), rebuilt bit-exactly from (seed, step, name) anywhere.

The derivation uses integer hashing only (no JAX PRNG, no library RNG), so a generator in
another process, machine or framework rebuilds the same A from the seed:

  * ``mix64(z)`` is the splitmix64 finaliser on unsigned 64-bit integers (all arithmetic mod
    2**64): ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
    z ^= z >> 31``.
  * ``name_hash`` is 64-bit FNV-1a over the UTF-8 bytes of the matrix name.
  * ``key = mix64(mix64(mix64(seed + GOLDEN) ^ (step * STEP_MUL)) ^ name_hash)``.
  * Element ``i`` of the row-major (R, K) matrix uses ``h_i = mix64(key + (i + 1) * GOLDEN)``.
  * ``s_R = float32(1 / sqrt(R))`` (float64 sqrt and division, then rounded to float32).
  * Rademacher: ``A_i = +s_R if the top bit of h_i is 0 else -s_R``.
  * Gaussian: Box–Muller in 32-bit fixed point. Only integer operations and one correctly
    rounded float32 conversion and product per element, so numpy, plain Python and XLA on
    any device agree bit for bit (float log/cos would not: libm and XLA round differently,
    and XLA fuses multiply-adds). With ``mulhi(a, b) = (a * b) >> 32`` on 32-bit words,
    ``w = h_i >> 32`` and ``v = h_i mod 2**32``:
    - ``t = -2 ln u1`` in Q58 (a 64-bit word) for ``u1 = 1 - w * 2**-32``: ``t = 0`` if
      ``w = 0``; else ``y = 2**32 - w``, ``n = 32 - bit_length(y)``, ``f = 2**32 - (y << n)``
      (so that ``u1 = 2**-n (1 - f * 2**-32)``, ``f * 2**-32`` in (0, 1/2]), the series
      ``-ln(1 - x) = x sum_k x**k / (k + 1)`` by Horner: ``p = LOG_Q31[26]``, then
      ``p = LOG_Q31[k] + mulhi(p, f)`` for k = 25 … 0, and
      ``t = n * LN2_Q59 + ((f * p) >> 4)`` (``f * p`` the full 64-bit product).
    - ``rad = isqrt(t)`` (``sqrt(-2 ln u1)`` in Q29: the integer square root, floored).
    - ``cos(2 pi v 2**-32)`` in Q30 from the quadrant ``q = v >> 30`` and
      ``x = (v mod 2**30) << 2`` (Q32), ``x2 = mulhi(x, x)``: Taylor series of
      ``cos(pi x / 2)`` (q even) and ``sin(pi x / 2)`` (q odd) by Horner,
      ``c = COS_Q30[6]``, ``c = COS_Q30[k] - mulhi(c, x2)`` for k = 5 … 0,
      ``cos = 2**30 - min(mulhi(c, x2), 2**30)``; ``s = SIN_Q30[6]``, ``s = SIN_Q30[k] -
      mulhi(s, x2)`` for k = 5 … 0, ``sin = mulhi(s, x)``; negative for q in {1, 2}.
    - ``z = ±mulhi(rad, cos or sin)`` (Q27: |z| 2**-27 <= 6.67, so |z| < 2**30) and
      ``A_i = float32(z) * (s_R * 2**-27)`` in float32: the conversion and the product
      each round once to nearest-even (the constant is exact).
    The coefficient tables (literal below) are ``LOG_Q31[k] = round(2**31 / (k + 1))``,
    ``SIN_Q30[k] = round((pi/2)**(2k+1) / (2k+1)! * 2**30)``, ``COS_Q30[k] =
    round((pi/2)**(2k+2) / (2k+2)! * 2**30)``, ``LN2_Q59 = round(ln 2 * 2**59)``. The
    result is float64 Box–Muller of the same u1, u2 = v 2**-32 within 1e-7 absolute in
    z (measured 1.3e-8), so N(0, 1/R) up to a tail cut at |z| = 6.66 (u1 >= 2**-32).
  * Orthogonal (a block subsampled randomised Hadamard transform, R ≤ K): write K as a sum
    of powers of two, largest first (K = 576 → blocks of 512 and 64 at offsets 0 and 512).
    Column signs ``d_j`` are the Rademacher signs of elements ``j = 0 … K-1`` above. The K
    candidate rows (block b, local row l), numbered block by block, are ordered by
    ``mix64((key ^ ROW_SALT) + (g + 1) * GOLDEN)`` for candidate ``g`` (ascending, ties by
    ``g``), and the first R are taken. Selected row (b, l) is zero outside its block and
    ``A[o_b + c] = d_{o_b + c} · (-1)^popcount(l & c) · sqrt(K / (R · n_b))`` inside it
    (block offset ``o_b``, size ``n_b``; the sqrt in float64, then rounded to float32).
    The rows are orthogonal: A Aᵀ = (K/R) I, and AᵀA = (K/R) P with P a random rank-R
    orthogonal projection; at R = K, AᵀA = I exactly.
    The sketch's reconstruction cosine is sqrt(R/K), against sqrt(R/(R+K)) for i.i.d. A.

Stacked (scanned) layers use the name ``f"{path}/{layer}"`` for layer ``layer``.
E[AᵀA] = I for every kind. A in a narrower dtype is the float32 A rounded to nearest-even;
``exact_dtype`` says where that loses nothing (bfloat16: Rademacher only for R a power of 4,
where s_R = 2**-k; see its docstring). ``projection_jax`` builds the same bits on device.
"""
import hashlib

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
STEP_MUL = 0xD1B54A32D192ED03
ROW_SALT = 0x2545F4914F6CDD1D
KINDS = ('rademacher', 'gaussian', 'orthogonal')
MASK32 = (1 << 32) - 1
LOG_Q31 = (2147483648, 1073741824, 715827883, 536870912, 429496730, 357913941, 306783378,
           268435456, 238609294, 214748365, 195225786, 178956971, 165191050, 153391689,
           143165577, 134217728, 126322568, 119304647, 113025455, 107374182, 102261126,
           97612893, 93368854, 89478485, 85899346, 82595525, 79536431)
SIN_Q30 = (1686629713, 693598668, 85569306, 5026995, 172272, 3864, 61)
COS_Q30 = (1324675879, 272375560, 22401992, 987048, 27060, 506, 7)
LN2_Q59 = 399572145162582989


def _mix64(z):
  """splitmix64 finaliser on a numpy uint64 array (wrapping arithmetic)."""
  z = np.asarray(z, dtype=np.uint64)
  with np.errstate(over='ignore'):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def name_hash(name: str) -> int:
  """64-bit FNV-1a of the UTF-8 bytes of ``name``."""
  h = 0xCBF29CE484222325
  for byte in name.encode('utf-8'):
    h = ((h ^ byte) * 0x100000001B3) & MASK64
  return h


def projection_key(seed: int, step: int, name: str) -> int:
  """The 64-bit key of one matrix at one step (see the module docstring)."""
  for v, what in ((seed, 'seed'), (step, 'step')):
    if not isinstance(v, (int, np.integer)) or v < 0:
      raise ValueError(f'{what} must be a non-negative integer, got {v!r}')
  k = int(_mix64(np.uint64((int(seed) + GOLDEN) & MASK64)))
  k = int(_mix64(np.uint64(k ^ ((int(step) * STEP_MUL) & MASK64))))
  return int(_mix64(np.uint64(k ^ name_hash(name))))


def sample_projection(seed, step, name, rank, dim, kind='rademacher', dtype=np.float32):
  """Draws A (rank, dim) with E[AᵀA] = I, deterministic in (seed, step, name).

  Args:
    seed: run seed (non-negative int).
    step: optimizer step (pass 0 for fixed projections).
    name: the matrix name, e.g. 'layers/attn/q_proj/kernel/3'.
    rank: R. dim: K (the kernel's input dimension).
    kind: 'rademacher' (±1/√R), 'gaussian' (N(0, 1/R)) or 'orthogonal' (block SRHT, R ≤ K,
      orthogonal rows; see the module docstring).

  Returns:
    A numpy array (rank, dim) of ``dtype``.
  """
  if kind not in KINDS:
    raise ValueError(f'projection kind must be one of {KINDS}, got {kind!r}')
  if int(rank) < 1 or int(dim) < 1:
    raise ValueError(f'rank and dim must be >= 1, got rank={rank}, dim={dim}')
  key = np.uint64(projection_key(seed, step, name))
  if kind == 'orthogonal':
    return _orthogonal(key, int(rank), int(dim)).astype(np.float32).astype(dtype)
  h = _element_hashes(key, rank * dim)
  scale = rademacher_scale(rank)
  if kind == 'rademacher':
    out = np.where(h >> np.uint64(63), -scale, scale)
  else:
    out = gaussian_q27(h).astype(np.float32) * np.float32(scale * np.float32(2.0**-27))
  return out.astype(np.float32).astype(dtype).reshape(rank, dim)


def rademacher_scale(rank) -> np.float32:
  """s_R = float32(1 / sqrt(R)), the magnitude of a Rademacher entry."""
  return np.float32(1.0 / np.sqrt(float(rank)))


def _mulhi(a, b):
  """(a * b) >> 32 for uint64 arrays holding 32-bit words (the product fits in 64 bits)."""
  return (a * b) >> np.uint64(32)


def _neg_two_log_q58(w):
  """-2 ln(1 - w 2**-32) in Q58 for 32-bit words w (uint64 array); see the docstring."""
  one = np.uint64(1 << 32)
  y = np.where(w == 0, np.uint64(1), one - w)
  n = np.uint64(32) - np.frexp(y.astype(np.float64))[1].astype(np.uint64)  # exact bit length
  f = one - (y << n)
  p = np.full_like(w, LOG_Q31[-1])
  for c in reversed(LOG_Q31[:-1]):
    p = np.uint64(c) + _mulhi(p, f)
  t = n * np.uint64(LN2_Q59) + ((f * p) >> np.uint64(4))
  return np.where(w == 0, np.uint64(0), t)


def _isqrt(t):
  """floor(sqrt(t)) for a uint64 array t, bit by bit (every root is below 2**32)."""
  r = np.zeros_like(t)
  for bit in reversed(range(32)):
    c = r | np.uint64(1 << bit)
    r = np.where(c * c <= t, c, r)
  return r


def _cos_turn_q30(v):
  """|cos(2 pi v 2**-32)| in Q30 and its sign (True: negative) for 32-bit words v."""
  q = v >> np.uint64(30)
  x = (v & np.uint64((1 << 30) - 1)) << np.uint64(2)
  x2 = _mulhi(x, x)
  c, s = np.full_like(v, COS_Q30[-1]), np.full_like(v, SIN_Q30[-1])
  for kc, ks in zip(reversed(COS_Q30[:-1]), reversed(SIN_Q30[:-1])):
    c, s = np.uint64(kc) - _mulhi(c, x2), np.uint64(ks) - _mulhi(s, x2)
  cos = np.uint64(1 << 30) - np.minimum(_mulhi(c, x2), np.uint64(1 << 30))
  mag = np.where(q & np.uint64(1), _mulhi(s, x), cos)
  return mag, (q == 1) | (q == 2)


def gaussian_q27(h):
  """Box–Muller z (int64, Q27) from 64-bit element hashes, in fixed point (see docstring)."""
  h = np.asarray(h, dtype=np.uint64)
  rad = _isqrt(_neg_two_log_q58(h >> np.uint64(32)))
  mag, neg = _cos_turn_q30(h & np.uint64(MASK32))
  z = _mulhi(rad, mag).astype(np.int64)
  return np.where(neg, -z, z)


def _element_hashes(key, n):
  """h_i = mix64(key + (i + 1) * GOLDEN) for i = 0 … n-1 (uint64, wrapping)."""
  with np.errstate(over='ignore'):
    return _mix64(key + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GOLDEN))


def _signs(h):
  """+1.0 where the top bit of h is 0, else -1.0."""
  return 1.0 - 2.0 * (h >> np.uint64(63)).astype(np.float64)


def orthogonal_scales(rank, dim):
  """float32(sqrt(K / (R n_b))) for each power-of-two block (offset, size) of K."""
  return [np.float32(np.sqrt(dim / (rank * size))) for _, size in _hadamard_blocks(dim)]


def exact_dtype(kind, rank, dim, dtype):
  """``dtype`` if it holds every float32 entry of A exactly, else float32.

  float32 and float64 always do. A narrower float (bfloat16, float16) holds Rademacher A iff
  it holds s_R: bfloat16 does for R = 4**k (s_R = 2**-k) only, checked for every R < 5000,
  since otherwise 1/sqrt(R) has a 24-bit float32 significand. Orthogonal A likewise iff it
  holds every block scale; Gaussian A never (its entries use all 24 bits).
  """
  dtype = np.dtype(dtype)
  if dtype.itemsize >= 4:
    return dtype
  mags = {'rademacher': lambda: [rademacher_scale(rank)],
          'orthogonal': lambda: orthogonal_scales(rank, dim), 'gaussian': lambda: [np.nan]}
  if kind not in mags:
    raise ValueError(f'projection kind must be one of {KINDS}, got {kind!r}')
  ok = all(np.float32(m).astype(dtype).astype(np.float32) == m for m in mags[kind]())
  return dtype if ok else np.dtype(np.float32)


def _hadamard_blocks(dim):
  """(offset, size) of the power-of-two blocks of ``dim``, largest first."""
  blocks, offset = [], 0
  for bit in reversed(range(dim.bit_length())):
    if dim >> bit & 1:
      blocks.append((offset, 1 << bit))
      offset += 1 << bit
  return blocks


def _orthogonal(key, rank, dim):
  """The block-SRHT projection (rank, dim) in float64 (see the module docstring)."""
  if rank > dim:
    raise ValueError(f"orthogonal projections need rank <= dim, got rank={rank}, dim={dim}")
  signs = _signs(_element_hashes(key, dim))
  order = _element_hashes(key ^ np.uint64(ROW_SALT), dim)
  chosen = np.argsort(order, kind='stable')[:rank]
  blocks = _hadamard_blocks(dim)
  starts = np.array([o for o, _ in blocks])
  out = np.zeros((rank, dim))
  for i, g in enumerate(chosen):
    offset, size = blocks[int(np.searchsorted(starts, g, side='right')) - 1]
    local = np.uint64(g - offset)
    c = np.arange(size, dtype=np.uint64)
    parity = np.bitwise_count(local & c).astype(np.int64) & 1
    out[i, offset:offset + size] = ((1 - 2 * parity) * signs[offset:offset + size]
                                    * np.sqrt(dim / (rank * size)))
  return out


def projection_checksum(a) -> str:
  """SHA-256 hex digest of A's shape and float32 little-endian bytes."""
  a = np.ascontiguousarray(np.asarray(a, dtype='<f4'))
  h = hashlib.sha256(repr(tuple(a.shape)).encode())
  h.update(a.tobytes())
  return h.hexdigest()
