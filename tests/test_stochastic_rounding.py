"""Stochastic rounding (SR) of bf16 kernels in the LoGRA apply (`sketch.update`).

Rounding W + ΔW to the nearest bf16 keeps ~3.5% of the paper's relative step (6e-5) along
its direction (docs/memory.md); SR is unbiased. References: bf16 values are the f32 values
whose low 16 bits are 0, so a value's two bf16 neighbours (in magnitude: toward zero, away
from zero) come from its f32 bit pattern in numpy; means are taken in float64 (exact for
sums of a few thousand bf16 values).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sketch
from logra_jax.models.presets import get_preset
from logra_jax.models.transformer import Transformer, init_params
from logra_jax.rl import losses as rl_losses
from logra_jax.sketch import update as upd
from logra_jax.train import config as config_lib
from logra_jax.train import methods, optimizers, steps
from logra_jax.train.steps import rounding as step_rounding
from logra_jax.train.config import LograSection, OptimSection

DRAWS = 2000


def neighbours(x_f32):
  """(toward zero, away from zero) bf16 neighbours of f32 x, as float64 (numpy bits)."""
  bits = np.asarray(x_f32, np.float32).view(np.uint32)
  lo = (bits & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
  hi = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
  exact = (bits & np.uint32(0xFFFF)) == 0
  return lo, np.where(exact, lo, hi.astype(np.float64))


def draws(x_f32, n=DRAWS, seed=0):
  keys = jax.random.split(jax.random.key(seed), n)
  y = jax.jit(jax.vmap(upd.stochastic_round_bf16, in_axes=(None, 0)))(jnp.asarray(x_f32), keys)
  return np.asarray(y.astype(jnp.float32)).astype(np.float64)


def sample_values(rng, n=256):
  """bf16 weights of mixed sign and magnitude plus updates of 1e-4 .. 1 ulp."""
  w = np.asarray(jnp.asarray(rng.normal(0, 0.05, n), jnp.bfloat16).astype(jnp.float32))
  d = w * rng.choice([1e-4, 1e-3, 6e-3, 2e-2], n) * rng.choice([-1, 1], n)
  return (w + d).astype(np.float32)


def test_sr_is_unbiased(x64):
  x = sample_values(np.random.default_rng(0))
  y = draws(x)
  lo, hi = neighbours(x)
  exact = x.astype(np.float64)
  # One draw is a Bernoulli between lo and hi around x: variance (x − lo)(hi − x). The mean
  # of DRAWS draws has sd sqrt(that / DRAWS); 6 sd bounds it (a 2e-9 chance per entry).
  sd = np.sqrt(np.abs((exact - lo) * (hi - exact)) / DRAWS)
  err = np.abs(y.mean(0) - exact)
  assert np.all(err <= 6 * sd), np.max(err / np.maximum(sd, 1e-300))
  # Not vacuous: nearest rounding misses by ~a quarter ulp on average, far outside 6 sd.
  nearest = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32), np.float64)
  assert np.mean(np.abs(nearest - exact) > 6 * sd) > 0.5


def test_every_result_is_a_neighbour_and_both_occur():
  x = sample_values(np.random.default_rng(1))
  y = draws(x, n=200)
  lo, hi = neighbours(x)
  assert np.all((y == lo) | (y == hi))
  inexact = lo != hi
  frac = np.abs((x - lo) / (hi - lo + (~inexact)))
  both = inexact & (frac > 0.1) & (frac < 0.9)  # P(one side in 200 draws) < 1e-9
  assert np.all(np.any(y[:, both] == lo[both], 0) & np.any(y[:, both] == hi[both], 0))


def test_exact_values_specials_and_the_max():
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.normal(0, 1, 64), jnp.bfloat16)
  bf16_max = float(jnp.finfo(jnp.bfloat16).max)
  special = jnp.asarray([0.0, -0.0, np.inf, -np.inf, bf16_max, -bf16_max, 1e-40], jnp.bfloat16)
  exact = jnp.concatenate([w, special]).astype(jnp.float32)
  y = draws(exact, n=50)
  want = np.asarray(exact, np.float64)
  np.testing.assert_array_equal(np.signbit(y), np.broadcast_to(np.signbit(want), y.shape))
  np.testing.assert_array_equal(y, np.broadcast_to(want, y.shape))
  # The largest finite f32s above bf16's max: a carry would reach inf; they saturate.
  big = np.array([0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000], np.uint32).view(np.float32)
  np.testing.assert_array_equal(draws(big, n=50), np.broadcast_to(
      np.array([bf16_max, -bf16_max, bf16_max]), (50, 3)))
  # NaN stays NaN, also a NaN whose payload sits only in the truncated low bits.
  nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF80FFFF], np.uint32).view(np.float32)
  assert np.all(np.isnan(draws(nans, n=10)))
  with pytest.raises(ValueError, match='float32'):
    upd.stochastic_round_bf16(jnp.zeros(2, jnp.bfloat16), jax.random.key(0))


L, K, D, R = 3, 48, 64, 4


def stacked_problem(ratio, dtype=jnp.bfloat16, seed=3):
  """W (L, K, D) ~ N(0, 0.02), A Rademacher, U with ‖Aᵀ U‖ = ratio · ‖W‖ per layer."""
  rng = np.random.default_rng(seed)
  w = jnp.asarray(rng.normal(0, 0.02, (L, K, D)), dtype)
  a = jnp.asarray(rng.choice([-1.0, 1.0], (L, R, K)) / np.sqrt(R), jnp.float32)
  u = rng.normal(size=(L, R, D))
  du = np.einsum('lrk,lrd->lkd', np.asarray(a, np.float64), u)
  w64 = np.asarray(w.astype(jnp.float32), np.float64)
  u *= (ratio * np.linalg.norm(w64, axis=(1, 2)) / np.linalg.norm(du, axis=(1, 2)))[:, None, None]
  return {'w': {'kernel': w}}, {'w': {'kernel': a}}, {'w': {'kernel': jnp.asarray(u, jnp.float32)}}


def kept_fraction(params, new, a, u):
  """⟨ΔW_applied, ΔW⟩ / ‖ΔW‖² per layer (float64): 1 = the whole update along its direction."""
  du = np.einsum('lrk,lrd->lkd', np.asarray(a['w']['kernel'], np.float64),
                 np.asarray(u['w']['kernel'], np.float64))
  old = np.asarray(params['w']['kernel'].astype(jnp.float32), np.float64)
  applied = np.asarray(new.astype(jnp.float32), np.float64) - old
  return np.einsum('...lkd,lkd->...l', applied, du) / np.sum(du**2, axis=(1, 2))


def apply_many(params, a, u, keys):
  fn = lambda k: upd.apply_sketch_updates(params, u, a, 1.0, key=k)['w']['kernel']
  return jax.jit(jax.vmap(fn))(keys)


def test_apply_keeps_the_whole_small_update_on_average(x64):
  params, a, u = stacked_problem(6e-5)
  n = 200
  kept = kept_fraction(params, apply_many(params, a, u, jax.random.split(jax.random.key(4), n)),
                       a, u)
  nearest = kept_fraction(params, upd.apply_sketch_updates(params, u, a)['w']['kernel'], a, u)
  # The kept fraction of one draw is a noisy ratio; its mean over n draws (per layer) is
  # within 6 standard errors of 1 (the SE is estimated from the draws).
  mean, se = kept.mean(0), kept.std(0, ddof=1) / np.sqrt(n)
  assert np.all(np.abs(mean - 1) <= 6 * se) and np.all(se < 0.05), (mean, se)
  assert np.all(nearest < 0.2), nearest  # ~0.04 here: the failure SR fixes


def test_layers_and_matrices_get_independent_keys():
  params, a, u = stacked_problem(6e-5)
  same = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), t)
  params, a, u = same(params), same(a), same(u)  # every layer identical
  two = lambda t: {'p': t['w'], 'q': t['w']}     # two identical matrices
  new = upd.apply_sketch_updates(two(params), two(u), two(a), 1.0, key=jax.random.key(5))
  p, q = (np.asarray(new[n]['kernel'].astype(jnp.float32)) for n in 'pq')
  assert not np.array_equal(p, q)
  assert all(not np.array_equal(p[i], p[j]) for i in range(L) for j in range(i))


def test_zero_update_leaves_bf16_kernel_unchanged():
  params, a, u = stacked_problem(6e-5)
  u = jax.tree.map(jnp.zeros_like, u)
  new = apply_many(params, a, u, jax.random.split(jax.random.key(6), 8))
  want = np.asarray(params['w']['kernel'].astype(jnp.float32))
  np.testing.assert_array_equal(np.asarray(new.astype(jnp.float32)),
                                np.broadcast_to(want, new.shape))


def test_fp32_kernels_take_the_exact_path_bit_for_bit():
  params, a, u = stacked_problem(6e-5, dtype=jnp.float32)
  fn = jax.jit(lambda p, k: upd.apply_sketch_updates(p, u, a, 0.7, key=k))
  with_key = fn(params, jax.random.key(7))['w']['kernel']
  without = jax.jit(lambda p: upd.apply_sketch_updates(p, u, a, 0.7))(params)['w']['kernel']
  np.testing.assert_array_equal(np.asarray(with_key), np.asarray(without))
  ref = params['w']['kernel'] + 0.7 * jnp.einsum('lrk,lrd->lkd', a['w']['kernel'],
                                                u['w']['kernel'])
  np.testing.assert_allclose(np.asarray(without), np.asarray(ref), rtol=0, atol=1e-9)


def test_other_narrow_dtypes_are_refused():
  params, a, u = stacked_problem(6e-5, dtype=jnp.float16)
  with pytest.raises(ValueError, match='bf16 kernels only.*float16'):
    upd.apply_sketch_updates(params, u, a, 1.0, key=jax.random.key(0))


def test_config_key_param_rounding_is_validated_and_reaches_the_step():
  cfg = config_lib.default_config()
  assert cfg.optim.logra.param_rounding == 'stochastic'
  cfg.optim.logra.param_rounding = 'floor'
  with pytest.raises(ValueError, match=r"optim\.logra\.param_rounding='floor' must be one of"):
    config_lib.from_config_dict(cfg)
  cfg.optim.logra.param_rounding = 'nearest'
  sc = methods._step_config(config_lib.from_config_dict(cfg), 4)  # pylint: disable=protected-access
  assert sc.param_rounding == 'nearest'
  assert step_rounding.rounding_key(sc, jax.random.key(0)) is None
  assert config_lib.CHOICES['optim.logra.param_rounding'] == steps.PARAM_ROUNDINGS
  with pytest.raises(ValueError, match=r"param_rounding='up'.*optim\.logra\.param_rounding"):
    step_rounding.rounding_key(sc._replace(param_rounding='up'), jax.random.key(0))


def between_neighbours(n=256, seed=8):
  """f32 values between two bf16 neighbours, 1/4 .. 3/4 of the way from one to the next."""
  rng = np.random.default_rng(seed)
  w = np.asarray(jnp.asarray(rng.normal(0, 0.05, n), jnp.bfloat16).astype(jnp.float32))
  frac = rng.uniform(0.25, 0.75, n)  # of the way to w's next bf16 away from zero
  bits = w.view(np.uint32) + (frac * 0x10000).astype(np.uint32)
  return bits.view(np.float32)


def test_the_step_key_sets_the_rounding():
  """Rounding a step's W + ΔW depends on the step's key through `rounding_key`: the same
  step rounds the same way (a resumed step), another step another way. Each value here is
  rounded up with probability p in [1/4, 3/4], so two keys round all 256 alike with
  probability <= (p² + (1 − p)²)^256 <= 0.625^256 ~ 1e-52: a difference is certain unless the
  key stops mattering (a constant rounding key, SR ignoring its key, or nearest rounding)."""
  sc = steps.StepConfig(4, 1, 1, True, 'jvp', 3.0, 0.0)
  x = jnp.asarray(between_neighbours())
  step_key = lambda t: jax.random.fold_in(jax.random.key(0), t)  # the trainer's key of step t
  rounded = lambda t: np.asarray(upd.stochastic_round_bf16(
      x, step_rounding.rounding_key(sc, step_key(t))).astype(jnp.float32))
  np.testing.assert_array_equal(rounded(5), rounded(5))
  assert not np.array_equal(rounded(5), rounded(6))
  lo, hi = neighbours(np.asarray(x))
  assert np.all(lo != hi) and np.all((rounded(5) == lo) | (rounded(5) == hi))
  # The rounding key is not the step key itself (whose other use is the sparse mask): the
  # bits drawn from the two differ.
  data = lambda k: np.asarray(jax.random.key_data(k))
  assert not np.array_equal(data(step_rounding.rounding_key(sc, step_key(5))),
                            data(step_key(5)))
  direct = np.asarray(upd.stochastic_round_bf16(x, step_key(5)).astype(jnp.float32))
  assert not np.array_equal(direct, rounded(5))


@pytest.mark.parametrize('name', ['adam', 'lora'])
def test_bf16_params_are_refused_for_dense_updates(name):
  cfg = config_lib.default_config()
  cfg.optim.name, cfg.model.param_dtype = name, 'bfloat16'
  with pytest.raises(ValueError, match=rf"model\.param_dtype=bfloat16 with optim\.name='{name}'"):
    config_lib.from_config_dict(cfg)
  cfg.model.param_dtype = 'float32'
  config_lib.from_config_dict(cfg)



def _tiny_bf16_step(rounding):
  """A LoGRA step on a tiny bf16-param model from fixed inputs: key -> (params, metrics).

  The relative step is the paper's (6e-5), below bf16's spacing (2^-8 .. 2^-7 relative), so
  rounding to nearest leaves nearly every entry where it was and SR moves an entry with
  probability |ΔW| / ulp."""
  mc = get_preset('tiny', vocab_size=16, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=2, num_kv_heads=1, max_position_embeddings=16,
                  dtype='float32', param_dtype='bfloat16')
  opt = optimizers.logra_optimizer(
      OptimSection(logra=LograSection(learning_rate=1.0, update_ratio=6e-5)), 10)
  sc = steps.StepConfig(2, 1, 2, False, 'jvp', 3.0, 0.0, telemetry_every=0,
                        param_rounding=rounding)
  loss = rl_losses.LossConfig('reinforce_tis', (('cap', 2.0),))
  proj = steps.ProjectionSpec(4)
  step = steps.make_logra_step(Transformer(mc), loss, opt, sc, proj)
  params = init_params(mc, jax.random.key(0))
  probes = sketch.zero_probes(params, steps.draw_projections(params, 0, 0, proj))
  tokens = np.random.default_rng(9).integers(1, 16, (4, 4)).astype(np.int32)
  batch = dict(tokens=tokens, mask=np.ones((4, 4), bool), targets=tokens[:, 2:],
               target_mask=np.ones((4, 2), np.float32),
               behaviour_logp=np.full((4, 2), -np.log(16), np.float32),
               advantages=np.array([1.0, -1.0, 0.5, -0.5], np.float32))
  u32 = np.uint32(0)

  def run(key):
    copy = jax.tree.map(jnp.copy, params)  # the step donates its params
    new, _, metrics = step(copy, opt.init(probes), batch, u32, u32, np.float32(1e-3), key,
                           telemetry=False)
    assert float(metrics['skipped']) == 0
    return new
  return run, params


def _kernels(params):
  """The layers' bf16 kernels, those LoGRA updates (lm_head is not sketched), as f32."""
  flat = [(jax.tree_util.keystr(kp), x) for kp, x in jax.tree_util.tree_leaves_with_path(params)]
  return [np.asarray(x.astype(jnp.float32)) for path, x in flat
          if path.startswith("['layers']") and 'kernel' in path and x.dtype == jnp.bfloat16]


