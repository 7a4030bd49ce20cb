"""Faults the bridge refuses or survives (docs/bridge.md, "Faults and checks").

On the JAX engine's server over HTTP on 127.0.0.1 (tiny preset), the shared `admission`
module, the trainer's client, and vLLM's middleware against a stand-in ASGI app (vLLM itself:
tests/test_vllm_bridge.py). Every local server here binds 127.0.0.1 and is shut down.
"""
import asyncio
import contextlib
import dataclasses
import http.server
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import types
from collections import namedtuple

import jax
import numpy as np
import pytest
from safetensors.numpy import save

from logra_jax.bridge import admission, client, sync, wire
from logra_jax.bridge.client import BridgeError, Fleet, FleetDown, ServerClient
from logra_jax.bridge.engine import JaxEngine
from logra_jax.bridge.server import BridgeServer
from logra_jax.models import get_preset, init_params
from logra_jax.rl.types import GenerationRequest, SamplingParams
from logra_jax.sketch import projection

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = 'fault-token'
CONFIG = get_preset('tiny', vocab_size=32)
PARAMS = init_params(CONFIG, jax.random.key(0))
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4, n=2, seed=0)


@contextlib.contextmanager
def _bridge(**kw):
  server = BridgeServer(JaxEngine(CONFIG, PARAMS), TOKEN, **kw).start()
  try:
    yield server.engine, server, ServerClient(server.url, TOKEN, client.Timeouts(generation_s=60, update_s=60))
  finally:
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def _http(handler):
  httpd = http.server.ThreadingHTTPServer(('127.0.0.1', 0), handler)
  threading.Thread(target=httpd.serve_forever, daemon=True).start()
  try:
    yield httpd, f'http://127.0.0.1:{httpd.server_address[1]}'
  finally:
    httpd.shutdown()
    httpd.server_close()


def _snapshot(engine):
  return {k: v.tobytes() for k, v in engine.master_weights().items()}, engine.weight_version


def _lowrank(engine, base, new, scale=1e-2, u_dtype='fp32'):
  names = [n for n in engine.spec if wire.is_projection_weight(n)]
  rng = np.random.default_rng(int(new))
  u = {n: (scale * rng.normal(size=(engine.spec[n][0], 4))).astype(np.float32) for n in names}
  return wire.encode_lowrank(u, {n: engine.spec[n][1] for n in names}, seed=0, step=int(new),
                             kind='rademacher', base_version=base, new_version=new,
                             projection=projection, u_dtype=u_dtype)


def _session(client_, info, version=None):
  """pause → start → update → finish (``version`` when accepted, else none) → resume; the
  update's BridgeError or None."""
  client_.call('POST', '/pause?mode=wait')
  client_.call('POST', '/start_weight_update', {})
  try:
    client_.call('POST', '/update_weights', {'update_info': info})
  except BridgeError as e:
    client_.call('POST', '/finish_weight_update', {})
    return e
  finally:
    client_.call('POST', '/resume', {})
  if version is not None:
    client_.call('POST', '/finish_weight_update', {'weight_version': str(version)})
  return None


def _write(tmp_path, blob, name):
  path = tmp_path / name
  path.write_bytes(blob)
  return {'path': str(path)}


# --- A: one validation module, loadable by path with the standard library ------------------


