"""The jitted training steps against independent float64 references.

The LoGRA step (as the trainer builds it: `optimizers.logra_optimizer` + `make_logra_step`,
with the paper's RowAdam and relative step) must equal "dense gradient, then sketch, then
RowAdam, then the relative step, then α·AᵀU" computed here in numpy/jnp float64; the
finite-difference KL probe, the sparse mask and bf16 compute are checked inside the step;
micro-batching must not change it; a non-finite batch must leave everything untouched. Also
the LoRA step and merge, batch assembly and the embedded generator.

Tolerances of the float64 tests: O(1) weights and tiny shapes; two computations of the same
quantity in different summation orders agree to ~1e-15 relative, and the step's nonlinear
parts (RowAdam's normalisation, the relative step, α = sqrt(δ/q)) amplify that by at most a
few orders, so 1e-9 relative to the largest entry is ample and still catches any real error.
Only tests that compare against float64 use the `x64` fixture; the fp32/bf16 tests run
without it (as users do).
"""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from logra_jax import rl, sketch
from logra_jax.models.generator import JaxGenerator
from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params
from logra_jax.rl import losses as rl_losses
from logra_jax.rl.types import GenerationRequest, GenerationResult, SamplingParams
from logra_jax.train import lora as lora_lib
from logra_jax.train import optimizers, steps
from logra_jax.train.steps import losses as step_losses
from logra_jax.train.config import LograSection, LoraSection, OptimSection
from logra_jax.train.rollout import assemble_batch

N, P, T = 4, 4, 3           # sequences, prompt length, completion length
PROMPT_LENS = (4, 3, 2, 4)  # left padded to P
COMPLETION_LENS = (3, 2, 3, 1)  # micro-batches of 2 rows hold 5 and 4 target tokens
RANK = 4
BUDGET = 1e-4
RTOL = 1e-9
SEED, A_STEP = 0, 1  # the fixtures' A: what the steps draw on device from (SEED, A_STEP)


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


def model_config(dtype, param_dtype=None):
  """The tiny test model; like the trainer (`tasks.build_model`), only the compute dtype is
  set from the config's `model.dtype`: the params keep the preset's float32 unless given."""
  extra = {'param_dtype': param_dtype} if param_dtype else {}
  return get_preset('tiny', vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=2, num_kv_heads=1, max_position_embeddings=32, dtype=dtype,
                    **extra)


@pytest.fixture(scope='module')
def setup():
  """float64 model, params, batch and A (built under x64; used only by x64 tests)."""
  with jax.enable_x64(True):
    mc = model_config('float64', 'float64')
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
    logits = jax.jit(lambda p, b: step_losses.completion_logits(model, {'params': p}, b, P))(
        params, batch)
    logp = rl_losses.token_logprobs(logits, batch['targets'])
    batch['behaviour_logp'] = np.asarray(logp) + rng.uniform(-0.1, 0.1, (N, T))
    batch = jax.tree.map(jnp.asarray, batch)
    a = sketch.make_projections(params, seed=SEED, step=A_STEP, ranks=RANK, dtype=jnp.float64)
  return mc, model, params, batch, a


def to_float32(tree):
  """float64 leaves rounded to float32 (ints and bools unchanged), as numpy-backed arrays."""
  def cast(x):
    x = np.asarray(x)
    return jnp.asarray(x.astype(np.float32) if x.dtype == np.float64 else x)
  return jax.tree.map(cast, tree)


@pytest.fixture
def no_x64():
  """fp32/bf16 tests run as users do, even where another test module turned x64 on globally."""
  with jax.enable_x64(False):
    yield


@pytest.fixture(scope='module')
def setup32(setup):
  """The same model, params, batch and A in float32 (no x64): float32 compute."""
  with jax.enable_x64(False):
    mc = model_config('float32')
    _, _, params, batch, a = setup
    return mc, Transformer(mc), to_float32(params), to_float32(batch), to_float32(a)


