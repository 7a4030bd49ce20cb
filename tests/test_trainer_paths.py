"""The loop's RL paths on the tiny task: a reward signal that drives the policy gradient, every
advantage estimator and policy loss of the configs with an exact resume, the KL probe's rows,
the rollout engine key. The runs are tests/trainer_runs.py's (format reward, no entropy)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
import pytest

from logra_jax.train import config as config_lib
from logra_jax.train import loop
from logra_jax.train.steps import kl_probe
from logra_jax.train.fleet import FleetGenerator
from trainer_runs import (assert_same_run, format_reward, make_config, quiet,  # noqa: F401
                          run_and_resume, trees_differ, xla_cache)


def test_format_reward_gives_advantages_and_the_policy_gradient_moves_the_weights(tmp_path):
  """One dense-Adam step: rewards vary inside GRPO groups, so advantages are non-zero, the
  policy loss is non-zero and (no entropy or KL term) its gradient alone moves the weights."""
  cfg = make_config(optim__name='adam', total_steps=1)
  g = cfg.data.samples_per_prompt
  with jax.enable_x64(False):
    trainer = loop.Trainer(cfg, str(tmp_path), log=quiet)
  seen = []
  real_update = trainer.estimator.update

  def update(rewards, state, group_size):  # records what the loop computes, changes nothing
    adv, state = real_update(rewards, state, group_size=group_size)
    seen.append((np.asarray(rewards), np.asarray(adv)))
    return adv, state

  trainer.estimator = trainer.estimator._replace(update=update)
  before = jax.device_get(trainer.state['params'])
  try:
    with jax.enable_x64(False):
      row = trainer.train_step()
  finally:
    trainer.close()
  (rewards, adv), = seen
  varies = np.ptp(rewards.reshape(-1, g), axis=1) > 0
  assert varies.any(), rewards
  adv_PxG = adv.reshape(-1, g)
  assert np.all(np.abs(adv_PxG[varies]) > 0.1) and np.all(adv_PxG[~varies] == 0), adv
  assert row['loss/policy'] != 0.0 and row['loss'] == row['loss/policy'], row
  # Adam's first step is -lr·g/(|g| + eps) per weight: the weights move where g != 0.
  assert trees_differ(before, trainer.state['params'])


# Each advantage estimator and policy loss of the configs; the paper's running baseline with
# LoGRA (the paper's method), the others with dense Adam (fewer programs to compile).
PATHS = {
    'running_baseline': dict(rl__advantage='running_baseline'),
    'rloo': dict(rl__advantage='rloo', optim__name='adam'),
    'reinforce_pp': dict(rl__advantage='reinforce_pp', optim__name='adam'),
    'ppo_clip': dict(rl__loss='ppo_clip', optim__name='adam'),
    # LoGRA with the unsketched leaves trained by Adam (optim.logra.rest_learning_rate) and
    # per-entry sketch Adam with A redrawn at step 2: the (sketch, rest) optimizer state pair
    # checkpoints and resumes, its second moments through a change of A.
    'logra_rest': dict(optim__logra__rest_learning_rate=1e-3,
                       optim__logra__sketch_optimizer='adam', optim__logra__refresh_every=2),
    # An adaptive subspace (A in the state, rebuilt from the co-sketch at steps 2 and 3: refresh
    # every 2 steps would rebuild at 2 only, so every step; two random rows of the 64).
    'logra_adaptive': dict(optim__logra__subspace='adaptive', optim__logra__refresh_every=1,
                           optim__logra__subspace_random_rows=2),
}


@pytest.mark.slow
@pytest.mark.parametrize('path', PATHS)
def test_advantage_and_loss_paths_run_and_resume_exactly(path, tmp_path):
  """3 steps uninterrupted == 1 step, stop, resume to 3: metrics, weights, optimizer and
  advantage state identical; the path's loss ran and its gradient was non-zero."""
  make = lambda **kw: make_config(**{'total_steps': 3, 'eval_every': 1, **PATHS[path], **kw})
  full, full_rows, resumed, rows = run_and_resume(make, tmp_path, stop_at=1)
  assert_same_run(full, full_rows, resumed, rows)
  assert any(r['loss/policy'] != 0.0 for r in rows[1:])
  ppo = PATHS[path].get('rl__loss') == 'ppo_clip'
  # Each loss writes its own per-token metric: the clip fraction or the capped IS fraction.
  assert all(('ppo_clipped' in r, 'is_capped' in r) == (ppo, not ppo) for r in rows[1:])
  # Norm scales start at exactly 1: they move under dense Adam and LoGRA with a trained rest,
  # never under LoGRA alone (it sketches the projections only).
  scales = [x for k, x in traverse_util.flatten_dict(resumed.state['params']).items()
            if k[-1] == 'scale']
  trains_rest = path == 'logra_rest' or PATHS[path].get('optim__name') == 'adam'
  assert any(np.any(np.asarray(x) != 1.0) for x in scales) == trains_rest
  if path == 'logra_adaptive':
    # A lives in the state, rebuilt at each step: orthogonal rows of norm √(K/R), not the
    # seed's (which has ±1 entries), and the A before it kept for the moments' transfer.
    a = traverse_util.flatten_dict(jax.device_get(resumed.state['projections']))
    prev = traverse_util.flatten_dict(jax.device_get(resumed.state['prev_projections']))
    for p, x in a.items():
      r, k = x.shape[-2:]
      for layer in x.reshape(-1, r, k):
        np.testing.assert_allclose(layer @ layer.T, (k / r) * np.eye(r), atol=1e-3 * k / r)
      assert not np.allclose(np.abs(x), 1.0) and not np.allclose(x, prev[p]), p
  if path == 'running_baseline':
    # b_1 = mean r_1 (no previous batch), b_{t+1} = (1 − ema) b_t + ema·mean r_t. The loop's
    # baseline is float32 (rewards 1 and -0.01): 1e-6 relative covers its rounding.
    ema, b = full.cfg.rl.baseline_ema, rows[1]['reward_mean']
    for r in rows[2:]:
      b = (1 - ema) * b + ema * r['reward_mean']
    assert int(resumed.adv_state.count) == 3
    np.testing.assert_allclose(float(resumed.adv_state.value), b, rtol=1e-6)


