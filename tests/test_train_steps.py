"""The jitted training steps against independent float64 references.

The LoGRA step must equal "dense gradient, then sketch, then optimizer, then α·AᵀU" computed
here with `jax.grad` on the kernels; micro-batching must not change it; a non-finite batch
must leave everything untouched. Also the LoRA step and merge, batch assembly and the
embedded generator.

Tolerances: everything is float64 with O(1) weights and tiny shapes; two computations of the
same quantity in different summation orders agree to ~1e-15 relative, and the step's
nonlinear parts (RowAdam's normalisation, α = sqrt(δ/q)) amplify that by at most a few
orders, so 1e-9 relative to the largest entry is ample and still catches any real error.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

jax.config.update('jax_enable_x64', True)

from logra_jax import rl, sketch  # noqa: E402
from logra_jax.models.presets import get_preset  # noqa: E402
from logra_jax.models.transformer import Transformer, init_params  # noqa: E402
from logra_jax.rl import losses as rl_losses  # noqa: E402
from logra_jax.rl.types import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402
from logra_jax.train import optimizers, steps  # noqa: E402
from logra_jax.train.config import OptimSection  # noqa: E402
from logra_jax.train.rollout import JaxGenerator, assemble_batch  # noqa: E402

N, P, T = 4, 4, 3           # sequences, prompt length, completion length
PROMPT_LENS = (4, 3, 2, 4)  # left padded to P
COMPLETION_LENS = (3, 2, 3, 1)  # micro-batches of 2 rows hold 5 and 4 target tokens
RANK = 4
BUDGET = 1e-4
RTOL = 1e-9


def close(actual, expected, rtol=RTOL):
  """|actual − expected| <= rtol · max|expected| (entries near 0 need no relative match)."""
  actual, expected = np.asarray(actual), np.asarray(expected)
  scale = max(float(np.max(np.abs(expected))), 1e-300)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


def copy(tree):
  """The steps donate params and optimizer state: hand them a copy."""
  return jax.tree.map(jnp.array, tree)


def flat(tree):
  return traverse_util.flatten_dict(jax.device_get(tree))


def assert_equal_trees(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope='module')
def setup():
  mc = get_preset('tiny', vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=2, num_kv_heads=1, max_position_embeddings=32, dtype='float64',
                  param_dtype='float64')
  model = Transformer(mc)
  params = init_params(mc, jax.random.key(0))
  rng = np.random.default_rng(0)
  tokens = np.zeros((N, P + T), np.int32)
  mask = np.zeros((N, P + T), bool)
  tmask = np.zeros((N, T), np.float64)
  for i, (p, c) in enumerate(zip(PROMPT_LENS, COMPLETION_LENS)):
    tokens[i, P - p:P + c] = rng.integers(3, 16, p + c)
    mask[i, P - p:P + c] = True
    tmask[i, :c] = 1.0
  batch = dict(tokens=tokens, mask=mask, targets=tokens[:, P:], target_mask=tmask,
               advantages=rng.normal(size=N))
  # Behaviour log-probs near the model's own (importance ratios in [0.9, 1.1], under the cap).
  logits = jax.jit(lambda p, b: steps.completion_logits(model, {'params': p}, b, P))(params, batch)
  logp = rl_losses.token_logprobs(logits, batch['targets'])
  batch['behaviour_logp'] = np.asarray(logp) + rng.uniform(-0.1, 0.1, (N, T))
  batch = jax.tree.map(jnp.asarray, batch)
  a = sketch.make_projections(params, seed=0, step=1, ranks=RANK, dtype=jnp.float64)
  return mc, model, params, batch, a


def loss_config(aggregation='token'):
  return rl_losses.LossConfig('reinforce_tis', (('cap', 2.0),), entropy_coef=0.01,
                              aggregation=aggregation)


def step_config(m=1):
  return steps.StepConfig(prompt_len=P, micro_batches=m, kl_sequences=N, kl_control=True,
                          kl_probe='jvp', alpha_max=3.0, sparse_mask=0.0)


LOGRA_OPT = optimizers.logra_optimizer(OptimSection(), total_steps=10)
ADAM_OPT = optimizers.adam_optimizer(OptimSection(name='adam'), total_steps=10)
_STEPS = {}


def logra_step(model, aggregation='token', m=1):
  """One jitted step per setting, shared by the tests (compiling is most of their time)."""
  key = ('logra', aggregation, m)
  if key not in _STEPS:
    _STEPS[key] = steps.make_logra_step(model, loss_config(aggregation), LOGRA_OPT,
                                        step_config(m))
  return _STEPS[key]


def run_logra(setup, aggregation='token', m=1, batch=None, params=None, opt_state=None, a=None):
  _, model, params0, batch0, a0 = setup
  params = params0 if params is None else params
  a = a0 if a is None else a
  if opt_state is None:
    opt_state = LOGRA_OPT.init(sketch.zero_probes(params, a))
  return logra_step(model, aggregation, m)(
      copy(params), copy(opt_state), batch0 if batch is None else batch, a,
      jnp.float64(BUDGET), jax.random.key(0))


@pytest.fixture(scope='module')
def dense_grads(setup):
  """(loss, dL/dparams) of the whole batch with plain (unsketched) weights, token mean."""
  _, model, params, batch, _ = setup

  def loss(p):
    logits = steps.completion_logits(model, {'params': p}, batch, P)
    return rl_losses.rl_loss(loss_config(), logits, batch['targets'], batch['behaviour_logp'],
                             batch['advantages'], batch['target_mask'])[0]
  return jax.jit(jax.value_and_grad(loss))(params)


# ------------------------------------------------------------------------------- LoGRA step

@pytest.mark.parametrize('aggregation', ['token', 'sequence'])
def test_micro_batches_do_not_change_the_step(setup, aggregation):
  params = setup[2]
  p1, o1, m1 = run_logra(setup, aggregation, m=1)
  p2, o2, m2 = run_logra(setup, aggregation, m=2)
  assert m1['skipped'] == 0 and m2['skipped'] == 0
  for path, w in flat(params).items():
    close(flat(p2)[path] - w, flat(p1)[path] - w)
  for k in ('loss', 'loss/policy', 'alpha', 'kl_coefficient', 'predicted_kl', 'realized_kl',
            'sketch_norm', 'entropy', 'mismatch', 'is_ratio'):
    close(m2[k], m1[k])
  for x, y in zip(jax.tree.leaves(o2), jax.tree.leaves(o1)):
    close(x, y)


def test_logra_update_is_alpha_times_a_transpose_u_of_the_dense_gradient_sketch(
    setup, dense_grads):
  _, model, params, batch, a = setup
  new, _, metrics = run_logra(setup)
  # Independent reference: the dense kernel gradient G, its sketch S = A G (per layer), the
  # optimizer's U from S, the direction D = Aᵀ U, q from a dense JVP along D, α = min(α_max,
  # sqrt(δ/q)), and the update α·D.
  loss, grads = dense_grads
  kernels = sketch.kernels_of(grads, a)
  s = jax.tree.map(lambda a_, g: jnp.einsum('lrk,lkd->lrd', a_, g), a, kernels)
  u, _ = LOGRA_OPT.update(s, LOGRA_OPT.init(s), sketch.kernels_of(params, a), projections=a)
  d = jax.tree.map(lambda a_, u_: jnp.einsum('lrk,lrd->lkd', a_, u_), a, u)
  tangent = jax.tree.map(jnp.zeros_like, params)
  tangent = traverse_util.unflatten_dict({**traverse_util.flatten_dict(tangent),
                                          **traverse_util.flatten_dict(d)})
  logits_fn = lambda p: steps.completion_logits(model, {'params': p}, batch, P)
  logits, dlogits = jax.jit(lambda p, t: jax.jvp(logits_fn, (p,), (t,)))(params, tangent)
  q = sketch.kl_coefficient(logits, dlogits, 1.0, batch['target_mask'])
  alpha = min(3.0, math.sqrt(BUDGET / float(q)))
  assert metrics['skipped'] == 0
  close(metrics['loss'], loss)
  close(metrics['sketch_norm'], jnp.sqrt(sum(jnp.sum(x**2) for x in jax.tree.leaves(s))))
  close(metrics['kl_coefficient'], q)
  close(metrics['alpha'], alpha)
  close(metrics['predicted_kl'], alpha**2 * q)
  targets = traverse_util.flatten_dict(d)
  for path, w in flat(params).items():
    if path in targets:
      close(flat(new)[path] - w, alpha * targets[path])
    else:  # embeddings, norms, the LM head: not sketched, bit-for-bit unchanged
      np.testing.assert_array_equal(flat(new)[path], w)
  # The realized KL of the step is the predicted one up to the O(α³) remainder of the
  # second-order expansion: ~sqrt(KL) ≈ 1% relative at this budget.
  np.testing.assert_allclose(metrics['realized_kl'], metrics['predicted_kl'], rtol=0.1)


def test_kl_budget_as_a_ceiling_with_scale_free_row_adam(setup, dense_grads):
  """The tiny default's rule: α = min(1, sqrt(δ/q)) on lr · S/root (preserve_norm=False)."""
  _, model, params, batch, a = setup
  lr = 1e-3
  opt = optimizers.logra_optimizer(OptimSection(preserve_norm=False, learning_rate=lr), 10)
  step = steps.make_logra_step(model, loss_config(), opt, step_config()._replace(alpha_max=1.0))
  s = jax.tree.map(lambda a_, g: jnp.einsum('lrk,lkd->lrd', a_, g), a,
                   sketch.kernels_of(dense_grads[1], a))
  # Step 1: root = the RMS of each output unit's sketch column, U = −lr·S/(root + ε·mean root).
  def unit_scaled(s_):
    root = jnp.sqrt(jnp.mean(s_**2, axis=1, keepdims=True))
    return s_ / (root + 1e-8 * jnp.mean(root, axis=2, keepdims=True))
  d = jax.tree.map(lambda a_, s_: jnp.einsum('lrk,lrd->lkd', a_, -lr * unit_scaled(s_)), a, s)
  targets = traverse_util.flatten_dict(d)
  run = lambda budget: step(copy(params), opt.init(sketch.zero_probes(params, a)), batch, a,
                            jnp.float64(budget), jax.random.key(0))
  free, _, m = run(1e6)  # a budget far above the step's predicted KL: α = 1, the lr step
  assert m['skipped'] == 0 and float(m['alpha']) == 1.0
  for path, w in flat(params).items():
    if path in targets:
      close(flat(free)[path] - w, targets[path])
  q = float(m['kl_coefficient'])
  capped, _, m = run(0.25 * q)  # a quarter of the step's predicted KL: α = 1/2
  close(m['alpha'], 0.5)
  close(m['predicted_kl'], 0.25 * q)
  for path, w in flat(params).items():
    if path in targets:
      close(flat(capped)[path] - w, 0.5 * targets[path])


