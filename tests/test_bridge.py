"""The bridge on the embedded JAX engine: payloads, routes, auth, refusals, atomicity, drift.

Everything runs over real HTTP on 127.0.0.1 against a `BridgeServer` in this process (threads),
on the tiny preset, so the whole lifecycle is exercised in seconds.
"""
import concurrent.futures
import json
import struct
import urllib.error
import urllib.request

import hypothesis
import jax
import numpy as np
import openai
import pytest
from hypothesis import strategies as st

from flax import traverse_util

from logra_jax import sketch
from logra_jax.bridge import device_apply, sync, wire
from logra_jax.bridge.client import BridgeError, Fleet, ServerClient
from logra_jax.bridge.engine import EngineError, JaxEngine
from logra_jax.bridge.server import BridgeServer
from logra_jax.models import get_preset, hf_io, init_params, sampler
from logra_jax.models.generator import JaxGenerator
from logra_jax.rl.types import GenerationRequest, SamplingParams
from logra_jax.sketch import projection

TOKEN = 'test-token'
CONFIG = get_preset('tiny', vocab_size=32)
PROMPT = (1, 5, 7, 3)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, n=1, seed=0)


_PARAMS = {}


def _params(seed=0):
  if seed not in _PARAMS:
    _PARAMS[seed] = init_params(CONFIG, jax.random.key(seed))
  return _PARAMS[seed]


@pytest.fixture
def served():
  engine = JaxEngine(CONFIG, _params())
  server = BridgeServer(engine, TOKEN, max_update_bytes=4 << 20).start()
  yield engine, server, ServerClient(server.url, TOKEN)
  server.shutdown()
  server.server_close()


def _snapshot(engine):
  return {k: v.tobytes() for k, v in engine.master_weights().items()}, engine.weight_version


def _names(engine):
  return [n for n in engine.spec if wire.is_projection_weight(n)]


def _lowrank(engine, base, new, scale=1e-2, seed=0, step=None, u_dtype='fp32', rank=4):
  rng = np.random.default_rng(new)
  names = _names(engine)
  u = {n: (scale * rng.normal(size=(engine.spec[n][0], rank))).astype(np.float32)
       for n in names}
  return wire.encode_lowrank(u, {n: engine.spec[n][1] for n in names}, seed=seed,
                             step=new if step is None else step, kind='rademacher',
                             base_version=base, new_version=new, projection=projection,
                             u_dtype=u_dtype)


def _greedy(client):
  body = {'prompt': list(PROMPT), 'temperature': 0.0, 'max_tokens': 6, 'logprobs': 0,
          'return_token_ids': True}
  c = client.call('POST', '/v1/completions', body)['choices'][0]
  return c['weight_version'], c['token_ids'], c['logprobs']['token_logprobs']


def _push(client, blob, version, tmp_path):
  path = tmp_path / f'u{version}.safetensors'
  path.write_bytes(blob)
  client.call('POST', '/pause?mode=keep')
  client.call('POST', '/start_weight_update', {})
  try:
    client.call('POST', '/update_weights', {'update_info': {'path': str(path)}})
  except BridgeError:
    client.call('POST', '/finish_weight_update', {})
    client.call('POST', '/resume', {})
    raise
  client.call('POST', '/finish_weight_update', {'weight_version': str(version)})
  client.call('POST', '/resume', {})


def test_every_route_but_health_needs_the_token_and_does_nothing_without_it(served):
  engine, server, _ = served
  before = _snapshot(engine)
  with urllib.request.urlopen(server.url + '/health') as r:
    assert r.status == 200
  routes = [('GET', '/v1/models'), ('GET', '/weight_info'), ('POST', '/v1/completions'),
            ('POST', '/pause?mode=abort'), ('POST', '/resume'), ('POST', '/start_weight_update'),
            ('POST', '/init_weight_transfer_engine'), ('POST', '/update_weights'),
            ('POST', '/finish_weight_update')]
  for header in ({}, {'Authorization': 'Bearer wrong'}, {'Authorization': TOKEN}):
    for method, path in routes:
      req = urllib.request.Request(server.url + path, data=b'{}' if method == 'POST' else None,
                                   headers=header, method=method)
      with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req)
      assert e.value.code == 401, (path, header)
  assert not engine.info()['paused'] and not engine.info()['update_in_progress']
  assert _snapshot(engine) == before


