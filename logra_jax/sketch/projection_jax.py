"""Projections A built on device inside jitted code, bit-identical to ``projection.py``.

The derivation is the one documented in ``projection.py``; only its arithmetic differs.
JAX without x64 has no uint64, so every 64-bit word is a pair ``(hi, lo)`` of uint32 arrays
and 64-bit products are built from 16-bit limbs (``mulhi32``). Every step is an integer
operation except one correctly rounded int32 → float32 conversion and one float32 product
per Gaussian entry (no additions to fuse into FMAs), so the bits do not depend on the device
or on XLA's float optimisations.

``seed`` and ``step`` may be traced int32/uint32 scalars (one compile serves every step);
they must lie in [0, 2**32). ``name_hash`` is a Python int (``projection.name_hash``) or a
traced uint32 array ``[hi, lo]`` (e.g. one row of ``layer_name_hashes`` inside a scan).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax import lax

from logra_jax.sketch import projection as P
from logra_jax.sketch.rank import RankRules
from logra_jax.sketch.tree import DEFAULT_TARGETS, path_str, stacked_name, target_paths

U32 = jnp.uint32


def _c(v):
  """A uint32 constant."""
  return np.uint32(v & P.MASK32)


def mulhi32(a, b):
  """(a * b) >> 32 for uint32 arrays, from four 16-bit limb products."""
  a0, a1, b0, b1 = a & _c(0xFFFF), a >> 16, b & _c(0xFFFF), b >> 16
  p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
  mid = (p00 >> 16) + (p01 & _c(0xFFFF)) + (p10 & _c(0xFFFF))
  return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)


def _const64(v):
  return _c(v >> 32), _c(v)


def _mul64(x, c):
  """x * c mod 2**64, x = (hi, lo) uint32, c a Python int."""
  (xh, xl), (ch, cl) = x, _const64(c)
  return mulhi32(xl, cl) + xl * ch + xh * cl, xl * cl


def _add64(x, y):
  lo = x[1] + y[1]
  return x[0] + y[0] + (lo < x[1]).astype(U32), lo


def _xor64(x, y):
  return x[0] ^ y[0], x[1] ^ y[1]


def _shr64(x, s):
  """x >> s for 0 < s < 32."""
  return x[0] >> s, (x[1] >> s) | (x[0] << (32 - s))


def mix64(x):
  """The splitmix64 finaliser on (hi, lo) uint32 pairs."""
  x = _mul64(_xor64(x, _shr64(x, 30)), 0xBF58476D1CE4E5B9)
  x = _mul64(_xor64(x, _shr64(x, 27)), 0x94D049BB133111EB)
  return _xor64(x, _shr64(x, 31))


def name_hash_words(name_hash):
  """A name hash (Python int or uint32 [hi, lo]) as a (hi, lo) pair of uint32 scalars."""
  if isinstance(name_hash, (int, np.integer)):
    if not 0 <= int(name_hash) < 1 << 64:
      raise ValueError(f'name_hash must be a 64-bit unsigned int, got {name_hash!r}')
    return tuple(jnp.asarray(w, U32) for w in _const64(int(name_hash)))
  h = jnp.asarray(name_hash)
  if h.shape != (2,) or h.dtype != U32:
    raise ValueError(f'name_hash array must be uint32 [hi, lo], got {h.dtype} {h.shape}')
  return h[0], h[1]


def name_hash_array(name):
  """``projection.name_hash(name)`` as a numpy uint32 [hi, lo] (a jit argument)."""
  return np.array(_const64(P.name_hash(name)), dtype=np.uint32)


def layer_name_hashes(name, n_layers):
  """uint32 (L, 2) [hi, lo] hashes of f'{name}/{l}', the names of a stacked kernel's layers."""
  return np.array([name_hash_array(f'{name}/{l}') for l in range(n_layers)],
                  dtype=np.uint32).reshape(n_layers, 2)


def _scalar_u32(v, what):
  if isinstance(v, (int, np.integer)) and not 0 <= int(v) < 1 << 32:
    raise ValueError(f'{what} must lie in [0, 2**32) on device, got {v!r}')
  v = jnp.asarray(v)
  if v.shape != () or not jnp.issubdtype(v.dtype, jnp.integer):
    raise ValueError(f'{what} must be an integer scalar, got {v.dtype} {v.shape}')
  return v.astype(U32)


def projection_key_words(seed, step, name_hash):
  """``projection.projection_key`` as a (hi, lo) uint32 pair; seed/step may be traced."""
  zero = jnp.zeros((), U32)
  k = mix64(_add64((zero, _scalar_u32(seed, 'seed')), _const64(P.GOLDEN)))
  k = mix64(_xor64(k, _mul64((zero, _scalar_u32(step, 'step')), P.STEP_MUL)))
  return mix64(_xor64(k, name_hash_words(name_hash)))


