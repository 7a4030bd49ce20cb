"""The JAX engine as an HTTP server: vLLM's routes, so one trainer client drives both.

Routes (every one but /health needs ``Authorization: Bearer <token>``):
  GET  /health, /v1/models, /weight_info (?fingerprint=K: the served weights' fingerprint,
                         `fingerprint.py`)
  POST /v1/completions   token-id prompts, n, seed, temperature, top_p, top_k, max_tokens,
                         stop_token_ids, logprobs, return_token_ids (OpenAI's subset the
                         trainer uses); every choice carries its `weight_version`
  POST /pause?mode=abort|wait|keep, /resume
  POST /init_weight_transfer_engine {"init_info"}, /start_weight_update,
       /update_weights {"update_info": {"path"} | {"url"}} (checked by `admission`),
       /finish_weight_update {"weight_version"?}
Errors are OpenAI-shaped JSON ``{"error": {"message", "type", "code"}}``: 401 no/bad token,
413 too large, 409 stale base, 400 anything malformed, 503 paused too long (the engine's
``pause_timeout_s``). Every socket read and write is bounded (``socket_timeout_s``): no client
holds a handler thread forever. Binds 127.0.0.1 unless told otherwise.
"""
import hmac
import json
import threading
import time
import urllib.parse
from typing import Optional
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from logra_jax.bridge import admission
from logra_jax.bridge import fingerprint as fp_lib
from logra_jax.bridge.engine import EngineError, JaxEngine
from logra_jax.rl.types import GenerationRequest, SamplingParams

MAX_JSON_BYTES = 4 << 20
SESSION_HEADER = 'X-Logra-Session'  # the client's key of an update session (engine.py)
SESSION_KEY = '\0session'  # where the handler passes it to the routes (no query name clashes)
SOCKET_TIMEOUT_S = 120.0  # a connection idle (or sending nothing) this long is closed


class BridgeServer(ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self, engine: JaxEngine, token: str, host: str = '127.0.0.1', port: int = 0,
               model_name: str = 'logra', max_update_bytes: Optional[int] = None,
               update_dirs: tuple = (), update_origins: tuple = (), tokenizer=None,
               socket_timeout_s: float = SOCKET_TIMEOUT_S):
    """``socket_timeout_s``: the longest a read or write on a connection may block (a client
    that connects and sends nothing, or stops mid-request, releases its thread then); a request
    waiting out a pause is bounded by the engine's ``pause_timeout_s``."""
    if not token:
      raise ValueError('the bridge server needs a token (LOGRA_BRIDGE_TOKEN or --token)')
    super().__init__((host, port), _Handler)
    self.engine, self.token, self.model_name = engine, token, model_name
    self.socket_timeout_s = socket_timeout_s
    self.max_update_bytes = (admission.max_update_bytes(engine.spec) if max_update_bytes is None
                             else max_update_bytes)  # None: sized from the model
    self.tokenizer = tokenizer
    self.update_dirs = admission.update_dirs(update_dirs)
    self.update_origins = admission.update_origins(update_origins)

  @property
  def url(self) -> str:
    return f'http://{self.server_address[0]}:{self.server_address[1]}'

  def start(self) -> 'BridgeServer':
    threading.Thread(target=self.serve_forever, daemon=True).start()
    return self


# --- request parsing ------------------------------------------------------------------------


def _field(body, key, typ, default):
  value = body.get(key, default)
  if value is None:
    return default
  if typ is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
    raise EngineError(400, f'{key} must be {typ.__name__}, got {value!r}')
  return value


def _prompts(body, vocab_size):
  prompt = body.get('prompt')
  rows = [prompt] if isinstance(prompt, list) and prompt and all(
      isinstance(t, int) for t in prompt) else prompt
  if not isinstance(rows, list) or not rows or not all(
      isinstance(r, list) and r and all(isinstance(t, int) and not isinstance(t, bool)
                                        for t in r) for r in rows):
    raise EngineError(400, 'prompt must be a non-empty list of token ids (or a list of them)')
  if any(t < 0 or t >= vocab_size for r in rows for t in r):
    raise EngineError(400, f'prompt token ids must be in [0, {vocab_size})')
  return rows


