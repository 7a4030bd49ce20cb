r"""The memory plan: the trainer's real jitted steps compiled for the paper's shapes, per device.

Lowers and compiles `steps.make_logra_step` / `steps.make_dense_step` with the shardings of
`train.methods` (params, optimizer state and sketch accumulators FSDP over the mesh, batch
data-parallel, projections replicated) from abstract inputs (`jax.ShapeDtypeStruct` with
shardings: nothing is allocated), on N simulated CPU devices, one subprocess per N
(XLA_FLAGS=--xla_force_host_platform_device_count=N). Shapes: the paper configs
(configs/qwen2_5_math_1_5b.py, qwen2_5_math_7b.py, paper_27b_reasoning_gym.py, whose 27B
stand-in is the larger Qwen2.5-32B shape), bf16 compute, bf16 params for LoGRA (rank 256),
fp32 master weights + fp32 AdamW moments for dense, one 4,096-token sequence per device per
micro-batch, the configs' remat / vocab_chunk / blockwise attention.

Prints per device: argument, output, aliased, temp bytes, peak = arg + out − alias + temp,
fits / OOM against 80 GiB, next to the paper's Table 1 (docs/method.md). CPU FIGURES ARE
UPPER BOUNDS: the CPU compiler runs bf16 dots in f32 (f32 copies of operands in temp).
The last stdout line is one JSON object: {"1.5b": {"dense_peak_gib": x, "logra_peak_gib": y},
"7b": {..., "logra_1dev_peak_gib": z}, "27b": {..., "logra_2dev_peak_gib": w}}.

  python experiments/memory_plan.py                 # 1.5b, 7b, 27b (docs/memory.md)
  python experiments/memory_plan.py --models=7b
  python experiments/memory_plan.py --only=7b_logra_4dev --dump_to=DIR  # one row
  python experiments/memory_plan.py --tiny          # the tiny model, same code (tests)
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_list('models', ['1.5b', '7b', '27b'], 'Model shapes to plan: 1.5b, 7b, 27b.')
flags.DEFINE_bool('tiny', False, 'Plan the tiny model instead (fast: the test suite).')
flags.DEFINE_list('only', None, "Compile only these rows, named MODEL_METHOD_NDEV, e.g. "
                  "'7b_logra_4dev' (one compile per try).")
flags.DEFINE_string('dump_to', None, "XLA's dumps (HLO, buffer assignment, "
                    '*memory-usage-report.txt) of every compiled row under this directory.')
flags.DEFINE_string('worker', None, 'Internal: compile these rows in this process.')

GIB = 2**30
HBM_GIB = 80.0
XLA_FLAGS = ('--xla_force_host_platform_device_count={n} '
             '--xla_disable_hlo_passes=while-loop-invariant-code-motion')
# (method, devices) rows per model; the JSON key of each row's peak.
ROWS = (('dense', 4, 'dense_peak_gib'), ('logra', 4, 'logra_peak_gib'))
EXTRA = {'7b': (('logra', 1, 'logra_1dev_peak_gib'),),
         '27b': (('logra', 2, 'logra_2dev_peak_gib'),)}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rows_for(models):
  """[(model, method, devices, json key)] in plan order."""
  return [(m, method, n, key) for m in models for method, n, key in ROWS + EXTRA.get(m, ())]


def row_name(row) -> str:
  """'7b_logra_4dev': the --only name of a plan row."""
  return f'{row[0]}_{row[1]}_{row[2]}dev'


def select_rows(rows, only):
  """The rows named in ``only`` (all when None); an unknown name is an error naming it."""
  if not only:
    return rows
  names = {row_name(r): r for r in rows}
  unknown = [n for n in only if n not in names]
  if unknown:
    raise app.UsageError(f'--only: unknown row(s) {unknown}; known: {sorted(names)}')
  return [names[n] for n in only]


def compile_row(model, method, devices) -> dict:
  """One row compiled in this process: memory per device, argument parts, compile time."""
  import jax  # pylint: disable=g-import-not-at-top
  from logra_jax.analysis import memory_plan as mp  # pylint: disable=g-import-not-at-top
  start = time.time()
  e = mp.entry(model, method, devices)
  with jax.set_mesh(e.mesh):  # as experiments/train.py traces the trainer's steps
    compiled = e.fn.lower(*e.args).compile()
  named = [(n, a) for n, a in zip(e.names, e.args) if a is not None]
  return dict(model=model, method=method, devices=devices, **mp.memory(compiled),
              parts={n: mp.bytes_per_device(a) for n, a in named},
              parts_global={n: mp.global_bytes(a) for n, a in named},
              compile_s=round(time.time() - start, 1))


def worker(spec: str):
  """Compiles 'model:method:devices,...' and prints one JSON line per row."""
  for item in spec.split(','):
    model, method, devices = item.split(':')
    print('ROW ' + json.dumps(compile_row(model, method, int(devices))), flush=True)


def run_workers(rows) -> list:
  """One subprocess per device count (each sees exactly N simulated CPU devices)."""
  out = []
  for n in sorted({r[2] for r in rows}):
    spec = ','.join(f'{m}:{meth}:{d}' for m, meth, d, _ in rows if d == n)
    xla = XLA_FLAGS.format(n=n) + (f' --xla_dump_to={FLAGS.dump_to}' if FLAGS.dump_to else '')
    env = dict(os.environ, XLA_FLAGS=xla, JAX_PLATFORMS='cpu',
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get('PYTHONPATH')) if p))
    with tempfile.TemporaryFile('w+') as err:
      proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), f'--worker={spec}'],
                              env=env, stdout=subprocess.PIPE, stderr=err, text=True)
      for line in proc.stdout:  # each row as it compiles (progress on stderr)
        if line.startswith('ROW '):
          out.append(json.loads(line[4:]))
          print(line.strip(), file=sys.stderr, flush=True)
      if proc.wait():
        err.seek(0)
        raise RuntimeError(f'memory plan worker for {n} device(s) failed:\n'
                           f'{err.read()[-4000:]}')
  return out


def paper_text(model, method) -> str:
  from logra_jax.analysis.memory_plan import PAPER  # pylint: disable=g-import-not-at-top
  if model not in PAPER:
    return '-'
  fig = PAPER[model][method]
  return 'OOM' if fig is None else f'{fig[0]:.2f} avg / {fig[1]:.2f} peak'


def table(results) -> str:
  g = lambda b: f'{b / GIB:8.2f}'
  lines = ['model  method devs  arg GiB  out GiB alias GiB temp GiB peak GiB  80 GiB  '
           'paper (4 GPUs)   compile s']
  for r in results:
    fits = 'fits' if r['peak'] / GIB <= HBM_GIB else 'OOM'
    lines.append(f"{r['model']:6s} {r['method']:6s} {r['devices']:4d} {g(r['argument'])} "
                 f"{g(r['output'])} {g(r['alias'])} {g(r['temp'])} {g(r['peak'])}  {fits:6s} "
                 f"{paper_text(r['model'], r['method']) if r['devices'] == 4 else '-':16s} "
                 f"{r['compile_s']:8.1f}")
  return '\n'.join(lines)


def summary(rows, results) -> dict:
  """The issue's JSON: {model: {json key: peak GiB}}."""
  out = {}
  for (model, _, _, key), r in zip(rows, results):
    out.setdefault(model, {})[key] = round(r['peak'] / GIB, 3)
  return out