def loss_config(aggregation='token'):
  return rl_losses.LossConfig('reinforce_tis', (('cap', 2.0),), entropy_coef=0.01,
                              aggregation=aggregation)


def step_config(m=1, **changes):
  return steps.StepConfig(prompt_len=P, micro_batches=m, kl_sequences=N, kl_control=True,
                          kl_probe='jvp', alpha_max=3.0, sparse_mask=0.0)._replace(**changes)


# The paper's LoGRA recipe (configs/qwen2_5_math_*.py): RowAdam (b2 0.95, eps 1e-8, norm
# preserving), the authors' relative step, lr 1. The paper's update_ratio is 6e-5; this tiny
# random model is far less sensitive than a trained LLM (q ≈ 5e-9 at 6e-5, α would sit at
# α_max), so 1e-2 puts α = sqrt(δ/q) inside (0, α_max) and every factor of the step is seen.
UPDATE_RATIO = 1e-2
LOGRA_SECTION = OptimSection(logra=LograSection(learning_rate=1.0, update_ratio=UPDATE_RATIO))
LOGRA_OPT = optimizers.logra_optimizer(LOGRA_SECTION, total_steps=10)
ADAM_OPT = optimizers.adam_optimizer(OptimSection(name='adam'), total_steps=10)
_STEPS = {}


def projection_spec(model, ranks=RANK):
  """The fixtures' A drawn in the step: float64 for float64 params, else bfloat16 (exact at
  R = 4, float32 where not), as the trainer draws them."""
  dtype = jnp.float64 if model.config.param_dtype == 'float64' else jnp.bfloat16
  return steps.ProjectionSpec(ranks, dtype=dtype)


def logra_step(model, aggregation='token', m=1, ranks=RANK, **changes):
  """One jitted step per setting, shared by the tests (compiling is most of their time)."""
  key = (model.config.dtype, model.config.param_dtype, aggregation, m, ranks,
         tuple(sorted(changes.items())))
  if key not in _STEPS:
    _STEPS[key] = steps.make_logra_step(model, loss_config(aggregation), LOGRA_OPT,
                                        step_config(m, **changes), projection_spec(model, ranks))
  return _STEPS[key]


def run_logra(setup, aggregation='token', m=1, batch=None, params=None, opt_state=None,
              ranks=RANK, a_step=A_STEP, **changes):
  """One step from the fixture's params at A = projections of (SEED, a_step, ranks)."""
  _, model, params0, batch0, a0 = setup
  params = params0 if params is None else params
  if opt_state is None:
    opt_state = LOGRA_OPT.init(sketch.zero_probes(params, a0))
  budget = jnp.asarray(BUDGET, jax.tree.leaves(a0)[0].dtype)
  return logra_step(model, aggregation, m, ranks, **changes)(
      copy(params), copy(opt_state), batch0 if batch is None else batch, np.uint32(SEED),
      np.uint32(a_step), budget, jax.random.key(0))


@pytest.fixture(scope='module')
def dense_grads(setup):
  """(loss, dL/dparams) of the whole batch with plain (unsketched) weights, token mean."""
  _, model, params, batch, _ = setup

  def loss(p):
    logits = step_losses.completion_logits(model, {'params': p}, batch, P)
    return rl_losses.rl_loss(loss_config(), logits, batch['targets'], batch['behaviour_logp'],
                             batch['advantages'], batch['target_mask'])[0]
  with jax.enable_x64(True):
    return jax.jit(jax.value_and_grad(loss))(params)


def dense_sketch(a, grads):
  """S = A G per layer, numpy float64: the sketch of the dense kernel gradients."""
  return {p: np.einsum('lrk,lkd->lrd', a_, grads[p]) for p, a_ in flat(a).items()}


