"""The trainer on a fleet (`rollout.engine='http'`): launched JAX-engine servers over HTTP.

The fleet samples with the same per-request seeds as the embedded sampler, and its weights
are the trainer's (a full sync at start, then low-rank blobs rebuilt from the seed), so the
run is the embedded run: the same rollouts, rewards and evaluations, step for step, and the
loss to float32 rounding of the behaviour log-probs (`loss_atol`: the generators' weights are
the trainer's to ~1e-9, so their behaviour log-probs differ in the last bits).
"""
import json

import jax
import numpy as np
import pytest

from logra_jax.models.generator import JaxGenerator
from logra_jax.train import fleet, loop, tasks
from logra_jax.train.rollout import Rollouts
from trainer_runs import (assert_same_run, format_reward, make_config,  # noqa: F401
                          read_metrics, run_and_resume, train, xla_cache)


# Behaviour log-probs from generators whose weights equal the trainer's to ~1e-9 (below
# float32's 6e-8) differ by the rounding of a float32 forward: a few ulps of a log-prob of
# size <= 8 (ulp 9.5e-7). 4 ulps:
BEHAVIOUR_LOGP_ROUNDING = 4e-6


def loss_atol(row, cfg) -> float:
  """How far two runs' losses may differ when only their behaviour log-probs differ by
  rounding, |Δ_t| <= BEHAVIOUR_LOGP_ROUNDING.

  The loss is a token mean of ℓ_t = -ρ_t A_b logp_t, ρ_t = min(exp(logp_t - logp^β_t), cap),
  a sum that cancels (GRPO's A sums to 0 in each group), so its relative error is unbounded
  and an rtol tests nothing (rtol 1e-5 failed at 1.67e-5 on one stream). A behaviour
  log-prob moved by Δ_t moves ρ_t by at most ρ_t·|Δ_t| (first order; ρ_t only falls at the
  cap), so |Δloss| <= max|Δ| · mean_t |ρ_t A_b logp_t|
                   <= max|Δ| · cap · max|A| · mean_t(-logp_t),
  the scale of the sum's terms, not of the sum. GRPO with ddof=1 over G: |A| <= (G - 1)/√G
  (one reward apart from the others). mean_t(-logp_t) of the sampled tokens estimates the
  policy's entropy (logged as ``entropy``); twice it covers that estimate's scatter. Rounding
  of the token mean itself (64 terms, ~64·6e-8 relative to the terms) is below this.
  """
  assert cfg.rl.advantage == 'grpo', cfg.rl.advantage  # the bound on |A| below is GRPO's
  g = cfg.data.samples_per_prompt
  a_max = (g - 1) / np.sqrt(g)
  return BEHAVIOUR_LOGP_ROUNDING * cfg.rl.tis_cap * a_max * 2 * row['entropy']


@pytest.mark.slow
def test_fleet_run_equals_the_embedded_run_and_resumes(tmp_path):
  make = lambda **kw: make_config(**{'total_steps': 3, 'eval_every': 1,
                                     'rollout__engine': 'http', 'rollout__launch': 2,
                                     'rollout__drift_check_every': 1, **kw})
  embedded = train(make(rollout__engine='embedded', rollout__launch=0), tmp_path / 'embedded')
  full, full_rows, resumed, rows = run_and_resume(make, tmp_path, stop_at=1)
  emb_rows = read_metrics(tmp_path / 'embedded')
  # Same rollouts and evaluations as in process (weights equal to ~1e-9, same seeds).
  for fleet_row, emb_row in zip(full_rows, emb_rows):
    for key in ('reward_mean', 'accuracy', 'response_length', 'eval_accuracy'):
      assert fleet_row.get(key) == emb_row.get(key), (fleet_row['step'], key)
    if fleet_row['step']:
      np.testing.assert_allclose(fleet_row['loss'], emb_row['loss'], rtol=0,
                                 atol=loss_atol(emb_row, embedded.cfg))
  # Every step after the first sent a low-rank update (never full weights) and the generators
  # serve the trainer's weights to fp32 rounding (their fingerprints, asked every step).
  assert all(r['sync_full'] == 0.0 and r['sync_servers'] == 2 for r in full_rows[1:])
  assert all(r['generator_drift'] < 1e-6 and r['generator_resyncs'] == 0
             for r in full_rows[1:])
  # The resumed run repeats the uninterrupted one: the same rollouts, rewards and evaluations
  # exactly. The resumed generators restart from the trainer's exact weights (a full sync)
  # where the uninterrupted ones hold them to ~1e-9, so behaviour log-probs, and
  # with them the loss and the update, agree to float32 rounding rather than bit for bit.
  for row, ref in zip(rows, full_rows):
    for key in ('reward_mean', 'accuracy', 'response_length', 'eval_accuracy'):
      assert row.get(key) == ref.get(key), (row['step'], key)
    if row['step']:
      np.testing.assert_allclose(row['loss'], ref['loss'], rtol=0, atol=loss_atol(ref, full.cfg))
  for x, y in zip(jax.tree.leaves(resumed.state['params']), jax.tree.leaves(full.state['params'])):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ rollout.max_staleness