def main(argv):
  del argv
  if FLAGS.worker:
    worker(FLAGS.worker)
    return
  models = ['tiny'] if FLAGS.tiny else FLAGS.models
  unknown = set(models) - {'1.5b', '7b', '27b', 'tiny'}
  if unknown:
    raise app.UsageError(f'--models: unknown {sorted(unknown)}; use 1.5b, 7b, 27b')
  rows = select_rows(rows_for(models), FLAGS.only)
  start = time.time()
  by_key = {(r['model'], r['method'], r['devices']): r for r in run_workers(rows)}
  results = [by_key[(m, meth, d)] for m, meth, d, _ in rows]
  print(table(results))
  print('\nPer device, 4,096 tokens per device per micro-batch (tiny: 64). CPU figures are '
        f'UPPER BOUNDS: XLA:CPU computes bf16 dots in f32 (f32 operand copies in temp).')
  print('Argument parts per device (MiB): ' + '; '.join(
      f"{r['model']} {r['method']} x{r['devices']}: " + ', '.join(
          f'{k} {v / 2**20:.1f}' for k, v in r['parts'].items()) for r in results))
  print(f'Compiled {len(rows)} steps in {time.time() - start:.0f} s.')
  print('ROWS ' + json.dumps(results))
  print(json.dumps(summary(rows, results)))


if __name__ == '__main__':
  app.run(main)
