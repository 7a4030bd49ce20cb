"""`--middleware logra_vllm.middleware.LograMiddleware`: auth, routes and the update protocol.

* Every route except /health needs ``Authorization: Bearer <LOGRA_BRIDGE_TOKEN>`` (vLLM's
  --api-key guards /v1/* only; its RL routes /pause, /start_weight_update … would run for
  anyone). A refused request gets 401 and reaches nothing.
* Only the routes of `ROUTES` exist (the OpenAI routes the trainer uses, the RL update
  lifecycle, /weight_info, /health): every other route is 404 and websockets are closed.
  /weight_info?fingerprint=K is answered here: the served weights' fingerprint
  (`logra_jax/bridge/fingerprint.py`), the `logra_fingerprint` worker call.
  vLLM registers its RL routes only with VLLM_SERVER_DEV_MODE=1, which also opens
  /collective_rpc (any worker method), /sleep, /reset_prefix_cache …; the launcher runs without
  it and this middleware adds the RL router itself on the first request. /collective_rpc is
  answered here, for the read-only `RPC_METHODS` only (403 for any other method).
* Weight versions start at "0" (vLLM starts at "default").
* Every /v1/completions choice reports `weight_version`, the version of the weights that
  produced it (vLLM reports none on this route; its per-token `weight_versions` come only from
  /inference/v1/generate with --enable-scale-out). How it is guaranteed: the weights change
  only inside an update window (/start_weight_update … /finish_weight_update), which this
  middleware opens only while generation is paused (400 otherwise) and in which it refuses
  /resume (400), so a forward pass always runs on the committed version's weights; a window
  ends with a commit (a new version) or a rollback to the same weights. The paused check and
  the opening of a window, and /resume's check of the window, hold one lock, so no /resume
  slips between them; a window closes only when the engine's session has ended (a finish
  whose body is malformed is answered 400 and leaves the window, and the session, open). A
  completion arriving while paused waits here (at most PAUSE_TIMEOUT_S, then 503) and reads
  the version once generation resumes. A completion during which no commit happened was
  produced by the version read when it arrived, exactly. One that overlapped a commit (a
  request frozen by /pause?mode=keep, or one that passed the paused check as a pause came)
  reports the OLDER version as `weight_version` and the range as
  `weight_versions: [old, new]`: never newer than the weights that produced a token. The
  trainer waits for its completions before it sends an update, so its are exact. Versions
  are set only by /finish_weight_update (/update_weight_version is refused). Streaming
  responses pass through unchanged. One API-server process (vLLM's default) is assumed.
* Update sessions may carry a key (header X-Logra-Session, the trainer's client sends a fresh
  one per push): a keyed start while another key's window is open and idle ends that window
  first (vLLM's finish without a version: the engine rolls back; a trainer that died
  mid-update leaves it open), and a keyed /update_weights or /finish_weight_update of a
  superseded session is 409. Bounds: a /pause that has not returned after PAUSE_TIMEOUT_S
  ($LOGRA_PAUSE_TIMEOUT_S, the launcher's --pause-timeout-s) is undone and answered 503; a
  request body over MAX_BODY_BYTES is 413.
* /update_weights: a refusal recorded by the `logra` engine is answered with its 4xx status and
  OpenAI-shaped JSON ``{"error": {"message", "type", "code"}, "weight_version"}``.
* /finish_weight_update {"weight_version": V} keeps the session's updates if V is their
  new_version (the engine's `commit`), else answers 400 and, like a finish without a version,
  rolls them back. After a finish the served version is the weights' version and the prefix
  cache (built with the old weights) is reset. A finish naming the served version with no
  session open is answered 200 (a client's retry of a commit that landed).
"""
import asyncio
import hmac
import json
import os
import urllib.parse

OPEN_PATHS = ('/health',)
SESSION_HEADER = b'x-logra-session'  # an update session's key (the trainer's, fresh per push)
PAUSE_TIMEOUT_S = float(os.environ.get('LOGRA_PAUSE_TIMEOUT_S') or 300)  # as the JAX engine
MAX_BODY_BYTES = 4 << 20  # every route's JSON body (blobs travel by path or URL, not here)
ROUTES = frozenset({
    ('GET', '/health'), ('GET', '/v1/models'), ('POST', '/v1/completions'),
    ('POST', '/pause'), ('POST', '/resume'), ('GET', '/is_paused'), ('GET', '/weight_info'),
    ('POST', '/init_weight_transfer_engine'), ('POST', '/start_weight_update'),
    ('POST', '/update_weights'), ('POST', '/finish_weight_update'),
    ('POST', '/update_weight_version'),  # answered 400 here: versions are set by the finish
    ('POST', '/collective_rpc'),  # answered here, for RPC_METHODS only
})
RPC_METHODS = ('logra_status', 'logra_drift')  # read-only (logra_drift: the sync benchmark)