def _schedule(staleness):
  """(cfg, model config, starting params, Rollouts over a fresh data iterator, requests fn)."""
  cfg = make_config(rollout__max_staleness=staleness)
  task = tasks.build_task(cfg)
  _, mc, params = tasks.build_model(cfg, task)
  requests = lambda records, t: loop._requests(  # pylint: disable=protected-access
      task, records, cfg, t, cfg.data.samples_per_prompt, cfg.rollout.temperature)
  gen = JaxGenerator(mc, params, pad_id=task.pad_id, own_params=staleness > 0)
  return cfg, mc, params, Rollouts(gen, task.train_iter, requests, staleness), requests, task


def _moved(params, scale=0.05):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                   for x, k in zip(leaves, keys)])


def _same_results(a, b):
  assert [(r.completion_token_ids, r.behaviour_logprobs, r.weight_version) for r in a] == [
      (r.completion_token_ids, r.behaviour_logprobs, r.weight_version) for r in b]


def test_stale_batches_come_from_the_weights_before_the_update():
  """max_staleness=1: step 2's batch is generated (during step 1) by version 0, exactly what
  version 0 samples for step 2's requests; a pending batch survives a JSON round trip; a
  batch older than max_staleness is regenerated on the current weights."""
  with jax.enable_x64(False):
    _, mc, params0, rollouts, requests, task = _schedule(1)
    records1, results1, m1 = rollouts.take(1)
    assert m1 == {'staleness_max': 0.0, 'staleness_mean': 0.0, 'stale_regenerated': 0.0}
    params1 = _moved(params0)
    rollouts.wait()
    rollouts.generator.update_weights(params1, 1)
    records2, results2, m2 = rollouts.take(2)  # launches step 3's batch on version 1
    assert m2 == {'staleness_max': 1.0, 'staleness_mean': 1.0, 'stale_regenerated': 0.0}
    assert {r.weight_version for r in results2} == {0}
    by = lambda p, v: JaxGenerator(mc, p, version=v, pad_id=task.pad_id)
    _same_results(results2, by(params0, 0).generate(requests(records2, 2)))
    on_policy = by(params1, 1).generate(requests(records2, 2))
    assert [r.behaviour_logprobs for r in on_policy] != [r.behaviour_logprobs for r in results2]
    # The checkpointed state: data before the pending draw, the pending completions as JSON.
    state, data = json.loads(json.dumps(rollouts.get_state())), rollouts.data_state()
    assert [item['step'] for item in state] == [3]
    _, _, _, fresh, _, _ = _schedule(1)
    fresh.data_iter.set_state(data)
    fresh.set_state(state)
    fresh.generator.update_weights(params1, 2)
    rollouts.wait()
    rollouts.generator.update_weights(params1, 2)
    ref, got = rollouts.take(3), fresh.take(3)
    assert ref[0] == got[0] and ref[2] == got[2] == dict(m2, stale_regenerated=0.0)
    _same_results(ref[1], got[1])
    # Step 4's batch was launched on version 2; at version 4 it is 2 updates old: regenerated.
    rollouts.wait()
    rollouts.generator.update_weights(params0, 4)
    _, results4, m4 = rollouts.take(4)
    assert m4 == {'staleness_max': 0.0, 'staleness_mean': 0.0, 'stale_regenerated': 1.0}
    assert {r.weight_version for r in results4} == {4}
    for r in (rollouts, fresh):
      r.close()
    del records1, results1