def test_openai_client_completions_with_token_ids_logprobs_and_version(served):
  engine, server, client = served
  oa = openai.OpenAI(base_url=server.url + '/v1', api_key=TOKEN)
  assert [m.id for m in oa.models.list().data] == ['logra']
  out = oa.completions.create(model='logra', prompt=list(PROMPT), max_tokens=5, n=3, seed=7,
                              temperature=1.0, logprobs=0,
                              extra_body={'return_token_ids': True, 'stop_token_ids': [2]})
  assert len(out.choices) == 3
  # The same request through the in-process sampler gives the same tokens and log-probs.
  want = JaxGenerator(CONFIG, _params()).generate([GenerationRequest(
      PROMPT, SamplingParams(temperature=1.0, max_new_tokens=5, n=3, seed=7,
                             stop_token_ids=(2,)))])
  for choice, ref in zip(out.choices, want):
    extra = choice.model_extra
    assert extra['token_ids'] == list(ref.completion_token_ids)
    np.testing.assert_array_equal(choice.logprobs.token_logprobs, ref.behaviour_logprobs)
    assert extra['weight_version'] == '0'
  with pytest.raises(openai.BadRequestError, match='prompt token ids'):
    oa.completions.create(model='logra', prompt=[99], max_tokens=2)


def test_bad_completion_requests_are_400_with_the_field_named(served):
  _, _, client = served
  good = {'prompt': list(PROMPT), 'max_tokens': 2}
  for bad, field in ((dict(good, seed='x'), 'seed'), (dict(good, n=0), 'n'),
                     (dict(good, max_tokens='2'), 'max_tokens'), (dict(good, prompt=[]), 'prompt'),
                     (dict(good, temperature=-1.0), 'temperature'),
                     (dict(good, stop_token_ids='2'), 'stop_token_ids')):
    with pytest.raises(BridgeError, match=field) as e:
      client.call('POST', '/v1/completions', bad)
    assert e.value.status == 400