def row_adam_reference(s_LxRxD, b2=0.95, eps=1e-8):
  """RowAdam's first step (docs/method.md §7), per layer: D = S/denom, ‖D‖_F = ‖S‖_F."""
  root_LxD = np.sqrt((1 - b2) * np.mean(s_LxRxD**2, axis=1) / (1 - b2))
  denom_LxD = root_LxD + np.maximum(eps * np.mean(root_LxD, axis=1, keepdims=True), 1e-30)
  d = s_LxRxD / denom_LxD[:, None, :]
  norm = lambda x: np.sqrt(np.sum(x**2, axis=(1, 2), keepdims=True))
  return d * norm(s_LxRxD) / norm(d)


def relative_step_reference(d, kernels, a, ratio, lr):
  """U = −lr · η · D with η = ratio · sqrt(Σ‖W‖² / Σ‖AᵀD‖²) over all sketched kernels."""
  w_sq = sum(np.sum(w**2) for w in kernels.values())
  d_sq = sum(np.sum(np.einsum('lrk,lrd->lkd', a[p], d[p])**2) for p in d)
  eta = ratio * np.sqrt(w_sq / d_sq)
  return {p: -lr * eta * x for p, x in d.items()}


def paper_direction_reference(params, a, grads):
  """(S, Δ) in numpy float64: the sketch S = A G of the dense kernel gradients, RowAdam's D,
  the relative step U = −lr·η·D (`LOGRA_SECTION`) and the kernels' direction Δ = Aᵀ U."""
  a_np, w = flat(a), {p: flat(params)[p] for p in flat(a)}
  s = dense_sketch(a, flat(grads))
  d = {p: row_adam_reference(x) for p, x in s.items()}
  u = relative_step_reference(d, w, a_np, UPDATE_RATIO, LOGRA_SECTION.logra.learning_rate)
  return s, {p: np.einsum('lrk,lrd->lkd', a_np[p], u[p]) for p in u}


# ------------------------------------------------------------------------------- LoGRA step

def norm(tree):
  return np.sqrt(sum(np.sum(np.square(x)) for x in jax.tree.leaves(tree)))


def dense_tangent(params, delta):
  """A tangent of all params: ``delta`` on the sketched kernels, 0 elsewhere."""
  zeros = traverse_util.flatten_dict(jax.tree.map(jnp.zeros_like, params))
  return traverse_util.unflatten_dict({**zeros, **{p: jnp.asarray(x) for p, x in delta.items()}})


@pytest.mark.parametrize('aggregation', ['token', 'sequence'])
def test_micro_batches_do_not_change_the_step(x64, setup, aggregation):
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


def test_logra_update_is_alpha_times_relative_row_adam_step_of_the_dense_gradient_sketch(
    x64, setup, dense_grads):
  """RowAdam → the relative step → α·AᵀU inside the jitted step == numpy float64."""
  _, model, params, batch, a = setup
  new, _, metrics = run_logra(setup)
  # Independent reference: the dense kernel gradient G, its sketch S = A G (per layer),
  # RowAdam's D from S, the relative step U = −lr·η·D with η = update_ratio ·
  # sqrt(Σ‖W‖² / Σ‖AᵀD‖²), the direction Δ = Aᵀ U, q from a dense JVP along Δ,
  # α = min(α_max, sqrt(δ/q)), and the update α·Δ.
  loss, grads = dense_grads
  w = {p: flat(params)[p] for p in flat(a)}
  s, delta = paper_direction_reference(params, a, grads)
  # The relative step's defining property: ‖Δ‖ = update_ratio · lr · ‖W‖ over all kernels.
  np.testing.assert_allclose(norm(delta), UPDATE_RATIO * norm(w), rtol=1e-12)
  logits_fn = lambda p: step_losses.completion_logits(model, {'params': p}, batch, P)
  logits, dlogits = jax.jit(lambda p, t: jax.jvp(logits_fn, (p,), (t,)))(
      params, dense_tangent(params, delta))
  q = float(sketch.kl_coefficient(logits, dlogits, 1.0, batch['target_mask']))
  alpha = min(3.0, math.sqrt(BUDGET / q))
  assert 0.1 < alpha < 3.0  # unclamped: α and q are both seen (see UPDATE_RATIO)
  assert metrics['skipped'] == 0
  close(metrics['loss'], loss)
  close(metrics['sketch_norm'], norm(s))
  close(metrics['kl_coefficient'], q)
  close(metrics['alpha'], alpha)
  close(metrics['predicted_kl'], alpha**2 * q)
  for path, w_ in flat(params).items():
    if path in delta:
      close(flat(new)[path] - w_, alpha * delta[path])
    else:  # embeddings, norms, the LM head: not sketched, bit-for-bit unchanged
      np.testing.assert_array_equal(flat(new)[path], w_)
  # The realized KL of the step is the predicted one up to the O(α³) remainder of the
  # second-order expansion: ~sqrt(KL) ≈ 1% relative at this budget.
  np.testing.assert_allclose(metrics['realized_kl'], metrics['predicted_kl'], rtol=0.1)


