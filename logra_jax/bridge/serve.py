"""Serves a model with the embedded JAX engine on the bridge routes (see `server.py`).

  LOGRA_BRIDGE_TOKEN=secret python -m logra_jax.bridge.serve --model=smollm2.gguf --port=8100

`--model` is a preset name, an HF checkpoint directory or a `.gguf` file. With `--port=0` a
free port is chosen; the URL is printed and, with `--port_file`, written there once serving.
"""
import os

from absl import app, flags

from logra_jax.bridge.engine import JaxEngine
from logra_jax.bridge.server import BridgeServer
from logra_jax.models import api

_MODEL = flags.DEFINE_string('model', None, 'Preset name, HF checkpoint directory or .gguf.')
_HOST = flags.DEFINE_string('host', '127.0.0.1', 'Address to bind.')
_PORT = flags.DEFINE_integer('port', 8100, 'Port (0: any free port).')
_TOKEN = flags.DEFINE_string('token', None, 'Bearer token (default: $LOGRA_BRIDGE_TOKEN).')
_DTYPE = flags.DEFINE_string('dtype', 'float32', 'Compute and storage dtype.')
_MAX_UPDATE = flags.DEFINE_integer(
    'max_update_bytes', None, 'Largest update blob (413). Default: sized from the model, its '
    'full fp32 blob x 1.25 + headers (admission.max_update_bytes).')
_PORT_FILE = flags.DEFINE_string('port_file', None, 'Write the URL here once serving.')
_PAD = flags.DEFINE_integer('pad_id', 0, 'Padding token id.')
_PAUSE_TIMEOUT = flags.DEFINE_float(
    'pause_timeout_s', 300.0, 'Longest wait of a request for /resume, and of /pause for the '
    'in-flight requests (then 503).')
_SOCKET_TIMEOUT = flags.DEFINE_float(
    'socket_timeout_s', 120.0, 'Longest a read or write on a connection may block.')
flags.mark_flag_as_required('model')


def main(argv):
  del argv
  token = _TOKEN.value or os.environ.get('LOGRA_BRIDGE_TOKEN')
  if not token:
    raise app.UsageError('set LOGRA_BRIDGE_TOKEN or --token: every route but /health needs it')
  model = api.load(_MODEL.value, dtype=_DTYPE.value)
  engine = JaxEngine(model.config, model.params, pad_id=_PAD.value,
                     pause_timeout_s=_PAUSE_TIMEOUT.value)
  server = BridgeServer(engine, token, _HOST.value, _PORT.value,
                        model_name=os.path.basename(_MODEL.value.rstrip('/')),
                        max_update_bytes=_MAX_UPDATE.value,
                        socket_timeout_s=_SOCKET_TIMEOUT.value)
  print(f'serving {_MODEL.value} on {server.url}', flush=True)
  if _PORT_FILE.value:
    tmp = _PORT_FILE.value + '.tmp'
    with open(tmp, 'w') as f:
      f.write(server.url)
    os.replace(tmp, _PORT_FILE.value)
  server.serve_forever()


if __name__ == '__main__':
  app.run(main)
