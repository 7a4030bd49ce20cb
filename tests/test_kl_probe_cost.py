"""The KL probe costs only what it is used for (issue 11): `optim.logra.kl_control=False` with
`optim.telemetry_every=0` traces no JVP and no extra forward; the realised-KL telemetry runs
only at the steps the caller asks for, and the metrics say which steps those were.

Forward passes are counted in the step's jaxpr as scans over the model's layers that compute
attention (the Transformer runs its blocks in one `nn.scan`): the gradient's forward, the JVP
probe's (primal and tangent in the same scan) and the realised KL's.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sketch
from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params
from logra_jax.rl import losses as rl_losses
from logra_jax.train import config as config_lib
from logra_jax.train import optimizers, steps

N, P, T, LAYERS = 4, 3, 2, 3  # LAYERS differs from every other scan length in the step
BUDGET = np.float32(1e-4)


@pytest.fixture(scope='module')
def setup():
  with jax.enable_x64(False):
    mc = get_preset('tiny', vocab_size=16, hidden_size=16, intermediate_size=24,
                    num_layers=LAYERS, num_heads=2, num_kv_heads=1, max_position_embeddings=16)
    params = init_params(mc, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 16, (N, P + T)), jnp.int32)
    batch = dict(tokens=tokens, mask=jnp.ones((N, P + T), bool), targets=tokens[:, P:],
                 target_mask=jnp.ones((N, T), jnp.float32),
                 advantages=jnp.asarray(rng.normal(size=N), jnp.float32),
                 behaviour_logp=jnp.full((N, T), -2.7, jnp.float32))
    a = sketch.make_projections(params, seed=0, step=1, ranks=2)
  return Transformer(mc), params, batch, a


def _step(model, kl_control, telemetry_every):
  sc = steps.StepConfig(prompt_len=P, micro_batches=1, kl_sequences=2, kl_control=kl_control,
                        kl_probe='jvp', alpha_max=3.0, sparse_mask=0.0,
                        telemetry_every=telemetry_every)
  opt = optimizers.logra_optimizer(config_lib.OptimSection(), total_steps=10)
  loss_cfg = rl_losses.LossConfig('reinforce_tis', (('cap', 2.0),))
  # A drawn in the step: seed 0, step 1, rank 2, the names `setup`'s numpy A was drawn under.
  return steps.make_logra_step(model, loss_cfg, opt, sc, steps.ProjectionSpec(2)), opt


def _subjaxprs(eqn):
  for p in eqn.params.values():
    for sub in (p if isinstance(p, (list, tuple)) else (p,)):
      if isinstance(sub, jax.extend.core.ClosedJaxpr):
        sub = sub.jaxpr
      if isinstance(sub, jax.extend.core.Jaxpr):
        yield sub


def _primitives(jaxpr):
  names = set()
  for eqn in jaxpr.eqns:
    names.add(eqn.primitive.name)
    for sub in _subjaxprs(eqn):
      names |= _primitives(sub)
  return names


def forward_passes(jaxpr, in_cond=False):
  """(inside a lax.cond?) for every forward pass: a scan over the LAYERS blocks that computes
  an attention softmax (`exp`). The backward scan reuses the forward's residuals (no remat
  here) and the per-layer kernel updates compute no exp: neither is counted."""
  found = []
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == 'scan' and eqn.params['length'] == LAYERS
        and 'exp' in _primitives(eqn.params['jaxpr'].jaxpr)):
      found.append(in_cond)
      continue
    for sub in _subjaxprs(eqn):
      found += forward_passes(sub, in_cond or eqn.primitive.name == 'cond')
  return found


def _args(setup, opt):
  _, params, batch, a = setup
  state = opt.init(sketch.zero_probes(params, a))
  return (jax.tree.map(jnp.array, params), state, batch, np.uint32(0), np.uint32(1), BUDGET,
          jax.random.key(0))


def test_no_probe_without_kl_control_or_telemetry(setup):
  with jax.enable_x64(False):
    counts = {}
    for kl_control, every in ((True, 1), (False, 1), (False, 0)):
      step, opt = _step(setup[0], kl_control, every)
      jaxpr = jax.make_jaxpr(step.jitted)(*_args(setup, opt), np.asarray(True))
      counts[kl_control, every] = forward_passes(jaxpr.jaxpr)
  # The gradient's forward alone.
  assert counts[False, 0] == [False], counts
  # kl_control: the JVP unconditionally, the realised-KL forward only under the telemetry cond.
  assert sorted(counts[True, 1]) == [False, False, True], counts
  # No kl_control but telemetry: the JVP and the forward, both only where telemetry is asked.
  assert sorted(counts[False, 1]) == [False, True, True], counts


def test_telemetry_flag_changes_the_metrics_not_the_update(setup):
  with jax.enable_x64(False):
    step, opt = _step(setup[0], True, 1)
    p_on, _, m_on = step(*_args(setup, opt), telemetry=True)
    p_off, _, m_off = step(*_args(setup, opt), telemetry=False)
    quiet, opt = _step(setup[0], False, 0)
    p_q, _, m_q = quiet(*_args(setup, opt), telemetry=True)
  for x, y in zip(jax.tree.leaves(p_on), jax.tree.leaves(p_off)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert m_on['kl_telemetry'] == 1.0 and np.isfinite(m_on['realized_kl'])
  assert m_on['realized_kl'] > 0.0
  assert m_off['kl_telemetry'] == 0.0 and np.isnan(m_off['realized_kl'])
  assert m_off['kl_coefficient'] == m_on['kl_coefficient'] and m_off['alpha'] == m_on['alpha']
  # No probe at all: α = 1, q and both KLs unknown (NaN, written as null), and it says so.
  assert m_q['alpha'] == 1.0 and m_q['kl_telemetry'] == 0.0 and m_q['skipped'] == 0.0
  assert all(np.isnan(m_q[k]) for k in ('kl_coefficient', 'predicted_kl', 'realized_kl'))


def test_telemetry_every_is_validated_and_scheduled():
  with pytest.raises(ValueError, match='optim.telemetry_every'):
    config_lib.TrainConfig(optim=config_lib.OptimSection(telemetry_every=-1))
  assert [steps.telemetry_at(3, t) for t in range(1, 7)] == [False, False, True] * 2
  assert not any(steps.telemetry_at(0, t) for t in range(1, 7))
  assert all(steps.telemetry_at(1, t) for t in range(1, 7))