def test_finite_difference_kl_probe_agrees_with_the_jvp(x64, setup):
  """optim.logra.kl_probe='fd' (the 27B config): same U, q from a true KL, α and the KL from q."""
  params = setup[2]
  p_jvp, _, m_jvp = run_logra(setup)
  p_fd, _, m_fd = run_logra(setup, kl_probe='fd')
  assert m_jvp['skipped'] == 0 and m_fd['skipped'] == 0
  q, alpha, q_fd = float(m_jvp['kl_coefficient']), float(m_jvp['alpha']), float(
      m_fd['kl_coefficient'])
  # KL(εΔ) = ε²q + ε³c + O(ε⁴): the probe's q_fd = KL(εΔ)/ε² is off by (ε/α)·(r − 1) + O(ε²),
  # where r − 1 = αc/q + O(α²) is the JVP step's own realized/predicted KL − 1 at its α. The
  # probe step ε is within a factor 2 of α, so |q_fd/q − 1| <= 2|r − 1| (+ float64 rounding of
  # the KL, ~1e-16/KL ≈ 1e-12 relative).
  r = float(m_jvp['realized_kl'] / m_jvp['predicted_kl'])
  assert abs(r - 1) < 0.1
  assert abs(q_fd / q - 1) <= 2 * abs(r - 1) + 1e-9, (q_fd, q, r)
  # α and the predicted KL follow from q_fd; U is the JVP branch's, so the update is the
  # JVP step's update rescaled by α_fd/α.
  alpha_fd = min(3.0, math.sqrt(BUDGET / q_fd))
  close(m_fd['alpha'], alpha_fd)
  close(m_fd['predicted_kl'], alpha_fd**2 * q_fd)
  for path, w in flat(params).items():
    close(flat(p_fd)[path] - w, alpha_fd / alpha * (flat(p_jvp)[path] - w))
  # The FD step meets its budget as closely as the JVP step's expansion allows.
  assert abs(float(m_fd['realized_kl']) / BUDGET - 1) <= 2 * abs(r - 1)


