"""Drift measured on the generators: the fingerprint (`bridge/fingerprint.py`), the servers'
`GET /weight_info?fingerprint=K`, and the trainer's check and re-sync (`train/fleet.py`).

Two JAX-engine servers in this process on 127.0.0.1 (threads), the tiny preset.
"""
import dataclasses

import jax
import numpy as np
import pytest

from logra_jax.bridge import device_fingerprint, fingerprint, sync, wire
from logra_jax.bridge.client import ServerClient
from logra_jax.bridge.engine import JaxEngine
from logra_jax.bridge.server import BridgeServer
from logra_jax.models import get_preset, hf_io, init_params
from logra_jax.train import config as config_lib
from logra_jax.train.fleet import FleetGenerator

TOKEN = 'test-token'
CONFIG = get_preset('tiny', vocab_size=32)


def _hf(params):
  return {k: np.asarray(v, np.float32) for k, v in hf_io.hf_tensors(params, CONFIG).items()}


def _moved(params, scale, seed):
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype)
                                   for x, k in zip(leaves, keys)])


def test_the_device_fingerprint_is_the_float64_one():
  """The trainer's and the JAX engine's (fp32 on device) against numpy's float64 of the same
  weights: the same names, and a drift 10x below the fp32 tolerance (4e-7 seen: fp32 sums)."""
  params = init_params(CONFIG, jax.random.key(0))
  got = device_fingerprint.params_fingerprint(params, CONFIG)
  want = fingerprint.fingerprint(_hf(params))
  assert set(got) == set(want) == set(sync.hf_shapes(CONFIG))
  assert fingerprint.drift(want, got)[0] < fingerprint.TOLERANCE['float32'] / 10


def test_one_perturbed_element_moves_every_projection_by_its_size():
  """W' = W + δ e_ij: r_kᵀ W' c_k − r_kᵀ W c_k = r_k[i] c_k[j] δ = ±δ for every k, so the rms
  of the differences is |δ| and the drift |δ| / ‖W‖ (the norm moves by less than |δ|)."""
  weights = _hf(init_params(CONFIG, jax.random.key(0)))
  name = 'model.layers.1.self_attn.v_proj.weight'
  before = fingerprint.fingerprint(weights)
  w = weights[name].copy()
  delta = 1e-3 * float(np.linalg.norm(w))
  w[3, 5] += delta
  after = fingerprint.fingerprint(dict(weights, **{name: w}))
  drift, worst = fingerprint.drift(before, after)
  assert worst == name
  np.testing.assert_allclose(drift, delta / np.linalg.norm(weights[name]), rtol=1e-5)
  assert drift > fingerprint.TOLERANCE['float32']
  assert fingerprint.drift(before, {k: v for k, v in after.items() if k != name})[0] == np.inf


@pytest.fixture
def two_servers():
  params = init_params(CONFIG, jax.random.key(0))
  engines = [JaxEngine(CONFIG, params) for _ in range(2)]
  servers = [BridgeServer(e, TOKEN, max_update_bytes=4 << 20).start() for e in engines]
  yield engines, servers
  for s in servers:
    s.shutdown()
    s.server_close()


def _config(urls, every):
  base = config_lib.TrainConfig()
  rollout = dataclasses.replace(base.rollout, engine='http', urls=','.join(urls),
                                drift_check_every=every)
  return dataclasses.replace(base, rollout=rollout)


def _rogue(url, name, weights, version, tmp_path):
  """An authorised client perturbs one tensor, version kept (a full blob of the served
  weights, every tensor, one of them moved: a re-sync to other weights): what the trainer did
  not send."""
  w = weights[name] + 1e-2 * np.random.default_rng(0).standard_normal(weights[name].shape)
  path = tmp_path / 'rogue.safetensors'
  path.write_bytes(wire.encode_full(dict(weights, **{name: w.astype(np.float32)}), version,
                                    version))
  client = ServerClient(url, TOKEN)
  client.call('POST', '/pause?mode=keep')
  client.call('POST', '/start_weight_update', {})
  client.call('POST', '/update_weights', {'update_info': {'path': str(path)}})
  client.call('POST', '/finish_weight_update', {'weight_version': str(version)})
  client.call('POST', '/resume', {})


def test_a_rogue_update_of_one_tensor_is_detected_and_resynced(two_servers, tmp_path,
                                                               monkeypatch):
  engines, servers = two_servers
  monkeypatch.setenv('LOGRA_BRIDGE_TOKEN', TOKEN)
  params0 = init_params(CONFIG, jax.random.key(0))
  gen = FleetGenerator(_config([s.url for s in servers], every=2), '', CONFIG, params0, 0)
  try:
    params1 = _moved(params0, 1e-2, 1)
    stats = gen.update_weights(params1, 1)  # no check at step 1 (every 2)
    assert 'generator_drift' not in stats
    params2 = _moved(params1, 1e-2, 2)
    stats = gen.update_weights(params2, 2)  # faithful servers: a drift of fp32 sums only
    assert stats['generator_drift'] < fingerprint.TOLERANCE['float32'] / 10
    assert stats['generator_resyncs'] == 0
    # Behind the trainer's back, before its next check (what update_weights runs every 2
    # steps, after its push; a low-rank push would leave the perturbation in place).
    name = 'model.layers.0.mlp.down_proj.weight'
    _rogue(servers[1].url, name, engines[1].master_weights(), 2, tmp_path)
    stats = gen.check_drift(params2)
    assert stats['generator_drift'] > fingerprint.TOLERANCE['float32']
    assert stats['generator_resyncs'] == 1
    want = _hf(params2)
    for engine in engines:
      assert engine.weight_version == '2'
      for k, v in engine.master_weights().items():
        np.testing.assert_array_equal(v, want[k], err_msg=k)
    stats = gen.check_drift(params2)
    assert stats['generator_drift'] < fingerprint.TOLERANCE['float32'] / 10
    assert stats['generator_resyncs'] == 0
  finally:
    gen.close()


def test_weight_info_reports_the_served_fingerprint_and_refuses_bad_k(two_servers):
  engines, servers = two_servers
  client = ServerClient(servers[0].url, TOKEN)
  plain = client.call('GET', '/weight_info')
  assert 'fingerprint' not in plain and plain['weight_version'] == '0'
  info = client.call('GET', '/weight_info?fingerprint=4')
  assert info['dtype'] == 'float32' and info['fingerprint_k'] == 4
  want = fingerprint.fingerprint(engines[0].master_weights())
  assert fingerprint.drift(want, info['fingerprint'])[0] < fingerprint.TOLERANCE['float32'] / 10
  for bad in ('x', '0', '65'):
    with pytest.raises(Exception, match='400'):
      client.call('GET', f'/weight_info?fingerprint={bad}')
