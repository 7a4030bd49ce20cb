"""`transformer.constrain_batch`: the residual stream's rows split over the mesh's batch axes.

What the 7B memory plan needs (docs/memory.md: without it the partitioner replicates the
batch after the vocab-sharded embedding gather and each device runs every KL-probe row).
Checked on the traced program under an abstract 4-device mesh (no devices needed): the
constraint is there, on ('data', 'fsdp'), exactly when a mesh is set and the rows divide.
The values are unchanged by construction (a sharding constraint); tests/test_sharding.py
runs the steps and experiments/train.py under a 4-device mesh against one device.
"""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, PartitionSpec as P

from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params

CONFIG = get_preset('tiny', vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=2, num_kv_heads=1, max_position_embeddings=32)


@pytest.fixture(scope='module')
def params():
  return init_params(CONFIG, jax.random.key(0))


def constraints(params, rows, mesh=None):
  """The sharding constraints of the forward's top-level program on ``rows`` sequences."""
  fn = lambda p, t: Transformer(CONFIG).apply({'params': p}, t)[0]
  tokens = jnp.zeros((rows, 5), jnp.int32)
  if mesh is None:
    jaxpr = jax.make_jaxpr(fn)(params, tokens)
  else:
    with jax.sharding.use_abstract_mesh(mesh):
      jaxpr = jax.make_jaxpr(fn)(params, tokens)
  return [e.params['sharding'] for e in jaxpr.eqns if e.primitive.name == 'sharding_constraint']


def mesh(data, fsdp):
  return AbstractMesh((data, fsdp), ('data', 'fsdp'), axis_types=(AxisType.Auto,) * 2)


@pytest.mark.parametrize('data,fsdp,rows', [(1, 4, 8), (2, 2, 4), (4, 1, 4)])
def test_rows_split_over_data_and_fsdp(params, data, fsdp, rows):
  (sharding,) = constraints(params, rows, mesh(data, fsdp))
  assert sharding.spec == P(('data', 'fsdp')), sharding


@pytest.mark.parametrize('m,rows', [(None, 8), (mesh(1, 4), 6), (mesh(1, 1), 8)],
                         ids=['no_mesh', 'rows_do_not_divide', 'one_device'])
def test_no_constraint_without_a_mesh_or_a_split(params, m, rows):
  assert not constraints(params, rows, m)
