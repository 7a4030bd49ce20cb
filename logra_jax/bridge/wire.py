"""The update payload `logra-update/1`: one safetensors blob, HF names and layouts (docs/bridge.md).

numpy and safetensors only, and no other module of ours but `quant.py` beside it (how U
travels: bf16, fp8-e4m3, int4), so that a generator in another environment (vLLM's) loads this
file by path (it then loads `quant.py` by path too) and passes `logra_jax/sketch/projection.py`,
loaded the same way, as ``projection``.

    full:     <name>            the new tensor (HF layout), float32 or float16
    lowrank:  <name>.U          (d_out, r): W ← W + U @ A, A = sample_projection(seed, step, name)
              <name>.U.scale    (d_out,) float32 per-row scales (u_dtype fp8-e4m3 / int4)
              <name>.A          (r, d_in) float32, optional: A sent instead of rebuilt

Metadata (all strings): format, kind, base_version, new_version and, for lowrank, seed, step,
projection, u_dtype, A_sha256 (JSON {name: checksum}). `decode` validates everything — names,
shapes, dtypes, finiteness, checksums, versions, whole fused groups — before the caller
touches a weight, and raises `UpdateError(status, message)` (400 malformed, 409 a low-rank
update for another base version: the sender then sends full weights, which need no base).
A receiver that forms U @ A itself (the JAX engine, on device) calls `parse`, rebuilds the
A's, passes them to `check_projections` and checks W + U @ A finite before it commits.
"""
import dataclasses
import importlib.util
import json
import os
import re
from typing import Mapping, Optional

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

if __package__:  # imported as logra_jax.bridge.wire
  from logra_jax.bridge import quant  # pylint: disable=g-import-not-at-top
else:  # loaded by path (vLLM's environment): the sibling file, by path too
  _spec = importlib.util.spec_from_file_location(
      'logra_quant', os.path.join(os.path.dirname(os.path.abspath(__file__)), 'quant.py'))
  quant = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(quant)

FORMAT = 'logra-update/1'
KINDS = ('full', 'lowrank')
U_DTYPES, quantize_u, dequantize_u = quant.U_DTYPES, quant.quantize_u, quant.dequantize_u
FUSED = {'q_proj': 'qkv_proj', 'k_proj': 'qkv_proj', 'v_proj': 'qkv_proj',
         'gate_proj': 'gate_up_proj', 'up_proj': 'gate_up_proj'}
_LAYER = re.compile(r'^(model\.layers\.\d+\.(?:self_attn|mlp)\.)(\w+)\.(weight|bias)$')


