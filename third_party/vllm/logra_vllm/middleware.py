"""`--middleware logra_vllm.middleware.LograMiddleware`: auth and the logra update protocol.

* Every route except /health needs ``Authorization: Bearer <LOGRA_BRIDGE_TOKEN>`` (vLLM's
  --api-key guards /v1/* only; its RL routes /pause, /start_weight_update, /collective_rpc …
  would run for anyone). A refused request gets 401 and reaches nothing.
* Weight versions start at "0" (vLLM starts at "default").
* /update_weights: a refusal recorded by the `logra` engine is answered with its 4xx status and
  OpenAI-shaped JSON ``{"error": {"message", "type", "code"}, "weight_version"}``.
* /finish_weight_update {"weight_version": V} keeps the session's updates if V is their
  new_version (the engine's `commit`), else answers 400 and, like a finish without a version,
  rolls them back. After a finish the served version is the weights' version and the prefix
  cache (built with the old weights) is reset.
"""
import asyncio
import hmac
import json
import os

OPEN_PATHS = ('/health',)


def _error(status: int, message: str, **extra) -> dict:
  """OpenAI's error shape (as the JAX engine server answers), so its client raises with it."""
  kind = {401: 'authentication_error'}.get(status, 'invalid_request_error')
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


class LograMiddleware:
  """Raw ASGI middleware (outermost: vLLM adds --middleware after its own)."""

  def __init__(self, app):
    self.app = app
    token = os.environ.get('LOGRA_BRIDGE_TOKEN', '')
    if not token:
      raise ValueError('LOGRA_BRIDGE_TOKEN is empty: the logra launcher needs --token')
    self._expected = f'Bearer {token}'.encode()
    self._versioned = False
    self._lock = asyncio.Lock()

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
      return await self.app(scope, receive, send)
    engine = scope['app'].state.engine_client
    await self._start_at_zero(engine)
    if path == '/update_weights':
      return await self._update(engine, scope, receive, send)
    if path == '/finish_weight_update':
      return await self._finish(engine, scope, receive, send)
    return await self.app(scope, receive, send)

  async def _start_at_zero(self, engine):
    if self._versioned:
      return
    async with self._lock:
      if not self._versioned:
        if await engine.get_weight_version() == 'default':
          await engine.update_weight_version('0')
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
    except (ValueError, AttributeError):
      return await _send_json(send, 400, _error(400, 'body must be a JSON object'))
    state = await self._status(engine)
    problem = None
    if wanted is not None and state['in_session']:
      if state['refusal'] is not None or state['pending'] is None:
        problem = 'nothing to commit: ' + (state['refusal'] or {}).get(
            'error', 'no update was received')
      elif str(wanted) != state['pending']:
        problem = (f"weight_version {wanted!r} differs from the updates' new_version "
                   f"{state['pending']}")
      else:
        await engine.collective_rpc('logra_commit')
    if problem is not None:
      body = b'{}'  # vLLM's finish still ends the session; the engine rolls it back
    messages = []

    async def capture(message):
      messages.append(message)
    await self.app(scope, _replay(body, receive), capture)
    if messages and messages[0].get('status') == 200:  # synced before the client hears back
      version = (await self._status(engine))['version']
      if await engine.get_weight_version() != version:
        await engine.update_weight_version(version)
      await engine.reset_prefix_cache()
      if problem is not None:
        return await _send_json(send, 400, _error(400, problem, weight_version=version))
    for message in messages:
      await send(message)
