"""The LoGRA step draws A on device: the same bits as numpy's `projection.py`, the same step.

The generators (bridge, vLLM receiver) rebuild A with numpy from (seed, step, kind) under the
HF names (`optimizers.projections_at`); the trainer's jitted step draws A itself from traced
(seed, step) scalars. Both must agree bit for bit, and the step must equal the step on host A.
float32 compute, as the trainer runs (no x64).
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from logra_jax import sketch
from logra_jax.analysis import hlo
from logra_jax.models import hf_io
from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params
from logra_jax.rl import losses as rl_losses
from logra_jax.train import methods, optimizers, steps
from logra_jax.train.steps import losses as step_losses
from logra_jax.train.config import (LograSection, OptimSection, default_config,
                                    from_config_dict)

N, P, T = 4, 4, 3
SEED = 5
# Rank 4 on attention (1/2: exact in bfloat16), 3 on the MLP (1/sqrt(3): float32 only).
SECTION = LograSection(rank=3, rank_rules='[qkvo]_proj=4')
SC = steps.StepConfig(prompt_len=P, micro_batches=2, kl_sequences=N, kl_control=True,
                      kl_probe='jvp', alpha_max=3.0, sparse_mask=0.0, return_update=True)
LOSS = rl_losses.LossConfig('reinforce_tis', (('cap', 2.0),), entropy_coef=0.01)


@pytest.fixture(scope='module')
def tiny():
  mc = get_preset('tiny', vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=2, num_kv_heads=1, max_position_embeddings=32)
  model = Transformer(mc)
  params = init_params(mc, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, 16, (N, P + T)).astype(np.int32)
  batch = dict(tokens=tokens, mask=np.ones((N, P + T), bool), targets=tokens[:, P:],
               target_mask=np.ones((N, T), np.float32),
               advantages=rng.normal(size=N).astype(np.float32))
  logits = jax.jit(lambda p, b: step_losses.completion_logits(model, {'params': p}, b, P))(
      params, batch)
  logp = np.asarray(rl_losses.token_logprobs(logits, batch['targets']))
  batch['behaviour_logp'] = (logp + rng.uniform(-0.1, 0.1, (N, T))).astype(np.float32)
  return mc, model, params, batch


def bits(a):
  return np.asarray(jnp.asarray(a, jnp.float32)).view(np.uint32)


def assert_bitwise_equal(got, want):
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert x.dtype == y.dtype
    np.testing.assert_array_equal(bits(x), bits(y))


@pytest.mark.parametrize('refresh', [True, False])
def test_device_projections_are_the_numpy_ones_in_bfloat16_where_exact(tiny, refresh):
  """The trainer's spec (HF names, bf16) == `projections_at`, bit for bit, one compile."""
  mc, _, params, _ = tiny
  o = dataclasses.replace(SECTION, refresh=refresh)  # fixed A: step 0's at every t
  names = hf_io.projection_name_fn(mc)
  spec = optimizers.projection_spec(o, 0, names)
  draw = jax.jit(lambda seed, t: steps.draw_projections(params, seed, t, spec))
  for t in (0, 1, 9):
    got = traverse_util.flatten_dict(
        draw(np.uint32(SEED), np.uint32(optimizers.projection_step(o, t))))
    want = traverse_util.flatten_dict(optimizers.projections_at(o, params, SEED, t, names))
    assert got.keys() == want.keys()
    for path, a in got.items():
      attn = path[-2] in ('q_proj', 'k_proj', 'v_proj', 'o_proj')
      assert a.shape[-2] == (4 if attn else 3)
      assert a.dtype == (jnp.bfloat16 if attn else jnp.float32), (path, a.dtype)
      np.testing.assert_array_equal(bits(a), bits(want[path]), err_msg=str((path, t)))
  assert draw._cache_size() == 1  # pylint: disable=protected-access