def _staleness(rows):
  return [r.get('staleness_max') for r in rows[1:]]


@pytest.mark.slow
def test_stale_runs_embedded_and_on_the_fleet(tmp_path):
  """max_staleness=1: step 1 on-policy, every later step on the samples of the step before;
  the embedded run resumes exactly; the fleet run is the embedded run (same rollouts) and
  resumes to float32 rounding (see the module docstring)."""
  make = lambda **kw: make_config(**{'total_steps': 4, 'eval_every': 2,
                                     'rollout__max_staleness': 1, **kw})
  full, full_rows, resumed, rows = run_and_resume(make, tmp_path / 'embedded', stop_at=2)
  assert_same_run(full, full_rows, resumed, rows)
  assert _staleness(full_rows) == [0.0, 1.0, 1.0, 1.0]
  on_policy = read_metrics(train(make(rollout__max_staleness=0), tmp_path / 'on_policy')
                           .workdir)
  assert _staleness(on_policy) == [0.0] * 4
  # The same data and step 1; then stale behaviour log-probs: the trainer/generator mismatch
  # (KL(behaviour ‖ trainer)) is the one step's policy change instead of rounding (0 here).
  for key in ('reward_mean', 'accuracy', 'loss', 'mismatch'):
    assert full_rows[1][key] == on_policy[1][key], key
  # Measured: on-policy |mismatch| <= 1.2e-9 (the sampler's and the trainer's float32
  # log-probs of the same weights); stale 2.4e-5 .. 5.4e-5. 1e-6 lies 800x above the one and
  # 24x below the other.
  assert all(abs(r['mismatch']) < 1e-6 for r in on_policy[1:])
  assert all(r['mismatch'] > 1e-6 for r in full_rows[2:])
  fleet = lambda **kw: make(**{'rollout__engine': 'http', 'rollout__launch': 2, **kw})
  _, fleet_rows, _, fleet_resumed = run_and_resume(fleet, tmp_path / 'fleet', stop_at=2)
  assert _staleness(fleet_rows) == _staleness(fleet_resumed) == _staleness(full_rows)
  for got in (fleet_rows, fleet_resumed):
    for row, ref in zip(got, full_rows):
      for key in ('reward_mean', 'accuracy', 'response_length', 'eval_accuracy'):
        assert row.get(key) == ref.get(key), (row['step'], key)
      if row['step']:  # behaviour log-probs equal to rounding: `loss_atol` (rtol 1e-5 on
        # this cancelling sum failed at 1.3e-5 once tiny.py's default took momentum)
        np.testing.assert_allclose(row['loss'], ref['loss'], rtol=0,
                                   atol=loss_atol(ref, full.cfg))


def test_max_staleness_is_validated():
  with pytest.raises(ValueError, match=r'rollout\.max_staleness must be >= 0'):
    make_config(rollout__max_staleness=-1)


class _FakeServer:
  """A `subprocess.Popen` stand-in: records the environment a server would start with and
  writes its port file at once."""
  envs = []

  def __init__(self, args, stdout=None, stderr=None, env=None):
    del stdout, stderr
    _FakeServer.envs.append(env)
    port_file = next(a for a in args if a.startswith('--port_file=')).partition('=')[2]
    with open(port_file, 'w') as f:
      f.write('http://127.0.0.1:1')

  def poll(self):
    return None


