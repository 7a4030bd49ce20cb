import jax
import jax.numpy as jnp
import numpy as np
import pytest

from logra_jax.rl import advantages as adv_lib

# float32, as the trainer runs them (rewards arrive as float32). Each expected value is a few
# float32 operations on exact or nearly exact inputs: rounding error ≤ ~4 ulp, so rtol 1e-6
# (≈ 8 ulp at 2^-23 ≈ 1.2e-7) separates rounding from any arithmetic slip (≥ 1e-3 here).
F32 = 1e-6


def test_running_baseline_uses_previous_batches_only():
  est = adv_lib.get_advantage_fn('running_baseline', ema=0.1)
  state = est.init()
  # Batch 0: no previous batch, so b_0 = mean(r_0) = (1 - .01 - .01 + 1) / 4 = 0.495.
  # A = r - 0.495 = [.505, -.505, -.505, .505]; state after it: b_1 = 0.495.
  a, state = est.update(jnp.array([1.0, -0.01, -0.01, 1.0]), state)
  np.testing.assert_allclose(a, [0.505, -0.505, -0.505, 0.505], atol=1e-6)
  np.testing.assert_allclose(state.value, 0.495, atol=1e-6)
  # Batch 1: mean 0.7475 but A = r - b_1 = r - 0.495 (the batch itself is not used);
  # b_2 = 0.9 * 0.495 + 0.1 * 0.7475 = 0.4455 + 0.07475 = 0.52025.
  a, state = est.update(jnp.array([1.0, 1.0, 1.0, -0.01]), state)
  np.testing.assert_allclose(a, [0.505, 0.505, 0.505, -0.505], atol=1e-6)
  np.testing.assert_allclose(state.value, 0.52025, atol=1e-6)
  # Batch 2: A = 0 - 0.52025; b_3 = 0.9 * 0.52025 + 0.1 * 0 = 0.468225.
  a, state = est.update(jnp.array([0.0, 0.0]), state)
  np.testing.assert_allclose(a, [-0.52025, -0.52025], atol=1e-6)
  np.testing.assert_allclose(state.value, 0.468225, atol=1e-6)
  assert int(state.count) == 3


def test_running_baseline_jits_without_recompiling():
  est = adv_lib.get_advantage_fn('running_baseline')
  traces = []

  def step(r, s):
    traces.append(1)
    return est.update(r, s)

  step = jax.jit(step)
  s = est.init()
  for _ in range(3):
    a, s = step(jnp.ones(4), s)
  assert len(traces) == 1
  np.testing.assert_allclose(a, 0.0)


def test_grpo_by_hand():
  # Group [1,0,0,0]: mean .25, squared deviations .5625 + 3 * .0625 = .75, var (ddof 1)
  # = .75 / 3 = .25, std .5 -> A = [.75, -.25, -.25, -.25] / .5 = [1.5, -.5, -.5, -.5].
  # Group [1,1,1,1]: std 0 -> A = 0 / eps = 0.
  # Group [2,4] (G=2 case below): mean 3, std sqrt(2) -> -+1/sqrt(2).
  r = jnp.array([1.0, 0, 0, 0, 1, 1, 1, 1])
  est = adv_lib.get_advantage_fn('grpo', eps=1e-12)
  a, _ = est.update(r, est.init(), group_size=4)
  assert a.dtype == jnp.float32
  np.testing.assert_allclose(a, [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], rtol=F32, atol=F32)
  a = adv_lib.grpo_advantages(jnp.array([2.0, 4.0]), group_size=2, eps=0.0)
  np.testing.assert_allclose(a, [-1 / np.sqrt(2), 1 / np.sqrt(2)], rtol=F32)


def test_rloo_by_hand():
  # [1,0,0,0]: A_0 = 1 - (0+0+0)/3 = 1; A_j = 0 - (1+0+0)/3 = -1/3.
  # [3,1,2]:   A = [3 - 1.5, 1 - 2.5, 2 - 2] = [1.5, -1.5, 0].
  a = adv_lib.rloo_advantages(jnp.array([1.0, 0, 0, 0]), group_size=4)
  np.testing.assert_allclose(a, [1, -1 / 3, -1 / 3, -1 / 3], rtol=F32)
  a = adv_lib.rloo_advantages(jnp.array([3.0, 1, 2]), group_size=3)
  np.testing.assert_allclose(a, [1.5, -1.5, 0.0], atol=F32)


def test_reinforce_pp_by_hand():
  # r = [1,0,0,0,1,1,1,1]: mean 5/8, var = p(1-p) = 15/64, std = sqrt(15)/8.
  # A(1) = (3/8) / (sqrt(15)/8) = 3/sqrt(15); A(0) = -5/sqrt(15).
  r = jnp.array([1.0, 0, 0, 0, 1, 1, 1, 1])
  est = adv_lib.get_advantage_fn('reinforce_pp', eps=0.0)
  a, _ = est.update(r, est.init(), group_size=4)
  s = np.sqrt(15.0)
  np.testing.assert_allclose(a, [3 / s, -5 / s, -5 / s, -5 / s, 3 / s, 3 / s, 3 / s, 3 / s],
                             rtol=F32)


def test_errors_are_clear():
  with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*grpo"):
    adv_lib.get_advantage_fn('ppo')
  with pytest.raises(ValueError, match='group_size >= 2'):
    adv_lib.grpo_advantages(jnp.ones(4), group_size=1)
  with pytest.raises(ValueError, match='multiple of group_size'):
    adv_lib.rloo_advantages(jnp.ones(5), group_size=2)


# The rollout types have no test file of their own; their checks live here.
def test_rollout_types_validate():
  from logra_jax.rl import types  # pylint: disable=g-import-not-at-top
  params = types.SamplingParams(n=4, stop_token_ids=[2])
  assert params.stop_token_ids == (2,)
  with pytest.raises(ValueError, match='top_p'):
    types.SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match='n \\(samples per prompt\\)'):
    types.SamplingParams(n=0)
  req = types.GenerationRequest(prompt_token_ids=[1, 4], params=params, request_id='r')
  assert req.prompt_token_ids == (1, 4)
  with pytest.raises(ValueError, match="request 'e': prompt_token_ids is empty"):
    types.GenerationRequest(prompt_token_ids=[], request_id='e')
  ok = dict(request_id='r', sample_index=0, prompt_token_ids=[1], completion_token_ids=[5, 2],
            behaviour_logprobs=[-0.1, -0.2], finish_reason='stop', weight_version=3)
  assert types.GenerationResult(**ok).behaviour_logprobs == (-0.1, -0.2)
  with pytest.raises(ValueError, match='1 behaviour log-probs for 2 completion tokens'):
    types.GenerationResult(**dict(ok, behaviour_logprobs=[-0.1]))
  with pytest.raises(ValueError, match='finish_reason'):
    types.GenerationResult(**dict(ok, finish_reason='eos'))

  class Mock:
    weight_version = 0

    def generate(self, requests):
      return []

  assert isinstance(Mock(), types.Generator)