def test_admission_loads_by_path_without_site_packages_and_both_engines_use_its_limits():
  """vLLM's side loads admission.py by path (refs.py); -S -I: no numpy, no logra_jax."""
  code = ('import importlib.util, sys; spec = importlib.util.spec_from_file_location("a", '
          'sys.argv[1]); m = importlib.util.module_from_spec(spec); '
          'spec.loader.exec_module(m); print(m.max_update_bytes({"w": (3, 5), "b": (7,)}))')
  out = subprocess.run([sys.executable, '-S', '-I', '-c', code,
                        os.path.join(REPO, 'logra_jax', 'bridge', 'admission.py')],
                       check=True, capture_output=True, text=True).stdout
  assert int(out) == int(4 * 22 * 1.25) + 2 * 1024 + (1 << 20)
  refs = open(os.path.join(REPO, 'third_party', 'vllm', 'logra_vllm', 'refs.py')).read()
  assert "'logra_jax/bridge/admission.py'" in refs
  # One default limit: the vLLM launcher sets none of its own (the engine takes admission's).
  spec = importlib.util.spec_from_file_location(
      'logra_launch', os.path.join(REPO, 'third_party', 'vllm', 'launch.py'))
  launch = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(launch)
  args, _ = launch.parse(['--model=x', '--token=t'])
  assert args.max_update_bytes is None
  with _bridge() as (engine, server, _):
    assert server.max_update_bytes == admission.max_update_bytes(engine.spec)
  # Sized from the model: a 7B model's full fp32 blob (30 GB, over the old 8 GiB default)
  # fits; an explicit limit replaces it.
  spec7b = sync.hf_shapes(get_preset('qwen2.5-7b'))
  blob7b = 4 * sum(int(np.prod(s)) for s in spec7b.values())
  assert blob7b > 8 << 30 and admission.max_update_bytes(spec7b) > blob7b + 1024 * len(spec7b)
  with _bridge(max_update_bytes=123) as (_, server, _):
    assert server.max_update_bytes == 123


def test_a_full_blob_fits_the_default_limit_and_a_larger_one_is_refused(tmp_path):
  """The default limit is the model's full fp32 blob with room: that blob is accepted; one
  past the limit is refused (413) before it is read, weights unchanged."""
  with _bridge() as (engine, server, c):
    whole = {k: np.array(v) for k, v in engine.master_weights().items()}
    blob = wire.encode_full(whole, 0, 1)
    assert len(blob) < server.max_update_bytes
    assert _session(c, _write(tmp_path, blob, 'full'), version=1) is None
    before = _snapshot(engine)
    big = tmp_path / 'big'
    big.write_bytes(b'')
    os.truncate(big, server.max_update_bytes + 1)
    err = _session(c, {'path': str(big)}, version=2)
    assert err is not None and err.status == 413 and _snapshot(engine) == before


_LOAD_WIRE = """
import importlib.abc, importlib.util, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'logra_jax', 'torch'):
      raise ImportError(name)
sys.meta_path.insert(0, Block())
def load(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  m = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(m)
  return m
wire = load('logra_wire', sys.argv[1] + '/logra_jax/bridge/wire.py')
projection = load('logra_projection', sys.argv[1] + '/logra_jax/sketch/projection.py')
import numpy as np
u = {'model.layers.0.mlp.down_proj.weight': np.ones((4, 2), np.float32)}
blob = wire.encode_lowrank(u, {k: 6 for k in u}, seed=1, step=2, kind='rademacher',
                           base_version=0, new_version=1, projection=projection, u_dtype='int4')
upd = wire.decode(blob, {k: (4, 6) for k in u}, '0', projection)
print(sorted(upd.tensors), 'jax' in sys.modules)
"""


def test_wire_loads_by_path_with_numpy_and_safetensors_alone():
  """What vLLM loads by path (wire.py, and quant.py through it) imports no JAX, no logra_jax."""
  out = subprocess.run([sys.executable, '-I', '-c', _LOAD_WIRE, REPO], check=True,
                       capture_output=True, text=True).stdout
  assert out.split() == ["['model.layers.0.mlp.down_proj.weight']", 'False']


def test_update_paths_outside_the_dirs_or_through_a_symlink_out_are_refused(tmp_path):
  inside = tmp_path / 'dir'
  inside.mkdir()
  (inside / 'ok').write_bytes(b'abc')
  os.symlink('/etc/hostname', inside / 'out')
  dirs = admission.update_dirs([str(inside)])
  assert admission.read_update({'path': str(inside / 'ok')}, dirs=dirs, origins=(),
                               token='t', max_bytes=3) == b'abc'
  for info, status in (({'path': str(inside / 'out')}, 400), ({'path': str(inside)}, 400),
                       ({'path': str(inside / 'ok')}, 413), ({'path': 5}, 400),
                       ({'path': 'a', 'url': 'b'}, 400)):
    with pytest.raises(admission.Refused) as e:
      admission.read_update(info, dirs=dirs, origins=(), token='t', max_bytes=2)
    assert e.value.status == status, info


