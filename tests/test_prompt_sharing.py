"""Prompt sharing: a group's rows computed as one packed row give the unpacked numbers.

`completion.forward(..., share=s)` packs each run of s rows that share a prompt into one row
(the prompt once, then the completions, `Transformer(shared_prefix=True)`). It is the same
function of the weights: every completion position attends the same keys with the same
positions; only the order of the softmax's and the contractions' sums changes (the packed
row's scores hold exact zeros where the unpacked ones are shorter). In float64, with O(1)
logits, that moves values by ~1e-15; RTOL 1e-10 relative to the largest entry leaves five
orders of margin and catches any real error (a completion attending another completion, or a
shifted position, moves logits by > 1e-2). Float64, tiny shapes; dense and blockwise attention,
full and vocabulary-chunked heads; the LoGRA and dense-AdamW steps end to end.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numerics
from logra_jax import sketch
from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params
from logra_jax.rl import losses as rl_losses
from logra_jax.train import completion, methods, optimizers, steps
from logra_jax.train.steps import kl_probe, micro_batches
from logra_jax.train.steps import losses as step_losses
from logra_jax.train import config as config_lib
from logra_jax.train.config import OptimSection

pytestmark = pytest.mark.usefixtures('x64')
RTOL = 1e-10
G, PROMPTS, P, T = 3, 2, 5, 4  # samples per prompt, prompts, prompt length, completion length
N = G * PROMPTS

close = functools.partial(numerics.close, rtol=RTOL)
close_trees = functools.partial(numerics.close_trees, rtol=RTOL)


def tiny_config(**kw):
  base = dict(vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
              num_kv_heads=2, max_position_embeddings=64, dtype='float64',
              param_dtype='float64')
  return get_preset('tiny', **{**base, **kw})


def grouped_batch(seed=0):
  """PROMPTS prompts (left padded, lengths 5 and 3) × G completions (right padded, lengths
  4, 2, 3, ...), rows of a prompt contiguous, as `rollout.assemble_batch` lays them out."""
  rng = np.random.default_rng(seed)
  tokens = np.zeros((N, P + T), np.int32)
  mask = np.zeros((N, P + T), bool)
  tmask = np.zeros((N, T))
  for g, plen in enumerate((5, 3)):
    prompt = rng.integers(3, 16, plen)
    for j in range(G):
      i, clen = g * G + j, (4, 2, 3)[(g + j) % 3]
      tokens[i, P - plen:P], mask[i, P - plen:P] = prompt, True
      tokens[i, P:P + clen], mask[i, P:P + clen] = rng.integers(3, 16, clen), True
      tmask[i, :clen] = 1.0
  return dict(tokens=tokens, mask=mask, targets=tokens[:, P:], target_mask=tmask,
              advantages=rng.normal(size=N))


@pytest.fixture
def setup():
  mc = tiny_config()
  params = init_params(mc, jax.random.key(0))
  batch = grouped_batch()
  ref = steps.make_ref_logp(Transformer(mc), P, 1.0)(params, batch)
  rng = np.random.default_rng(1)
  batch['behaviour_logp'] = np.asarray(ref) + rng.uniform(-0.1, 0.1, (N, T))
  return mc, params, jax.tree.map(jnp.asarray, batch)


def test_packed_rows_hold_each_prompt_once():
  batch = jax.tree.map(jnp.asarray, grouped_batch())
  packed = completion.pack_prompt_groups(batch, P, G)
  assert packed.tokens.shape == (PROMPTS, P + G * (T - 1))
  np.testing.assert_array_equal(packed.tokens[:, :P], batch['tokens'][::G, :P])
  np.testing.assert_array_equal(packed.segments[0], [0] * P + [1] * 3 + [2] * 3 + [3] * 3)
  # A completion keeps the positions of its own row: after the real prompt tokens.
  np.testing.assert_array_equal(packed.positions[1, P:P + 2], [3, 4])  # prompt of 3 tokens
  with pytest.raises(ValueError, match='runs of 4'):
    completion.pack_prompt_groups(batch, P, 4)


@pytest.mark.parametrize('attention', ['dense', 'blockwise'])
@pytest.mark.parametrize('vocab_chunk', [0, 5])
@pytest.mark.parametrize('share', [1, G])
def test_shared_forward_equals_the_row_by_row_forward(setup, attention, vocab_chunk, share):
  mc, params, batch = setup
  mc = mc.replace(attention=attention, attention_block=4, vocab_chunk=vocab_chunk)
  model = Transformer(mc)
  want = step_losses.completion_logits(Transformer(tiny_config()), {'params': params}, batch, P)
  out = completion.forward(model, {'params': params}, batch, P, share)
  got = (completion._head_logits(mc, out.h_NxTxD, out.w)  # pylint: disable=protected-access
         if vocab_chunk else out)
  assert got.shape == want.shape
  close(got, want)


def test_shared_jvp_equals_the_row_by_row_jvp(setup):
  """The KL probe's JVP along a probe tangent, packed (the linear sketch mode)."""
  mc, params, batch = setup
  a = sketch.make_projections(params, seed=0, step=1, ranks=4, dtype=jnp.float64)
  probes = sketch.zero_probes(params, a)
  rng = np.random.default_rng(2)
  u = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape)), probes)
  linear = Transformer(mc).clone(sketch_mode='linear')
  outs = []
  for share in (1, G):
    fn = lambda p, share=share: completion.forward(
        linear, sketch.sketch_variables(params, a, p), batch, P, share)
    outs.append(sketch.logits_and_tangents(fn, probes, u))
  close_trees(outs[1], outs[0])


