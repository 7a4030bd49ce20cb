"""Starts vLLM's OpenAI server with the logra engine, worker extension and middleware.

Run by `third_party/vllm/serve` in vLLM's virtual environment. Arguments after `--` go to vLLM.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def parse(argv):
  p = argparse.ArgumentParser(prog='third_party/vllm/serve', description=__doc__)
  p.add_argument('--model', required=True, help='an HF checkpoint directory or a .gguf file')
  p.add_argument('--host', default='127.0.0.1')
  p.add_argument('--port', type=int, default=8000)
  p.add_argument('--token', default=os.environ.get('LOGRA_BRIDGE_TOKEN', ''),
                 help='bearer token for every route but /health (default $LOGRA_BRIDGE_TOKEN)')
  p.add_argument('--max-update-bytes', type=int, default=None,
                 help='larger update blobs are refused with 413 (default: sized from the '
                 "model, its full fp32 blob x 1.25 + headers: logra_jax/bridge/admission.py's "
                 'max_update_bytes)')
  p.add_argument('--update-origins', default=os.environ.get('LOGRA_UPDATE_ORIGINS', ''),
                 help='comma-separated http(s)://host:port that update_info.url may name (the '
                 "trainer's blob server); empty: URLs are refused, only paths are read")
  p.add_argument('--pause-timeout-s', type=float, default=300.0,
                 help='a completion waits at most this long for /resume, and /pause?mode=wait '
                 'for in-flight requests, then 503 (a trainer that paused and died hangs no '
                 'client; as the JAX engine server)')
  p.add_argument('--timeout-keep-alive', type=int, default=5,
                 help="seconds uvicorn keeps an idle connection open (vLLM's "
                 'VLLM_HTTP_TIMEOUT_KEEP_ALIVE)')
  p.add_argument('--dtype', default='float32')
  p.add_argument('--workdir', default=os.path.join(REPO, 'runs', 'vllm'),
                 help='holds the vLLM cache and the HF exports of .gguf models')
  p.add_argument('--compile', action='store_true', help='drop --enforce-eager (slower start)')
  args, extra = p.parse_known_args(argv)
  if extra and extra[0] == '--':
    extra = extra[1:]
  if not args.token:
    p.error('--token (or LOGRA_BRIDGE_TOKEN) is required: every route but /health needs it')
  return args, extra


def export_gguf(path: str, workdir: str) -> str:
  """The HF directory of a .gguf, exported once by the repo's own environment."""
  stat = os.stat(path)
  key = hashlib.sha256(f'{os.path.abspath(path)}:{stat.st_size}:{stat.st_mtime_ns}'.encode())
  out = os.path.join(workdir, 'hf-' + key.hexdigest()[:16])
  if os.path.exists(os.path.join(out, 'config.json')):
    return out
  python = os.environ.get('LOGRA_PYTHON') or os.path.join(REPO, '.venv', 'bin', 'python')
  if not os.path.exists(python):
    sys.exit(f'exporting {path} needs the repo environment ({python}; make venv, or set '
             'LOGRA_PYTHON)')
  code = ('import sys; from logra_jax.models import api; '
          'api.load(sys.argv[1]).save(sys.argv[2])')
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get('PYTHONPATH', '')]))
  subprocess.run([python, '-c', code, path, out + '.tmp'], check=True, env=env)
  os.replace(out + '.tmp', out)
  return out


def vllm_argv(args, model_dir, extra):
  argv = [sys.executable, '-m', 'vllm.entrypoints.openai.api_server', '--model', model_dir,
          '--host', args.host, '--port', str(args.port), '--dtype', args.dtype,
          '--worker-extension-cls', 'logra_vllm.extension.LograWorkerExtension',
          '--weight-transfer-config', json.dumps({'backend': 'logra'}),
          '--middleware', 'logra_vllm.middleware.LograMiddleware']
  if not args.compile:
    argv.append('--enforce-eager')
  return argv + extra


def main(argv=None):
  args, extra = parse(sys.argv[1:] if argv is None else argv)
  os.makedirs(args.workdir, exist_ok=True)
  model = args.model
  if os.path.isfile(model) and model.endswith('.gguf'):
    model = export_gguf(model, args.workdir)
  elif not os.path.isdir(model):
    sys.exit(f'--model {model!r} is neither an HF checkpoint directory nor a .gguf file')
  # No VLLM_SERVER_DEV_MODE: the middleware adds vLLM's RL router itself (its dev routes,
  # /collective_rpc with any worker method, /sleep …, stay unregistered).
  env = dict(os.environ, LOGRA_BRIDGE_TOKEN=args.token, LOGRA_REPO=REPO,
             LOGRA_UPDATE_ORIGINS=args.update_origins,
             PYTHONPATH=os.pathsep.join(p for p in [HERE, os.environ.get('PYTHONPATH')] if p))
  env.pop('VLLM_SERVER_DEV_MODE', None)
  env['LOGRA_PAUSE_TIMEOUT_S'] = str(args.pause_timeout_s)
  env['VLLM_HTTP_TIMEOUT_KEEP_ALIVE'] = str(args.timeout_keep_alive)
  if args.max_update_bytes is not None:
    env['LOGRA_MAX_UPDATE_BYTES'] = str(args.max_update_bytes)
  env.setdefault('VLLM_CPU_KVCACHE_SPACE', '1')
  env.setdefault('VLLM_CACHE_ROOT', os.path.join(args.workdir, 'cache'))
  argv = vllm_argv(args, model, extra)
  os.execve(argv[0], argv, env)


if __name__ == '__main__':
  main()
