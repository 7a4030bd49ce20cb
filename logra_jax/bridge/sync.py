"""Trainer state → update blobs (HF names and layouts); `Mirror`, a host reference for tests.

Our kernels are (d_in, d_out) stacked over layers; HF weights are (d_out, d_in) per layer. A
LoGRA step adds α·Aᵀ U to kernel l, i.e. W_l ← W_l + (α U_l)ᵀ A_l in HF layout: the blob's
``<name>.U`` is (α U_l)ᵀ, and A_l is what `projection.sample_projection(seed, step, name, …)`
gives for the HF name (the trainer draws its projections under those names:
`hf_io.projection_name_fn`).
"""
import jax
import numpy as np
from flax import traverse_util

from logra_jax.bridge import wire
from logra_jax.models import hf_io
from logra_jax.models.config import ModelConfig
from logra_jax.sketch import projection


def full_blob(params, config: ModelConfig, base_version: int, new_version: int) -> bytes:
  tensors = {k: np.asarray(v, np.float32) for k, v in hf_io.hf_tensors(params, config).items()}
  return wire.encode_full(tensors, base_version, new_version)


def _per_layer(tree, config: ModelConfig) -> dict:
  """{HF name: layer l's float32 slice} of a kernel tree of layer-stacked (N, r, ·) leaves."""
  name_fn = hf_io.projection_name_fn(config)
  return {name_fn('/'.join(path), i): x_l
          for path, x in traverse_util.flatten_dict(jax.device_get(tree)).items()
          for i, x_l in enumerate(np.asarray(x, np.float32))}


def lowrank_factors(u_tree, config: ModelConfig) -> tuple[dict, dict]:
  """({HF name: U (d_out, r)}, {HF name: d_in}) from the step's α-scaled (N, r, d_out) tree."""
  factors = {n: np.ascontiguousarray(u_l.T) for n, u_l in _per_layer(u_tree, config).items()}
  d_in = {name: shape[1] for name, shape in hf_shapes(config).items() if name in factors}
  return factors, d_in


def hf_shapes(config: ModelConfig) -> dict:
  """{HF name: shape} of every tensor of the model, without allocating."""
  out = {}
  shapes = hf_io.param_shapes(config)
  for s in hf_io.weight_specs(config):
    shape = shapes[s.path]
    layers = range(config.num_layers) if '{i}' in s.hf_name else [None]
    per = shape[1:] if '{i}' in s.hf_name else shape
    for i in layers:
      out[s.hf_name.format(i=i)] = tuple(reversed(per)) if s.transpose else tuple(per)
  return out


def lowrank_projections(a_tree, config: ModelConfig) -> dict:
  """{HF name: A (r, d_in)} from a kernel tree of stacked A (N, r, d_in): the projections a
  step applied, for a low-rank blob that carries them (an adaptive subspace's)."""
  return {n: np.ascontiguousarray(a_l) for n, a_l in _per_layer(a_tree, config).items()}


def lowrank_blob(u_tree, config: ModelConfig, *, seed: int, step: int, kind: str,
                 base_version: int, new_version: int, u_dtype: str = 'fp32',
                 a_tree=None) -> bytes:
  """``a_tree`` (optional): the A the step applied, sent in the blob (`lowrank_projections`)
  instead of derived from (seed, step, kind)."""
  factors, d_in = lowrank_factors(u_tree, config)
  given = None if a_tree is None else lowrank_projections(a_tree, config)
  return wire.encode_lowrank(factors, d_in, seed=seed, step=step, kind=kind,
                             base_version=base_version, new_version=new_version,
                             projection=projection, u_dtype=u_dtype, projections=given)


class Mirror:
  """What a generator should hold: the last full weights plus every low-rank delta, in fp32
  on the host (a full copy of the model: tests' reference only; the trainer asks the servers
  for their fingerprints instead, `fingerprint.py`)."""

  def __init__(self, params, config: ModelConfig):
    self.config = config
    self.weights = {k: np.asarray(v, np.float32) for k, v in
                    hf_io.hf_tensors(params, config).items()}

  def apply(self, blob: bytes, version: str):
    upd = wire.decode(blob, {k: v.shape for k, v in self.weights.items()}, version, projection)
    self.weights.update(wire.apply(self.weights, upd))

  def drift(self, params) -> float:
    """‖W_trainer − W_generator‖ / ‖W_trainer‖ over all tensors."""
    num = den = 0.0
    for k, v in hf_io.hf_tensors(params, self.config).items():
      v = np.asarray(v, np.float64)
      num += float(np.sum((v - self.weights[k]) ** 2))
      den += float(np.sum(v * v))
    return float(np.sqrt(num / max(den, 1e-300)))

