"""`fingerprint.py`'s fingerprint of a param tree in our layout, computed on its devices.

Used by the trainer (its params) and by the JAX engine (the params it serves), so neither
copies the model to the host: one jitted pass per leaf (all its layers at once) forms
[‖W_l‖, r_kᵀ W_l c_k] with the HF orientation of W (a kernel K_l = W_lᵀ: c_kᵀ K_l r_k), in
float32 with fp32 products (`Precision.HIGHEST`); only (layers, K + 1) numbers per leaf leave
the device, as float64. The sign vectors are drawn once per model and kept on device (int8).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from logra_jax.bridge import device_apply
from logra_jax.bridge import fingerprint as fp_lib
from logra_jax.models.config import ModelConfig

HIGHEST = jax.lax.Precision.HIGHEST


def _leaves(config: ModelConfig) -> dict:
  """{leaf path: (transpose, [(layer or None, HF name)])} in layer order."""
  out = {}
  for name, s in device_apply.slots(config).items():
    out.setdefault(s.path, (s.transpose, []))[1].append((s.layer, name))
  for _, items in out.values():
    items.sort(key=lambda item: -1 if item[0] is None else item[0])
  return out


@functools.lru_cache(maxsize=4)
def _signs(config: ModelConfig, shapes: tuple, k: int) -> dict:
  """{leaf path: (R (N, k, d_out), C (N, k, d_in)) int8 on device}, HF orientation."""
  out, shape_of = {}, dict(shapes)
  for path, (transpose, items) in _leaves(config).items():
    shape = shape_of[path][1:] if items[0][0] is not None else shape_of[path]
    hf = tuple(reversed(shape)) if transpose else tuple(shape)
    pairs = [fp_lib.sign_vectors(name, hf, k) for _, name in items]
    out[path] = tuple(jnp.asarray(np.stack([p[i] for p in pairs]), jnp.int8) for i in (0, 1))
  return out


@functools.partial(jax.jit, static_argnames=('transpose', 'stacked'))
def _leaf_fingerprint(leaf, rows, cols, *, transpose: bool, stacked: bool):
  """(N, 1 + k) float32: per layer ‖W‖ and r_kᵀ W c_k, W the HF view of ``leaf``."""
  x = leaf.astype(jnp.float32)
  x = x if stacked else x[None]
  if x.ndim == 2:  # 1-D tensors per layer: W is (1, d)
    x = x[:, None, :]
  x = x.reshape(x.shape[0], x.shape[1], -1)
  rows, cols = rows.astype(jnp.float32), cols.astype(jnp.float32)
  if transpose:  # x_l = K_l = W_lᵀ: (d_in, d_out)
    y = jnp.einsum('nio,nko->nki', x, rows, precision=HIGHEST)
    proj = jnp.sum(y * cols, axis=-1)
  else:  # x_l = W_l: (d_out, d_in)
    y = jnp.einsum('noi,nki->nko', x, cols, precision=HIGHEST)
    proj = jnp.sum(y * rows, axis=-1)
  norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=(1, 2)))
  return jnp.concatenate([norm[:, None], proj], axis=1)


def params_fingerprint(params, config: ModelConfig, k: int = fp_lib.K) -> dict:
  """{HF name: [‖W‖, r_1ᵀ W c_1, …]} (float64 lists) of a param tree or its flat dict."""
  flat = params if isinstance(next(iter(params)), tuple) else traverse_util.flatten_dict(
      params)
  shapes = tuple(sorted((p, tuple(v.shape)) for p, v in flat.items()))
  signs = _signs(config, shapes, k)
  pending = {}
  for path, (transpose, items) in _leaves(config).items():
    rows, cols = signs[path]
    pending[path] = _leaf_fingerprint(flat[path], rows, cols, transpose=transpose,
                                      stacked=items[0][0] is not None)
  host = jax.device_get(pending)
  out = {}
  for path, (_, items) in _leaves(config).items():
    values = np.asarray(host[path], np.float64)
    for i, (_, name) in enumerate(items):
      out[name] = [float(v) for v in values[i]]
  return out