def test_sparse_mask_inside_the_step(x64, setup, dense_grads):
  """optim.logra.sparse_mask: per step key, drop output units (update exactly 0), rescale the rest."""
  _, model, params, batch, a = setup
  p, lr = 0.5, 1e-2
  opt = optimizers.logra_optimizer(
      OptimSection(logra=LograSection(sketch_optimizer='sgd', learning_rate=lr)), 10)
  step = steps.make_logra_step(model, loss_config(), opt,
                               step_config(kl_control=False, sparse_mask=p),
                               projection_spec(model))
  run = lambda key: step(copy(params), opt.init(sketch.zero_probes(params, a)), batch, SEED,
                         A_STEP, jnp.float64(BUDGET), key)
  new, _, metrics = run(jax.random.key(1))
  assert metrics['skipped'] == 0 and float(metrics['alpha']) == 1.0
  s = dense_sketch(a, flat(dense_grads[1]))
  # The mask the step must use: the library's, drawn from the step key (S tree order).
  masked = flat(sketch.sparse_mask_tree(traverse_util.unflatten_dict(s), jax.random.key(1), p))
  dropped = total = 0
  for path, s_ in s.items():
    got = flat(new)[path] - flat(params)[path]          # (L, K, D)
    # SGD acts per unit: Δ_j = −lr·Aᵀ S_j/(1−p) for a kept unit j, exactly 0 for a dropped
    # one; P(kept) = 1 − p, so E[Δ] = −lr·Aᵀ S (unbiased).
    kept_full = -lr * np.einsum('lrk,lrd->lkd', flat(a)[path], s_) / (1 - p)
    zero_LxD = np.all(got == 0, axis=1)
    assert np.all(np.any(kept_full != 0, axis=1))     # no unit is 0 unless dropped
    np.testing.assert_array_equal(zero_LxD, np.all(masked[path] == 0, axis=1))
    close(np.where(zero_LxD[:, None, :], 0.0, kept_full), got)
    dropped, total = dropped + zero_LxD.sum(), total + zero_LxD.size
  # Binomial(total ≈ 450, p): σ ≈ 0.024 of the fraction; 0.1 is over 4σ.
  assert abs(dropped / total - p) < 0.1, (dropped, total)
  close(metrics['sketch_norm'], norm(masked))
  # Deterministic from the key: the same key gives the same step, another key another mask.
  assert_equal_trees(run(jax.random.key(1))[0], new)
  other = run(jax.random.key(2))[0]
  assert any(np.any((flat(other)[k] == flat(params)[k]) != (flat(new)[k] == flat(params)[k]))
             for k in s)
  # RowAdam also acts per unit: a dropped unit's update is exactly 0 there too.
  u, _ = LOGRA_OPT.update(traverse_util.unflatten_dict(masked),
                          LOGRA_OPT.init(traverse_util.unflatten_dict(masked)),
                          sketch.kernels_of(params, a), projections=a)
  for path, u_ in flat(u).items():
    dropped_LxD = np.all(masked[path] == 0, axis=1)
    assert np.all(np.where(dropped_LxD[:, None, :], np.asarray(u_), 0.0) == 0)
    assert np.all(np.any(np.asarray(u_) != 0, axis=1) | dropped_LxD)


def test_kl_budget_as_a_ceiling_with_scale_free_row_adam(x64, setup, dense_grads):
  """The tiny default's rule: α = min(1, sqrt(δ/q)) on lr · S/root (preserve_norm=False)."""
  _, model, params, batch, a = setup
  lr = 1e-3
  opt = optimizers.logra_optimizer(
      OptimSection(logra=LograSection(preserve_norm=False, learning_rate=lr)), 10)
  step = steps.make_logra_step(model, loss_config(), opt, step_config(alpha_max=1.0),
                               projection_spec(model))
  s = jax.tree.map(lambda a_, g: jnp.einsum('lrk,lkd->lrd', a_, g), a,
                   sketch.kernels_of(dense_grads[1], a))
  # Step 1: root = the RMS of each output unit's sketch column, U = −lr·S/(root + ε·mean root).
  def unit_scaled(s_):
    root = jnp.sqrt(jnp.mean(s_**2, axis=1, keepdims=True))
    return s_ / (root + 1e-8 * jnp.mean(root, axis=2, keepdims=True))
  d = jax.tree.map(lambda a_, s_: jnp.einsum('lrk,lrd->lkd', a_, -lr * unit_scaled(s_)), a, s)
  targets = traverse_util.flatten_dict(d)
  run = lambda budget: step(copy(params), opt.init(sketch.zero_probes(params, a)), batch, SEED,
                            A_STEP, jnp.float64(budget), jax.random.key(0))
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


