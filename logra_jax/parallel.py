"""The device mesh and every sharding of the run: one code path from 1 CPU to N devices.

Mesh axes ('data', 'fsdp'): params, optimizer states, LoRA adapters and sketch trees are
split FSDP-style over 'fsdp' (replicated over 'data'); batches are split over both; LoGRA
projections A are replicated. A param's logical axis names (``transformer.logical_axes``:
'layers', 'embed', 'q_heads', 'kv_heads', 'mlp', 'vocab') become mesh axes through the rules
('embed=fsdp,mlp=fsdp,...'), resolved per dimension, left to right: a dimension takes its
rule's mesh axis unless that axis is already used by an earlier dimension of the same array,
or the dimension is not divisible by the axis size — then it is REPLICATED (and the axis stays
free for a later dimension). So a kernel (embed, mlp) with embed=128 on fsdp=4 is split on
embed; with fsdp=3 it is split on mlp if that divides, else kept whole on every device.

Derived trees (flat dicts path -> logical axes, built from the kernel's (…, K, D) axes):
  probe / sketch / LoGRA update (…, R, D): (…, None, D's axis)
  RowAdam second moment (…, D):            (…, D's axis)  (the sketch's axes less the rank)
  LoRA a (…, K, r), b (…, r, D):           (…, K's axis, None), (…, None, D's axis)
  AdamW mu / nu:                           the param's axes
  step counts, scalars, projections A:     replicated
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from logra_jax.models.transformer import Transformer, abstract_variables, logical_axes

AXES = ('data', 'fsdp')
BATCH_AXES = ('data', 'fsdp')  # a batch's leading axis is split over every device


def mesh_shape(data: int, fsdp: int, num_devices: int) -> tuple[int, int]:
  """(data, fsdp) with a -1 filled in; their product must be the device count."""
  if data == -1:
    data = num_devices // fsdp if fsdp > 0 else 0
  if fsdp == -1:
    fsdp = num_devices // data if data > 0 else 0
  if data < 1 or fsdp < 1 or data * fsdp != num_devices:
    raise ValueError(f'config keys mesh.data={data} x mesh.fsdp={fsdp} must multiply to the '
                     f'{num_devices} devices jax.devices() gives (-1: all remaining)')
  return data, fsdp


def make_mesh(data: int = 1, fsdp: int = -1, devices=None) -> Mesh:
  """A ('data', 'fsdp') mesh with Auto axes (the compiler propagates FSDP shardings).

  Devices are laid out in `jax.devices()` order (process by process), 'data' outermost.
  """
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(data, fsdp, len(devices))
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES)


def spec_for(logical: tuple, shape: tuple, rules, mesh: Mesh) -> P:
  """The PartitionSpec of one array from its logical axes (see the module docstring)."""
  if len(logical) != len(shape):
    raise ValueError(f'logical axes {logical} do not match an array of shape {shape}')
  table = {}
  for name, axis in rules:
    table.setdefault(name, axis)
  used, out = set(), []
  for name, size in zip(logical, shape):
    axis = table.get(name)
    if axis is None or axis in used or size % mesh.shape[axis]:
      out.append(None)
    else:
      used.add(axis)
      out.append(axis)
  return P(*out)


def check_rules(rules, param_logical: dict):
  """Every rule names a logical axis of the model (a typo would silently replicate)."""
  known = {n for axes in param_logical.values() for n in axes if n is not None}
  for name, _ in rules:
    if name not in known:
      raise ValueError(f'config key mesh.rules names logical axis {name!r}; the model has '
                       f'{sorted(known)}')


def param_logical(config) -> dict:
  """{param path: logical axes} from the model's boxed variables."""
  return {k: tuple(v) for k, v in traverse_util.flatten_dict(logical_axes(config)).items()}


def abstract_params(config):
  """The params tree of ShapeDtypeStructs (unboxed), without allocating."""
  return nn.unbox(abstract_variables(config))['params']


def probe_logical(params_logical: dict, paths) -> dict:
  """Probe / sketch / update (…, R, D) of each sketched kernel (…, K, D): D like the kernel."""
  return {p: params_logical[p][:-2] + (None, params_logical[p][-1]) for p in paths}


def lora_logical(params_logical: dict, paths) -> dict:
  """LoRA a (…, K, r) and b (…, r, D) of each adapted kernel."""
  out = {}
  for p in paths:
    *lead, k, d = params_logical[p]
    out[p + ('a',)] = (*lead, k, None)
    out[p + ('b',)] = (*lead, None, d)
  return out


def _dict_keys(key_path) -> tuple:
  return tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))


def leaf_logical(key_path, leaf, ref_logical: dict) -> tuple:
  """Logical axes of one optimizer-state leaf over a tree with ``ref_logical``.

  A leaf whose dict-key path ends in a reference path takes the reference's axes (same rank:
  Adam's moments) or those less the rank axis −2 (one rank lower: RowAdam's per-unit
  moment); any other leaf (counts, schedules' state) is replicated.
  """
  keys = _dict_keys(key_path)
  ref = next((ref_logical[keys[i:]] for i in range(len(keys)) if keys[i:] in ref_logical),
             None)
  if ref is not None and len(ref) == leaf.ndim:
    return ref
  if ref is not None and len(ref) == leaf.ndim + 1 and leaf.ndim >= 1:
    return ref[:-2] + ref[-1:]
  return (None,) * leaf.ndim


