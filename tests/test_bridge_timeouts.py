"""The JAX engine's server holds no thread forever: socket timeouts, a bounded wait for /resume
and a bounded /pause; the client marks a hung server down after one timeout (docs/bridge.md,
"Faults and checks"). Servers bind 127.0.0.1 (threads).
"""
import contextlib
import dataclasses
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import pytest

from logra_jax.bridge.client import BridgeError, Fleet, ServerClient, Timeouts
from logra_jax.bridge.engine import JaxEngine
from logra_jax.bridge.server import BridgeServer
from logra_jax.models import get_preset, init_params

TOKEN = 'timeout-token'
CONFIG = get_preset('tiny', vocab_size=32)
PARAMS = init_params(CONFIG, jax.random.key(0))
PAUSE_S, SOCKET_S = 1.0, 1.0
BODY = {'prompt': [1, 5, 7], 'temperature': 0.0, 'max_tokens': 3, 'logprobs': 0,
        'return_token_ids': True}


@contextlib.contextmanager
def _bridge():
  engine = JaxEngine(CONFIG, PARAMS, pause_timeout_s=PAUSE_S)
  server = BridgeServer(engine, TOKEN, socket_timeout_s=SOCKET_S).start()
  try:
    yield engine, server, ServerClient(server.url, TOKEN, Timeouts(generation_s=30, update_s=30))
  finally:
    server.shutdown()
    server.server_close()


def _completion(url, timeout=30):
  """(status, seconds) of one completion request (no retries)."""
  req = urllib.request.Request(url + '/v1/completions', method='POST',
                               data=json.dumps(BODY).encode(),
                               headers={'Authorization': f'Bearer {TOKEN}',
                                        'Content-Type': 'application/json'})
  start = time.monotonic()
  try:
    with urllib.request.urlopen(req, timeout=timeout) as r:
      return r.status, time.monotonic() - start
  except urllib.error.HTTPError as e:
    return e.code, time.monotonic() - start


def test_a_paused_server_with_no_resume_answers_503_within_the_timeout():
  """A trainer paused the server and died: a completion gets 503 after PAUSE_S, not a hang
  (the old server waited for /resume without bound: the 30 s client timeout fired)."""
  with _bridge() as (_, server, client):
    assert _completion(server.url)[0] == 200  # compiled
    client.call('POST', '/pause?mode=keep')
    status, took = _completion(server.url)
    assert status == 503 and PAUSE_S <= took < PAUSE_S + 10
    client.call('POST', '/resume', {})
    assert _completion(server.url)[0] == 200


def test_a_silent_or_stalled_client_is_disconnected():
  """A client that connects and sends nothing, or stops inside its body, loses the
  connection after SOCKET_S (the old handler thread read forever)."""
  with _bridge() as (_, server, _):
    host, port = server.server_address
    for sent in (b'', b'POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer '
                      + TOKEN.encode() + b'\r\nContent-Length: 100\r\n\r\n{"pro'):
      with socket.create_connection((host, port)) as sock:
        sock.settimeout(SOCKET_S + 10)
        sock.sendall(sent)
        start = time.monotonic()
        while sock.recv(4096):  # until the server closes (a 408/400 answer, if any, first)
          pass
        assert time.monotonic() - start < SOCKET_S + 10


def test_pause_that_cannot_drain_fails_with_503_and_leaves_the_server_unpaused():
  """pause(mode=wait) with a request in flight that outlasts PAUSE_S: 503 naming it, and the
  server is not left paused (new requests are served)."""
  with _bridge() as (engine, server, client):
    assert _completion(server.url)[0] == 200
    release, real = threading.Event(), engine._gen.generate  # pylint: disable=protected-access

    def stuck(requests):
      release.wait(30)
      return real(requests)
    engine._gen.generate = stuck  # pylint: disable=protected-access
    slow = threading.Thread(target=_completion, args=(server.url,))
    slow.start()
    time.sleep(0.3)
    with pytest.raises(BridgeError, match='503.*in flight'):
      client.call('POST', '/pause?mode=wait')
    assert client.call('GET', '/weight_info')['paused'] is False
    release.set()
    slow.join()


@contextlib.contextmanager
def _hung(close_after_s=30.0):
  """A server on 127.0.0.1 that accepts connections, reads nothing and never answers; each
  connection is closed after ``close_after_s`` (bounded), all of them when the block ends.
  Yields (its URL, the number of connections it accepted so far)."""
  listener = socket.create_server(('127.0.0.1', 0))
  listener.settimeout(0.2)
  accepted, stop = [], threading.Event()

  def serve():
    while not stop.is_set():
      try:
        conn, _ = listener.accept()
        accepted.append((conn, time.monotonic()))
      except OSError:
        pass
      for c, at in list(accepted):
        if time.monotonic() - at > close_after_s:
          c.close()
  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  try:
    yield f'http://127.0.0.1:{listener.getsockname()[1]}', lambda: len(accepted)
  finally:
    stop.set()
    thread.join(5)
    for conn, _ in accepted:
      conn.close()
    listener.close()


def test_a_hung_server_is_marked_down_after_one_timeout_and_its_requests_rerouted():
  """A server that accepts and never answers: the client gives up after its generation
  timeout (the hung server closes connections only after 30 s, so a client without it would
  see a closed connection instead), does not repeat the call, marks it down; the request is
  answered by the server that is up, with the same samples; /health and the update lifecycle
  time out the same way, each on its own timeout."""
  from logra_jax.rl.types import GenerationRequest, SamplingParams  # pylint: disable=g-import-not-at-top
  timeouts = Timeouts(connect_s=1.0, health_s=0.5, generation_s=1.0, update_s=1.0)
  request = GenerationRequest((1, 5, 7), SamplingParams(temperature=1.0, max_new_tokens=3,
                                                        n=2, seed=4), request_id='r')
  with _hung() as (hung_url, accepted), _bridge() as (_, server, _):
    assert not ServerClient(hung_url, TOKEN, timeouts).healthy()
    for method, path in (('POST', '/v1/completions'), ('POST', '/pause?mode=keep'),
                         ('GET', '/weight_info')):
      before = accepted()
      with pytest.raises(BridgeError, match='no answer within 1 s') as err:
        ServerClient(hung_url, TOKEN, timeouts).call(method, path, {} if method == 'POST'
                                                     else None)
      assert err.value.status == 0
      assert accepted() == before + 1, path  # one try: a timeout is not repeated
    want = Fleet([server.url], TOKEN).generate([request])  # compiles the sampler
    fleet = Fleet([hung_url, server.url], TOKEN,
                  timeouts=dataclasses.replace(timeouts, generation_s=5.0))
    try:
      got = fleet.generate([request])  # the request goes to the hung server first (index 0)
      assert fleet.down() == [0] and fleet.servers_up == 1
      assert [r.completion_token_ids for r in got] == [r.completion_token_ids for r in want]
    finally:
      fleet.close()