REST_LR = 1e-3


@pytest.mark.parametrize('m,under_budget', [(1, True), (2, True), (2, False)])
def test_rest_trains_by_adam_on_its_dense_gradient_under_the_same_alpha(x64, setup, dense_grads,
                                                                        m, under_budget):
  """optim.logra.rest_learning_rate: the unsketched leaves take Adam's first step −lr·g/(|g| + ε)
  on their dense gradient, the kernels the same U as without them, and one α from a dense JVP
  along both together scales both (float64; the micro-batches change nothing). With
  optim.logra.rest_step='own' (``under_budget`` False) the rest takes its step itself and α
  comes from the JVP along the kernels' direction alone."""
  _, model, params, batch, a = setup
  rest_opt = optimizers.rest_optimizer(
      OptimSection(logra=LograSection(rest_learning_rate=REST_LR)), total_steps=10)
  step = steps.make_logra_step(model, loss_config(), LOGRA_OPT,
                               step_config(m, rest_under_budget=under_budget),
                               projection_spec(model), rest_opt=rest_opt)
  opt_state = (LOGRA_OPT.init(sketch.zero_probes(params, a)),
               rest_opt.init(sketch.rest_of(params, a)))
  new, (_, rest_state), metrics = step(copy(params), copy(opt_state), batch, np.uint32(SEED),
                                       np.uint32(A_STEP), jnp.float64(BUDGET),
                                       jax.random.key(0))
  assert metrics['skipped'] == 0
  loss, grads = dense_grads
  _, delta = paper_direction_reference(params, a, grads)
  rest_paths = [p for p in flat(params) if p not in delta]
  assert rest_paths and all(p[-1] in ('embedding', 'scale', 'kernel') for p in rest_paths)
  g = flat(grads)
  v = {p: -REST_LR * g[p] / (np.abs(g[p]) + 1e-8) for p in rest_paths}  # Adam's first step
  logits_fn = lambda p: step_losses.completion_logits(model, {'params': p}, batch, P)
  logits, dlogits = jax.jit(lambda p, t: jax.jvp(logits_fn, (p,), (t,)))(
      params, dense_tangent(params, {**delta, **v} if under_budget else delta))
  q = float(sketch.kl_coefficient(logits, dlogits, 1.0, batch['target_mask']))
  alpha = min(3.0, math.sqrt(BUDGET / q))
  assert 0.1 < alpha < 3.0
  close(metrics['loss'], loss)
  close(metrics['kl_coefficient'], q)
  close(metrics['alpha'], alpha)
  rest_scale = alpha if under_budget else 1.0
  for path, w_ in flat(params).items():
    close(flat(new)[path] - w_, alpha * delta[path] if path in delta else rest_scale * v[path])
  for path in rest_paths:  # Adam's first moment holds (1 − b1)·g
    close(flat(rest_state[0].mu)[path],
          0.1 * g[path])


def test_rest_refuses_the_low_rank_payload(setup):
  _, model, _, _, _ = setup
  rest_opt = optimizers.rest_optimizer(
      OptimSection(logra=LograSection(rest_learning_rate=REST_LR)), total_steps=10)
  with pytest.raises(ValueError, match='cannot carry the densely trained rest'):
    steps.logra_update_fn(model, loss_config(), LOGRA_OPT, step_config(return_update=True),
                          rest_opt=rest_opt)
  assert optimizers.rest_optimizer(OptimSection(), 10) is None  # 0: the rest frozen


