"""Random projections A (R×K), rebuilt bit-exactly from (seed, step, name) anywhere.

The derivation uses integer hashing only (no JAX PRNG, no library RNG), so a generator in
another process, machine or framework rebuilds the same A from the seed:

  * ``mix64(z)`` is the splitmix64 finaliser on unsigned 64-bit integers (all arithmetic mod
    2**64): ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
    z ^= z >> 31``.
  * ``name_hash`` is 64-bit FNV-1a over the UTF-8 bytes of the matrix name.
  * ``key = mix64(mix64(mix64(seed + GOLDEN) ^ (step * STEP_MUL)) ^ name_hash)``.
  * Element ``i`` of the row-major (R, K) matrix uses ``h_i = mix64(key + (i + 1) * GOLDEN)``.
  * Rademacher: ``A_i = (+1 if the top bit of h_i is 0 else -1) / sqrt(R)`` (exact in float32).
  * Gaussian: ``u1 = ((h_i >> 11) + 1) * 2**-53``, ``u2 = (mix64(h_i ^ GAUSS_SALT) >> 11) *
    2**-53``, ``A_i = float32(sqrt(-2 ln u1) cos(2 pi u2) / sqrt(R))`` computed in float64.
    The float32 result is bit-exact wherever the C library's float64 log/cos agree, which
    differ, if at all, in the last float64 bit (a float32 flip has odds ~1e-9 per element);
    ``projection_checksum`` travels with every update so a receiver detects any mismatch.
  * Orthogonal (a block subsampled randomised Hadamard transform, R ≤ K): write K as a sum
    of powers of two, largest first (K = 576 → blocks of 512 and 64 at offsets 0 and 512).
    Column signs ``d_j`` are the Rademacher signs of elements ``j = 0 … K-1`` above. The K
    candidate rows (block b, local row l), numbered block by block, are ordered by
    ``mix64((key ^ ROW_SALT) + (g + 1) * GOLDEN)`` for candidate ``g`` (ascending, ties by
    ``g``), and the first R are taken. Selected row (b, l) is zero outside its block and
    ``A[o_b + c] = d_{o_b + c} · (-1)^popcount(l & c) · sqrt(K / (R · n_b))`` inside it
    (block offset ``o_b``, size ``n_b``). Every value is a correctly rounded sqrt, so the
    matrix is bit-exact everywhere. The rows are orthogonal: A Aᵀ = (K/R) I, and AᵀA =
    (K/R) P with P a random rank-R orthogonal projection; at R = K, AᵀA = I exactly.
    The sketch's reconstruction cosine is sqrt(R/K), against sqrt(R/(R+K)) for i.i.d. A.

Stacked (scanned) layers use the name ``f"{path}/{layer}"`` for layer ``layer``.
E[AᵀA] = I for every kind.
"""
import hashlib

import numpy as np

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
STEP_MUL = 0xD1B54A32D192ED03
GAUSS_SALT = 0x5851F42D4C957F2D
ROW_SALT = 0x2545F4914F6CDD1D
KINDS = ('rademacher', 'gaussian', 'orthogonal')


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
  if kind == 'rademacher':
    out = _signs(h) / np.sqrt(rank)
  else:
    u1 = ((h >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0**-53
    u2 = (_mix64(h ^ np.uint64(GAUSS_SALT)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
    out = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2) / np.sqrt(rank)
  return out.astype(np.float32).astype(dtype).reshape(rank, dim)


def _element_hashes(key, n):
  """h_i = mix64(key + (i + 1) * GOLDEN) for i = 0 … n-1 (uint64, wrapping)."""
  with np.errstate(over='ignore'):
    return _mix64(key + np.arange(1, n + 1, dtype=np.uint64) * np.uint64(GOLDEN))


def _signs(h):
  """+1.0 where the top bit of h is 0, else -1.0."""
  return 1.0 - 2.0 * (h >> np.uint64(63)).astype(np.float64)


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