def test_the_logra_step_rounds_bf16_params_with_its_key():
  """The step's key reaches the apply and its bits set the stored bf16 weights: the same key
  gives the same weights (a resumed step), another key other weights; with 'nearest' the key
  does not matter. (This step has no other randomness: no sparse mask, no KL probe.) Each of
  the 7 kernels (2,048 to 4,096 entries) has tens to hundreds of entries moved (28 to 348
  seen), each with probability |ΔW| / ulp, so two keys moving the same ones in a kernel is
  beyond any chance. The key is the trainer's fold_in(key(seed), t)."""
  run, params = _tiny_bf16_step('stochastic')
  k5, k6 = (jax.random.fold_in(jax.random.key(0), t) for t in (5, 6))
  a, again, b = (_kernels(run(k)) for k in (k5, k5, k6))
  before = _kernels(params)
  assert len(before) == 7 and all(np.array_equal(x, y) for x, y in zip(a, again))
  assert all(not np.array_equal(x, y) for x, y in zip(a, before))  # SR moved every kernel
  assert all(not np.array_equal(x, y) for x, y in zip(a, b))  # each by the key's bits
  run, _ = _tiny_bf16_step('nearest')
  assert all(np.array_equal(x, y) for x, y in zip(_kernels(run(k5)), _kernels(run(k6))))