def test_bf16_compute_fp32_params_step_is_close_to_the_fp32_step(no_x64, setup32):
  """model.dtype='bfloat16' with fp32 params (the paper configs): fp32 params, sketch, state.

  The hybrid of the paper's configs that exercises every bf16-sensitive path: RowAdam and the
  relative step (qwen2_5_math_*) with the finite-difference KL probe (paper_27b).
  """
  assert jnp.asarray(1.0).dtype == jnp.float32  # not under x64 (the no_x64 fixture)
  mc16 = model_config('bfloat16')
  assert mc16.param_dtype == 'float32'  # what the trainer builds from model.dtype='bfloat16'
  _, _, params, batch, a = setup32
  p32, _, m32 = run_logra(setup32, kl_probe='fd')
  p16, o16, m16 = run_logra((mc16, Transformer(mc16), params, batch, a), kl_probe='fd')
  assert m32['skipped'] == 0 and m16['skipped'] == 0
  for tree in (p16, o16, m16):
    for x in jax.tree.leaves(tree):
      if jnp.issubdtype(x.dtype, jnp.floating):
        assert x.dtype == jnp.float32, x.dtype  # params, RowAdam state, metrics
        assert np.all(np.isfinite(x))
  assert m16['sketch_norm'].dtype == jnp.float32  # the sketch itself is fp32
  # The fp32 step's FD probe is right: its step realizes the predicted KL (the authors' 3%).
  assert abs(float(m32['realized_kl'] / m32['predicted_kl']) - 1) < 0.03
  # bf16 (unit roundoff u = 2^-8 ≈ 3.9e-3) rounds every activation, logit and backward
  # cotangent of the 2-block model: ~10 roundings in series, so the sketch, and with it U
  # (RowAdam and the relative step are scale-free, 1-Lipschitz in direction) and q, move by
  # up to ~10u ≈ 4% relative. The probe runs in fp32, so q follows U: |Δq/q| <= 2·|ΔU/U|.
  d32 = {k: flat(p32)[k] - w for k, w in flat(params).items()}
  d16 = {k: flat(p16)[k] - w for k, w in flat(params).items()}
  rel = norm({k: d16[k] - d32[k] for k in d32}) / norm(d32)
  assert rel < 0.04, rel
  np.testing.assert_allclose(m16['kl_coefficient'], m32['kl_coefficient'], rtol=0.08)
  np.testing.assert_allclose(m16['alpha'], m32['alpha'], rtol=0.04)


def test_logra_step_skips_a_non_finite_batch(no_x64, setup32):
  params, batch = setup32[2], setup32[3]
  # A normal step: weights move, the optimizer counts it.
  p1, o1, m1 = run_logra(setup32, kl_probe='fd')
  assert m1['skipped'] == 0
  assert any(np.any(x != y) for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  assert int(o1[0].count) == 1
  bad = dict(batch, advantages=batch['advantages'].at[1].set(jnp.nan))
  p2, o2, m2 = run_logra(setup32, batch=bad, params=p1, opt_state=o1, kl_probe='fd')
  assert m2['skipped'] == 1
  assert_equal_trees(p2, p1)
  assert_equal_trees(o2, o1)


def test_dense_adam_step_skips_a_non_finite_batch(no_x64, setup32):
  _, model, params, batch, _ = setup32
  step = steps.make_dense_step(model, loss_config(), ADAM_OPT, step_config())
  p1, o1, m1 = step(None, copy(params), ADAM_OPT.init(params), batch)
  assert m1['skipped'] == 0
  assert all(np.any(x != y) for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(params)))
  bad = dict(batch, advantages=batch['advantages'].at[0].set(jnp.inf))
  p2, o2, m2 = step(None, copy(p1), copy(o1), bad)
  assert m2['skipped'] == 1
  assert_equal_trees(p2, p1)
  assert_equal_trees(o2, o1)


