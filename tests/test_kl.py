"""Predicted KL (JVP and finite difference) against the true KL of the perturbed model."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax import sketch
from logra_jax.analysis.tiny_lm import TinyLM, init_params

# float64 throughout: the predicted KL is compared with the true KL at α down to 1e-4, where
# the KL is ~1e-9 and float32 rounding would swamp the O(α) error being measured.
pytestmark = pytest.mark.usefixtures('x64_module')


def test_kl_coefficient_by_hand():
  # Two tokens, uniform p (z = 0), ż = (1, -1): Var = 1, q = 1/(2·1·T²) with T = 2 → 1/8.
  q = sketch.kl_coefficient(jnp.zeros((1, 2)), jnp.array([[1.0, -1.0]]), 2.0)
  np.testing.assert_allclose(q, 1 / 8)
  # A constant shift of all logits changes nothing; a masked-out position is ignored.
  z = jnp.array([[0.3, -1.0, 2.0], [5.0, 1.0, 0.0]])
  zd = jnp.array([[1.0, 2.0, -1.0], [7.0, 7.0, 7.0]])
  np.testing.assert_allclose(
      sketch.kl_coefficient(z, zd, 1.0, jnp.array([1.0, 0.0])),
      sketch.kl_coefficient(z[:1], zd[:1] + 3.0))
  # Huge logits stay finite.
  assert np.isfinite(sketch.kl_coefficient(jnp.array([[1e4, -1e4]]), jnp.array([[1.0, 0.0]])))


@pytest.fixture(scope='module')
def perturbed():
  model = TinyLM(vocab=13, d=8, f=12, layers=2, dtype=jnp.float64)
  tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, 13)
  params = init_params(model, jax.random.key(0), tokens)
  a = sketch.make_projections(params, 1, 0, 4, dtype=jnp.float64)
  probes = sketch.zero_probes(params, a)
  u = jax.tree.map(lambda p: jax.random.normal(jax.random.key(5), p.shape), probes)
  lin = model.clone(sketch_mode='linear')
  logits_fn = lambda p: lin.apply(sketch.sketch_variables(params, a, p), tokens)

  def true_kl(alpha):
    moved = sketch.apply_sketch_updates(params, u, a, alpha)
    return sketch.mean_kl(model.apply({'params': params}, tokens),
                          model.apply({'params': moved}, tokens))
  return logits_fn, probes, u, true_kl


def test_predicted_kl_error_shrinks_linearly_and_budget_is_met(perturbed):
  logits_fn, probes, u, true_kl = perturbed
  q = sketch.predicted_kl_coefficient(logits_fn, probes, u)
  errs = [abs(q * a**2 / true_kl(a) - 1) for a in (1e-2, 1e-3, 1e-4)]
  # KL = α²q + O(α³): the relative error is O(α), so each 10x smaller α cuts it ~10x.
  for big, small in zip(errs, errs[1:]):
    assert 7 < big / small < 13
  budget = 1e-4
  alpha = sketch.step_scale(q, budget, alpha_max=1e3)
  assert abs(true_kl(alpha) / budget - 1) < 0.03  # the authors' own bar


def test_finite_difference_probe_agrees(perturbed):
  logits_fn, probes, u, _ = perturbed
  q = sketch.predicted_kl_coefficient(logits_fn, probes, u)
  q_fd = sketch.finite_difference_kl_coefficient(logits_fn, probes, u, eps=1e-4)
  np.testing.assert_allclose(q_fd, q, rtol=1e-2)  # O(ε·|u|) term; see the linearity test


def test_step_scale_rules():
  np.testing.assert_allclose(sketch.step_scale(4.0, 1.0, 3.0), 0.5)
  np.testing.assert_allclose(sketch.step_scale(1e-9, 1.0, 3.0), 3.0)
  assert float(sketch.step_scale(0.0, 1e-4)) == 1.0
  with pytest.raises(ValueError, match='finite'):
    sketch.step_scale(float('nan'), 1e-4)
  with pytest.raises(ValueError, match='finite'):
    sketch.step_scale(-1.0, 1e-4)
  assert np.isnan(jax.jit(sketch.step_scale)(jnp.array(-1.0), 1e-4))


def test_budget_schedule_and_mismatch_floor():
  sched = sketch.kl_budget_schedule()
  np.testing.assert_allclose([sched(0), sched(150), sched(300)], [2e-4, 1.1e-4, 2e-5])
  np.testing.assert_allclose(sketch.effective_budget(2e-4, 5e-5), 1.5e-4)
  np.testing.assert_allclose(sketch.effective_budget(2e-4, 5e-4), 1e-4)
