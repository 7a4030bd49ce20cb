"""The trainer's side of the bridge: a fleet of generation servers behind one `Generator`.

Requests are spread over the servers (one /v1/completions call per prompt, with its own seed,
concurrently); an update is broadcast to every server concurrently on vLLM's lifecycle:
pause(keep) → start → update(update_info) → finish(version) → resume. A server that answers
409 (its weights are not the update's base) gets full weights instead; any other refusal is
finished without a version (the server keeps its previous weights) and raised.

A call that fails in transit is retried only when a repeat is harmless: the connection was
refused (nothing was sent), or the call is idempotent (`IDEMPOTENT`: reads, pause, resume,
completions, and a finish that names its version: both servers answer a repeat of a commit
that landed with 200). A start or an update that may have reached the server is not repeated:
it raises. Completions that come back aborted (empty, `finish_reason` abort: another client
paused the server with mode abort) are requested again, at most `ABORT_RETRIES` times, and
counted; they never reach the trainer.

Every call is bounded (`Timeouts`: connect, /health, a completion, an update call); one that
times out is not repeated. A server that fails in transit (the client's retries spent: dead,
or not answering in time) is marked down: its requests go to the servers that are up, updates skip it, and it serves again only
after `Fleet.rejoin` (full weights first). No server up: `FleetDown`, naming every server.
"""
import concurrent.futures
import dataclasses
import http.client
import json
import os
import secrets
import tempfile
import threading
import time
import urllib.parse
from typing import Callable, Optional, Sequence

from logra_jax.rl.types import GenerationRequest, GenerationResult

RETRIES = 4
ABORT_RETRIES = 3
SHM = '/dev/shm'
SHM_HEADROOM = 64 << 20  # left free in /dev/shm (Docker's default size is all of 64 MiB)
IDEMPOTENT = ('/pause', '/resume', '/v1/completions')  # POSTs a repeat of which is harmless
SESSION_HEADER = 'X-Logra-Session'  # an update session's key, fresh per push (`_push_one`)


class BridgeError(RuntimeError):
  """A server refused a call: ``status`` and its JSON message."""

  def __init__(self, url: str, status: int, message: str):
    super().__init__(f'{url}: HTTP {status}: {message}')
    self.url, self.status, self.message = url, status, message


class FleetDown(RuntimeError):
  """No generation server is up; ``servers``: {url: why it was marked down}."""

  def __init__(self, servers: dict):
    self.servers = dict(servers)
    super().__init__('no generation server is up: ' + '; '.join(
        f'{url} ({why})' for url, why in self.servers.items()))


@dataclasses.dataclass(frozen=True)
class Timeouts:
  """How long the client waits, in seconds (config keys rollout.*_timeout_s).

  ``connect_s``: for the TCP connection (a refused or unanswered connect sent nothing: it is
  retried); ``health_s``: for GET /health; ``generation_s``: for the answer to a
  /v1/completions call; ``update_s``: for the answer to every other call (the update
  lifecycle, /weight_info). A call whose answer does not come in time is not repeated: the
  server is taken as hung (`Fleet` marks it down), so a hung server costs one timeout.
  """
  connect_s: float = 10.0
  health_s: float = 10.0
  generation_s: float = 300.0
  update_s: float = 900.0

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if not getattr(self, field.name) > 0:
        raise ValueError(f'client timeout {field.name} must be > 0, got '
                         f'{getattr(self, field.name)!r}')

  def read_s(self, method: str, path: str) -> float:
    """The answer's timeout of a call of ``method`` on ``path``."""
    path = path.split('?', 1)[0]
    if path == '/health':
      return self.health_s
    return self.generation_s if path == '/v1/completions' else self.update_s


class _Unsent(Exception):
  """The connection was not made: nothing was sent."""


