import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.rl import losses

# Hand-derived values compared at 1e-12: float64 for every test of this module.
pytestmark = pytest.mark.usefixtures('x64')

LOGP = np.array([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
BEHAV = np.array([[-1.0, -2.5, -3.0], [-1.2, -0.9, -1.0]])
ADV = np.array([1.0, -2.0])
MASK = np.array([[1, 1, 1], [1, 1, 0]])
# Importance ratios exp(logp - behav):
#   row 0: [e^0, e^0.5, e^2.5] = [1, 1.64872, 12.18]  -> capped at 2: [1, 1.64872, 2]
#   row 1: [e^0.2, e^-0.1, e^0] = [1.22140, 0.904837, 1]   (last token is padding)
RHO = np.array([[1.0, np.exp(0.5), 2.0], [np.exp(0.2), np.exp(-0.1), 1.0]])


def _policy_loss(logp, mode, **hp):
  per_token, _ = losses.reinforce_tis(logp, BEHAV, ADV, **hp)
  return losses.aggregate(per_token, MASK, mode)


def test_reinforce_tis_token_gradient_and_cap():
  # l_bt = -sg(rho_bt) A_b logp_bt; token mean over 5 valid tokens, so
  # dL/dlogp_bt = -rho_bt A_b m_bt / 5: row 0 = -[1, 1.64872, 2] / 5,
  # row 1 = +2 [1.22140, 0.904837, 0] / 5. The ratio carries no gradient (stop-gradient).
  grad = jax.grad(_policy_loss)(LOGP, 'token')
  expected = -RHO * np.asarray(ADV)[:, None] * np.asarray(MASK) / 5.0
  np.testing.assert_allclose(grad, expected, rtol=1e-12)
  assert grad.dtype == jnp.float64
  # Value: -(1*-1 + 1.64872*-2 + 2*-.5 - 2*(1.22140*-1 + .904837*-1)) / 5.
  value = -(-1 - 2 * np.exp(0.5) - 1 + 2 * (np.exp(0.2) + np.exp(-0.1))) / 5
  np.testing.assert_allclose(_policy_loss(LOGP, 'token'), value, rtol=1e-12)


def test_reinforce_tis_sequence_aggregation_and_no_cap():
  # Sequence mean: row 0 averages over 3 tokens, row 1 over 2, then the mean of 2 rows:
  # dL/dlogp_bt = -rho_bt A_b m_bt / (n_b * 2), n = [3, 2]. No cap: rho_02 = e^2.5.
  grad = jax.grad(_policy_loss)(LOGP, 'sequence', cap=None)
  rho = RHO.copy()
  rho[0, 2] = np.exp(2.5)
  expected = -rho * np.array([[1.0], [-2.0]]) * np.asarray(MASK) / (np.array([[3.0], [2.0]]) * 2)
  np.testing.assert_allclose(grad, expected, rtol=1e-12)


def test_reinforce_tis_metrics():
  _, m = losses.reinforce_tis(LOGP, BEHAV, ADV, cap=2.0)
  # One of 5 valid tokens has a ratio above 2 (e^2.5); the padded token is ignored.
  np.testing.assert_allclose(losses.aggregate(m['is_capped'], MASK), 0.2)


def test_ppo_clip_four_cases():
  # eps = 0.2. Ratios exp(logp - behav) = [1.5, 0.5, 1.5, 0.5]; A = [1, 1, -1, -1].
  #  A>0, rho 1.5: min(1.5, 1.2) = 1.2 clipped constant        -> grad 0
  #  A>0, rho 0.5: min(0.5, 0.8) = 0.5 = rho A, d rho = rho    -> grad -0.5
  #  A<0, rho 1.5: min(-1.5, -1.2) = -1.5 = rho A              -> grad +1.5
  #  A<0, rho 0.5: min(-0.5, -0.8) = -0.8 clipped constant     -> grad 0
  rho = jnp.array([[1.5], [0.5], [1.5], [0.5]])
  behav = jnp.zeros((4, 1))
  adv = jnp.array([1.0, 1.0, -1.0, -1.0])

  def loss(logp):
    per_token, _ = losses.ppo_clip(logp, behav, adv, clip_eps=0.2)
    return jnp.sum(per_token)

  grad = jax.grad(loss)(jnp.log(rho))
  np.testing.assert_allclose(grad[:, 0], [0.0, -0.5, 1.5, 0.0], atol=1e-12)
  _, m = losses.ppo_clip(jnp.log(rho), behav, adv, clip_eps=0.2)
  np.testing.assert_allclose(m['ppo_clipped'][:, 0], [1, 0, 0, 1])


def test_token_logprobs_and_entropy():
  # z = log [1, 2, 3]: p = [1, 2, 3] / 6. log p(target 2) = log(1/2).
  # d log p_y / dz = onehot(y) - p = [-1/6, -1/3, 1/2].
  z = jnp.log(jnp.array([[[1.0, 2.0, 3.0]]]))
  y = jnp.array([[2]])
  np.testing.assert_allclose(losses.token_logprobs(z, y), [[np.log(0.5)]], rtol=1e-12)
  grad = jax.grad(lambda z: losses.token_logprobs(z, y).sum())(z)
  np.testing.assert_allclose(grad[0, 0], [-1 / 6, -1 / 3, 1 / 2], rtol=1e-12)
  # Temperature 2: p ∝ sqrt([1, 2, 3]) -> log p_2 = log(sqrt3 / (1 + sqrt2 + sqrt3)).
  expected = np.log(np.sqrt(3) / (1 + np.sqrt(2) + np.sqrt(3)))
  np.testing.assert_allclose(losses.token_logprobs(z, y, 2.0), [[expected]], rtol=1e-12)
  # Entropy: uniform over 4 -> log 4; p = [1,2,3]/6 -> -sum p log p.
  np.testing.assert_allclose(losses.token_entropy(jnp.zeros((1, 1, 4))), [[np.log(4)]])
  p = np.array([1, 2, 3]) / 6
  np.testing.assert_allclose(losses.token_entropy(z), [[-(p * np.log(p)).sum()]], rtol=1e-12)


def test_kl_k3_value_and_gradient():
  # d = ref - logp = 0.5: k3 = e^.5 - .5 - 1 = 0.148721; d k3 / d logp = 1 - e^.5.
  logp, ref = jnp.array([[-1.0, -1.0]]), jnp.array([[-0.5, -1.0]])
  np.testing.assert_allclose(losses.kl_k3(logp, ref), [[np.exp(0.5) - 1.5, 0.0]], atol=1e-12)
  grad = jax.grad(lambda l: losses.kl_k3(l, ref).sum())(logp)
  np.testing.assert_allclose(grad, [[1 - np.exp(0.5), 0.0]], atol=1e-12)


def test_rl_loss_composes_the_terms():
  key = jax.random.PRNGKey(0)
  logits = jax.random.normal(key, (2, 3, 5), jnp.float64)
  targets = jnp.array([[0, 1, 2], [3, 4, 0]])
  ref = BEHAV - 0.1
  cfg = losses.LossConfig(entropy_coef=0.01, kl_coef=0.05, aggregation='sequence')
  loss, metrics = losses.rl_loss(cfg, logits, targets, BEHAV, ADV, MASK, ref)
  logp = losses.token_logprobs(logits, targets)
  per_token = (losses.reinforce_tis(logp, BEHAV, ADV, cap=2.0)[0]
               + 0.05 * losses.kl_k3(logp, ref) - 0.01 * losses.token_entropy(logits))
  np.testing.assert_allclose(loss, losses.aggregate(per_token, MASK, 'sequence'), rtol=1e-12)
  assert {'loss', 'loss/policy', 'kl_ref', 'entropy', 'is_ratio', 'is_capped'} <= set(metrics)
  with pytest.raises(ValueError, match='needs ref_logp'):
    losses.rl_loss(cfg, logits, targets, BEHAV, ADV, MASK)


def test_config_and_registry_errors():
  assert losses.get_policy_loss('ppo_clip') is losses.ppo_clip
  with pytest.raises(ValueError, match=r"unknown policy loss 'grpo'.*reinforce_tis"):
    losses.get_policy_loss('grpo')
  with pytest.raises(ValueError, match='aggregation'):
    losses.LossConfig(aggregation='sum')
  with pytest.raises(ValueError, match='aggregation'):
    losses.aggregate(jnp.ones((1, 1)), jnp.ones((1, 1)), 'sum')