def test_prompt_share_keeps_runs_inside_groups_micro_batches_and_devices():
  assert micro_batches.prompt_share(range(16), 4) == 4
  assert micro_batches.prompt_share(range(16), 4, divides=2) == 2  # 8 micro-batches of 2 rows
  assert micro_batches.prompt_share(range(16), 4, split=8) == 2  # 8 packed rows for 8 devices
  assert micro_batches.prompt_share(range(16), 1) == 1
  assert micro_batches.prompt_share(kl_probe.kl_rows(16, 8), 4) == 2  # rows 0, 2 | 4, 6 | ...
  assert micro_batches.prompt_share(kl_probe.kl_rows(16, 4), 4) == 1  # one row per prompt
  assert micro_batches.prompt_share(kl_probe.kl_rows(16, 6), 4) == 1  # 0 2|5|8 10|13: uneven
  assert micro_batches.prompt_share(range(12), 6, divides=4) == 2  # runs may not straddle groups


def test_micro_batches_split_over_devices_keep_every_device_packing():
  """16 rows in 2 micro-batches of 8, split over 4 devices, groups of 4: runs of 2 (4 packed
  rows per micro-batch, one per device), not of 4 (2 packed rows: two devices idle)."""
  mesh = jax.sharding.AbstractMesh((1, 4), ('data', 'fsdp'))
  sh = steps.StepShardings(None, None, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec(('data', 'fsdp'))), None)
  sc = steps.StepConfig(prompt_len=P, micro_batches=2, kl_sequences=8, kl_control=True,
                        kl_probe='jvp', alpha_max=3.0, sparse_mask=0.0, prompt_group=4)
  batch = {'tokens': np.zeros((16, P + T), np.int32)}
  assert micro_batches.mb_share(sc, batch, sh) == 2
  assert micro_batches.mb_share(sc, batch, None) == 4


def loss_config():
  return rl_losses.LossConfig('reinforce_tis', (('cap', 2.0),), entropy_coef=0.01)


def test_logra_and_dense_steps_with_prompt_sharing_equal_the_unshared_steps(setup):
  """Micro-batches of 3 rows (one group each), the KL probe on every row: sketches, q, α,
  the realised KL and the new weights, and the dense-AdamW step's gradient and weights (the
  chunked head's packed forward is the forward test's)."""
  mc, params, batch = setup
  model = Transformer(mc)
  logra_opt = optimizers.logra_optimizer(OptimSection(), total_steps=10)
  adam_opt = optimizers.adam_optimizer(OptimSection(name='adam'), total_steps=10)
  copy = lambda tree: jax.tree.map(jnp.array, tree)
  results = []
  for group in (1, G):
    sc = steps.StepConfig(prompt_len=P, micro_batches=PROMPTS, kl_sequences=N, kl_control=True,
                          kl_probe='jvp', alpha_max=3.0, sparse_mask=0.0, prompt_group=group)
    logra = steps.make_logra_step(model, loss_config(), logra_opt, sc,
                                  steps.ProjectionSpec(4, dtype=jnp.float64))
    a = sketch.make_projections(params, seed=0, step=1, ranks=4, dtype=jnp.float64)
    new, _, metrics = logra(copy(params), logra_opt.init(sketch.zero_probes(params, a)), batch,
                            0, 1, jnp.float64(1e-3), jax.random.key(0))
    dense = steps.make_dense_step(model, loss_config(), adam_opt, sc)
    new_d, _, metrics_d = dense(None, copy(params), adam_opt.init(params), batch)
    results.append((new, metrics, new_d, metrics_d))
  assert results[0][1]['skipped'] == 0 and results[0][3]['skipped'] == 0
  assert 0 < results[0][1]['alpha'] < 3.0  # the probe set the step size
  for got, want in zip(results[1], results[0]):
    close_trees(got, want)


def test_trainer_rejects_rows_whose_group_does_not_share_a_prompt():
  """Every method's step places its batch through `Placement.put_batch`, which checks it."""
  cfg = config_lib.default_config()
  cfg.data.prompts_per_step, cfg.data.samples_per_prompt = PROMPTS, G
  placement = methods.Placement(config_lib.from_config_dict(cfg), Transformer(tiny_config()),
                                None)
  batch = grouped_batch()
  placement.put_batch(batch, P)  # the layout assemble_batch makes
  batch['tokens'][G + 1, P - 1] += 1  # the second group's second row: another prompt
  with pytest.raises(ValueError, match='row 4 .* prompt of row 3'):
    placement.put_batch(batch, P)
  cfg.optim.share_prompts = False  # nothing packed, nothing to check
  methods.Placement(config_lib.from_config_dict(cfg), Transformer(tiny_config()),
                    None).put_batch(batch, P)