class Layout:
  """A mesh and its logical-axis rules: NamedShardings for every tree of the run."""

  def __init__(self, mesh: Mesh, rules=()):
    self.mesh, self.rules = mesh, tuple(rules)
    self.replicated = NamedSharding(mesh, P())
    self.batch = NamedSharding(mesh, P(BATCH_AXES))

  def named(self, logical, shape) -> NamedSharding:
    return NamedSharding(self.mesh, spec_for(tuple(logical), tuple(shape), self.rules, self.mesh))

  def flat(self, abstract, logical: dict):
    """Shardings of a nested-dict tree whose flat paths are the keys of ``logical``."""
    flat = traverse_util.flatten_dict(abstract)
    return traverse_util.unflatten_dict(
        {k: self.named(logical[k], v.shape) for k, v in flat.items()})

  def state(self, abstract_state, ref_logical: dict):
    """Shardings of an optimizer state (see `leaf_logical`)."""
    return jax.tree_util.tree_map_with_path(
        lambda kp, x: self.named(leaf_logical(kp, x, ref_logical), x.shape), abstract_state)

  def batch_for(self, tree):
    """Data-parallel shardings of a batch: each leaf's leading axis over every device.

    Raises:
      ValueError: a leaf has no leading axis or one that does not divide over the devices
        (replicating it instead would have every device compute the whole batch).
    """
    n = self.mesh.size
    bad = {jax.tree_util.keystr(kp): tuple(x.shape)
           for kp, x in jax.tree_util.tree_leaves_with_path(tree)
           if not x.ndim or x.shape[0] % n}
    if bad:
      raise ValueError(f'a batch whose leading dimension does not divide over the {n} devices '
                       f'of the mesh (every device would compute the whole batch): shapes '
                       f'{bad}; make each leading dimension a multiple of {n}')
    return jax.tree.map(lambda _: self.batch, tree)


def param_shardings(layout: Layout, config):
  """NamedShardings of the model's params from its logical axes and ``layout.rules``."""
  logical = param_logical(config)
  check_rules(layout.rules, logical)
  return layout.flat(abstract_params(config), logical)


def init_params(config, rng, shardings):
  """`transformer.init_params`, each param created in its sharding (same values)."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  init = lambda r: nn.unbox(Transformer(config).init(r, tokens)['params'])
  return jax.jit(init, out_shardings=shardings)(rng)


def parse_axis_rules(text: str):
  """'embed=fsdp,vocab=' -> (('embed', 'fsdp'), ('vocab', None)): logical -> mesh axis."""
  rules = []
  for item in filter(None, (s.strip() for s in text.split(','))):
    logical, eq, mesh_axis = (p.strip() for p in item.partition('='))
    if not eq or not logical:
      raise ValueError(f"config key mesh.rules: expected 'logical=mesh_axis', got {item!r}")
    mesh_axis = None if mesh_axis in ('', 'none', 'None') else mesh_axis
    if mesh_axis is not None and mesh_axis not in AXES:
      raise ValueError(f'config key mesh.rules: {item!r} names mesh axis {mesh_axis!r}; '
                       f'the mesh axes are {AXES}')
    rules.append((logical, mesh_axis))
  return tuple(rules)


def layout_from_config(mesh_cfg, devices=None) -> Layout:
  return Layout(make_mesh(mesh_cfg.data, mesh_cfg.fsdp, devices),
                parse_axis_rules(mesh_cfg.rules))


def put(tree, shardings):
  """Each leaf into its sharding, from host numpy shard by shard (never whole on one device).

  Works with several processes when every process holds the same host values.
  """
  def one(x, s):
    if isinstance(x, jax.Array):
      if x.sharding == s:
        return x
      if not x.is_fully_addressable:
        return jax.device_put(x, s)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
  return jax.tree.map(one, tree, shardings)


def to_host(tree):
  """numpy copies of (possibly multi-process) arrays: the global values on every process."""
  if all(getattr(x, 'is_fully_addressable', True) for x in jax.tree.leaves(tree)):
    return jax.device_get(tree)
  return multihost_utils.process_allgather(tree, tiled=True)


def same_on_every_process(x: np.ndarray) -> np.ndarray:
  """Process 0's copy of host-side data (e.g. rewards), so every process steps alike."""
  if jax.process_count() == 1:
    return x
  return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(x)))


def shard_bytes(x: jax.Array) -> dict:
  """{device id: bytes of ``x`` it holds} (addressable shards)."""
  return {s.device.id: s.data.nbytes for s in x.addressable_shards}


def run_info(layout: Layout, config: dict) -> dict:
  """What `experiments/train.py` writes to WORKDIR/run_info.json."""
  return {'devices': jax.device_count(), 'processes': jax.process_count(),
          'mesh': {a: int(layout.mesh.shape[a]) for a in AXES},
          'jax_version': jax.__version__, 'config': config}