class UpdateError(ValueError):
  """A refused update: HTTP ``status`` and a message naming what is wrong."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


@dataclasses.dataclass(frozen=True)
class Factor:
  """One validated low-rank factor: ``u`` (d_out, r) float32, finite; ``a`` (r, d_in) float32 if
  it was sent, else None (rebuilt from the derivation); ``checksum``: its A_sha256 entry."""
  u: np.ndarray
  a: Optional[np.ndarray]
  rank: int
  checksum: Optional[str]


@dataclasses.dataclass(frozen=True)
class Update:
  """A validated update: new tensors (full) or dense deltas U @ A (lowrank), float32.

  `parse` leaves a low-rank update as ``factors`` (``tensors`` empty) with its derivation
  (``seed``, ``step``, ``projection``): the receiver rebuilds every A, checks it with
  `check_projections`, and checks U @ A finite, before it applies anything.
  """
  kind: str
  base_version: str
  new_version: str
  tensors: Mapping[str, np.ndarray]  # full: the new value; lowrank: the delta to add
  factors: Mapping[str, Factor] = dataclasses.field(default_factory=dict)
  seed: int = 0
  step: int = 0
  projection: str = ''


# --- encoding -------------------------------------------------------------------------------


def _version(v) -> str:
  s = str(v)
  if not s.isdigit():
    raise ValueError(f'weight versions are decimal integer strings, got {v!r}')
  return s


def encode_full(tensors: Mapping[str, np.ndarray], base_version, new_version) -> bytes:
  """A full-weights blob: every tensor in HF layout (float32 or float16)."""
  meta = {'format': FORMAT, 'kind': 'full', 'base_version': _version(base_version),
          'new_version': _version(new_version)}
  return st_save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=meta)


def encode_lowrank(factors: Mapping[str, np.ndarray], d_in: Mapping[str, int], *, seed: int,
                   step: int, kind: str, base_version, new_version, projection,
                   u_dtype: str = 'fp32', send_a: bool = False,
                   projections: Optional[Mapping[str, np.ndarray]] = None) -> bytes:
  """A low-rank blob: per HF weight name, U (d_out, r) with W ← W + U @ A.

  Args:
    factors: {HF name: U (d_out, r)}; d_in: {HF name: the weight's input dimension}.
    seed, step, kind: the projection derivation (`projection.sample_projection`).
    base_version, new_version: the weights this applies to, and their version after it.
    projection: the module `logra_jax.sketch.projection` (numpy only).
    u_dtype: how U travels: fp32, bf16, fp8-e4m3 or int4 (the last two with per-row scales).
    send_a: also send every A explicitly (then the receiver needs no derivation).
    projections: {HF name: A (r, d_in)} given instead of derived (an adaptive subspace's A,
      which no (seed, step) rebuilds): each is sent, and its checksum is the given A's.
  """
  meta = {'format': FORMAT, 'kind': 'lowrank', 'base_version': _version(base_version),
          'new_version': _version(new_version), 'seed': str(int(seed)), 'step': str(int(step)),
          'projection': kind, 'u_dtype': u_dtype}
  tensors, sums, ranks = {}, {}, {}
  for name, u in factors.items():
    if not is_projection_weight(name):
      raise ValueError(f'low-rank updates apply to projection weights '
                       f'(model.layers.N.self_attn|mlp.X.weight), got {name!r}')
    if projections is not None:
      a = np.asarray(projections[name], np.float32)
      if a.shape != (u.shape[1], d_in[name]):
        raise ValueError(f'{name}: A has shape {a.shape}, not (r, d_in) = '
                         f'{(u.shape[1], d_in[name])}')
    else:
      a = projection.sample_projection(int(seed), int(step), name, u.shape[1], d_in[name], kind)
    sums[name], ranks[name] = projection.projection_checksum(a), int(u.shape[1])
    for suffix, value in quant.quantize_u(u, u_dtype).items():
      tensors[f'{name}.U{suffix}'] = np.ascontiguousarray(value)
    if send_a or projections is not None:
      tensors[f'{name}.A'] = np.ascontiguousarray(a, np.float32)
  meta['A_sha256'] = json.dumps(sums, sort_keys=True)
  meta['ranks'] = json.dumps(ranks, sort_keys=True)
  return st_save(tensors, metadata=meta)


def is_projection_weight(name: str) -> bool:
  m = _LAYER.match(name)
  return bool(m) and m.group(3) == 'weight'


# --- decoding and validation ----------------------------------------------------------------


def _refuse(message, status=400):
  raise UpdateError(status, message)


def read_blob(blob: bytes):
  """(tensors, metadata) of a safetensors blob, or a 400 naming why it is not one."""
  if len(blob) < 8:
    _refuse(f'update blob is {len(blob)} bytes: not a safetensors file')
  header_len = int.from_bytes(blob[:8], 'little')
  if header_len > len(blob) - 8:
    _refuse('update blob is truncated: its safetensors header is longer than the blob')
  try:
    header = json.loads(blob[8:8 + header_len])
    tensors = st_load(blob)
  except Exception as e:  # safetensors raises its own error types for every malformation
    _refuse(f'update blob is not a valid safetensors file: {type(e).__name__}: {e}')
  meta = header.get('__metadata__') if isinstance(header, dict) else None
  if not isinstance(meta, dict):
    _refuse('update blob has no safetensors metadata (format, kind, versions)')
  return tensors, meta


def _check_versions(meta, current_version):
  """Low-rank updates need the generator at base_version (else 409) and move it forward; a
  full update replaces the weights whatever they were (it is the answer to a 409)."""
  for key in ('base_version', 'new_version'):
    if not str(meta.get(key, '')).isdigit():
      _refuse(f'metadata {key} must be a decimal integer string, got {meta.get(key)!r}')
  if meta.get('kind') != 'lowrank':
    return
  if meta['base_version'] != str(current_version):
    _refuse(f'update applies to version {meta["base_version"]}, but this generator serves '
            f'version {current_version}: send full weights', status=409)
  if int(meta['new_version']) <= int(meta['base_version']):
    _refuse(f'new_version {meta["new_version"]} must be greater than base_version '
            f'{meta["base_version"]}')


def _finite(name, x):
  if not np.all(np.isfinite(x)):
    _refuse(f'tensor {name} has non-finite values')


def _check_groups(names, spec):
  """Every fused group (q/k/v, gate/up) that is touched is touched whole, per layer."""
  touched = {}
  for name in names:
    m = _LAYER.match(name)
    if m and m.group(2) in FUSED:
      touched.setdefault((m.group(1), FUSED[m.group(2)], m.group(3)), set()).add(name)
  for (prefix, group, kind), got in sorted(touched.items()):
    members = {f'{prefix}{mod}.{kind}' for mod, g in FUSED.items() if g == group}
    members &= set(spec)
    if got != members:
      _refuse(f'update touches part of the fused group {prefix}{group} ({kind}): '
              f'missing {sorted(members - got)}; send whole groups')


def _decode_full(tensors, spec):
  out = {}
  for name, x in tensors.items():
    if name not in spec:
      _refuse(f'unknown tensor name {name!r}')
    if tuple(x.shape) != tuple(spec[name]):
      _refuse(f'tensor {name} has shape {tuple(x.shape)}, expected {tuple(spec[name])}')
    if x.dtype not in (np.float32, np.float16):
      _refuse(f'tensor {name} has dtype {x.dtype}; full updates are float32 or float16')
    _finite(name, x)
    out[name] = x.astype(np.float32, copy=False)  # st_load's arrays are ours already
  return out


def _lowrank_meta(meta):
  try:
    seed, step = int(meta['seed']), int(meta['step'])
    sums, ranks = json.loads(meta['A_sha256']), json.loads(meta['ranks'])
    kind, u_dtype = meta['projection'], meta['u_dtype']
  except (KeyError, ValueError, TypeError) as e:
    _refuse(f'low-rank metadata needs seed, step, projection, u_dtype, ranks and A_sha256: '
            f'{type(e).__name__}: {e}')
  if seed < 0 or step < 0 or not isinstance(sums, dict) or not isinstance(ranks, dict):
    _refuse('low-rank metadata: seed and step must be >= 0, A_sha256 and ranks JSON objects')
  if u_dtype not in U_DTYPES:
    _refuse(f'u_dtype must be one of {U_DTYPES}, got {u_dtype!r}')
  return seed, step, kind, u_dtype, sums, ranks


def _split_lowrank(tensors, spec):
  """{weight name: {'U', 'U.scale', 'A'}} with every tensor name checked."""
  parts = {}
  for name in tensors:
    suffix = next((x for x in ('.U.scale', '.U', '.A') if name.endswith(x)), None)
    if suffix is None:
      _refuse(f'unknown tensor name {name!r} in a low-rank update (<weight>.U, .U.scale, .A)')
    base = name[:-len(suffix)]
    if base not in spec or not is_projection_weight(base):
      _refuse(f'unknown weight {base!r}: low-rank updates apply to projection weights')
    parts.setdefault(base, {})[suffix[1:]] = tensors[name]
  return parts


def _lowrank_factor(name, part, shape, u_dtype, checksum, rank):
  d_out, d_in = shape
  if 'U' not in part:
    _refuse(f'{name}: a low-rank update needs {name}.U')
  if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= d_in:
    _refuse(f'{name}: rank {rank!r} (metadata ranks) must be an integer in [1, {d_in}]')
  stored, scale = part['U'], part.get('U.scale')
  cols = (rank + 1) // 2 if u_dtype == 'int4' else rank
  if stored.dtype != quant.STORED_DTYPE[u_dtype] or stored.shape != (d_out, cols):
    _refuse(f'{name}.U has shape {tuple(stored.shape)} and dtype {stored.dtype}; expected '
            f'({d_out}, {cols}) of {np.dtype(quant.STORED_DTYPE[u_dtype])} for rank {rank}, '
            f'u_dtype {u_dtype}')
  needs_scale = u_dtype in ('fp8-e4m3', 'int4')
  if needs_scale != (scale is not None) or (needs_scale and (
      scale.shape != (d_out,) or scale.dtype != np.float32)):
    _refuse(f'{name}.U.scale must be float32 ({d_out},) exactly when u_dtype is fp8-e4m3 or int4')
  if needs_scale:
    _finite(f'{name}.U.scale', scale)
  if u_dtype == 'fp8-e4m3' and np.any((stored & 0x7F) == quant.E4M3_NAN):
    _refuse(f'{name}.U holds the fp8-e4m3 NaN code 0x7f/0xff')
  u = np.asarray(quant.dequantize_u(stored, scale, u_dtype, rank), np.float32)
  _finite(f'{name}.U', u)
  a = part.get('A')
  if a is not None:
    if a.dtype != np.float32 or a.shape != (rank, d_in):
      _refuse(f'{name}.A must be float32 ({rank}, {d_in}), got {a.dtype} {tuple(a.shape)}')
    _finite(f'{name}.A', a)
  return Factor(u, a, rank, checksum if isinstance(checksum, str) else None)


def parse(blob: bytes, spec: Mapping[str, tuple], current_version) -> Update:
  """Validates everything of a blob that needs no A: format, kind, versions, names, shapes,
  dtypes, finiteness of the tensors, U and scales, whole fused groups. A low-rank update comes
  back as ``factors``; `check_projections` must pass before any of it is applied."""
  tensors, meta = read_blob(blob)
  if meta.get('format') != FORMAT:
    _refuse(f'metadata format must be {FORMAT!r}, got {meta.get("format")!r}')
  if meta.get('kind') not in KINDS:
    _refuse(f'metadata kind must be one of {KINDS}, got {meta.get("kind")!r}')
  _check_versions(meta, current_version)
  if not tensors:
    _refuse('update blob holds no tensors')
  versions = (meta['kind'], meta['base_version'], meta['new_version'])
  if meta['kind'] == 'full':
    out = _decode_full(tensors, spec)
    _check_groups(out, spec)
    return Update(*versions, out)
  seed, step, kind, u_dtype, sums, ranks = _lowrank_meta(meta)
  factors = {name: _lowrank_factor(name, part, tuple(spec[name]), u_dtype, sums.get(name),
                                   ranks.get(name))
             for name, part in _split_lowrank(tensors, spec).items()}
  _check_groups(factors, spec)
  return Update(*versions, {}, factors, seed, step, kind)


def rebuild_projections(update: Update, spec: Mapping[str, tuple], projection) -> dict:
  """{name: A} of a parsed low-rank update: the sent A, else `projection.sample_projection`."""
  out = {}
  for name, f in update.factors.items():
    if f.a is not None:
      out[name] = f.a
      continue
    try:
      out[name] = projection.sample_projection(update.seed, update.step, name, f.rank,
                                               spec[name][1], update.projection)
    except ValueError as e:
      refuse_rebuild(name, e)
  return out


def refuse_rebuild(name: str, error: Exception):
  _refuse(f'{name}: cannot rebuild A: {error}')


def check_projections(update: Update, a_by_name: Mapping[str, np.ndarray], projection):
  """400 unless every factor's A (host array) matches its A_sha256 checksum."""
  for name, f in update.factors.items():
    if f.checksum is None or f.checksum != projection.projection_checksum(a_by_name[name]):
      _refuse(f'{name}: A checksum mismatch (sent {f.checksum!r}): the projection derivation, '
              'seed, step or name differ between trainer and generator')


def decode(blob: bytes, spec: Mapping[str, tuple], current_version, projection) -> Update:
  """Validates a blob against the generator's tensors ``spec`` {HF name: shape}.

  Returns an `Update` whose tensors are float32 and finite (low-rank: the dense deltas U @ A);
  raises `UpdateError` before any weight is touched. ``projection``:
  `logra_jax/sketch/projection.py` as a module.
  """
  update = parse(blob, spec, current_version)
  if update.kind == 'full':
    return update
  a_by_name = rebuild_projections(update, spec, projection)
  check_projections(update, a_by_name, projection)
  out = {}
  for name, f in update.factors.items():
    out[name] = f.u @ np.asarray(a_by_name[name], np.float32)
    _finite(f'{name} (U @ A)', out[name])
  return dataclasses.replace(update, tensors=out, factors={})


def apply(weights: Mapping[str, np.ndarray], update: Update) -> dict:
  """New {name: float32 array} for the touched names (the inputs are not modified)."""
  if update.kind == 'full':
    return {k: v.copy() for k, v in update.tensors.items()}
  return {k: np.asarray(weights[k], np.float32) + d for k, d in update.tensors.items()}