@pytest.mark.parametrize('trainer_platforms, launch_platform, expected', [
    ('cuda', '', 'cuda'),   # the trainer's JAX_PLATFORMS
    (None, '', None),       # unset: the trainer's backend (jax.default_backend())
    ('cuda', 'cpu', 'cpu'),  # rollout.launch_platform says otherwise
])
def test_launched_servers_get_the_trainers_platform(tmp_path, monkeypatch, trainer_platforms,
                                                    launch_platform, expected):
  """Never JAX_PLATFORMS=cpu unless asked: on a GPU host the servers generate on the GPU."""
  if trainer_platforms is None:
    monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  else:
    monkeypatch.setenv('JAX_PLATFORMS', trainer_platforms)
  monkeypatch.setattr(fleet.subprocess, 'Popen', _FakeServer)
  monkeypatch.setattr(fleet.ServerClient, 'wait_healthy', lambda self, *a, **k: None)
  _FakeServer.envs = []
  urls, _ = fleet.launch_servers('model', 2, 'token', str(tmp_path), platform=launch_platform)
  assert urls == ['http://127.0.0.1:1'] * 2
  want = expected or jax.default_backend()
  assert [e['JAX_PLATFORMS'] for e in _FakeServer.envs] == [want, want]
  # Servers sharing an accelerator with the trainer never preallocate 75% of it each.
  assert all(e['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false' for e in _FakeServer.envs)


def test_fleet_generator_passes_rollout_launch_platform(tmp_path, monkeypatch):
  class Launched(Exception):
    pass

  def launch(*args):
    raise Launched(args[-1])
  monkeypatch.setattr(fleet.hf_io, 'save_hf_checkpoint', lambda directory, *a: directory)
  monkeypatch.setattr(fleet, 'launch_servers', launch)
  cfg = make_config(rollout__engine='http', rollout__launch=1, rollout__launch_platform='tpu')
  with pytest.raises(Launched, match='^tpu$'):
    fleet.FleetGenerator(cfg, str(tmp_path), None, {}, 0)


def test_fleet_generator_passes_rollout_blob_dir_and_timeouts(tmp_path, monkeypatch):
  """rollout.blob_dir (a directory servers on other hosts share) and the client's timeouts
  (rollout.*_timeout_s) reach the client."""
  class Built(Exception):
    pass

  def fleet_cls(urls, token, blob_dir=None, timeouts=None):
    raise Built(blob_dir, timeouts)
  monkeypatch.setenv('LOGRA_BRIDGE_TOKEN', 'token')
  monkeypatch.setattr(fleet, 'Fleet', fleet_cls)
  cfg = make_config(rollout__engine='http', rollout__urls='http://127.0.0.1:1',
                    rollout__blob_dir=str(tmp_path), rollout__connect_timeout_s=3.0,
                    rollout__generation_timeout_s=42.0)
  with pytest.raises(Built) as built:
    fleet.FleetGenerator(cfg, str(tmp_path), None, {}, 0)
  blob_dir, timeouts = built.value.args
  assert blob_dir == str(tmp_path)
  assert timeouts == fleet.client_timeouts(cfg.rollout)
  assert (timeouts.connect_s, timeouts.generation_s) == (3.0, 42.0)


@pytest.mark.slow
def test_an_adaptive_subspace_syncs_low_rank_with_its_a(tmp_path):
  """An adaptive A (optim.logra.subspace='adaptive', rebuilt every step here) is derivable
  from no seed: each low-rank blob carries the A its step applied, and the generator serves
  the trainer's weights to fp32 rounding after every step (its fingerprint, asked each step).
  Seen failing (the drift check) with the blob's A derived from the seed instead."""
  run = train(make_config(total_steps=3, eval_every=3, rollout__engine='http',
                          rollout__launch=1, rollout__drift_check_every=1,
                          optim__logra__subspace='adaptive',
                          optim__logra__subspace_random_rows=8,
                          optim__logra__refresh_every=1), tmp_path)
  rows = [r for r in read_metrics(tmp_path) if r.get('step')]
  assert len(rows) == 3 and all(r['skipped'] == 0 for r in rows)
  assert all(r['sync_full'] == 0.0 and r['sync_servers'] == 1 for r in rows)
  assert all(r['generator_drift'] < 1e-6 and r['generator_resyncs'] == 0 for r in rows)
  assert run.cfg.optim.logra.subspace == 'adaptive'