# --- B: update_info {"url"} -----------------------------------------------------------------


class _Recorder(http.server.BaseHTTPRequestHandler):
  """Records every request's Authorization header; serves ``blob`` or redirects to
  ``location`` (class attributes set per server)."""
  seen: list = []
  blob, location = b'', None

  def do_GET(self):  # pylint: disable=invalid-name
    type(self).seen.append(self.headers.get('Authorization'))
    if self.location:
      self.send_response(302)
      self.send_header('Location', self.location)
      self.send_header('Content-Length', '0')
      self.end_headers()
      return
    self.send_response(200)
    self.send_header('Content-Length', str(len(self.blob)))
    self.end_headers()
    self.wfile.write(self.blob)

  def log_message(self, *args):
    del args


def test_a_redirect_never_carries_the_token_to_another_port():
  """The allowed origin 302s to another local port: refused, that port hears nothing, and
  the error names neither it nor its address."""
  other = type('Other', (_Recorder,), {'seen': []})
  trainer = type('Trainer', (_Recorder,), {'seen': []})
  with _bridge() as (engine, _, c0), _http(other) as (_, other_url):
    other.blob = _lowrank(engine, 0, 1)
    trainer.location = other_url + '/blob'
    with _http(trainer) as (_, trainer_url):
      with _bridge(update_origins=(trainer_url,)) as (engine, _, c):
        before = _snapshot(engine)
        err = _session(c, {'url': trainer_url + '/blob'}, version=1)
        assert err is not None and err.status == 400, err
        assert trainer.seen == [f'Bearer {TOKEN}'] and other.seen == []
        assert 'redirect' in err.message and other_url.split(':')[-1] not in err.message
        # Another origin is refused before any connection is made.
        err = _session(c, {'url': other_url + '/blob'}, version=1)
        assert err.status == 400 and other.seen == [] and other_url not in err.message
        assert _snapshot(engine) == before
    # A server with no origins configured fetches no URL at all.
    err = _session(c0, {'url': other_url + '/blob'}, version=1)
    assert err.status == 400 and 'disabled' in err.message and other.seen == []


def test_a_url_on_the_allowed_origin_is_fetched_and_bounded():
  handler = type('Blob', (_Recorder,), {'seen': []})
  with _bridge() as (engine, _, _):
    handler.blob = _lowrank(engine, 0, 1)
  with _http(handler) as (_, url):
    with _bridge(update_origins=(url,), max_update_bytes=len(handler.blob)) as (engine, _, c):
      assert _session(c, {'url': url + '/u'}, version=1) is None
      assert engine.weight_version == '1' and handler.seen == [f'Bearer {TOKEN}']
    with _bridge(update_origins=(url,), max_update_bytes=len(handler.blob) - 1) as (e, _, c):
      assert _session(c, {'url': url + '/u'}, version=1).status == 413
      assert e.weight_version == '0'


# --- C: full updates cover the model; versions never go backward ----------------------------


def test_a_partial_full_blob_and_a_backward_version_are_refused_byte_identical(tmp_path):
  with _bridge() as (engine, _, c):
    assert _session(c, _write(tmp_path, _lowrank(engine, 0, 3), 'l3'), version=3) is None
    whole = {k: np.array(v) for k, v in engine.master_weights().items()}  # served at 3
    before = _snapshot(engine)
    one = {'model.norm.weight': whole['model.norm.weight'] + 1}
    cases = [('partial full for another base', wire.encode_full(one, 1, 4), 400),
             ('partial full for the served base', wire.encode_full(one, 3, 4), 400),
             ('partial full at the served version', wire.encode_full(one, 3, 3), 400),
             ('whole model, backward version', wire.encode_full(whole, 1, 2), 400),
             ('low-rank, backward version', _lowrank(engine, 3, 2), 400)]
    for what, blob, status in cases:
      err = _session(c, _write(tmp_path, blob, 'b'), version=4)
      assert err is not None and err.status == status, (what, err)
      assert _snapshot(engine) == before, what
    # Allowed: the whole model for any base, at the served version (a re-sync: every tensor
    # replaced) or later.
    assert _session(c, _write(tmp_path, wire.encode_full(whole, 1, 3), 'w'), version=3) is None
    assert _snapshot(engine) == before  # the served weights themselves: nothing moved
    whole['model.norm.weight'] += 1
    assert _session(c, _write(tmp_path, wire.encode_full(whole, 3, 4), 'p'), version=4) is None
    assert engine.weight_version == '4'
    np.testing.assert_array_equal(engine.master_weights()['model.norm.weight'],
                                  whole['model.norm.weight'])


