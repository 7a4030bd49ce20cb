"""The JAX engine's server holds no thread forever: socket timeouts, a bounded wait for /resume
and a bounded /pause (docs/bridge.md, "Faults and checks"). Servers bind 127.0.0.1 (threads).
"""
import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import pytest

from logra_jax.bridge.client import BridgeError, ServerClient
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
    yield engine, server, ServerClient(server.url, TOKEN, timeout=30)
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
