"""`--middleware logra_vllm.middleware.LograMiddleware`: auth and the logra update protocol.

* Every route except /health needs ``Authorization: Bearer <LOGRA_BRIDGE_TOKEN>`` (vLLM's
  --api-key guards /v1/* only; its RL routes /pause, /start_weight_update, /collective_rpc …
  would run for anyone). A refused request gets 401 and reaches nothing.
* Weight versions start at "0" (vLLM starts at "default").
* /update_weights: a refusal recorded by the `logra` engine is answered with its 4xx status and
  a JSON message ``{"error", "weight_version"}``.
* /finish_weight_update: a ``weight_version`` other than the one the weights are at is refused
  (409); after a finish the served version is the weights' version and the prefix cache (built
  with the old weights) is reset.
"""
import asyncio
import hmac
import json
import os

OPEN_PATHS = ('/health',)


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
      return await _send_json(send, 401, {'error': 'missing or wrong bearer token'})
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
        return await _send_json(send, state['refusal']['status'],
                                {'error': state['refusal']['error'],
                                 'weight_version': state['version']})
    for message in messages:
      await send(message)

  async def _finish(self, engine, scope, receive, send):
    body = await _read_body(receive)
    try:
      wanted = json.loads(body or b'{}').get('weight_version')
    except (ValueError, AttributeError):
      return await _send_json(send, 400, {'error': 'body must be a JSON object'})
    state = await self._status(engine)
    if wanted is not None and str(wanted) != state['version']:
      return await _send_json(send, 409, {
          'error': f'weight_version {wanted!r} given, but the weights are at version '
                   f'{state["version"]} (a refused update keeps the previous version): finish '
                   'without a version', 'weight_version': state['version']})
    messages = []

    async def capture(message):
      messages.append(message)
    await self.app(scope, _replay(body, receive), capture)
    if messages and messages[0].get('status') == 200:  # synced before the client hears back
      if await engine.get_weight_version() != state['version']:
        await engine.update_weight_version(state['version'])
      await engine.reset_prefix_cache()
    for message in messages:
      await send(message)
