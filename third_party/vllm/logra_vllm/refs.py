"""The repo's numpy-only modules, loaded by file path (the `logra_jax` package needs JAX):
the update checks both engines share (`admission`), the payload (`wire`), `projection` and
the weight fingerprint (`fingerprint`)."""
import importlib.util
import os

REPO = os.environ.get('LOGRA_REPO') or os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))))


def _load(name: str, relpath: str):
  path = os.path.join(REPO, relpath)
  spec = importlib.util.spec_from_file_location(name, path)
  if spec is None or not os.path.exists(path):
    raise ImportError(f'{path} not found: set LOGRA_REPO to the logra_jax checkout')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


admission = _load('logra_admission', 'logra_jax/bridge/admission.py')
wire = _load('logra_wire', 'logra_jax/bridge/wire.py')
projection = _load('logra_projection', 'logra_jax/sketch/projection.py')
fingerprint = _load('logra_fingerprint', 'logra_jax/bridge/fingerprint.py')