def test_a_session_left_open_by_a_dead_trainer_is_ended_by_the_next_start(tmp_path):
  """Trainer A pauses, starts and stages an update, then dies (no finish, no resume). The next
  trainer's push (a fresh session key) ends A's session: A's staged update is never served,
  the weights and version are byte-identical until the new push commits; a late call of A's
  (its key) is refused 409 and changes nothing. A keyless start still refuses an open session."""
  with _bridge() as (engine, _, c):
    before = _snapshot(engine)
    dead = {client.SESSION_HEADER: 'trainer-a'}
    c.call('POST', '/pause?mode=keep')
    c.call('POST', '/start_weight_update', {}, headers=dead)
    c.call('POST', '/update_weights', {'update_info': _write(tmp_path, _lowrank(engine, 0, 1),
                                                             'a')}, headers=dead)
    with pytest.raises(BridgeError, match='already in progress'):
      c.call('POST', '/start_weight_update', {})
    assert _snapshot(engine) == before and engine.info()['update_in_progress']
    fleet = Fleet([c.url], TOKEN)
    try:
      # A refused blob: the new session is rolled back too, so the weights are those of before
      # either session.
      partial = wire.encode_full({'model.norm.weight': np.zeros(CONFIG.hidden_size, np.float32)},
                                 0, 1)
      with pytest.raises(BridgeError, match='every tensor'):
        fleet.push(partial, 1, full_blob=lambda: None)
      assert _snapshot(engine) == before and not engine.info()['update_in_progress']
      assert engine.info()['sessions_superseded'] == 1 and not engine.info()['paused']
      for path, body in (('/update_weights', {'update_info': {'path': 'x'}}),
                         ('/finish_weight_update', {'weight_version': '1'})):
        c.call('POST', '/pause?mode=keep')
        c.call('POST', '/start_weight_update', {}, headers={client.SESSION_HEADER: 'b'})
        with pytest.raises(BridgeError) as err:
          c.call('POST', path, body, headers=dead)
        assert err.value.status == 409 and 'superseded' in err.value.message, path
        c.call('POST', '/finish_weight_update', {}, headers={client.SESSION_HEADER: 'b'})
        c.call('POST', '/resume', {})
      assert _snapshot(engine) == before
      fleet.push(_lowrank(engine, 0, 1), 1, full_blob=lambda: None)  # the run goes on
      assert engine.weight_version == '1'
    finally:
      fleet.close()


# --- D: fp8 NaN codes; /dev/shm ---------------------------------------------------------------


@pytest.mark.parametrize('code', [0x7F, 0xFF])
def test_fp8_nan_codes_are_refused(code):
  with _bridge() as (engine, _, _):
    blob = _lowrank(engine, 0, 1, u_dtype='fp8-e4m3')
    spec = engine.spec
  tensors, meta = wire.read_blob(blob)
  name = sorted(k for k in tensors if k.endswith('.U'))[0]
  bad = tensors[name].copy()
  bad[0, 0] = code
  with pytest.raises(wire.UpdateError, match='NaN code'):
    wire.parse(save(dict(tensors, **{name: bad}), metadata=meta), spec, '0')
  assert np.isnan(wire.dequantize_u(np.array([[code]], np.uint8), np.ones(1, np.float32),
                                    'fp8-e4m3')).all()