class ServerClient:
  """JSON calls to one server, with retries (exponential backoff) where a repeat is harmless."""

  def __init__(self, url: str, token: str, timeouts: Optional[Timeouts] = None):
    self.url, self.token = url.rstrip('/'), token
    self.timeouts = timeouts or Timeouts()
    parts = urllib.parse.urlsplit(self.url)
    if parts.scheme not in ('http', 'https') or not parts.hostname:
      raise ValueError(f'a server URL must be http(s)://host[:port], got {url!r}')
    self._parts = parts

  def _once(self, method: str, path: str, data: Optional[bytes], headers: dict,
            read_s: float) -> dict:
    """One request: the JSON answer; `BridgeError` for an HTTP error (redirects are not
    followed), `_Unsent` when no connection was made, `TimeoutError` for no answer in
    ``read_s``, another OSError or HTTPException if the connection broke."""
    cls = (http.client.HTTPSConnection if self._parts.scheme == 'https'
           else http.client.HTTPConnection)
    conn = cls(self._parts.hostname, self._parts.port, timeout=self.timeouts.connect_s)
    try:
      try:
        conn.connect()
      except OSError as e:
        raise _Unsent(f'cannot connect: {e}') from None
      conn.sock.settimeout(read_s)
      conn.request(method, self._parts.path + path, body=data, headers=headers)
      resp = conn.getresponse()
      raw = resp.read()
    finally:
      conn.close()
    if not 200 <= resp.status < 300:
      raise BridgeError(self.url, resp.status, _message(raw, resp.reason))
    return json.loads(raw or b'{}')

  def call(self, method: str, path: str, body: Optional[dict] = None,
           headers: Optional[dict] = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    headers = {'Authorization': f'Bearer {self.token}', 'Content-Type': 'application/json',
               **(headers or {})}
    repeatable = _idempotent(method, path, body)
    read_s = self.timeouts.read_s(method, path)
    for attempt in range(RETRIES):
      try:
        return self._once(method, path, data, headers, read_s)
      except BridgeError:
        raise
      except TimeoutError:  # connected, sent, and no answer: hung (or far too slow)
        raise BridgeError(self.url, 0, f'{method} {path}: no answer within {read_s:g} s '
                                       '(timed out; not repeated)') from None
      except (_Unsent, OSError, http.client.HTTPException) as e:
        if not (repeatable or isinstance(e, _Unsent)):
          raise BridgeError(self.url, 0, f'{method} {path} failed in transit and is not '
                                         f'repeated (it may have reached the server): '
                                         f'{e}') from None
        if attempt == RETRIES - 1:
          raise BridgeError(self.url, 0, f'unreachable after {RETRIES} tries: {e}') from None
        time.sleep(0.2 * 2**attempt)
    raise AssertionError('unreachable')

  def healthy(self) -> bool:
    """GET /health answered 200 within the connect and health timeouts (one try)."""
    try:
      self._once('GET', '/health', None, {}, self.timeouts.health_s)
      return True
    except (BridgeError, _Unsent, OSError, http.client.HTTPException, ValueError):
      return False

  def wait_healthy(self, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not self.healthy():
      if time.monotonic() > deadline:
        raise BridgeError(self.url, 0, f'not healthy after {timeout_s:.0f} s')
      time.sleep(0.25)


def _idempotent(method: str, path: str, body: Optional[dict]) -> bool:
  path = path.split('?', 1)[0]
  if method == 'GET' or path in IDEMPOTENT:
    return True
  return path == '/finish_weight_update' and bool(body) and 'weight_version' in body


def _message(raw: bytes, reason: str) -> str:
  """An error answer's message (OpenAI's JSON shape), else the HTTP reason."""
  try:
    return json.loads(raw)['error']['message']
  except (ValueError, KeyError, TypeError):
    return reason


def completion_body(request: GenerationRequest, model: str) -> dict:
  p = request.params
  return {'model': model, 'prompt': list(request.prompt_token_ids), 'n': p.n, 'seed': p.seed,
          'temperature': p.temperature, 'top_p': p.top_p, 'top_k': p.top_k,
          'max_tokens': p.max_new_tokens, 'stop_token_ids': list(p.stop_token_ids),
          'logprobs': 0, 'return_token_ids': True}


def _version(choice: dict) -> int:
  """A choice's weight version: the oldest that may have produced it (docs/bridge.md)."""
  version = choice.get('weight_version')
  if not isinstance(version, str) or not version.isdigit():
    raise ValueError(f'a completion choice reports weight_version={version!r}, not a decimal '
                     'string: is the server a logra JAX engine or vLLM with our plug-in?')
  return int(version)


def parse_choices(request: GenerationRequest, response: dict) -> list[GenerationResult]:
  out = []
  for j, c in enumerate(response['choices']):
    out.append(GenerationResult(
        request_id=request.request_id, sample_index=j, prompt_token_ids=request.prompt_token_ids,
        completion_token_ids=tuple(c['token_ids']),
        behaviour_logprobs=tuple(c['logprobs']['token_logprobs']),
        finish_reason=c['finish_reason'] if c['finish_reason'] in ('stop', 'length', 'abort')
        else 'stop', weight_version=_version(c)))
  return out


class Fleet:
  """Generation servers as one `logra_jax.rl.Generator`, and the update broadcast."""

  def __init__(self, urls: Sequence[str], token: str, model: str = 'logra',
               max_concurrency: int = 8, blob_dir: Optional[str] = None,
               timeouts: Optional[Timeouts] = None):
    """``blob_dir``: where update blob files are written (a directory the servers read, in
    their update dirs: a shared mount for servers on other hosts); None: `blob_dir`'s pick.
    ``timeouts``: the client's (`Timeouts`; a server that does not answer in time is marked
    down)."""
    if not urls:
      raise ValueError('a fleet needs at least one server URL')
    self.timeouts = timeouts or Timeouts()
    self.servers = [ServerClient(u, token, self.timeouts) for u in urls]
    self.model, self.version, self.blob_dir, self.token = model, 0, blob_dir, token
    self.aborts_retried = 0  # completions requested again because they came back aborted
    self._count = threading.Lock()
    self._down = {}  # index -> why the server was marked down (the client's error)
    self._pool = concurrent.futures.ThreadPoolExecutor(max_concurrency * len(urls))

  @property
  def weight_version(self) -> int:
    return self.version

  @property
  def servers_up(self) -> int:
    return len(self.servers) - len(self._down)

  def down(self) -> list:
    """The indices of the servers marked down."""
    with self._count:
      return sorted(self._down)

  def _up(self) -> list:
    with self._count:
      up = [i for i in range(len(self.servers)) if i not in self._down]
      if not up:
        raise FleetDown({self.servers[i].url: why for i, why in sorted(self._down.items())})
      return up

  def mark_down(self, i: int, error: Exception):
    with self._count:
      self._down.setdefault(i, str(error))

  def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
    up = self._up()
    futures = [self._pool.submit(self._complete_on_any, up[k % len(up)], r)
               for k, r in enumerate(requests)]
    return [res for f in futures for res in f.result()]

  def _complete_on_any(self, i: int, request: GenerationRequest) -> list:
    """`_complete` on server ``i``, else (marked down on a transit failure) on another that
    is up: a request's seed makes its completions the same on any server."""
    while True:
      try:
        return self._complete(self.servers[i], request)
      except BridgeError as e:
        if e.status:  # the server answered: a refusal, not a fault of the server
          raise
        self.mark_down(i, e)
      up = self._up()
      i = up[i % len(up)]

  def _complete(self, server: ServerClient, request: GenerationRequest) -> list:
    """One request's choices, none aborted (requested again; raises after ABORT_RETRIES)."""
    for attempt in range(ABORT_RETRIES + 1):
      results = parse_choices(request, server.call('POST', '/v1/completions',
                                                   completion_body(request, self.model)))
      if not any(r.finish_reason == 'abort' for r in results):
        return results
      if attempt < ABORT_RETRIES:
        with self._count:
          self.aborts_retried += 1
        time.sleep(0.1 * 2**attempt)
    raise BridgeError(server.url, 0, f'completions of request {request.request_id} came '
                                     f'back aborted {ABORT_RETRIES + 1} times')

  def push(self, blob: bytes, version: int, full_blob: Callable[[], bytes]) -> dict:
    """Broadcasts one update to the servers up; those answering 409 get ``full_blob()``, those
    failing in transit are marked down (`FleetDown` when none is left). Returns counts."""
    up = self._up()
    with _BlobFile(blob, self.blob_dir) as path:
      results = self._push_each(up, path, version)
    stale = [i for i, r in zip(up, results) if r == 409]
    if stale:
      with _BlobFile(full_blob(), self.blob_dir) as path:
        self._push_each(stale, path, version, strict=True)
    self._up()
    self.version = version
    with self._count:
      aborts, self.aborts_retried = self.aborts_retried, 0
    return {'sync_servers': len(up), 'sync_full_fallbacks': len(stale),
            'sync_bytes': len(blob), 'fleet_aborts_retried': aborts,
            'fleet_servers_up': self.servers_up}

  def _push_each(self, indices: Sequence[int], path: str, version: int, strict=False) -> list:
    """`_push_one` on each server at ``indices``; one failing in transit is marked down."""
    def push(i):
      try:
        return _push_one(self.servers[i], path, version, strict)
      except BridgeError as e:
        if e.status:
          raise
        self.mark_down(i, e)
        return None
    return list(self._pool.map(push, indices))

  def rejoin(self, i: int, blob: bytes, url: Optional[str] = None) -> bool:
    """Server ``i`` (at ``url`` when it moved: a relaunch) serves again once the full weights
    ``blob`` of the current version are committed on it; False (still down) if they are not."""
    if url:
      self.servers[i] = ServerClient(url, self.token, self.timeouts)
    with _BlobFile(blob, self.blob_dir) as path:
      try:
        _push_one(self.servers[i], path, self.version, strict=True)
      except BridgeError as e:
        with self._count:
          self._down[i] = str(e)
        return False
    with self._count:
      self._down.pop(i, None)
    return True

  def weight_infos(self, k: int) -> list:
    """Every server's `GET /weight_info?fingerprint=k` (version, dtype, fingerprint); None for
    a server that is down (or fails in transit now: then marked down)."""
    def info(i):
      if i in self._down:
        return None
      try:
        return self.servers[i].call('GET', f'/weight_info?fingerprint={int(k)}')
      except BridgeError as e:
        if e.status:
          raise
        self.mark_down(i, e)
        return None
    return list(self._pool.map(info, range(len(self.servers))))

  def resync(self, indices: Sequence[int], blob: bytes) -> int:
    """Sends the full weights ``blob`` of the current version to the servers at ``indices``
    (a full blob for their base: every tensor replaced, the version kept); returns how many."""
    if indices:
      with _BlobFile(blob, self.blob_dir) as path:
        self._push_each(indices, path, self.version, strict=True)
    return len(indices)

  def close(self):
    self._pool.shutdown(wait=False)


def _push_one(server: ServerClient, path: str, version: int, strict: bool = False):
  """The lifecycle on one server; 409 is returned (not raised) unless ``strict``.

  Start, update and finish carry a fresh session key (`SESSION_HEADER`): a session that a
  dead trainer left open is ended by this start (weights and version unchanged), and no call
  of this push acts on a session another client started since."""
  key = {SESSION_HEADER: secrets.token_hex(16)}
  server.call('POST', '/pause?mode=keep')
  try:
    server.call('POST', '/start_weight_update', {}, headers=key)
    try:
      server.call('POST', '/update_weights', {'update_info': {'path': path}}, headers=key)
    except BridgeError as e:
      server.call('POST', '/finish_weight_update', {}, headers=key)
      if e.status == 409 and not strict:
        return 409
      raise
    server.call('POST', '/finish_weight_update', {'weight_version': str(version)},
                headers=key)
    return 200
  finally:
    server.call('POST', '/resume', {})


def blob_dir(size: int) -> str:
  """/dev/shm when it exists with ``size`` + `SHM_HEADROOM` bytes free, else the temp dir."""
  try:
    st = os.statvfs(SHM)
  except OSError:
    return tempfile.gettempdir()
  return SHM if st.f_bavail * st.f_frsize >= size + SHM_HEADROOM else tempfile.gettempdir()


class _BlobFile:
  """The blob in a file in ``directory``, else a shared-memory one (`blob_dir`; the temp dir
  when a write to /dev/shm fails), removed after."""

  def __init__(self, blob: bytes, directory: Optional[str] = None):
    self.blob, self.directory = blob, directory

  def __enter__(self) -> str:
    tried = [self.directory] if self.directory else [blob_dir(len(self.blob)),
                                                     tempfile.gettempdir()]
    for directory in dict.fromkeys(tried):
      fd, self.path = tempfile.mkstemp(prefix='logra-update-', suffix='.safetensors',
                                       dir=directory)
      try:
        with os.fdopen(fd, 'wb') as f:
          f.write(self.blob)
        return self.path
      except OSError:  # ENOSPC: the tmpfs filled since statvfs
        os.unlink(self.path)
        if directory == tried[-1]:
          raise
    raise AssertionError('unreachable')

  def __exit__(self, *exc):
    os.unlink(self.path)