def test_logra_step_skips_a_non_finite_batch(setup):
  params, batch = setup[2], setup[3]
  p1, o1, m1 = run_logra(setup)  # a normal step: weights move, the optimizer counts it
  assert m1['skipped'] == 0
  assert any(np.any(x != y) for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  assert int(o1[0].count) == 1
  bad = dict(batch, advantages=batch['advantages'].at[1].set(jnp.nan))
  p2, o2, m2 = run_logra(setup, batch=bad, params=p1, opt_state=o1)
  assert m2['skipped'] == 1
  assert_equal_trees(p2, p1)
  assert_equal_trees(o2, o1)


def test_dense_adam_step_skips_a_non_finite_batch(setup):
  _, model, params, batch, _ = setup
  step = steps.make_dense_step(model, loss_config(), ADAM_OPT, step_config())
  p1, o1, m1 = step(None, copy(params), ADAM_OPT.init(params), batch)
  assert m1['skipped'] == 0
  assert all(np.any(x != y) for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  bad = dict(batch, advantages=batch['advantages'].at[0].set(jnp.inf))
  p2, o2, m2 = step(None, copy(p1), copy(o1), bad)
  assert m2['skipped'] == 1
  assert_equal_trees(p2, p1)
  assert_equal_trees(o2, o1)


def test_rank_schedule_changes_projection_ranks_and_the_state_carries_over(setup):
  _, _, params, batch, a4 = setup
  o = OptimSection(rank=RANK, rank_delta=RANK, rank_tau=2.0)
  # r_t = 4 + ceil(4 tanh(t/2)): 4 at t = 0, 8 at t = 10 (tanh(5) > 0.99).
  ranks = lambda tree: {x.shape[-2] for x in jax.tree.leaves(tree)}
  assert ranks(optimizers.projections_at(o, params, 0, 0)) == {RANK}
  assert ranks(optimizers.projections_at(o, params, 0, 10)) == {2 * RANK}
  # The same rules, float64 A (the step compiled at rank 4 above is reused).
  a_at = lambda t: sketch.make_projections(params, 0, t, optimizers.rank_rules(o, t),
                                           o.projection, dtype=jnp.float64)
  a0, a10 = a_at(0), a_at(10)
  assert ranks(a0) == {RANK} and ranks(a10) == {2 * RANK}
  p1, o1, m1 = run_logra(setup, a=a0)
  p2, o2, m2 = run_logra(setup, params=p1, opt_state=o1, a=a10)
  assert m1['skipped'] == 0 and m2['skipped'] == 0
  assert int(o2[0].count) == 2
  # RowAdam keeps one second moment per output unit: its shapes do not depend on the rank.
  assert jax.tree.map(jnp.shape, o2) == jax.tree.map(jnp.shape, o1)
  assert any(np.any(x != y) for x, y in zip(jax.tree.leaves(p2), jax.tree.leaves(p1)))


# ------------------------------------------------------------------------------------ LoRA

def test_lora_merge_by_hand():
  w = jnp.array([[1., 2., 3.], [4., 5., 6.]])        # K=2, D=3
  a = jnp.array([[1.], [2.]])                          # (K, r=1)
  b = jnp.array([[1., 0., -1.]])                       # (r, D)
  params = {'attn': {'q_proj': {'kernel': w}}, 'norm': {'scale': jnp.ones(3)},
            'layers': {'up_proj': {'kernel': jnp.stack([w, 2 * w])}}}
  lora = {'attn': {'q_proj': {'kernel': {'a': a, 'b': b}}},
          'layers': {'up_proj': {'kernel': {'a': jnp.stack([a, -a]), 'b': jnp.stack([b, b])}}}}
  merged = optimizers.lora_merge(params, lora, 0.5)
  # a b = [[1, 0, -1], [2, 0, -2]]; times 0.5: [[.5, 0, -.5], [1, 0, -1]].
  np.testing.assert_array_equal(merged['attn']['q_proj']['kernel'],
                                [[1.5, 2., 2.5], [5., 5., 5.]])
  # Layer 1: 2w − 0.5 a b = [[2, 4, 6], [8, 10, 12]] − [[.5, 0, −.5], [1, 0, −1]].
  np.testing.assert_array_equal(merged['layers']['up_proj']['kernel'],
                                [[[1.5, 2., 2.5], [5., 5., 5.]],
                                 [[1.5, 4., 6.5], [7., 10., 13.]]])
  np.testing.assert_array_equal(merged['norm']['scale'], np.ones(3))


def test_lora_step_trains_only_the_adapters(setup, dense_grads):
  _, model, params, batch, _ = setup
  o = OptimSection(name='lora', lora_rank=2, lora_alpha=4.0)
  scale = o.lora_alpha / o.lora_rank
  merge = lambda p, lora: optimizers.lora_merge(p, lora, scale)
  lora = optimizers.init_lora(params, o.lora_rank, jax.random.key(1))
  opt = optimizers.adam_optimizer(o, total_steps=10)
  step = steps.make_dense_step(model, loss_config(), opt, step_config(), merge=merge)
  base = jax.device_get(params)
  new, _, metrics = step(params, copy(lora), opt.init(lora), batch)
  assert metrics['skipped'] == 0
  assert_equal_trees(params, base)  # the base weights are an input only
  # Reference: with b = 0 the merged weights are the base weights, dL/da = scale·G bᵀ = 0
  # and dL/db = scale·aᵀ G (G the dense kernel gradient); Adam's first step is
  # −lr·g/(|g| + eps) (bias-corrected moments m̂ = g, v̂ = g²).
  g_flat = traverse_util.flatten_dict(dense_grads[1])
  for path, ab in traverse_util.flatten_dict(jax.device_get(lora),
                                             is_leaf=lambda k, v: 'a' in v).items():
    got = new
    for k in path:
      got = got[k]
    np.testing.assert_array_equal(got['a'], ab['a'])
    g_b = scale * jnp.einsum('lkr,lkd->lrd', ab['a'], g_flat[path])
    close(got["b"], -o.adam_learning_rate * g_b / (jnp.abs(g_b) + 1e-8))
  merged = flat(merge(params, new))
  for path, w in flat(params).items():
    if path in traverse_util.flatten_dict(lora, is_leaf=lambda k, v: 'a' in v):
      assert np.any(merged[path] != w)
    else:
      np.testing.assert_array_equal(merged[path], w)


# ------------------------------------------------------------------- rollout and generator

def result(prompt, completion, logps, version=0):
  return GenerationResult(request_id='r', sample_index=0, prompt_token_ids=prompt,
                          completion_token_ids=completion, behaviour_logprobs=logps,
                          finish_reason='stop', weight_version=version)


def test_assemble_batch_by_hand():
  results = [result((5, 6, 7), (8, 2), (-0.5, -0.25)),
             result((9,), (10, 11, 12), (-1.0, -2.0, -3.0))]
  batch, p = assemble_batch(results, [1.5, -0.5], max_new_tokens=4, pad_id=0)
  assert p == 8  # the longest prompt (3) rounded up to the smallest bucket, 8
  # Prompts end at column P−1 (left padded); completions start at column P (right padded).
  np.testing.assert_array_equal(batch['tokens'], [[0, 0, 0, 0, 0, 5, 6, 7, 8, 2, 0, 0],
                                                  [0, 0, 0, 0, 0, 0, 0, 9, 10, 11, 12, 0]])
  np.testing.assert_array_equal(batch['mask'], [[0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0],
                                                [0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 0]])
  np.testing.assert_array_equal(batch['targets'], [[8, 2, 0, 0], [10, 11, 12, 0]])
  np.testing.assert_array_equal(batch['target_mask'], [[1, 1, 0, 0], [1, 1, 1, 0]])
  np.testing.assert_array_equal(batch['behaviour_logp'], [[-0.5, -0.25, 0, 0], [-1, -2, -3, 0]])
  np.testing.assert_array_equal(batch['advantages'], [1.5, -0.5])
  assert batch['tokens'].dtype == np.int32 and batch['advantages'].dtype == np.float32
  # A fixed prompt length (the task's) wins over the bucket, so the step never recompiles.
  wide, p16 = assemble_batch(results, [1.5, -0.5], max_new_tokens=4, prompt_len=16)
  assert p16 == 16 and wide['tokens'].shape == (2, 20)
  np.testing.assert_array_equal(wide['tokens'][:, 8:], batch['tokens'])


def test_jax_generator_is_a_generator_tagged_with_its_weight_version(setup):
  mc, _, params, _, _ = setup
  gen = JaxGenerator(mc, params, version=7, pad_id=0)
  assert isinstance(gen, rl.Generator)
  sp = lambda seed: SamplingParams(temperature=1.0, max_new_tokens=3, n=2, seed=seed)
  requests = [GenerationRequest((3, 4, 5), sp(11), request_id='a'),
              GenerationRequest((6,), sp(12), request_id='b')]
  out = gen.generate(requests)
  assert [(r.request_id, r.sample_index) for r in out] == [('a', 0), ('a', 1), ('b', 0), ('b', 1)]
  assert all(r.weight_version == 7 for r in out)
  assert all(1 <= len(r.completion_token_ids) <= 3 for r in out)
  assert out[2].prompt_token_ids == (6,)
  # Per-request seeds: a request's completions do not depend on its place in the batch.
  swapped = gen.generate(requests[::-1])
  assert [r.completion_token_ids for r in swapped] == [
      r.completion_token_ids for r in out[2:] + out[:2]]
  gen.update_weights(params, 8)
  assert gen.weight_version == 8
  assert all(r.weight_version == 8 for r in gen.generate(requests[:1]))