def test_blob_files_fall_back_to_the_temp_dir_when_shm_is_missing_or_small(monkeypatch):
  Stat = namedtuple('Stat', 'f_bavail f_frsize')
  real_statvfs, tmp = os.statvfs, tempfile.gettempdir()
  for free, want in ((client.SHM_HEADROOM, tmp), (4 * client.SHM_HEADROOM, client.SHM)):
    monkeypatch.setattr(os, 'statvfs', lambda p, free=free: Stat(free // 4096, 4096)
                        if p == client.SHM else real_statvfs(p))
    if want == client.SHM and not os.path.isdir(client.SHM):
      continue
    with client._BlobFile(b'x' * 1000) as path:  # pylint: disable=protected-access
      assert os.path.dirname(path) == want and open(path, 'rb').read() == b'x' * 1000
  monkeypatch.setattr(os, 'statvfs', real_statvfs)
  monkeypatch.setattr(client, 'SHM', '/nonexistent-shm')
  with client._BlobFile(b'y') as path:  # pylint: disable=protected-access
    assert os.path.dirname(path) == tmp


def test_the_fleet_writes_blobs_where_it_is_told(tmp_path):
  """A directory both hosts mount (multi-node): the client writes there, the server reads it."""
  shared = tmp_path / 'shared'
  shared.mkdir()
  with _bridge(update_dirs=(str(shared),)) as (engine, server, _):
    fleet = Fleet([server.url], TOKEN, blob_dir=str(shared))
    try:
      fleet.push(_lowrank(engine, 0, 1), 1, full_blob=lambda: None)
    finally:
      fleet.close()
    assert engine.weight_version == '1' and not os.listdir(shared)


# --- E: retries and aborted completions --------------------------------------------------------


def test_a_finish_whose_answer_is_lost_is_retried_and_the_push_succeeds():
  """The server commits, then the connection drops before its answer: the client repeats the
  finish (idempotent by its version) and the push completes; an update whose answer is lost
  is not repeated (it raises, and the server saw it once)."""
  with _bridge() as (engine, server, _):
    seen = []

    class Drop(server.RequestHandlerClass):
      drop = {'/finish_weight_update'}

      def _send(self, status, payload):
        seen.append(self.path)
        if self.path in self.drop:
          self.drop.discard(self.path)
          self.close_connection = True  # no answer: the client sees the connection close
          return
        super()._send(status, payload)

    server.RequestHandlerClass = Drop
    fleet = Fleet([server.url], TOKEN)
    try:
      fleet.push(_lowrank(engine, 0, 1), 1, full_blob=lambda: None)
      assert engine.weight_version == '1' and seen.count('/finish_weight_update') == 2
      Drop.drop = {'/update_weights'}
      # Its only server's state unknown, the fleet marks it down (to rejoin after a full sync):
      # FleetDown, naming the server and why.
      with pytest.raises(FleetDown, match='not repeated'):
        fleet.push(_lowrank(engine, 1, 2), 2, full_blob=lambda: None)
      assert seen.count('/update_weights') == 2  # one per push: the second never repeated
      assert engine.weight_version == '1' and not engine.info()['update_in_progress']
    finally:
      fleet.close()


def test_aborted_completions_are_requested_again_and_counted(monkeypatch):
  with _bridge() as (engine, server, _):
    requests = [GenerationRequest((1, 5, 7), GREEDY, request_id='r0')]
    want = engine.generate(requests)
    generate, aborted = engine.generate, []

    def abort_first(reqs):
      out = generate(reqs)
      if not aborted:
        aborted.append(1)
        return [dataclasses.replace(r, completion_token_ids=(), behaviour_logprobs=(),
                                    finish_reason='abort') for r in out]
      return out

    monkeypatch.setattr(engine, 'generate', abort_first)
    fleet = Fleet([server.url], TOKEN)
    try:
      got = fleet.generate(requests)
      assert [r.completion_token_ids for r in got] == [r.completion_token_ids for r in want]
      assert all(r.finish_reason != 'abort' and r.completion_token_ids for r in got)
      assert fleet.aborts_retried == 1
      stats = fleet.push(_lowrank(engine, 0, 1), 1, full_blob=lambda: None)
      assert stats['fleet_aborts_retried'] == 1 and fleet.aborts_retried == 0
      monkeypatch.setattr(engine, 'generate', lambda reqs: [dataclasses.replace(
          r, completion_token_ids=(), behaviour_logprobs=(), finish_reason='abort')
          for r in generate(reqs)])
      with pytest.raises(FleetDown, match='aborted'):  # its only server marked down
        fleet.generate(requests)
    finally:
      fleet.close()


# --- F: vLLM's middleware, against a stand-in app -------------------------------------------


def _middleware():
  sys.path.insert(0, os.path.join(REPO, 'third_party', 'vllm'))
  try:
    from logra_vllm import middleware  # pylint: disable=g-import-not-at-top
  finally:
    sys.path.pop(0)
  return middleware


class _FakeEngine:
  """vLLM's engine client as the middleware uses it, with the logra engine's status."""

  def __init__(self):
    self.paused, self.version, self.in_session = True, '0', False
    self.pause_check = None  # an asyncio.Event is_paused waits for, when set
    self.pause_hangs = False  # /pause never returns (in-flight requests that never finish)

  async def is_paused(self):
    if self.pause_check is not None:
      await self.pause_check.wait()
    return self.paused

  async def get_weight_version(self):
    return self.version

  async def update_weight_version(self, v):
    self.version = v

  async def reset_prefix_cache(self):
    pass

  async def resume_generation(self):
    self.paused = False

  async def collective_rpc(self, method, args=()):
    if method == 'logra_status':
      return [{'version': self.version, 'pending': None, 'refusal': None,
               'in_session': self.in_session, 'last_apply_s': None}]
    return [f'{method}{list(args)}']


def _asgi(engine, reached):
  """vLLM's app as far as the middleware can tell: records each path that reaches it."""
  app = types.SimpleNamespace(state=types.SimpleNamespace(engine_client=engine),
                              routes=[types.SimpleNamespace(path='/start_weight_update')])

  async def inner(scope, receive, send):
    reached.append(scope['path'])
    if scope['path'] == '/start_weight_update':
      engine.in_session = True
    if scope['path'] == '/finish_weight_update':
      engine.in_session = False
    if scope['path'] == '/resume':
      engine.paused = False
    if scope['path'] == '/pause' and engine.pause_hangs:
      await asyncio.Event().wait()  # mode=wait with requests that never finish
    await send({'type': 'http.response.start', 'status': 200,
                'headers': [(b'content-type', b'application/json')]})
    await send({'type': 'http.response.body', 'body': b'{}'})
  return app, inner


async def _call(mw, app, method, path, body=b'', headers=()):
  out = []

  async def receive():
    return {'type': 'http.request', 'body': body, 'more_body': False}

  async def send(message):
    out.append(message)
  scope = {'type': 'http', 'method': method, 'path': path, 'app': app,
           'headers': [(b'authorization', f'Bearer {TOKEN}'.encode()), *headers]}
  await mw(scope, receive, send)
  return out[0]['status'], json.loads(b''.join(m.get('body', b'') for m in out[1:]) or b'null')


@pytest.fixture
def vllm_mw(monkeypatch):
  monkeypatch.setenv('LOGRA_BRIDGE_TOKEN', TOKEN)
  engine, reached = _FakeEngine(), []
  app, inner = _asgi(engine, reached)
  return _middleware().LograMiddleware(inner), app, engine, reached


def test_the_vllm_middleware_allow_lists_routes(vllm_mw):
  mw, app, _, reached = vllm_mw

  async def run():
    for method, path in (('POST', '/sleep'), ('POST', '/wake_up'), ('POST', '/reset_prefix_cache'),
                         ('POST', '/abort_requests'), ('POST', '/v1/chat/completions'),
                         ('GET', '/server_info'), ('POST', '/weight_checker'),
                         ('POST', '/shutdown_weight_transfer_engine'), ('GET', '/metrics'),
                         ('POST', '/start_draft_weight_update'), ('GET', '/v1/completions'),
                         ('POST', '/inference/v1/generate'), ('POST', '/tokenize')):
      status, _ = await _call(mw, app, method, path, b'{}')
      assert status == 404, (method, path)
    for method in ('logra_commit', 'execute_model', 'load_model'):
      status, _ = await _call(mw, app, 'POST', '/collective_rpc',
                              json.dumps({'method': method}).encode())
      assert status == 403, method
    assert reached == []
    status, out = await _call(mw, app, 'POST', '/collective_rpc', b'{"method": "logra_status"}')
    assert status == 200 and out['results'][0]['version'] == '0'
    for method, path in (('GET', '/weight_info'), ('POST', '/pause'), ('GET', '/v1/models'),
                         ('GET', '/is_paused')):
      assert (await _call(mw, app, method, path))[0] == 200, path
    assert reached == ['/weight_info', '/pause', '/v1/models', '/is_paused']
  asyncio.run(run())


def test_the_vllm_middleware_locks_the_pause_check_and_keeps_the_window_on_a_bad_finish(vllm_mw):
  mw, app, engine, reached = vllm_mw

  async def run():
    engine.pause_check = asyncio.Event()
    start = asyncio.create_task(_call(mw, app, 'POST', '/start_weight_update'))
    await asyncio.sleep(0.01)  # start is inside the paused check
    resume = asyncio.create_task(_call(mw, app, 'POST', '/resume'))
    await asyncio.sleep(0.01)
    engine.pause_check.set()
    assert (await start)[0] == 200
    assert (await resume)[0] == 400 and '/resume' not in reached  # not between check and open
    status, out = await _call(mw, app, 'POST', '/finish_weight_update', b'not json')
    assert status == 400 and 'still open' in out['error']['message']
    assert (await _call(mw, app, 'POST', '/resume'))[0] == 400  # the window stays open
    assert (await _call(mw, app, 'POST', '/finish_weight_update', b'{}'))[0] == 200
    assert (await _call(mw, app, 'POST', '/resume'))[0] == 200
    # A repeated finish of the served version, with no session open: 200, vLLM not called.
    n = len(reached)
    status, out = await _call(mw, app, 'POST', '/finish_weight_update',
                              b'{"weight_version": "0"}')
    assert status == 200 and out == {'weight_version': '0'} and len(reached) == n
  asyncio.run(run())


def test_the_vllm_middleware_ends_a_stale_session_and_bounds_a_pause(vllm_mw, monkeypatch):
  """A session left open by a dead client (key a) is ended by the next client's start (key
  b): vLLM's finish without a version (the engine rolls back), then the new start; a's later
  calls are refused 409 and reach nothing. A completion while paused past the pause timeout is
  503 without reaching vLLM; a /pause that does not return in that time is undone: 503."""
  mw, app, engine, reached = vllm_mw
  middleware = _middleware()
  a, b = [(middleware.SESSION_HEADER, k) for k in (b'a', b'b')]

  async def run():
    assert (await _call(mw, app, 'POST', '/start_weight_update', headers=[a]))[0] == 200
    assert (await _call(mw, app, 'POST', '/start_weight_update'))[0] == 200  # keyless: vLLM's
    del reached[:]
    assert (await _call(mw, app, 'POST', '/start_weight_update', headers=[b]))[0] == 200
    assert reached == ['/finish_weight_update', '/start_weight_update']
    assert mw.sessions_superseded == 1 and engine.in_session
    for path in ('/update_weights', '/finish_weight_update'):
      status, out = await _call(mw, app, 'POST', path, b'{}', headers=[a])
      assert status == 409 and 'superseded' in out['error']['message'], path
    assert reached == ['/finish_weight_update', '/start_weight_update']
    assert (await _call(mw, app, 'POST', '/finish_weight_update', b'{}', headers=[b]))[0] == 200
    assert not engine.in_session
    monkeypatch.setattr(middleware, 'PAUSE_TIMEOUT_S', 0.3)
    del reached[:]
    status, out = await _call(mw, app, 'POST', '/v1/completions', b'{}')
    assert status == 503 and 'paused for more than' in out['error']['message'] and not reached
    engine.pause_hangs = True
    status, out = await _call(mw, app, 'POST', '/pause')
    assert status == 503 and 'not paused' in out['error']['message'] and not engine.paused
  asyncio.run(run())