def test_lowrank_update_applies_u_at_a_and_bumps_the_version(served, tmp_path):
  engine, _, client = served
  old = {k: v.copy() for k, v in engine.master_weights().items()}
  v0 = _greedy(client)
  _push(client, _lowrank(engine, 0, 1, scale=0.5), 1, tmp_path)
  assert engine.weight_version == '1'
  blob_u = wire.read_blob(_lowrank(engine, 0, 1, scale=0.5))[0]
  name = 'model.layers.1.self_attn.k_proj.weight'
  a = projection.sample_projection(0, 1, name, 4, engine.spec[name][1])
  np.testing.assert_allclose(engine.master_weights()[name], old[name] + blob_u[name + '.U'] @ a,
                             rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(engine.master_weights()['model.norm.weight'],
                                old['model.norm.weight'])
  v1 = _greedy(client)
  assert v1[0] == '1' and v1[2] != v0[2]


def _session(engine, *blobs, version=None):
  """pause(keep) → start → update(each blob) → finish(version) → resume, in process."""
  engine.pause('keep')
  engine.start_update()
  for blob in blobs:
    engine.update(blob)
  engine.finish_update(version)
  engine.resume()


def _some_factors(engine, rng, scale):
  """U for a whole fused group of one layer (q/k/v of layer 1, rank 4, a partial stacked
  leaf) and down_proj of every layer (rank 3, a whole leaf): both paths of the device add."""
  names = {f'model.layers.1.self_attn.{m}.weight': 4 for m in ('q_proj', 'k_proj', 'v_proj')}
  names.update({f'model.layers.{i}.mlp.down_proj.weight': 3 for i in range(CONFIG.num_layers)})
  return {n: (scale * rng.normal(size=(engine.spec[n][0], r))).astype(np.float32)
          for n, r in names.items()}


def _encode(engine, u, base, new):
  return wire.encode_lowrank(u, {n: engine.spec[n][1] for n in u}, seed=7, step=new,
                             kind='rademacher', base_version=base, new_version=new,
                             projection=projection)


def test_device_apply_equals_float64_w_plus_u_a_touches_only_its_leaves_and_never_retraces():
  """The fast path: W + U @ A on device equals the float64 reference; leaves the update does
  not touch are the very same device buffers; neither the apply nor the sampler recompiles
  on a second update of the same structure."""
  engine = JaxEngine(CONFIG, _params())
  req = [GenerationRequest(PROMPT, GREEDY)]
  engine.generate(req)
  traces = sampler.generate_arrays._cache_size()  # pylint: disable=protected-access
  before = traverse_util.flatten_dict(engine.params)
  w0 = {k: v.astype(np.float64) for k, v in engine.master_weights().items()}
  rng = np.random.default_rng(0)
  u = _some_factors(engine, rng, 0.3)
  _session(engine, _encode(engine, u, 0, 1), version='1')
  adds = device_apply._ADD._cache_size()  # pylint: disable=protected-access
  w1 = engine.master_weights()
  for name, u_n in u.items():
    r = u_n.shape[1]
    a = projection.sample_projection(7, 1, name, r, engine.spec[name][1]).astype(np.float64)
    want = w0[name] + u_n.astype(np.float64) @ a
    # fp32: the r-term dot errs by at most γ_r·(|U| @ |A|) (γ_r ≈ r·2^-24) and the add
    # rounds once more (2^-24·|W|); a factor 2 on each covers the second-order terms.
    bound = 2 * 2.0**-24 * np.abs(want) + 2 * r * 2.0**-24 * (np.abs(u_n) @ np.abs(a))
    assert np.all(np.abs(w1[name] - want) <= bound), name
  for name in w0:
    if name not in u:
      np.testing.assert_array_equal(w1[name], w0[name].astype(np.float32), err_msg=name)
  after = traverse_util.flatten_dict(engine.params)
  touched = {('layers', 'attn', m, 'kernel') for m in ('q_proj', 'k_proj', 'v_proj')}
  touched.add(('layers', 'mlp', 'down_proj', 'kernel'))
  assert {p for p in before if after[p] is not before[p]} == touched
  # The sampler takes the new params without retracing, and runs on the master (fp32: the
  # same arrays): a sampler built offline from master_weights() gives the same tokens.
  got = engine.generate(req)[0]
  assert sampler.generate_arrays._cache_size() == traces  # pylint: disable=protected-access
  params = hf_io.params_from_hf_tensors(w1.get, set(w1), CONFIG)
  want = JaxGenerator(CONFIG, jax.tree.map(jax.numpy.asarray, params)).generate(req)[0]
  assert got.completion_token_ids == want.completion_token_ids
  np.testing.assert_array_equal(got.behaviour_logprobs, want.behaviour_logprobs)
  traces = sampler.generate_arrays._cache_size()  # pylint: disable=protected-access
  _session(engine, _encode(engine, _some_factors(engine, rng, 0.3), 1, 2), version='2')
  engine.generate(req)
  assert engine.weight_version == '2'
  assert device_apply._ADD._cache_size() == adds  # pylint: disable=protected-access
  assert sampler.generate_arrays._cache_size() == traces  # pylint: disable=protected-access
  # A full update (the 409 answer) puts host tensors in every leaf: still no retrace.
  _session(engine, wire.encode_full(w1, 2, 3), version='3')
  assert engine.generate(req)[0].completion_token_ids == want.completion_token_ids
  assert sampler.generate_arrays._cache_size() == traces  # pylint: disable=protected-access


def test_staged_leaves_never_alias_served_ones_a_generation_in_flight_keeps_its_weights():
  """Two blobs in one session (the second donates the leaves the first staged), committed:
  the params a request in flight holds (pause mode keep) are neither deleted nor changed;
  a failed session leaves the served buffers themselves in place."""
  engine = JaxEngine(CONFIG, _params())
  rng = np.random.default_rng(1)
  held = traverse_util.flatten_dict(engine.params)  # what an in-flight generate() holds
  held_bytes = {p: np.asarray(v).tobytes() for p, v in held.items()}
  first, second = (_encode(engine, _some_factors(engine, rng, 0.1), 0, 1) for _ in range(2))
  _session(engine, first, second, version='1')
  for p, leaf in held.items():
    assert not leaf.is_deleted() and np.asarray(leaf).tobytes() == held_bytes[p], p
  served = traverse_util.flatten_dict(engine.params)
  engine.pause('keep')
  engine.start_update()
  engine.update(_encode(engine, _some_factors(engine, rng, 0.1), 1, 2))
  with pytest.raises(EngineError):
    engine.update(b'junk')
  engine.finish_update(None)
  engine.resume()
  now = traverse_util.flatten_dict(engine.params)
  assert all(now[p] is served[p] and not served[p].is_deleted() for p in served)
  assert engine.weight_version == '1'


def _refusals(engine, tmp_path):
  """(description, update_info or blob, expected status) for every kind of refusal."""
  good = _lowrank(engine, 0, 1)
  tensors, meta = wire.read_blob(good)
  name = _names(engine)[0]
  nan = dict(tensors)
  nan[name + '.U'] = np.full_like(tensors[name + '.U'], np.nan)
  wrong_shape = dict(tensors)
  wrong_shape[name + '.U'] = tensors[name + '.U'][:-1]
  unknown = dict(tensors, **{'model.layers.9.self_attn.q_proj.weight.U': tensors[name + '.U']})
  partial = {k: v for k, v in tensors.items() if 'k_proj' not in k}
  bad_sum = dict(meta, A_sha256=json.dumps(dict(json.loads(meta['A_sha256']), **{name: '0'})))
  from safetensors.numpy import save
  full = sync.full_blob(_params(), CONFIG, 0, 1)
  full_t, full_m = wire.read_blob(full)
  full_nan = dict(full_t, **{'model.norm.weight': full_t['model.norm.weight'] * np.inf})
  overflow = dict(tensors, **{name + '.U': np.full_like(tensors[name + '.U'], 3e38)})
  return [
      ('not safetensors', b'\x00' * 64, 400),
      ('truncated', good[:len(good) // 2], 400),
      ('non-finite U', save(nan, metadata=meta), 400),
      ('finite U whose U @ A overflows', save(overflow, metadata=meta), 400),
      ('wrong shape', save(wrong_shape, metadata=meta), 400),
      ('unknown name', save(unknown, metadata=meta), 400),
      ('part of a fused group', save(partial, metadata=meta), 400),
      ('checksum mismatch', save(tensors, metadata=bad_sum), 400),
      ('other seed than the checksums', save(tensors, metadata=dict(meta, seed='5')), 400),
      ('bad format', save(tensors, metadata=dict(meta, format='x')), 400),
      ('stale base', _lowrank(engine, 3, 4), 409),
      ('non-finite full weights', save(full_nan, metadata=full_m), 400),
      ('too large', b'\x00' * (5 << 20), 413),
  ]


def test_every_refusal_leaves_weights_and_version_byte_identical(served, tmp_path):
  engine, _, client = served
  before, served_before = _snapshot(engine), _greedy(client)
  for what, blob, status in _refusals(engine, tmp_path):
    with pytest.raises(BridgeError) as e:
      _push(client, blob, 1, tmp_path)
    assert e.value.status == status, (what, e.value)
    assert _snapshot(engine) == before, what
    assert not engine.info()['paused'] and not engine.info()['update_in_progress']
  for info, status in (({'path': '/etc/hostname'}, 400), ({'nope': 1}, 400),
                       ({'url': 'file:///etc/passwd'}, 400)):
    client.call('POST', '/pause?mode=wait')
    client.call('POST', '/start_weight_update', {})
    with pytest.raises(BridgeError) as e:
      client.call('POST', '/update_weights', {'update_info': info})
    assert e.value.status == status
    client.call('POST', '/finish_weight_update', {})
    client.call('POST', '/resume', {})
  with pytest.raises(BridgeError, match='call /pause before'):
    client.call('POST', '/start_weight_update', {})
  assert _snapshot(engine) == before and _greedy(client) == served_before


def test_a_refused_blob_fails_the_whole_session(served, tmp_path):
  engine, _, client = served
  before = _snapshot(engine)
  ok, bad = tmp_path / 'ok', tmp_path / 'bad'
  ok.write_bytes(_lowrank(engine, 0, 1))
  bad.write_bytes(b'junk' * 10)
  client.call('POST', '/pause?mode=wait')
  client.call('POST', '/start_weight_update', {})
  client.call('POST', '/update_weights', {'update_info': {'path': str(ok)}})
  with pytest.raises(BridgeError):
    client.call('POST', '/update_weights', {'update_info': {'path': str(bad)}})
  with pytest.raises(BridgeError, match='already failed'):
    client.call('POST', '/update_weights', {'update_info': {'path': str(ok)}})
  with pytest.raises(BridgeError, match='nothing to commit'):
    client.call('POST', '/finish_weight_update', {'weight_version': '1'})
  client.call('POST', '/resume', {})
  assert _snapshot(engine) == before  # the good first blob was staged, never served


def test_fleet_falls_back_to_full_weights_after_409(served):
  engine, server, client = served
  fleet = Fleet([server.url], TOKEN)
  target = _params(seed=3)
  fleet.push(_lowrank(engine, 0, 1), 1, full_blob=lambda: None)
  assert engine.weight_version == '1'
  stats = fleet.push(_lowrank(engine, 0, 2), 2,
                     full_blob=lambda: sync.full_blob(target, CONFIG, 1, 2))
  assert stats['sync_full_fallbacks'] == 1 and engine.weight_version == '2'
  want = hf_io.hf_tensors(target, CONFIG)
  for k, v in engine.master_weights().items():
    np.testing.assert_array_equal(v, want[k])
  fleet.close()


def test_concurrent_clients_always_see_whole_updates(served, tmp_path):
  """8 clients generate greedily while 20 low-rank updates land: each completion's tokens and
  log-probs are exactly those of the version it reports (computed offline per version)."""
  engine, server, client = served
  blobs, expected, mirror = [], {}, sync.Mirror(_params(), CONFIG)
  req = [GenerationRequest(PROMPT, GREEDY)]
  for v in range(21):
    if v:
      blobs.append(_lowrank(engine, v - 1, v, scale=0.05))
      mirror.apply(blobs[-1], str(v - 1))
    params = hf_io.params_from_hf_tensors(mirror.weights.get, set(mirror.weights), CONFIG)
    r = JaxGenerator(CONFIG, jax.tree.map(jax.numpy.asarray, params)).generate(req)[0]
    expected[str(v)] = (list(r.completion_token_ids), list(r.behaviour_logprobs))
  assert len({tuple(e[1]) for e in expected.values()}) > 15  # versions are distinguishable
  stop, seen = [], []

  def clients():
    c = ServerClient(server.url, TOKEN)
    while not stop:
      seen.append(_greedy(c))

  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    futures = [pool.submit(clients) for _ in range(8)]
    for v, blob in enumerate(blobs, 1):
      _push(client, blob, v, tmp_path)
    stop.append(True)
    for f in futures:
      f.result()
  assert len(seen) >= 20 and len({s[0] for s in seen}) > 2
  for version, tokens, logps in seen:
    assert (tokens, logps) == expected[version], version
  assert engine.weight_version == '20'


def test_drift_after_100_lowrank_updates_without_an_anchor(served, tmp_path):
  """The trainer applies α·AᵀU to its fp32 kernels in JAX; the generator W += U @ A in numpy.
  Both round in fp32 (2^-24 relative per add), so 100 updates drift by ~sqrt(100)·6e-8."""
  engine, _, _ = served
  params = _params()
  apply = jax.jit(sketch.apply_sketch_updates)
  for t in range(1, 101):
    a = sketch.make_projections(params, 0, t, 4, name_fn=hf_io.projection_name_fn(CONFIG))
    rng = np.random.default_rng(t)
    u = jax.tree.map(lambda p: (1e-2 * rng.normal(size=p.shape)).astype(np.float32),
                     sketch.zero_probes(params, a))
    params = apply(params, u, a, 1.0)
    blob = sync.lowrank_blob(u, CONFIG, seed=0, step=t, kind='rademacher', base_version=t - 1,
                             new_version=t)
    engine.pause('wait')
    engine.start_update()
    engine.update(blob)
    engine.finish_update(str(t))
    engine.resume()
  trainer = hf_io.hf_tensors(params, CONFIG)
  start = hf_io.hf_tensors(_params(), CONFIG)
  sq = lambda f: sum(float(np.sum(f(k).astype(np.float64) ** 2)) for k in trainer)
  diff = sq(lambda k: trainer[k].astype(np.float64) - engine.master_weights()[k])
  drift = np.sqrt(diff / sq(lambda k: trainer[k]))
  # Relative to what the updates moved (‖Σ ΔW‖), not only to ‖W‖: a wrong scale of 1e-5 on
  # every delta shows here as 1e-5, far above fp32 rounding (~1e-7 · sqrt(100)).
  drift_of_delta = np.sqrt(diff / sq(lambda k: trainer[k].astype(np.float64) - start[k]))
  print(f'drift after 100 low-rank updates: {drift:.2e} of W, {drift_of_delta:.2e} of ΔW')
  assert drift <= 1e-5 and drift_of_delta <= 2e-6


@hypothesis.settings(max_examples=220, deadline=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(data=st.data())
def test_fuzzed_payloads_are_refused_whole_or_applied_whole(data):
  engine = _FUZZ_ENGINE
  before = _snapshot(engine)
  blob = data.draw(_hostile_blobs(engine))
  engine.pause('wait')
  engine.start_update()
  try:
    engine.update(blob)
  except EngineError as e:
    assert e.status in (400, 409, 413), e
    engine.finish_update(None)
    engine.resume()
    assert _snapshot(engine) == before
    return
  engine.finish_update(None)  # a valid one (rare): staged, then discarded, never served
  engine.resume()
  assert _snapshot(engine) == before


_FUZZ_ENGINE = JaxEngine(CONFIG, _params())


@st.composite
def _hostile_blobs(draw, engine):
  good = _lowrank(engine, 0, 1)
  tensors, meta = wire.read_blob(good)
  from safetensors.numpy import save
  kind = draw(st.sampled_from(['bytes', 'truncate', 'flip', 'meta', 'tensor', 'header']))
  if kind == 'bytes':
    return draw(st.binary(max_size=256))
  if kind == 'truncate':
    return good[:draw(st.integers(0, len(good) - 1))]
  if kind == 'flip':
    i = draw(st.integers(0, len(good) - 1))
    return good[:i] + bytes([good[i] ^ draw(st.integers(1, 255))]) + good[i + 1:]
  if kind == 'meta':
    key = draw(st.sampled_from(sorted(meta) + ['junk']))
    value = draw(st.one_of(st.text(max_size=20), st.sampled_from(['-1', '1e9', '{}', '[]', ''])))
    return save(tensors, metadata=dict(meta, **{key: value}))
  if kind == 'tensor':
    name = draw(st.sampled_from(sorted(tensors)))
    x = tensors[name]
    choice = draw(st.sampled_from(['nan', 'inf', 'shape', 'dtype', 'drop', 'rename']))
    t = dict(tensors)
    if choice in ('nan', 'inf'):
      x = x.copy()
      x.flat[draw(st.integers(0, x.size - 1))] = np.nan if choice == 'nan' else np.inf
      t[name] = x
    elif choice == 'shape':
      t[name] = np.zeros((x.shape[0] + draw(st.integers(1, 3)), x.shape[1]), x.dtype)
    elif choice == 'dtype':
      t[name] = x.astype(draw(st.sampled_from([np.float64, np.float16, np.int32])))
    elif choice == 'drop':
      del t[name]
    else:
      t[draw(st.text(min_size=1, max_size=40))] = t.pop(name)
    return save(t, metadata=meta)
  header = json.dumps(draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8),
                                           max_size=3))).encode()
  return struct.pack('<Q', len(header)) + header + draw(st.binary(max_size=64))


def test_a_lowrank_blob_carries_an_a_that_no_seed_derives(served):
  """An adaptive subspace's A (optim.logra.subspace='adaptive') travels in the blob: the
  engine applies W + U @ A with the sent A (float64 reference; fp32 rounding of terms ~2e-2
  is ~1e-9, a wrong or derived A moves W by ~1e-2), every other tensor untouched. A blob that
  names such a kind without the A cannot be built; an A of the wrong shape is refused."""
  engine, _, _ = served
  names, rng = _names(engine), np.random.default_rng(5)
  u = {n: (1e-2 * rng.normal(size=(engine.spec[n][0], 4))).astype(np.float32) for n in names}
  a = {n: rng.normal(size=(4, engine.spec[n][1])).astype(np.float32) for n in names}
  d_in = {n: engine.spec[n][1] for n in names}
  encode = lambda given, **kw: wire.encode_lowrank(
      u, d_in, seed=0, step=1, kind='adaptive', base_version=0, new_version=1,
      projection=projection, projections=given, **kw)
  before = {k: v.copy() for k, v in engine.master_weights().items()}
  engine.pause('wait')
  engine.start_update()
  engine.update(encode(a))
  engine.finish_update('1')
  engine.resume()
  after = engine.master_weights()
  for k, w in before.items():
    if k in a:
      want = w.astype(np.float64) + u[k].astype(np.float64) @ a[k].astype(np.float64)
      np.testing.assert_allclose(after[k], want, rtol=0, atol=1e-7, err_msg=k)
    else:
      assert after[k].tobytes() == w.tobytes(), k
  assert engine.weight_version == '1'
  mirror = sync.Mirror(_params(), CONFIG)  # wire.decode: vLLM's engine's path (numpy)
  mirror.apply(encode(a), '0')
  for k in a:
    want = before[k].astype(np.float64) + u[k].astype(np.float64) @ a[k].astype(np.float64)
    np.testing.assert_allclose(mirror.weights[k], want, rtol=0, atol=1e-7, err_msg=k)
  # The same kind with its A stripped: refused whole (no seed derives it), nothing changed.
  tensors, meta = wire.read_blob(encode(a))
  stripped = wire.st_save({k: v for k, v in tensors.items() if not k.endswith('.A')},
                          metadata=dict(meta, base_version='1', new_version='2'))
  kept = {k: v.tobytes() for k, v in engine.master_weights().items()}
  engine.pause('wait')
  engine.start_update()
  with pytest.raises(EngineError, match='cannot rebuild A') as refused:
    engine.update(stripped)
  assert refused.value.status == 400
  assert {k: v.tobytes() for k, v in engine.master_weights().items()} == kept
  with pytest.raises(ValueError, match='adaptive'):  # no seed derives this kind's A
    encode(None)
  with pytest.raises(ValueError, match=r'A has shape \(4, 3\)'):
    encode({**a, names[0]: np.zeros((4, 3), np.float32)})
