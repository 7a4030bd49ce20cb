import collections
import os
import sys

import pytest

# Several concurrent OpenBLAS QR/SVD calls inside one XLA program can deadlock the CPU thread
# pool (seen with the randomized-SVD compressor): one BLAS thread per call avoids it.
os.environ.setdefault('OPENBLAS_NUM_THREADS', '1')

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402


# Whole files go to the two workers (`make test`: --dist loadfile --no-loadscope-reorder, which
# keeps this order): the files that take minutes first, longest first, then the rest with the
# most tests first (xdist's own order), so the last files to start are short and the two
# workers finish together. Seconds per file: the --durations of one full two-worker run
# (summed; rounded); only the order depends on them. Simulated with those times (each of the
# other files' times jittered +-50%), two workers end 15 s (median) / 49 s (worst of 300)
# after half the total work, against 46 s / 259 s in xdist's order.
HEAVY_FILES = {
    'test_sharding.py': 400, 'test_ablate.py': 380, 'test_fleet.py': 300,
    'test_ablations.py': 300, 'test_trainer.py': 300, 'test_notebooks.py': 270,
    'test_vllm_bridge.py': 200, 'test_configs.py': 170, 'test_weights.py': 150,
    'test_train_steps.py': 150, 'test_trainer_paths.py': 150, 'test_bridge.py': 120,
    'test_chunked.py': 110, 'test_memory_plan.py': 90, 'test_bench_vs_trl.py': 250,
    'test_bench_sampler.py': 265,
    # Session 12's files, timed alone on a loaded machine (halved): the parity study's smoke
    # runs (4 train.py runs, twice invoked), the probe's float64 tests, the fault runs.
    'test_compare_methods.py': 180, 'test_direction_quality.py': 130, 'test_faults.py': 200,
    'test_gpu_study.py': 50,  # session 19: gpu_measure.sh's tiny run
    'test_evaluate_checkpoint.py': 60,  # session 26: a tiny run, 4 evaluations, one command
    # session 30: three tiny runs (AdamW, LoGRA, adaptive), 9 tests, ~2 min (loaded)
    'test_probe_from_checkpoint.py': 100,
}


def pytest_collection_modifyitems(session, config, items):
  del session, config
  name = lambda item: os.path.basename(str(item.path))
  counts = collections.Counter(name(item) for item in items)
  items.sort(key=lambda item: (-HEAVY_FILES.get(name(item), 0), -counts[name(item)]))


def _session_dir(tmp_path_factory, name: str) -> str:
  """A directory every xdist worker of this session shares (under pytest's base temp)."""
  root = tmp_path_factory.getbasetemp()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    root = root.parent  # the workers' base temps are siblings
  path = root / name
  path.mkdir(exist_ok=True)
  return str(path)


@pytest.fixture(scope='session', autouse=True)
def warm_start_cache_dir(tmp_path_factory):
  """One session-wide warm-start cache directory (config key warm_start.cache_dir;
  logra_jax/train/warm_start_cache.py): the runs that warm-start the same model on the same
  batch do the SFT steps once. `trainer_runs.make_config` sets it; a subprocess gets it as
  `--config.warm_start.cache_dir=` this fixture's value."""
  import trainer_runs  # pylint: disable=g-import-not-at-top
  directory = _session_dir(tmp_path_factory, 'warm_start_cache')
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(trainer_runs, 'WARM_START_CACHE_DIR', directory)
    yield directory


@pytest.fixture(scope='session')
def shared_xla_env(tmp_path_factory):
  """Environment variables for a subprocess: XLA's persistent compilation cache in one
  directory for the session (the tiny runs of the ablations, compare_lora and notebook 03
  share programs). A size limit turns on the cache's file lock, so concurrent workers never
  read a half-written entry."""
  return {'JAX_COMPILATION_CACHE_DIR': _session_dir(tmp_path_factory, 'xla_cache_shared'),
          'JAX_COMPILATION_CACHE_MAX_SIZE': str(8 * 2**30)}


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