def completion_requests(body: dict, vocab_size: int) -> list[GenerationRequest]:
  """GenerationRequests from an OpenAI /v1/completions body (token-id prompts only)."""
  stop = body.get('stop_token_ids') or []
  if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
    raise EngineError(400, 'stop_token_ids must be a list of token ids')
  try:
    params = SamplingParams(
        temperature=_field(body, 'temperature', float, 1.0),
        top_p=_field(body, 'top_p', float, 1.0), top_k=max(_field(body, 'top_k', int, 0), 0),
        max_new_tokens=_field(body, 'max_tokens', int, 16), stop_token_ids=tuple(stop),
        n=_field(body, 'n', int, 1), seed=_field(body, 'seed', int, None))
    return [GenerationRequest(tuple(r), params, request_id=str(i))
            for i, r in enumerate(_prompts(body, vocab_size))]
  except ValueError as e:
    raise EngineError(400, str(e)) from None


def completion_response(results, model_name, want_logprobs, tokenizer=None) -> dict:
  choices = []
  for i, r in enumerate(results):
    choice = {'index': i, 'text': tokenizer.decode(list(r.completion_token_ids))
              if tokenizer is not None else '', 'finish_reason': r.finish_reason,
              'token_ids': list(map(int, r.completion_token_ids)),
              'prompt_token_ids': list(map(int, r.prompt_token_ids)),
              'weight_version': str(r.weight_version), 'logprobs': None}
    if want_logprobs:
      choice['logprobs'] = {'token_logprobs': list(map(float, r.behaviour_logprobs)),
                            'tokens': [f'token_id:{t}' for t in choice['token_ids']],
                            'top_logprobs': None, 'text_offset': None}
    choices.append(choice)
  versions = sorted({c['weight_version'] for c in choices})
  return {'id': f'cmpl-{time.time_ns()}', 'object': 'text_completion',
          'created': int(time.time()), 'model': model_name, 'choices': choices,
          'weight_version': versions[0] if len(versions) == 1 else versions,
          'usage': {'prompt_tokens': sum(len(c['prompt_token_ids']) for c in choices),
                    'completion_tokens': sum(len(c['token_ids']) for c in choices),
                    'total_tokens': sum(len(c['prompt_token_ids']) + len(c['token_ids'])
                                        for c in choices)}}


# --- the handler ----------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
  server: BridgeServer
  protocol_version = 'HTTP/1.1'

  def setup(self):
    self.timeout = self.server.socket_timeout_s  # StreamRequestHandler: socket.settimeout
    super().setup()

  def log_message(self, *args):  # quiet: the trainer logs what matters
    pass

  def _send(self, status: int, payload: dict):
    data = json.dumps(payload).encode()
    self.send_response(status)
    self.send_header('Content-Type', 'application/json')
    self.send_header('Content-Length', str(len(data)))
    self.end_headers()
    self.wfile.write(data)

  def _authorized(self) -> bool:
    got = self.headers.get('Authorization', '')
    return hmac.compare_digest(got.encode(), f'Bearer {self.server.token}'.encode())

  def _body(self) -> dict:
    try:
      length = int(self.headers.get('Content-Length') or 0)
    except ValueError:
      raise EngineError(400, 'bad Content-Length') from None
    if length > MAX_JSON_BYTES:
      raise EngineError(413, f'request body of {length} bytes exceeds {MAX_JSON_BYTES}')
    raw = self.rfile.read(length) if length > 0 else b''
    if not raw:
      return {}
    try:
      body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
      raise EngineError(400, f'request body is not JSON: {e}') from None
    if not isinstance(body, dict):
      raise EngineError(400, 'request body must be a JSON object')
    return body

  def do_GET(self):
    self._dispatch('GET')

  def do_POST(self):
    self._dispatch('POST')

  def _dispatch(self, method):
    url = urllib.parse.urlparse(self.path)
    try:
      if url.path == '/health' and method == 'GET':
        return self._send(200, {'status': 'ok'})
      if not self._authorized():
        self.close_connection = True
        return self._send(401, _error(401, 'missing or wrong bearer token'))
      body = self._body() if method == 'POST' else {}
      route = ROUTES.get((method, url.path))
      if route is None:
        return self._send(404, _error(404, f'no route {method} {url.path}'))
      query = dict(urllib.parse.parse_qsl(url.query))
      query.pop(SESSION_KEY, None)
      if self.headers.get(SESSION_HEADER):  # the update session's key (engine.start_update)
        query[SESSION_KEY] = self.headers[SESSION_HEADER]
      self._send(200, route(self.server, body, query))
    except EngineError as e:
      self._send(e.status, _error(e.status, str(e)))
    except Exception as e:  # pylint: disable=broad-except  # a bug: answer, do not hang
      self._send(500, _error(500, f'{type(e).__name__}: {e}'))


