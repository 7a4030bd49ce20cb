"""LoRA in the layer (`logra_jax.train.lora`): the merged form's loss and adapter gradients,
no (K, D) kernel or kernel gradient anywhere in the step, and the trainer runs and resumes.

Structure uses `logra_jax.analysis.hlo` on the real decoder, sized so that every kernel's
(K, D) is distinct from every other size of the program (as in tests/test_sketch_dense.py):
hidden 16, q 4x10=40, kv 2x10=20, MLP 28; vocab 19, batch 3, length 7 (prompt 4 +
completion 3), LoRA rank 6, layers 2, head dim 10, groups 2.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from logra_jax.analysis import hlo
from logra_jax.analysis.tiny_lm import token_nll
from logra_jax.models import transformer
from logra_jax.models.config import ModelConfig
from logra_jax.rl import losses as rl_losses
from logra_jax.train import lora, optimizers, steps, tasks
from logra_jax.train.config import LoraSection, OptimSection
from trainer_runs import (assert_same_run, format_reward, make_config,  # noqa: F401
                          run_and_resume, trees_differ, xla_cache)

DECODER = ModelConfig(vocab_size=19, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=10, intermediate_size=28, qkv_bias=True)
KERNELS = {(2, 16, 40), (2, 16, 20), (2, 40, 16), (2, 16, 28), (2, 28, 16)}
RANK, SCALE, N, P, T = 6, 1.5, 3, 4, 3


def _setup(dtype='float32', remat_policy='none'):
  """Model, params, adapters with b != 0 (so dL/da != 0), tokens (N, P + T)."""
  cfg = DECODER.replace(dtype=dtype, param_dtype=dtype, remat_policy=remat_policy)
  params = transformer.init_params(cfg, jax.random.key(0))
  ab = lora.init(params, RANK, jax.random.key(1))
  keys = iter(jax.random.split(jax.random.key(2), 32))
  ab = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape, x.dtype), ab)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 19, (N, P + T)), jnp.int32)
  return transformer.Transformer(cfg), params, ab, tokens


def _layer_loss(model):
  """LoRA in the layers: loss(adapters, tokens, params)."""
  m = lora.layer_model(model)
  return lambda ab, t, params: token_nll(m.apply(lora.variables(params, ab, SCALE), t)[0], t)


def _merged_loss(model):
  """The reference: the merged kernel W + s·a b in a plain forward."""
  return lambda ab, t, params: token_nll(
      model.apply({'params': lora.merge(params, ab, SCALE)}, t)[0], t)


def test_layer_lora_equals_the_merged_form_loss_and_adapter_gradients(x64):
  model, params, ab, tokens = _setup('float64')
  assert len(lora.adapters(ab)) == 7  # q k v o gate up down, stacked over 2 layers
  want_loss, want = jax.value_and_grad(_merged_loss(model))(ab, tokens, params)
  got_loss, got = jax.jit(jax.value_and_grad(_layer_loss(model)))(ab, tokens, params)
  # float64 and the same algebra in another order (x(W + s a b) vs xW + s(xa)b): O(1)
  # values, sums of < 10^3 products, so rounding is ~1e-13; 1e-10 leaves 1000x of room and
  # is ~1e7 below the gradients' scale (asserted > 1e-3 below).
  np.testing.assert_allclose(got_loss, want_loss, rtol=0, atol=1e-10)
  flat_got, flat_want = traverse_util.flatten_dict(got), traverse_util.flatten_dict(want)
  assert flat_got.keys() == flat_want.keys()
  for path, g in flat_want.items():
    assert np.abs(g).max() > 1e-3, path  # a non-trivial gradient for a and for b
    np.testing.assert_allclose(flat_got[path], g, rtol=0, atol=1e-10, err_msg=str(path))
  # The frozen base weights get no gradient: they are not a differentiated input.
  g_params = jax.grad(_layer_loss(model), argnums=2)(ab, tokens, params)
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(g_params))


@pytest.mark.parametrize('remat_policy', ['none', 'full'])
def test_layer_lora_backward_forms_no_kernel_gradient(remat_policy):
  model, params, ab, tokens = _setup(remat_policy=remat_policy)
  kernels = {x.shape for p, x in traverse_util.flatten_dict(params).items()
             if p in lora.adapters(ab)}
  assert kernels == KERNELS
  values = hlo.backward_values(_layer_loss(model), (ab, tokens, params))
  assert sum(v.primitive == 'dot_general' for v in values) > 14  # the backward was seen
  assert hlo.kernel_shaped(values, KERNELS) == []
  # Positive control: the merged form's backward forms every (stacked) kernel gradient.
  merged = hlo.kernel_shaped(hlo.backward_values(_merged_loss(model), (ab, tokens, params)),
                             KERNELS)
  assert KERNELS <= {v.shape for v in merged}


def _batch():
  rng = np.random.default_rng(3)
  tokens = rng.integers(0, 19, (N, P + T)).astype(np.int32)
  return {'tokens': tokens, 'mask': np.ones((N, P + T), bool),
          'targets': tokens[:, P:], 'target_mask': np.ones((N, T), np.float32),
          'behaviour_logp': np.full((N, T), -2.9, np.float32),
          'advantages': np.array([1.0, -0.5, -0.5], np.float32)}


def _lora_step(model):
  o = OptimSection(name='lora', lora=LoraSection(rank=RANK, alpha=RANK * SCALE))
  opt = optimizers.adam_optimizer(o, total_steps=10)
  loss_cfg = rl_losses.LossConfig(policy='reinforce_tis', hparams=(('cap', 2.0),))
  sc = steps.StepConfig(P, 1, N, False, 'jvp', 1.0, 0.0)
  scale = o.lora.alpha / o.lora.rank
  return steps.make_dense_step(model, loss_cfg, opt, sc, lora_scale=scale), opt


def test_lora_training_step_forms_no_kernel_shaped_value_from_the_adapters():
  """The whole jitted step (loss, backward, AdamW, the KL forwards): no value shaped like a
  kernel depends on the adapters — forward or backward (a merged kernel would)."""
  model, params, ab, _ = _setup()
  step, opt = _lora_step(model)
  args = (params, ab, opt.init(ab), _batch())
  values = hlo.dependent_values(step, args, sources=(1,))
  assert sum(v.primitive == 'dot_general' for v in values) > 14
  assert hlo.kernel_shaped(values, KERNELS) == []
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  new_ab, _, metrics = step(params, copy(ab), opt.init(ab), _batch())  # donates the adapters
  assert metrics['skipped'] == 0 and trees_differ(new_ab, ab)


@pytest.mark.slow
def test_lora_trainer_moves_the_adapters_and_resumes_exactly(tmp_path):
  """optim.name=lora through the loop: the adapters and the generator's (merged) weights move,
  and a run stopped at step 2 and resumed repeats the uninterrupted 4-step run exactly."""
  make = lambda **kw: make_config(optim__name='lora', **kw)
  full, full_rows, resumed, rows = run_and_resume(make, tmp_path, stop_at=2)
  assert_same_run(full, full_rows, resumed, rows)
  assert all(r['skipped'] == 0.0 for r in full_rows[1:])
  assert any(r['realized_kl'] > 0 for r in full_rows[1:])
  init = full.method.init(full.state['params'])  # fresh adapters: b = 0
  assert trees_differ(full.state['lora'], init['lora'])
  # The generator samples with the merged weights: they moved, the base weights did not.
  assert trees_differ(full.method.policy_params(full.state), full.state['params'])
  start = tasks.build_model(full.cfg, full.task)[2]  # the run's initial weights (no warm start)
  assert not trees_differ(start, full.state['params'])