def _error(status: int, message: str, **extra) -> dict:
  """OpenAI's error shape (as the JAX engine server answers), so its client raises with it."""
  kind = {401: 'authentication_error', 403: 'permission_error',
          404: 'not_found_error'}.get(status, 'invalid_request_error')
  return {'error': {'message': message, 'type': kind, 'code': status}, **extra}


async def _send_json(send, status: int, content: dict):
  body = json.dumps(content).encode()
  await send({'type': 'http.response.start', 'status': status,
              'headers': [(b'content-type', b'application/json'),
                          (b'content-length', str(len(body)).encode())]})
  await send({'type': 'http.response.body', 'body': body})


async def _read_body(receive) -> bytes:
  chunks, more = [], True
  while more:
    message = await receive()
    if message['type'] != 'http.request':
      break
    chunks.append(message.get('body', b''))
    more = message.get('more_body', False)
  return b''.join(chunks)


def _replay(body: bytes, receive):
  sent = False

  async def replay():
    nonlocal sent
    if not sent:
      sent = True
      return {'type': 'http.request', 'body': body, 'more_body': False}
    return await receive()
  return replay


def with_versions(body: dict, old: str, new: str, exact: bool) -> dict:
  """A completions body with `weight_version` on every choice (and on the body): ``old`` (the
  version when the request arrived); ``weight_versions: [old, new]`` where not ``exact``."""
  extra = {'weight_version': old}
  if not exact and old != new:
    extra['weight_versions'] = [old, new]
  for choice in body.get('choices') or []:
    choice.update(extra)
  return dict(body, **extra)