def element_hashes(key, n):
  """h_i = mix64(key + (i + 1) * GOLDEN), i = 0 … n-1, as (hi, lo) uint32 (n,) arrays."""
  i = jnp.arange(1, n + 1, dtype=U32)
  return mix64(_add64(key, _mul64((jnp.zeros_like(i), i), P.GOLDEN)))


def _fnv_byte(h, byte):
  """One FNV-1a step on a (hi, lo) hash: (h ^ byte) * 0x100000001B3 mod 2**64."""
  return _mul64((h[0], h[1] ^ byte), 0x100000001B3)


def layer_name_hash_jax(name, layer, n_layers):
  """FNV-1a of f'{name}/{layer}' for a traced layer in [0, n_layers): uint32 [hi, lo].

  The hash of ``name + '/'`` is a constant; the decimal digits of ``layer`` continue it on
  device, so a ``lax.scan`` over the layer index rebuilds ``layer_name_hashes``.
  """
  n_digits = len(str(max(int(n_layers) - 1, 0)))
  h = name_hash_words(P.name_hash(f'{name}/'))
  layer = jnp.asarray(layer).astype(U32)
  pow10 = jnp.asarray([10**e for e in range(n_digits)], U32)
  length = 1 + sum((layer >= 10**e).astype(jnp.int32) for e in range(1, n_digits))
  for pos in range(n_digits):
    e = jnp.clip(length - 1 - pos, 0, n_digits - 1)
    digit = (layer // pow10[e]) % _c(10)
    h = tuple(jnp.where(pos < length, new, old)
              for new, old in zip(_fnv_byte(h, digit + _c(48)), h))
  return jnp.stack(h)


def _neg_two_log_q58(w):
  """-2 ln(1 - w 2**-32) in Q58, (hi, lo), for uint32 words w (``projection.py``)."""
  nz = w != 0
  y = jnp.where(nz, ~w + _c(1), _c(1))
  n = lax.clz(y)
  f = ~(y << n) + _c(1)
  coef = jnp.asarray(P.LOG_Q31[::-1], U32)
  p = lax.fori_loop(1, len(P.LOG_Q31), lambda k, p: coef[k] + mulhi32(p, f),
                    jnp.full_like(w, coef[0]))
  t = _add64(_mul64((jnp.zeros_like(n), n), P.LN2_Q59), _shr64((mulhi32(f, p), f * p), 4))
  return jnp.where(nz, t[0], _c(0)), jnp.where(nz, t[1], _c(0))


def _isqrt64(t):
  """floor(sqrt(t)) for t = (hi, lo) uint32, bit by bit (the root is below 2**32)."""
  def body(i, r):
    c = r | (_c(1) << (_c(31) - i.astype(U32)))
    ch, cl = mulhi32(c, c), c * c
    return jnp.where((ch < t[0]) | ((ch == t[0]) & (cl <= t[1])), c, r)
  return lax.fori_loop(0, 32, body, jnp.zeros_like(t[0]))


def _cos_turn_q30(v):
  """|cos(2 pi v 2**-32)| in Q30 and its sign (True: negative) for uint32 words v."""
  q = v >> 30
  x = (v & _c((1 << 30) - 1)) << 2
  x2 = mulhi32(x, x)
  coef = jnp.asarray([P.COS_Q30[::-1], P.SIN_Q30[::-1]], U32)
  c, s = lax.fori_loop(
      1, len(P.COS_Q30), lambda k, cs: (coef[0, k] - mulhi32(cs[0], x2),
                                        coef[1, k] - mulhi32(cs[1], x2)),
      (jnp.full_like(v, coef[0, 0]), jnp.full_like(v, coef[1, 0])))
  cos = _c(1 << 30) - jnp.minimum(mulhi32(c, x2), _c(1 << 30))
  return jnp.where((q & _c(1)) == 1, mulhi32(s, x), cos), (q == 1) | (q == 2)


def gaussian_q27(h):
  """Box–Muller z (int32, Q27) from (hi, lo) element hashes, as ``projection.gaussian_q27``."""
  rad = _isqrt64(_neg_two_log_q58(h[0]))
  mag, neg = _cos_turn_q30(h[1])
  z = mulhi32(rad, mag).astype(jnp.int32)
  return jnp.where(neg, -z, z)


def _orthogonal(key, rank, dim):
  """The block-SRHT A (rank, dim) in float32 (``projection.py``'s recipe)."""
  sign_neg = element_hashes(key, dim)[0] >> 31
  oh, ol = element_hashes(_xor64(key, _const64(P.ROW_SALT)), dim)
  chosen = lax.sort((oh, ol, jnp.arange(dim, dtype=U32)), num_keys=3)[2][:rank]
  starts = np.array([o for o, _ in P._hadamard_blocks(dim)], np.uint32)
  col_block = np.searchsorted(starts, np.arange(dim), side='right') - 1
  col_local = (np.arange(dim) - starts[col_block]).astype(np.uint32)
  row_block = jnp.sum(chosen[:, None] >= starts[None, :], axis=1) - 1
  row_local = chosen - jnp.asarray(starts)[row_block]
  parity = lax.population_count(row_local[:, None] & col_local[None, :]) & _c(1)
  scale = np.array(P.orthogonal_scales(rank, dim), np.float32)[col_block]
  val = jnp.where((parity ^ sign_neg[None, :]) == 1, -scale, scale)
  return jnp.where(row_block[:, None] == col_block[None, :], val, np.float32(0))


def _check(kind, rank, dim, dtype):
  if kind not in P.KINDS:
    raise ValueError(f'projection kind must be one of {P.KINDS}, got {kind!r}')
  if int(rank) < 1 or int(dim) < 1:
    raise ValueError(f'rank and dim must be >= 1, got rank={rank}, dim={dim}')
  if kind == 'orthogonal' and rank > dim:
    raise ValueError(f'orthogonal projections need rank <= dim, got rank={rank}, dim={dim}')
  dtype = np.dtype(dtype)
  if P.exact_dtype(kind, rank, dim, dtype) != dtype:
    raise ValueError(f'{kind} A (rank={rank}, dim={dim}) is not exact in {dtype}: use float32')
  if dtype.itemsize > 4 and not jax.config.jax_enable_x64:
    raise ValueError(f'dtype {dtype} needs jax x64 enabled')
  return dtype


def sample_projection_jax(seed, step, name_hash, rank, dim, kind='rademacher',
                          dtype=jnp.float32):
  """``projection.sample_projection`` on device: the same bits, usable inside jit.

  Args:
    seed, step: int32/uint32 scalars in [0, 2**32), traced or not.
    name_hash: ``projection.name_hash(name)`` (a Python int) or a uint32 [hi, lo] array.
    rank, dim: R and K (static). kind: as ``sample_projection``.
    dtype: float32; float64 under x64; a narrower float only where ``exact_dtype`` allows.

  Returns:
    A (rank, dim) jnp array of ``dtype``.
  """
  dtype = _check(kind, int(rank), int(dim), dtype)
  key = projection_key_words(seed, step, name_hash)
  if kind == 'orthogonal':
    return _orthogonal(key, int(rank), int(dim)).astype(dtype)
  h = element_hashes(key, int(rank) * int(dim))
  scale = P.rademacher_scale(rank)
  if kind == 'rademacher':
    out = jnp.where(h[0] >> 31 == 1, -scale, scale)
  else:
    out = gaussian_q27(h).astype(jnp.float32) * np.float32(scale * np.float32(2.0**-27))
  return out.reshape(int(rank), int(dim)).astype(dtype)


def make_projections_jax(params, seed, step, ranks=16, kind='rademacher',
                         patterns=DEFAULT_TARGETS, dtype=jnp.float32, name_fn=stacked_name):
  """``tree.make_projections`` on device: the same tree, bit for bit, inside jit.

  ``seed``/``step`` may be traced scalars; ranks and shapes are static. A stacked kernel
  (L, K, D) gets (L, R, K) from the names ``name_fn(path, l)`` (default f'{path}/{l}'). Every A of one (R, K) is drawn by
  one vmapped call over its name hashes (one compiled generator per distinct shape). Each A
  is in ``dtype`` where ``exact_dtype`` allows it (bfloat16: Rademacher at R = 4**k, ...),
  else in float32.
  """
  rules = ranks if isinstance(ranks, RankRules) else RankRules(default=int(ranks))
  flat = traverse_util.flatten_dict(params)
  groups = {}
  for path in target_paths(params, patterns):
    shape, name = flat[path].shape, path_str(path)
    if len(shape) not in (2, 3):
      raise ValueError(f'sketched kernel {name} must be 2-D or layer-stacked 3-D, got {shape}')
    r = rules.rank(name, *shape[-2:])
    layers = range(shape[0]) if len(shape) == 3 else [None]
    hashes = np.stack([name_hash_array(name_fn(name, l)) for l in layers])
    key = (r, shape[-2], P.exact_dtype(kind, r, shape[-2], dtype))
    groups.setdefault(key, []).append((path, len(shape) == 3, hashes))
  out = {}
  for (r, d_in, dt), items in groups.items():
    draw = functools.partial(sample_projection_jax, seed, step, rank=r, dim=d_in, kind=kind,
                             dtype=dt)
    a_NxRxK = jax.vmap(draw)(jnp.asarray(np.concatenate([h for _, _, h in items])))
    start = 0
    for path, stacked, hashes in items:
      a = a_NxRxK[start:start + len(hashes)]
      out[path] = a if stacked else a[0]
      start += len(hashes)
  return traverse_util.unflatten_dict(out)
