"""Sharding: one code path from 1 CPU to N devices (logra_jax/parallel.py).

Every multi-device test runs in a subprocess with 4 simulated CPU devices (XLA_FLAGS), so
the other tests keep one device. Multi-host runs bind 127.0.0.1 only and are killed by PID.

Tolerance (float32): a sharded step computes the same sums in another order (each device
sums its quarter of the tokens, then the partial sums are added; reductions over a sharded
axis are split in four). The relative error of such a reordered fp32 sum of n terms is
about log2(n)·2^-24 ≈ 1e-6 here; RTOL = 1e-4 keeps 100× margin and is still far below
what a lost or doubled shard does (a quarter of a sum missing is a 25% change). Metrics
that are differences of O(1) fp32 log-probs (KL estimates, mismatch: values ~1e-7-1e-9)
carry the absolute rounding of those log-probs, a few ulp of 1: ATOL = 1e-6.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from logra_jax import parallel
from logra_jax.parallel import parse_axis_rules
from logra_jax.train.config import default_config, from_config_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RTOL, ATOL = 1e-4, 1e-6
TIMING = ('step_time_s', 'tokens_per_s', 'generate_s', 'update_s')
# train.py overrides: a few tiny steps (every compile is small on a 2-core CPU).
OVERRIDES = ('--config.total_steps=3', '--config.warm_start.steps=20',
             '--config.data.prompts_per_step=8', '--config.data.eval_size=16',
             '--config.eval_every=100', '--config.eval.k=2')


def _env(devices: int) -> dict:
  return dict(os.environ, XLA_FLAGS=f'--xla_force_host_platform_device_count={devices}',
              PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')


def run_script(script: str, devices: int = 4, timeout: int = 600) -> str:
  out = subprocess.run([sys.executable, '-c', textwrap.dedent(script)], env=_env(devices),
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
  assert out.returncode == 0 and out.stdout.strip().endswith('ok'), out.stderr[-4000:]
  return out.stdout


def _train_cmd(workdir, *extra):
  return [sys.executable, os.path.join(ROOT, 'experiments', 'train.py'),
          '--config=' + os.path.join(ROOT, 'configs', 'tiny.py'), f'--workdir={workdir}',
          *OVERRIDES, *extra]


def _metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f if line.strip()]


def assert_same_metrics(got, want):
  assert [r['step'] for r in got] == [r['step'] for r in want]
  for g, w in zip(got, want):
    assert set(g) == set(w), (g.keys() ^ w.keys())
    for k in sorted(set(w) - set(TIMING)):
      if w[k] is None or g[k] is None:
        assert g[k] == w[k], (g['step'], k, g[k], w[k])
      else:
        np.testing.assert_allclose(g[k], w[k], rtol=RTOL, atol=ATOL,
                                   err_msg=f"step {w['step']} {k}")


# ---- in-process: the rules (one device) ----------------------------------------------------

class _FakeMesh:
  shape = {'data': 1, 'fsdp': 4}


RULES = parse_axis_rules('embed=fsdp,mlp=fsdp,vocab=fsdp,layers=')


@pytest.mark.parametrize('logical,shape,want', [
    (('layers', 'embed', 'mlp'), (3, 128, 256), P(None, 'fsdp', None)),  # one axis per array
    (('layers', 'mlp', 'embed'), (3, 256, 128), P(None, 'fsdp', None)),
    (('vocab', 'embed'), (18, 128), P(None, 'fsdp')),   # 18 % 4: vocab whole, embed split
    (('embed', 'vocab'), (130, 18), P(None, None)),     # neither divides: replicated
    (('heads',), (8,), P(None)),                        # no rule: replicated
])
def test_logical_axes_resolve_left_to_right_with_divisibility_fallback(logical, shape, want):
  assert parallel.spec_for(logical, shape, RULES, _FakeMesh()) == want


def test_mesh_shape_fills_minus_one_and_names_bad_sizes():
  assert parallel.mesh_shape(1, -1, 8) == (1, 8)
  assert parallel.mesh_shape(-1, 2, 8) == (4, 2)
  with pytest.raises(ValueError, match=r'mesh.data=3 x mesh.fsdp=2 must multiply to the 8'):
    parallel.mesh_shape(3, 2, 8)


@pytest.mark.parametrize('key,value,pattern', [
    ('fsdp', 0, r'mesh.fsdp must be >= 1 or -1'),
    ('rules', 'embed', r"mesh.rules: expected 'logical=mesh_axis'"),
    ('rules', 'embed=tensor', r"mesh.rules: 'embed=tensor' names mesh axis 'tensor'"),
])
def test_bad_mesh_config_names_the_key(key, value, pattern):
  cfg = default_config()
  setattr(cfg.mesh, key, value)
  with pytest.raises(ValueError, match=pattern):
    from_config_dict(cfg)


def test_a_rule_for_an_unknown_logical_axis_is_an_error():
  with pytest.raises(ValueError, match=r"logical axis 'embd'; the model has"):
    parallel.check_rules(parse_axis_rules('embd=fsdp'), {('w',): ('embed', 'mlp')})


def test_default_mesh_is_fsdp_over_every_device():
  layout = parallel.layout_from_config(from_config_dict(default_config()).mesh)
  assert dict(layout.mesh.shape) == {'data': 1, 'fsdp': 1}  # this process has one device


# ---- 4 devices: the steps --------------------------------------------------------------------

STEP_SCRIPT = '''
    import sys
    import jax, numpy as np
    from jax.sharding import PartitionSpec as P
    from flax import traverse_util
    from logra_jax import parallel
    from logra_jax.models.presets import get_preset
    from logra_jax.models.transformer import Transformer, init_params
    from logra_jax.train import methods
    from logra_jax.train.config import default_config, from_config_dict
    devices, out_path = int(sys.argv[1]), sys.argv[2]
    assert jax.device_count() == devices, jax.devices()
    jax.config.update('jax_enable_x64', True)
    mc = get_preset('tiny', vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=2, num_kv_heads=1, max_position_embeddings=32,
                    dtype='float64', param_dtype='float64')
    model = Transformer(mc)
    host = jax.device_get(init_params(mc, jax.random.key(0)))
    N, PL, T = 16, 8, 4
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 16, (N, PL + T)).astype(np.int32)
    tokens[1::2, :PL] = tokens[::2, :PL]            # 8 prompts x 2 samples
    mask = np.ones((N, PL + T), bool)
    mask[:N // 2, :3] = False                       # some left padding
    tmask = (np.arange(T) < rng.integers(1, T + 1, (N, 1))).astype(np.float32)
    blogp = np.float32(-np.log(16)) + rng.uniform(-.1, .1, (N, T)).astype(np.float32)
    batch = dict(tokens=tokens, mask=mask, targets=tokens[:, PL:], target_mask=tmask,
                 behaviour_logp=blogp, advantages=rng.normal(size=N).astype(np.float32))
    layout = parallel.layout_from_config(from_config_dict(default_config()).mesh)
    assert dict(layout.mesh.shape) == {'data': 1, 'fsdp': devices}  # the default: FSDP, all
    jax.set_mesh(layout.mesh)  # as experiments/train.py traces the steps (model constraints)

    def per_device_bytes(tree):
      total = {}
      for x in jax.tree.leaves(tree):
        for d, b in parallel.shard_bytes(x).items():
          total[d] = total.get(d, 0) + b
      return total

    def check_split(tree, what):
      leaves = jax.tree.leaves(tree)
      full = sum(x.nbytes for x in leaves if x.ndim)
      scalars = sum(x.nbytes for x in leaves if not x.ndim)
      got = per_device_bytes(tree)
      assert sorted(got) == list(range(devices)), got
      assert all(b == full // devices + scalars for b in got.values()), (what, got, full)

    out = {}
    # logra_rest: the unsketched leaves by Adam, and Adafactor's row x column scaling in
    # sketch space (factored moments: (L, R) rows, (L, D) columns).
    # logra_adaptive: A in the state, rebuilt from the co-sketches at both steps.
    for name in ('logra', 'logra_rest', 'logra_adaptive', 'adam'):
      cfg = default_config()
      cfg.optim.name, cfg.optim.micro_batches = name.partition('_')[0], 2
      if name.startswith('logra'):
        cfg.optim.logra.rank = 8
        cfg.optim.logra.rest_learning_rate = 1e-3 if name == 'logra_rest' else 0.0
        if name == 'logra_rest':
          cfg.optim.logra.sketch_optimizer = 'adafactor'
        if name == 'logra_adaptive':
          cfg.optim.logra.subspace, cfg.optim.logra.subspace_random_rows = 'adaptive', 2
          cfg.optim.logra.momentum, cfg.optim.logra.refresh_every = 0.9, 1
      else:
        cfg.optim.adam.learning_rate = 1e-3
      # Pairs of samples: one and four devices pack the same rows (runs of 2 sharing a prompt,
      # 4 packed rows per micro-batch), so the two programs compute the same sums. (With
      # groups of 4 one device packs runs of 4 and four devices runs of 2, to keep 4 packed
      # rows: other rounding, which Adam's normalisation shows on near-zero gradients.)
      cfg.data.prompts_per_step, cfg.data.samples_per_prompt = 8, 2
      cfg.optim.kl_sequences = 8
      m = methods.get_method(from_config_dict(cfg), model, layout)
      state = m.init(host)
      for t in (1, 2):                               # step 2 reads the optimizer state
        state, metrics = m.step(state, batch, PL, t, 1e-3)
        for k, v in jax.device_get(metrics).items():
          out[f'{name}/metrics/{t}/{k}'] = v
      check_split(state['params'], name + ' params')
      check_split(state['opt_state'], name + ' optimizer state')
      q = state['params']['layers']['attn']['q_proj']['kernel']
      assert q.sharding.spec == P(None, 'fsdp', None), q.sharding
      if name == 'logra':                            # RowAdam: one moment per output unit
        nu = state['opt_state'][0].nu['layers']['mlp']['down_proj']['kernel']
        assert nu.sharding.spec == P(None, 'fsdp'), nu.sharding
      if name == 'logra_rest':                       # Adafactor's columns: the same layout
        _, col = state['opt_state'][0][0].nu['layers']['mlp']['down_proj']['kernel']
        assert col.sharding.spec == P(None, 'fsdp'), col.sharding
      flat = traverse_util.flatten_dict(jax.device_get(state['params']))
      for path, w in flat.items():                   # the update itself, not the weights
        out[f'{name}/update/' + '/'.join(path)] = w - traverse_util.flatten_dict(host)[path]
      for i, x in enumerate(jax.tree.leaves(jax.device_get(state['opt_state']))):
        out[f'{name}/opt_state/{i}'] = x
      if name == 'logra_adaptive':                   # A: replicated, the same on 1 and 4
        for i, x in enumerate(jax.tree.leaves(state['projections'])):
          assert x.sharding.is_fully_replicated, x.sharding
          out[f'{name}/projections/{i}'] = np.asarray(jax.device_get(x))
    np.savez(out_path, **out)
    print('ok')
'''


def _step_results(devices, path):
  return subprocess.Popen([sys.executable, '-c', textwrap.dedent(STEP_SCRIPT), str(devices),
                           path], env=_env(devices), cwd=ROOT, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def test_logra_and_adam_steps_sharded_equal_unsharded(tmp_path):
  """Two steps of each (LoGRA, LoGRA with its rest trained and sketch Adafactor, LoGRA with an
  adaptive subspace, AdamW) on 1 and on 4 devices (run side by side); each device holds 1/4.

  In float64: at step 2 Adam's update m̂/(√v̂ + ε) divides by the gradients' own size, so an
  entry whose gradient is a cancelling sum carries fp32 rounding far above the module's 1e-6
  (measured 2.6e-4 relative on one entry of 4096, the same with or without prompt sharing);
  in float64 that rounding is ~1e-12, and RTOL still catches a lost or doubled shard.
  """
  paths = [str(tmp_path / f'{d}.npz') for d in (1, 4)]
  procs = [_step_results(d, p) for d, p in zip((1, 4), paths)]
  try:
    outs = [p.communicate(timeout=600) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
  for p, (stdout, err) in zip(procs, outs):
    assert p.returncode == 0 and stdout.strip().endswith('ok'), err[-4000:]
  one, four = (dict(np.load(p)) for p in paths)
  assert sorted(one) == sorted(four)
  assert one['logra/metrics/1/alpha'] > 0 and one['logra/metrics/2/skipped'] == 0
  assert one['logra_rest/metrics/2/skipped'] == 0
  assert one['logra_adaptive/metrics/2/skipped'] == 0
  assert np.any(one['logra_rest/update/final_norm/scale'] != 0)  # the rest trained
  assert not np.any(one['logra/update/final_norm/scale'])        # and only there
  for k in sorted(one):
    want = one[k]
    # Updates and optimizer moments: relative to the leaf's largest entry (tiny entries of
    # a sum carry the absolute rounding of its large ones).
    atol = ATOL if '/metrics/' in k else RTOL * np.abs(want).max() + 1e-30
    np.testing.assert_allclose(four[k], want, rtol=RTOL, atol=atol, err_msg=k)


# ---- 4 devices: experiments/train.py -------------------------------------------------------

@pytest.fixture(scope='module')
def four_device_run():
  """experiments/train.py on 4 simulated devices (FSDP 4), started in the background."""
  workdir = tempfile.mkdtemp(prefix='fsdp4_')
  proc = subprocess.Popen(_train_cmd(workdir, '--config.mesh.fsdp=4'), env=_env(4), cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  done = []
  def result():
    if not done:
      try:
        done.append(proc.communicate(timeout=600)[1])
      finally:
        if proc.poll() is None:
          os.kill(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, done[0][-4000:]
    return workdir
  yield result
  if proc.poll() is None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _one_device_run(workdir):
  """The same run in this (one-device) process: the reference."""
  from configs.tiny import get_config
  from logra_jax.train.loop import train
  cfg = get_config()
  for flag in OVERRIDES:
    key, value = flag.removeprefix('--config.').split('=')
    section, _, name = key.rpartition('.')
    target = getattr(cfg, section) if section else cfg
    setattr(target, name, type(getattr(target, name))(value))
  train(from_config_dict(cfg), workdir, progress=False, log=lambda *_: None)
  return workdir


def test_train_py_on_four_devices_matches_one_device(four_device_run, tmp_path):
  want = _metrics(_one_device_run(str(tmp_path)))   # runs while the subprocess does
  workdir = four_device_run()
  assert_same_metrics(_metrics(workdir), want)
  with open(os.path.join(workdir, 'run_info.json')) as f:
    info = json.load(f)
  assert info['devices'] == 4 and info['processes'] == 1, info
  assert info['mesh'] == {'data': 1, 'fsdp': 4}, info
  assert info['config']['mesh']['fsdp'] == 4 and info['config']['total_steps'] == 3, info
  assert isinstance(info['jax_version'], str)


# ---- 2 processes x 2 devices ---------------------------------------------------------------

def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _multi_host_run(workdir, extra=(), env=None):
  """experiments/train.py as 2 processes of 2 CPU devices each, coordinated on 127.0.0.1."""
  port = _free_port()
  procs = [subprocess.Popen(
      _train_cmd(workdir, f'--coordinator_address=127.0.0.1:{port}', '--num_processes=2',
                 f'--process_id={i}', *extra),
      env=dict(_env(2), **(env or {})), cwd=ROOT, stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE, text=True)
      for i in range(2)]
  errs = []
  try:
    for p in procs:
      errs.append(p.communicate(timeout=1200)[1])  # bounded; a loaded CPU is slow
  finally:
    for p in procs:
      if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
  for p, err in zip(procs, errs):
    assert p.returncode == 0, err[-4000:]


@pytest.mark.slow
def test_two_processes_match_four_devices_and_resume_exactly(four_device_run, tmp_path,
                                                            shared_xla_env):
  """2 x 2 devices == 1 x 4 devices; a resume from step 2 redoes step 3 bit for bit.

  Both runs share XLA's persistent compilation cache: the resumed run loads the programs the
  first one compiled (measured alone: a second 2-process run 57 s against 81 s cold), and
  must still redo step 3 bit for bit.

  Gloo creates each cross-process communicator on first use and waits 30 s (fixed) for the
  other process: on a heavily shared 2-core CPU two processes compiling the same program can
  drift further apart than that (seen once at load 13: DEADLINE_EXCEEDED on 'cpu:gloo/...').
  """
  workdir = str(tmp_path)
  _multi_host_run(workdir, ['--config.checkpoint_every=1'], shared_xla_env)
  uninterrupted = _metrics(workdir)
  assert_same_metrics(uninterrupted, _metrics(four_device_run()))
  with open(os.path.join(workdir, 'run_info.json')) as f:
    info = json.load(f)
  assert (info['devices'], info['processes'], info['mesh']) == (4, 2, {'data': 1, 'fsdp': 4})
  # Drop the last checkpoint: the rerun resumes from step 2 and must redo step 3 exactly.
  ckpts = os.path.join(workdir, 'checkpoints')
  assert sorted(os.listdir(ckpts)) == ['2', '3'], os.listdir(ckpts)
  subprocess.run(['rm', '-rf', os.path.join(ckpts, '3')], check=True)
  _multi_host_run(workdir, ['--config.checkpoint_every=1'], shared_xla_env)
  resumed = _metrics(workdir)
  assert [r['step'] for r in resumed] == [0, 1, 2, 3]
  strip = lambda r: {k: v for k, v in r.items() if k not in TIMING}
  assert strip(resumed[3]) == strip(uninterrupted[3])