class LograMiddleware:
  """Raw ASGI middleware (outermost: vLLM adds --middleware after its own)."""

  def __init__(self, app):
    self.app = app
    token = os.environ.get('LOGRA_BRIDGE_TOKEN', '')
    if not token:
      raise ValueError('LOGRA_BRIDGE_TOKEN is empty: the logra launcher needs --token')
    self._expected = f'Bearer {token}'.encode()
    self._versioned = False
    self._rl_routes = False
    self._lock = asyncio.Lock()
    self._window_lock = asyncio.Lock()  # the paused check + opening, and /resume's check
    self._version = '0'  # the committed version (kept in step by /finish_weight_update)
    self._commits = 0    # commits so far: a completion spanning one reports a range
    self._window = False  # between /start_weight_update and /finish_weight_update
    self._session_key = None  # the open window's session key (None: a keyless client)
    self._busy = 0  # /update_weights calls in progress (a window being used is not stale)
    self.sessions_superseded = 0

  def _authorized(self, scope) -> bool:
    got = dict(scope.get('headers') or []).get(b'authorization', b'')
    return hmac.compare_digest(got, self._expected)

  async def __call__(self, scope, receive, send):
    if scope['type'] not in ('http', 'websocket'):
      return await self.app(scope, receive, send)
    path = scope.get('path', '')
    if path not in OPEN_PATHS and not self._authorized(scope):
      if scope['type'] == 'websocket':
        return await send({'type': 'websocket.close', 'code': 1008})
      return await _send_json(send, 401, _error(401, 'missing or wrong bearer token'))
    if scope['type'] != 'http':
      return await send({'type': 'websocket.close', 'code': 1008})
    if (scope.get('method'), path) not in ROUTES:
      return await _send_json(send, 404, _error(404, f'no route {scope.get("method")} {path}'))
    length = dict(scope.get('headers') or []).get(b'content-length', b'0')
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
      return await _send_json(send, 413, _error(
          413, f'request body of {length.decode("latin-1")} bytes: at most {MAX_BODY_BYTES}'))
    key = dict(scope.get('headers') or []).get(SESSION_HEADER)
    self._add_rl_routes(scope['app'])
    engine = scope['app'].state.engine_client
    await self._start_at_zero(engine)
    if path in ('/update_weights', '/finish_weight_update') and not self._owns(key):
      return await _send_json(send, 409, _error(
          409, f'{path}: this update session was superseded by another /start_weight_update '
               '(another client started an update)'))
    if path == '/update_weights':
      self._busy += 1
      try:
        return await self._update(engine, scope, receive, send)
      finally:
        self._busy -= 1
    if path == '/finish_weight_update':
      async with self._window_lock:
        return await self._finish(engine, scope, receive, send)
    if path == '/start_weight_update':
      async with self._window_lock:
        return await self._start(engine, scope, receive, send, key)
    if path == '/resume':
      async with self._window_lock:
        if self._window:
          return await _send_json(send, 400, _error(
              400, 'a weight update is in progress: /finish_weight_update before /resume'))
        return await self.app(scope, receive, send)
    if path == '/collective_rpc':
      return await self._rpc(engine, receive, send)
    if path == '/update_weight_version':
      return await _send_json(send, 400, _error(
          400, 'weight versions are set by /finish_weight_update {"weight_version"}'))
    if path == '/v1/completions':
      if not await self._wait_unpaused(engine):
        return await _send_json(send, 503, _error(
            503, f'generation has been paused for more than {PAUSE_TIMEOUT_S:g} s (a weight '
                 'update with no /resume yet): try again later'))
      return await self._completions(scope, receive, send)
    if path == '/pause':
      return await self._pause(engine, scope, receive, send)
    if path == '/weight_info' and b'fingerprint=' in scope.get('query_string', b''):
      return await self._fingerprint(engine, scope, send)
    return await self.app(scope, receive, send)

  async def _fingerprint(self, engine, scope, send):
    """/weight_info?fingerprint=K: the served weights' fingerprint (`fingerprint.py`) from
    the engine (worker 0), with its version, dtype and state."""
    query = urllib.parse.parse_qs(scope.get('query_string', b'').decode('latin-1'))
    try:
      k = int(query['fingerprint'][0])
    except (KeyError, ValueError, IndexError):
      return await _send_json(send, 400, _error(400, 'fingerprint must be an integer'))
    if not 1 <= k <= 64:
      return await _send_json(send, 400, _error(
          400, f'fingerprint must be an integer in [1, 64], got {k}'))
    async with self._window_lock:  # no window opens (no weight changes) while it is read
      info = (await engine.collective_rpc('logra_fingerprint', args=(str(k),)))[0]
      info['update_in_progress'] = self._window or info['update_in_progress']
    info['paused'] = await engine.is_paused()
    return await _send_json(send, 200, info)

  def _add_rl_routes(self, app):
    """vLLM's RL router (/pause, /start_weight_update …), which vLLM itself registers only in
    its dev mode; added once, before the first request is routed (no await: atomic)."""
    if self._rl_routes:
      return
    if '/start_weight_update' not in {getattr(r, 'path', None) for r in app.routes}:
      from vllm.entrypoints.rl.online import api_router  # pylint: disable=g-import-not-at-top
      app.include_router(api_router.router)
    self._rl_routes = True

  def _owns(self, key) -> bool:
    """A keyed call acts only on its own session (a keyless one on whatever is open)."""
    return key is None or not self._window or self._session_key == key

  async def _wait_unpaused(self, engine) -> bool:
    """False if generation stays paused for PAUSE_TIMEOUT_S (a pauser that died: the request
    is answered 503 instead of waiting inside vLLM without bound)."""
    deadline = asyncio.get_running_loop().time() + PAUSE_TIMEOUT_S
    while await engine.is_paused():
      if asyncio.get_running_loop().time() >= deadline:
        return False
      await asyncio.sleep(0.1)
    return True

  async def _pause(self, engine, scope, receive, send):
    """vLLM's /pause, bounded: one that has not returned after PAUSE_TIMEOUT_S (mode=wait
    with requests that do not finish) is undone (resumed) and answered 503."""
    messages = []

    async def capture(message):
      messages.append(message)
    try:
      await asyncio.wait_for(self.app(scope, receive, capture), PAUSE_TIMEOUT_S)
    except asyncio.TimeoutError:  # the pause was cancelled; undo what it did
      await engine.resume_generation()
      return await _send_json(send, 503, _error(
          503, f'/pause did not finish within {PAUSE_TIMEOUT_S:g} s (in-flight requests still '
               'running); not paused (use mode=keep to pause without waiting)'))
    for message in messages:
      await send(message)

  async def _end_stale_session(self, engine, scope):
    """Ends the open window's session (a client that started it and died): vLLM's finish
    with no version, so the engine rolls back what it staged; weights and version unchanged."""
    messages = []

    async def capture(message):
      messages.append(message)
    finish = dict(scope, path='/finish_weight_update', raw_path=b'/finish_weight_update',
                  query_string=b'')

    async def empty():
      return {'type': 'http.request', 'body': b'{}', 'more_body': False}
    await self.app(finish, empty, capture)
    self._window = (await self._status(engine))['in_session']
    if self._window:
      raise RuntimeError('logra: the stale update session did not end')
    self.sessions_superseded += 1

  async def _start(self, engine, scope, receive, send, key=None):
    """Opens an update window, only while paused (vLLM's engine crashes on an update of a
    running model). A start with a session key while another client's window is open and
    idle (no /update_weights of it running) ends that one first (`_end_stale_session`); a
    keyless start then is vLLM's (refused). The caller holds the window lock."""
    if not await engine.is_paused():
      return await _send_json(send, 400, _error(
          400, 'call /pause before /start_weight_update (an update needs paused generation)'))
    if self._window and key is not None and key != self._session_key:
      if self._busy:
        return await _send_json(send, 409, _error(
            409, 'another client\'s update is being applied: try again after it'))
      await self._end_stale_session(engine, scope)
    was_open, old_key = self._window, self._session_key
    self._window = True
    if not was_open:  # set before vLLM answers: the client's next call may come at once
      self._session_key = key
    try:
      await self.app(scope, receive, send)
    finally:
      self._window = (await self._status(engine))['in_session']
      if not self._window:
        self._session_key = None
      elif was_open:
        self._session_key = old_key

  async def _rpc(self, engine, receive, send):
    """/collective_rpc for the read-only `RPC_METHODS` ({"method", "args": [str]})."""
    try:
      body = json.loads(await _read_body(receive) or b'{}')
      method, args = body.get('method'), body.get('args', [])
    except (ValueError, AttributeError):
      return await _send_json(send, 400, _error(400, 'body must be a JSON object'))
    if method not in RPC_METHODS:
      return await _send_json(send, 403, _error(
          403, f'/collective_rpc serves only {list(RPC_METHODS)}'))
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
      return await _send_json(send, 400, _error(400, 'args must be a list of strings'))
    try:
      results = await engine.collective_rpc(method, args=tuple(args))
    except Exception as e:  # pylint: disable=broad-except  # e.g. a drift path refused
      return await _send_json(send, 400, _error(400, f'{method}: {e}'))
    return await _send_json(send, 200, {'results': list(results)})

  async def _completions(self, scope, receive, send):
    """vLLM's answer with each choice's weight_version (see the module docstring)."""
    before = (self._version, self._commits)
    messages = []

    async def capture(message):
      messages.append(message)
    await self.app(scope, receive, capture)
    start = messages[0] if messages else {}
    headers = dict(start.get('headers') or [])
    if start.get('status') != 200 or not headers.get(b'content-type', b'').startswith(
        b'application/json'):
      for message in messages:
        await send(message)
      return
    body = json.loads(b''.join(m.get('body', b'') for m in messages[1:]))
    body = with_versions(body, before[0], self._version, before[1] == self._commits)
    await _send_json(send, 200, body)

  async def _start_at_zero(self, engine):
    if self._versioned:
      return
    async with self._lock:
      if not self._versioned:
        if await engine.get_weight_version() == 'default':
          await engine.update_weight_version('0')
        self._version = await engine.get_weight_version()
        self._versioned = True

  async def _status(self, engine) -> dict:
    return (await engine.collective_rpc('logra_status'))[0]

  async def _update(self, engine, scope, receive, send):
    messages = []

    async def capture(message):
      messages.append(message)
    await self.app(scope, receive, capture)
    status = messages[0].get('status') if messages else 500
    if status == 200:
      state = await self._status(engine)
      if state['refusal'] is not None:
        refusal = state['refusal']
        return await _send_json(send, refusal['status'], _error(
            refusal['status'], refusal['error'], weight_version=state['version']))
    for message in messages:
      await send(message)

  async def _finish(self, engine, scope, receive, send):
    """With the session's new_version: commit, then vLLM's finish sets that version. Without
    one (or with another): vLLM's finish, and the engine rolls the session back."""
    body = await _read_body(receive)
    try:
      wanted = json.loads(body or b'{}').get('weight_version')
    except (ValueError, AttributeError):  # nothing ends: the window and the session stay open
      return await _send_json(send, 400, _error(
          400, 'body must be a JSON object ({} or {"weight_version"}); the update is still '
               'open'))
    state = await self._status(engine)
    if wanted is not None and not state['in_session'] and str(wanted) == state['version']:
      return await _send_json(send, 200, {'weight_version': state['version']})  # a retry
    problem, committed = None, False
    if wanted is not None and state['in_session']:
      if state['refusal'] is not None or state['pending'] is None:
        problem = 'nothing to commit: ' + (state['refusal'] or {}).get(
            'error', 'no update was received')
      elif str(wanted) != state['pending']:
        problem = (f"weight_version {wanted!r} differs from the updates' new_version "
                   f"{state['pending']}")
      else:
        await engine.collective_rpc('logra_commit')
        committed = True
    if problem is not None:
      body = b'{}'  # vLLM's finish still ends the session; the engine rolls it back
    messages = []

    async def capture(message):
      messages.append(message)
    try:
      await self.app(scope, _replay(body, receive), capture)
    finally:
      self._window = (await self._status(engine))['in_session']
      if not self._window:
        self._session_key = None
    if messages and messages[0].get('status') == 200:  # synced before the client hears back
      version = (await self._status(engine))['version']
      if await engine.get_weight_version() != version:
        await engine.update_weight_version(version)
      if committed or version != self._version:
        self._version, self._commits = version, self._commits + 1
      await engine.reset_prefix_cache()
      if problem is not None:
        return await _send_json(send, 400, _error(400, problem, weight_version=version))
    for message in messages:
      await send(message)
