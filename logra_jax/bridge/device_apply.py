"""Updates applied on device to the JAX engine's fp32 master tree, touched leaves only.

The master is our param tree flattened ({path tuple: float32 array}, `hf_io`'s layout): a
per-layer tensor is one leaf stacked on axis 0, a projection kernel is (d_in, d_out), i.e.
HF's W transposed. An HF name maps to a `Slot` (leaf path, layer, transposed). A low-rank
update W ← W + U @ A is K_l ← K_l + Aᵀ Uᵀ on the kernel, with A drawn on device by the
derivation of `projection_jax` (bit-identical to numpy's `projection.py`), in one jitted
function per update structure (which leaves, layers and ranks: the same every step, so it
compiles once). Leaves the caller owns are donated; leaves still served are read only, so a
generation running on them (pause mode keep) and a rollback keep them intact.
"""
import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from logra_jax.models import hf_io
from logra_jax.models.config import ModelConfig
from logra_jax.sketch import projection_jax

HIGHEST = jax.lax.Precision.HIGHEST  # fp32 products on every backend (no TF32 / bf16 passes)


@dataclasses.dataclass(frozen=True)
class Slot:
  path: tuple
  layer: Optional[int]
  transpose: bool


def slots(config: ModelConfig) -> dict:
  """{HF name: Slot} for every tensor of the model."""
  out = {}
  for s in hf_io.weight_specs(config):
    if '{i}' in s.hf_name:
      for layer in range(config.num_layers):
        out[s.hf_name.format(i=layer)] = Slot(s.path, layer, s.transpose)
    else:
      out[s.hf_name] = Slot(s.path, None, s.transpose)
  return out


def hf_views(master: dict, config: ModelConfig) -> dict:
  """{HF name: float32 numpy (out, in)} of a master tree (one host copy)."""
  host, out = jax.device_get(master), {}
  for name, s in slots(config).items():
    x = np.asarray(host[s.path])
    x = x[s.layer] if s.layer is not None else x
    out[name] = np.ascontiguousarray(x.T if s.transpose else x)
    out[name].setflags(write=False)  # shared by every caller until the next commit
  return out


# --- low-rank -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
  """The names of one update that share a leaf and a rank (A: (n, rank, d_in))."""
  path: tuple
  rank: int
  layers: tuple
  names: tuple
  sent: bool  # A travels in the blob (else drawn on device)


def lowrank_groups(update, slot_of: dict) -> list:
  """`Group`s of a parsed low-rank `wire.Update`, layers ascending."""
  by_key = {}
  for name, f in update.factors.items():
    s = slot_of[name]
    by_key.setdefault((s.path, f.rank, f.a is not None), []).append((s.layer, name))
  out = []
  for (path, rank, sent), items in sorted(by_key.items()):
    items.sort()
    out.append(Group(path, rank, tuple(l for l, _ in items), tuple(n for _, n in items), sent))
  return out


@functools.partial(jax.jit, static_argnames=('rank', 'dim', 'kind'))
def _draw(seed, step, hashes_Nx2, *, rank, dim, kind):
  draw = lambda h: projection_jax.sample_projection_jax(seed, step, h, rank, dim, kind)
  return jax.vmap(draw)(hashes_Nx2)


def draw_projections(update, groups, d_in: dict) -> list:
  """A (n, rank, d_in) per group, on device: sent, or drawn from (seed, step, name).

  Raises ValueError (kind, rank) like `projection.sample_projection`.
  """
  on_device = update.seed < 1 << 32 and update.step < 1 << 32  # uint32 on device
  out = []
  for g in groups:
    dim = d_in[g.names[0]]
    if g.sent:
      out.append(jnp.asarray(np.stack([update.factors[n].a for n in g.names])))
    elif on_device:
      hashes = np.stack([projection_jax.name_hash_array(n) for n in g.names])
      out.append(_draw(np.uint32(update.seed), np.uint32(update.step), hashes, rank=g.rank,
                       dim=dim, kind=update.projection))
    else:
      from logra_jax.sketch import projection  # pylint: disable=g-import-not-at-top
      out.append(jnp.asarray(np.stack([projection.sample_projection(
          update.seed, update.step, n, g.rank, dim, update.projection) for n in g.names])))
  return out