def test_rank_schedule_changes_projection_ranks_and_the_state_carries_over(no_x64, setup32):
  params = setup32[2]
  o = LograSection(rank=RANK, rank_delta=RANK, rank_tau=2.0)
  # r_t = 4 + ceil(4 tanh(t/2)): 4 at t = 0, 8 at t = 10 (tanh(5) > 0.99).
  ranks = lambda tree: {x.shape[-2] for x in jax.tree.leaves(tree)}
  assert ranks(optimizers.projections_at(o, params, 0, 0)) == {RANK}
  assert ranks(optimizers.projections_at(o, params, 0, 10)) == {2 * RANK}
  # The steps draw A at the spec's ranks: r_0 = RANK (the fp32 rank-4 step compiled above is
  # reused), then the rank-8 rules of step 10 (a second compile: A's shapes change).
  assert optimizers.projection_spec(o, 0).ranks.rank('any', 99, 99) == RANK
  r10 = optimizers.projection_spec(o, 10).ranks
  p1, o1, m1 = run_logra(setup32, a_step=0, kl_probe='fd')
  p2, o2, m2 = run_logra(setup32, params=p1, opt_state=o1, ranks=r10, a_step=10, kl_probe='fd')
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
  merged = lora_lib.merge(params, lora, 0.5)
  # a b = [[1, 0, -1], [2, 0, -2]]; times 0.5: [[.5, 0, -.5], [1, 0, -1]].
  np.testing.assert_array_equal(merged['attn']['q_proj']['kernel'],
                                [[1.5, 2., 2.5], [5., 5., 5.]])
  # Layer 1: 2w − 0.5 a b = [[2, 4, 6], [8, 10, 12]] − [[.5, 0, −.5], [1, 0, −1]].
  np.testing.assert_array_equal(merged['layers']['up_proj']['kernel'],
                                [[[1.5, 2., 2.5], [5., 5., 5.]],
                                 [[1.5, 4., 6.5], [7., 10., 13.]]])
  np.testing.assert_array_equal(merged['norm']['scale'], np.ones(3))


def test_lora_step_trains_only_the_adapters(x64, setup, dense_grads):
  _, model, params, batch, _ = setup
  o = OptimSection(name='lora', lora=LoraSection(rank=2, alpha=4.0))
  scale = o.lora.alpha / o.lora.rank
  merge = lambda p, lora: lora_lib.merge(p, lora, scale)
  lora = lora_lib.init(params, o.lora.rank, jax.random.key(1))
  opt = optimizers.adam_optimizer(o, total_steps=10)
  step = steps.make_dense_step(model, loss_config(), opt, step_config(), lora_scale=scale)
  base = jax.device_get(params)
  new, _, metrics = step(params, copy(lora), opt.init(lora), batch)
  assert metrics['skipped'] == 0
  assert_equal_trees(params, base)  # the base weights are an input only
  # Reference: with b = 0 the merged weights are the base weights, dL/da = scale·G bᵀ = 0
  # and dL/db = scale·aᵀ G (G the dense kernel gradient); Adam's first step is
  # −lr·g/(|g| + eps) (bias-corrected moments m̂ = g, v̂ = g²).
  g_flat = traverse_util.flatten_dict(dense_grads[1])
  g_bs = []
  for path, ab in traverse_util.flatten_dict(jax.device_get(lora),
                                             is_leaf=lambda k, v: 'a' in v).items():
    got = new
    for k in path:
      got = got[k]
    np.testing.assert_array_equal(got['a'], ab['a'])
    g_b = scale * jnp.einsum('lkr,lkd->lrd', ab['a'], g_flat[path])
    close(got["b"], -o.lora.learning_rate * g_b / (jnp.abs(g_b) + 1e-8))
    g_bs.append(g_b)
  # The dense steps report their gradient's norm (dL/da = 0: only dL/db counts), not LoGRA's.
  close(metrics['grad_norm'], jnp.sqrt(sum(jnp.sum(g**2) for g in g_bs)))
  assert 'sketch_norm' not in metrics
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


def test_jax_generator_is_a_generator_tagged_with_its_weight_version(no_x64, setup32):
  mc, _, params, _, _ = setup32
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
