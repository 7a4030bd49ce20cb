"""`parallel.Layout.batch_for`: a batch's leading axis over every device, or a ValueError.

Replicating a batch whose leading dimension does not divide the devices would have every
device compute the whole batch; the layout refuses it instead. Four simulated CPU devices run
in a subprocess (XLA_FLAGS must be set before JAX starts).
"""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import jax
import numpy as np
from jax.sharding import PartitionSpec as P
from logra_jax import parallel

assert jax.device_count() == 4
layout = parallel.Layout(parallel.make_mesh(data=2, fsdp=2))
ok = layout.batch_for({'tokens': np.zeros((8, 3)), 'adv': np.zeros(4)})
assert all(s == layout.batch for s in jax.tree.leaves(ok)), ok
assert layout.batch.spec == P(parallel.BATCH_AXES)

def refuses(tree, *needles):
  try:
    layout.batch_for(tree)
  except ValueError as e:
    assert all(n in str(e) for n in needles), (str(e), needles)
    return
  raise AssertionError(f'batch_for accepted {jax.tree.map(np.shape, tree)}')

refuses({'tokens': np.zeros((6, 3)), 'adv': np.zeros(8)}, '(6, 3)', '4 devices', "['tokens']")
refuses({'adv': np.zeros(2)}, '(2,)', '4 devices')
refuses({'scale': np.float32(1.0)}, '()', '4 devices')
print('ok')
"""


def test_batch_for_shards_the_leading_axis_or_raises_with_the_shapes():
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
             JAX_PLATFORMS='cpu', PYTHONPATH=ROOT)
  out = subprocess.run([sys.executable, '-c', textwrap.dedent(SCRIPT)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stdout.strip().endswith('ok'), out.stderr[-4000:]