def test_kl_probe_takes_rows_of_different_prompts():
  """Rows i·N//n: the probe sees min(n, prompts) prompts' groups, not the first prompt's."""
  def prompts_of(n_prompts, g, n):
    batch = {'row': jnp.arange(n_prompts * g), 'x_NxT': jnp.arange(2 * n_prompts * g)
             .reshape(-1, 2)}
    sub = jax.jit(lambda b: kl_probe.kl_subset(b, n))(batch)
    rows = np.asarray(sub['row'])
    np.testing.assert_array_equal(np.asarray(sub['x_NxT']), np.asarray(batch['x_NxT'])[rows])
    return rows.tolist(), set(rows // g)

  cfg = make_config()  # the trainer tests' and configs/tiny.py's shape: 4 probe rows
  rows, prompts = prompts_of(cfg.data.prompts_per_step, cfg.data.samples_per_prompt,
                             cfg.optim.kl_sequences)
  assert rows == [0, 4, 8, 12] and prompts == {0, 1, 2, 3}
  assert prompts_of(32, 8, 4)[1] == {0, 8, 16, 24}      # configs/tiny.py: 32 prompts x 8
  assert prompts_of(2, 4, 4) == ([0, 2, 4, 6], {0, 1})  # fewer prompts than probe rows
  assert prompts_of(3, 2, 4)[0] == [0, 1, 3, 4]  # N = 6 not a multiple of n
  assert len(prompts_of(128, 1, 8)[1]) == 8             # the paper: 128 prompts x 1
  assert prompts_of(2, 2, 8)[0] == [0, 1, 2, 3]  # n >= N: the whole batch


def test_rollout_engine_is_read_by_the_loop_and_an_unknown_one_is_named(tmp_path, monkeypatch):
  assert set(loop.GENERATORS) == set(config_lib.CHOICES['rollout.engine'])
  assert make_config().rollout.engine == 'embedded'
  assert loop.generator_class('http') is FleetGenerator
  # An engine the config accepts but the loop lacks fails in the Trainer, naming the key.
  monkeypatch.setitem(config_lib.CHOICES, 'rollout.engine', ('embedded', 'http', 'grpc'))
  cfg = make_config(rollout__engine='grpc')
  with pytest.raises(ValueError, match=r"rollout\.engine='grpc'.*known: \['embedded', 'http'\]"):
    loop.Trainer(cfg, str(tmp_path), log=quiet)
  assert not (tmp_path / 'checkpoints').exists()