def _add_lowrank(owned, shared, a_list, u_list, *, plan):
  """New leaves K[l] + A_lᵀ U_lᵀ, and per group (n,) flags: the new W finite (W is finite, so
  this also says ΔW = U @ A is)."""
  leaves, flags = {**shared, **owned}, []
  for (key, layers, full), a_NxRxK, u_NxDxR in zip(plan, a_list, u_list):
    delta_NxKxD = jnp.einsum('nrk,ndr->nkd', a_NxRxK, u_NxDxR, precision=HIGHEST)
    leaf = leaves[key]
    if full:  # every layer, in order: one add
      leaf = leaf + delta_NxKxD
      flags.append(jnp.all(jnp.isfinite(leaf), axis=(1, 2)))
    else:
      ok = []
      for n, l in enumerate(layers):
        leaf = leaf.at[l].add(delta_NxKxD[n])
        ok.append(jnp.all(jnp.isfinite(leaf[l])))
      flags.append(jnp.stack(ok))
    leaves[key] = leaf
  return leaves, flags


_ADD = jax.jit(_add_lowrank, static_argnames=('plan',), donate_argnums=(0,))


def apply_lowrank(master: dict, owned: set, update, groups, a_list) -> tuple:
  """({path: new leaf} for the touched leaves, [bool (n,) per group: W + U @ A finite]).

  ``owned``: paths whose master leaf the caller owns (donated: invalid afterwards).
  """
  keys = sorted({g.path for g in groups})
  num = {p: master[p].shape[0] for p in keys}
  plan = tuple(('/'.join(g.path), g.layers, g.layers == tuple(range(num[g.path])))
               for g in groups)
  u_list = [jnp.asarray(np.stack([update.factors[n].u for n in g.names])) for g in groups]
  owned_leaves = {'/'.join(p): master[p] for p in keys if p in owned}
  shared_leaves = {'/'.join(p): master[p] for p in keys if p not in owned}
  leaves, flags = _ADD(owned_leaves, shared_leaves, a_list, u_list, plan=plan)
  return {p: leaves['/'.join(p)] for p in keys}, jax.device_get(flags)


# --- full -----------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=('transpose',))
def _assemble(values, *, transpose):
  """One leaf from a tensor or a list of per-layer tensors (HF layout when ``transpose``)."""
  values = jnp.stack(values) if isinstance(values, (list, tuple)) else values
  return jnp.swapaxes(values, -1, -2) if transpose else values


def _set_layers(leaf, values, *, layers, transpose):
  values = _assemble(values, transpose=transpose)
  for n, l in enumerate(layers):
    leaf = leaf.at[l].set(values[n])
  return leaf


_SET_OWNED = jax.jit(_set_layers, static_argnames=('layers', 'transpose'), donate_argnums=(0,))
_SET_SHARED = jax.jit(_set_layers, static_argnames=('layers', 'transpose'))


def apply_full(master: dict, owned: set, tensors: dict, slot_of: dict) -> dict:
  """{path: new leaf} holding the given HF tensors (validated, float32) in our layout."""
  by_path = {}
  for name, x in tensors.items():
    s = slot_of[name]
    by_path.setdefault(s.path, []).append((s.layer, name, s.transpose))
  out = {}
  for path, items in by_path.items():
    items.sort(key=lambda t: -1 if t[0] is None else t[0])
    layers = None if items[0][0] is None else tuple(l for l, _, _ in items)
    transpose, leaf = items[0][2], master[path]
    values = jax.device_put(tensors[items[0][1]] if layers is None
                            else [tensors[n] for _, n, _ in items], leaf.sharding)
    if layers is None or layers == tuple(range(leaf.shape[0])):
      out[path] = _assemble(values, transpose=transpose)
    else:
      put = _SET_OWNED if path in owned else _SET_SHARED
      out[path] = put(leaf, values, layers=layers, transpose=transpose)
  return out
