import os
import sys

import pytest

# Several concurrent OpenBLAS QR/SVD calls inside one XLA program can deadlock the CPU thread
# pool (seen with the randomized-SVD compressor): one BLAS thread per call avoids it.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402


@pytest.fixture
def x64():
  """float64 for one test: only where a float64 reference is compared (users run fp32/bf16)."""
  with jax.enable_x64(True):
    yield


@pytest.fixture(scope='module')
def x64_module():
  """float64 for a whole module whose module-scoped fixtures build float64 references."""
  with jax.enable_x64(True):
    yield


# No silent skips. A skip must say why; and under CI (CI=true) every skip fails the run, so a
# test file that must run (vLLM, the real model) cannot go green by not running.
_SKIPS = []


def _record(report):
  if report.skipped and not hasattr(report, 'wasxfail'):
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    _SKIPS.append((report.nodeid, reason.removeprefix('Skipped').lstrip(': ').strip()))


def pytest_collectreport(report):
  _record(report)


def pytest_runtest_logreport(report):
  _record(report)


def _unexplained(reason):
  return not reason or reason in ('unconditional skip', 'skipped', '<Skipped instance>')


def pytest_sessionfinish(session, exitstatus):
  bad = [(n, r) for n, r in _SKIPS if _unexplained(r) or os.environ.get('CI')]
  if bad:
    lines = '\n'.join(f'  {n}: {r or "(no reason given)"}' for n, r in bad)
    why = 'CI runs every test' if os.environ.get('CI') else 'a skip must state its reason'
    sys.stderr.write(f'\nskipped tests ({why}):\n{lines}\n')
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
