"""What a generator admits as an update: where its blob comes from, how large, which versions.

One set of checks for both engines (docs/bridge.md, "Faults and checks"): the JAX engine's
server imports it; vLLM's side (`third_party/vllm/logra_vllm/refs.py`) loads this file by path,
so it uses the standard library only and no other module of ours.

  update_info {"path": FILE}  FILE (symlinks resolved) lies in an update directory: the
                              configured ones, else $LOGRA_UPDATE_DIRS, else /dev/shm and the
                              temp dir; at most ``max_bytes``.
  update_info {"url": URL}    only when URL's origin (scheme://host:port) is allow-listed (the
                              configured origins, else $LOGRA_UPDATE_ORIGINS; none by default, so
                              URLs are refused): no proxy, no redirect followed, the bearer token
                              sent to that origin only, at most ``max_bytes``, and errors that
                              name no host.
  versions                    never backward; a full blob holds every tensor of the model (any
                              base; the served version kept only by such a complete re-sync).
"""
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request

MAX_BYTES_MARGIN = 1.25  # the limit over a full fp32 blob's tensors (low-rank blobs are less)
HEADER_BYTES_PER_TENSOR = 1024  # safetensors header + metadata (name, shape, ranks, A checksum)
URL_TIMEOUT_S = 60.0
_PORTS = {'http': 80, 'https': 443}


class Refused(Exception):
  """A refused update: HTTP ``status`` and a message that names no other host."""

  def __init__(self, status: int, message: str):
    super().__init__(message)
    self.status = status


def update_dirs(configured=()) -> tuple:
  """Real paths of the existing directories update files may lie in."""
  dirs = [d for d in configured if d]
  if not dirs:
    dirs = [d for d in os.environ.get('LOGRA_UPDATE_DIRS', '').split(os.pathsep) if d]
  if not dirs:
    dirs = ['/dev/shm', tempfile.gettempdir()]
  return tuple(os.path.realpath(d) for d in dirs if os.path.isdir(d))


def origin(url: str) -> str:
  """``scheme://host:port`` of an http(s) URL (lower case, default port filled in), or ''."""
  try:
    parts = urllib.parse.urlsplit(url)
    port = parts.port or _PORTS.get(parts.scheme)
  except ValueError:
    return ''
  if parts.scheme not in _PORTS or not parts.hostname or parts.username or parts.password:
    return ''
  return f'{parts.scheme}://{parts.hostname.lower()}:{port}'


def update_origins(configured=()) -> tuple:
  """Origins ``update_info.url`` may name: configured, else $LOGRA_UPDATE_ORIGINS (commas)."""
  given = [o for o in configured if o]
  if not given:
    given = [o.strip() for o in os.environ.get('LOGRA_UPDATE_ORIGINS', '').split(',')]
  out = tuple(origin(o) for o in given if o)
  if '' in out:
    raise ValueError(f'update origins must be http(s)://host[:port], got {list(given)}')
  return out


def read_update(info, *, dirs: tuple, origins: tuple, token: str, max_bytes: int) -> bytes:
  """The blob named by ``update_info`` ({"path"} or {"url"}), or `Refused`."""
  if (not isinstance(info, dict) or len(info) != 1 or not {'path', 'url'} & set(info)
      or not isinstance(next(iter(info.values())), str)):
    raise Refused(400, 'update_info must be {"path": FILE} or {"url": URL}')
  if 'path' in info:
    return read_path(info['path'], dirs, max_bytes)
  return fetch_url(info['url'], origins, token, max_bytes)


def max_update_bytes(spec) -> int:
  """The default update limit for a model of tensors ``spec`` ({name: shape}): its full fp32
  blob (4 bytes a weight) x `MAX_BYTES_MARGIN`, plus a header bound per tensor and 1 MiB. A
  server's explicit limit (--max_update_bytes) replaces it."""
  weights = 0
  for shape in spec.values():
    n = 1
    for d in shape:
      n *= int(d)
    weights += n
  return int(4 * weights * MAX_BYTES_MARGIN) + HEADER_BYTES_PER_TENSOR * len(spec) + (1 << 20)


def _too_large(size, max_bytes):
  return Refused(413, f'update of {size} bytes exceeds the limit of {max_bytes} bytes')


def read_path(path: str, dirs: tuple, max_bytes: int) -> bytes:
  real = os.path.realpath(path)
  if not any(os.path.commonpath([real, d]) == d for d in dirs):
    raise Refused(400, f'update_info.path must lie in {list(dirs)}')
  try:
    with open(real, 'rb') as f:
      size = os.fstat(f.fileno()).st_size
      if size > max_bytes:
        raise _too_large(size, max_bytes)
      blob = f.read(max_bytes + 1)
  except (IsADirectoryError, FileNotFoundError, PermissionError):
    raise Refused(400, f'update_info.path {real!r} is not a readable file') from None
  if len(blob) > max_bytes:  # grew since fstat
    raise _too_large(len(blob), max_bytes)
  return blob


class _NoRedirect(urllib.request.HTTPRedirectHandler):
  """A 3xx is an error (urllib would follow it with the Authorization header, to any host)."""

  def redirect_request(self, req, fp, code, msg, headers, newurl):
    return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)


def fetch_url(url: str, origins: tuple, token: str, max_bytes: int) -> bytes:
  """GET ``url`` from an allow-listed origin; the token goes there and nowhere else."""
  if not origins:
    raise Refused(400, 'update_info.url is disabled on this server (no update origins '
                       'allowed): send {"path"} or configure LOGRA_UPDATE_ORIGINS')
  if origin(url) not in origins:
    raise Refused(400, 'update_info.url is not on an allowed update origin')
  req = urllib.request.Request(url, headers={'Authorization': f'Bearer {token}'})
  try:
    with _OPENER.open(req, timeout=URL_TIMEOUT_S) as resp:
      length = resp.headers.get('Content-Length')
      if length is not None and length.isdigit() and int(length) > max_bytes:
        raise _too_large(int(length), max_bytes)
      blob = resp.read(max_bytes + 1)
  except urllib.error.HTTPError as e:
    e.close()
    redirect = ' (redirects are not followed)' if 300 <= e.code < 400 else ''
    raise Refused(400, f'cannot fetch update_info.url: HTTP {e.code}{redirect}') from None
  except (OSError, ValueError):  # names no address: only that the allowed origin failed
    raise Refused(400, 'cannot fetch update_info.url: the connection failed') from None
  if len(blob) > max_bytes:
    raise _too_large(len(blob), max_bytes)
  return blob


def check_versions(kind: str, base: str, new: str, names, spec, current: str):
  """Refuses a version going backward (400) and a full blob that misses a tensor (400).

  ``names``: the tensors the update sets; ``spec``: {name: shape} of the whole model. A full
  blob always holds every tensor of the model, whatever its base: the weights it leaves are
  then exactly the blob's, so its ``new_version`` labels what is served. It may keep the
  served version (a re-sync: the trainer's first sync, and its answer to a drifted server,
  docs/bridge.md); a low-rank one moves it forward (`wire` checks its base).
  """
  if int(new) < int(current):
    raise Refused(400, f'new_version {new} is older than the served version {current}: '
                       'versions never go backward')
  if kind == 'full':
    missing = sorted(set(spec) - set(names))
    if missing:
      raise Refused(400, f'a full update must hold every tensor of the model; {len(missing)} '
                         f'of {len(spec)} are missing (e.g. {missing[0]}): send the whole '
                         'model, or a low-rank update for the served base')