def test_step_with_device_projections_equals_the_step_on_host_projections(tiny):
  """Two chained steps (t = 3, 4), HF names: params, RowAdam state, metrics and α·U equal.

  Exact, not a tolerance: A has the same values (bf16 where exact is the float32 A; the
  sketch's x Aᵀ casts A to the compute dtype), and both steps run the same ops on them.
  """
  mc, model, params, batch = tiny
  opt = optimizers.logra_optimizer(OptimSection(logra=SECTION), total_steps=10)
  names = hf_io.projection_name_fn(mc)
  spec = optimizers.projection_spec(SECTION, 3, names)
  device_step = steps.make_logra_step(model, LOSS, opt, SC, spec)
  host_step = jax.jit(steps.logra_update_fn(model, LOSS, opt, SC), donate_argnums=(0, 1))
  a0 = optimizers.projections_at(SECTION, params, SEED, 0, names)
  init = opt.init(sketch.zero_probes(params, a0))
  copy = lambda tree: jax.tree.map(jnp.array, tree)
  dev = host = (params, init)
  for t in (3, 4):
    a = optimizers.projections_at(SECTION, params, SEED, t, names)
    host_out = host_step(*copy(host), batch, a, np.float32(1e-4), jax.random.key(t))
    dev_out = device_step(*copy(dev), batch, np.uint32(SEED), np.uint32(t), np.float32(1e-4),
                          jax.random.key(t))
    assert float(dev_out[2]['skipped']) == 0
    assert_bitwise_equal(dev_out, host_out)
    dev, host = dev_out[:2], host_out[:2]
  assert device_step.jitted._cache_size() == 1  # pylint: disable=protected-access
  # The step holds the attention A (L, 4, K) in bfloat16 and the MLP A (L, 3, K) in float32.
  types = set(hlo.traced_shapes(device_step, params, init, batch, np.uint32(SEED),
                                np.uint32(3), np.float32(1e-4), jax.random.key(0)))
  for path, x in traverse_util.flatten_dict(a).items():
    dtype = np.dtype(jnp.bfloat16 if x.shape[-2] == 4 else jnp.float32)
    assert (x.shape, dtype) in types, (path, x.shape, dtype)


def test_logra_method_needs_a_uint32_seed(tiny):
  model = tiny[1]
  cfg = from_config_dict(dict(default_config().to_dict(), seed=2**32))
  with pytest.raises(ValueError, match=r'config key seed must lie in \[0, 2\*\*32\)'):
    methods.logra_method(cfg, model)


def test_momentum_follows_a_redrawn_a_in_the_device_step(tiny):
  """refresh_every=2 with sketch-space momentum, steps t = 1, 2, 3 (A of step 0, 2, 2): the
  device step carries the moments into step 2's basis with M = A_2 A_0⁺ from an A_0 it draws
  itself at the state's old step, bit for bit as the host step handed that M, and records
  the basis it left them in."""
  mc, model, params, batch = tiny
  o = dataclasses.replace(SECTION, refresh_every=2, momentum=0.9)
  opt = optimizers.logra_optimizer(OptimSection(logra=o), total_steps=10)
  names = hf_io.projection_name_fn(mc)
  spec = optimizers.projection_spec(o, 0, names)
  device_step = steps.make_logra_step(model, LOSS, opt, SC, spec)
  update = steps.logra_update_fn(model, LOSS, opt, SC)
  # A_old an argument (traced), as the device step's: a closed-over constant would be folded.
  host_step = jax.jit(lambda p, s, b, a, a_old, budget, key, basis: update(
      p, s, b, a, budget, key, basis=basis,
      basis_change=lambda _: sketch.basis_transfer(a, a_old)), donate_argnums=(0, 1))
  a_at = lambda t: optimizers.projections_at(o, params, SEED, t, names)
  init = opt.init(sketch.zero_probes(params, a_at(0)))
  copy = lambda tree: jax.tree.map(jnp.array, tree)
  dev = host = (params, init)
  for t in (1, 2, 3):
    a_step, old_step = optimizers.projection_step(o, t), optimizers.projection_step(o, t - 1)
    a, a_old = a_at(t), a_at(t - 1)
    host_out = host_step(*copy(host), batch, a, a_old, np.float32(1e-4), jax.random.key(t),
                         np.uint32(a_step))
    dev_out = device_step(*copy(dev), batch, np.uint32(SEED), np.uint32(a_step),
                          np.float32(1e-4), jax.random.key(t))
    assert float(dev_out[2]['skipped']) == 0
    assert_bitwise_equal(dev_out, host_out)
    moment = dev_out[1][1]  # the chain's states: RowAdam, momentum, learning rate
    assert isinstance(moment, sketch.SketchMomentumState)
    assert (int(moment.basis), int(moment.count)) == (a_step, t)
    assert old_step == (0 if t < 3 else 2)
    dev, host = dev_out[:2], host_out[:2]
  assert device_step.jitted._cache_size() == 1  # pylint: disable=protected-access


def test_projection_step_holds_a_for_refresh_every_steps():
  held = dataclasses.replace(SECTION, refresh_every=3)
  assert [optimizers.projection_step(held, t) for t in range(8)] == [0, 0, 0, 3, 3, 3, 6, 6]
  assert [optimizers.projection_step(SECTION, t) for t in range(3)] == [0, 1, 2]
  fixed = dataclasses.replace(SECTION, refresh=False, refresh_every=3)
  assert {optimizers.projection_step(fixed, t) for t in range(8)} == {0}