def _error(status: int, message: str) -> dict:
  """OpenAI's error shape, so its client raises with the message."""
  kind = {401: 'authentication_error', 404: 'not_found_error'}.get(status,
                                                                   'invalid_request_error')
  return {'error': {'message': message, 'type': kind, 'code': status}}


def _completions(srv, body, query):
  del query
  engine = srv.engine
  requests = completion_requests(body, engine.config.vocab_size)
  try:
    results = engine.generate(requests)
  except ValueError as e:
    raise EngineError(400, str(e)) from None
  return completion_response(results, srv.model_name, body.get('logprobs') is not None,
                             srv.tokenizer)


def _update(srv, body, query):
  srv.engine.check_session(query.get(SESSION_KEY), '/update_weights')  # before any read
  start = time.perf_counter()
  try:
    blob = admission.read_update(body.get('update_info'), dirs=srv.update_dirs,
                                 origins=srv.update_origins, token=srv.token,
                                 max_bytes=srv.max_update_bytes)
  except admission.Refused as e:
    raise EngineError(e.status, str(e)) from None
  read_s = time.perf_counter() - start
  srv.engine.update(blob, key=query.get(SESSION_KEY))
  srv.engine.timings['read_s'] = read_s
  return {'status': 'ok'}


def _finish(srv, body, query):
  version = body.get('weight_version')
  return {'weight_version': srv.engine.finish_update(None if version is None else str(version),
                                                     key=query.get(SESSION_KEY))}


def _call(action, status):
  """A route that runs ``action(engine, body, query)`` and answers {'status': status}."""
  def route(srv, body, query):
    action(srv.engine, body, query)
    return {'status': status}
  return route


def _weight_info(srv, body, query):
  """The version and state; with ``?fingerprint=K`` the served weights' fingerprint too."""
  del body
  if 'fingerprint' not in query:
    return srv.engine.info()
  try:
    k = int(query['fingerprint'] or fp_lib.K)
  except ValueError:
    raise EngineError(400, 'fingerprint must be an integer') from None
  return dict(srv.engine.info(), **srv.engine.fingerprint(k))


def _models(srv, body, query):
  del body, query
  return {'object': 'list', 'data': [{'id': srv.model_name, 'object': 'model',
                                      'owned_by': 'logra_jax'}]}


ROUTES = {
    ('GET', '/v1/models'): _models,
    ('GET', '/weight_info'): _weight_info,
    ('POST', '/v1/completions'): _completions,
    ('POST', '/pause'): _call(lambda e, b, q: e.pause(q.get('mode', 'abort')), 'paused'),
    ('POST', '/resume'): _call(lambda e, b, q: e.resume(), 'resumed'),
    ('POST', '/init_weight_transfer_engine'): _call(
        lambda e, b, q: e.init_transfer(b.get('init_info')), 'ok'),
    ('POST', '/start_weight_update'): _call(lambda e, b, q: e.start_update(q.get(SESSION_KEY)),
                                            'ok'),
    ('POST', '/update_weights'): _update,
    ('POST', '/finish_weight_update'): _finish,
}
