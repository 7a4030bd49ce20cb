"""The sampler on parameters sharded over 4 (simulated CPU) devices gives the same samples."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import jax, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from logra_jax.models import get_preset, init_params, generate
    assert jax.device_count() == 4, jax.devices()
    config = get_preset('tiny', vocab_size=32)
    params = init_params(config, jax.random.key(0))
    mesh = Mesh(np.array(jax.devices()), ('fsdp',))

    def shard(x):  # FSDP-style: split the first axis divisible by 4, replicate the rest
      for axis, size in enumerate(x.shape):
        if size % 4 == 0:
          spec = [None] * x.ndim
          spec[axis] = 'fsdp'
          return jax.device_put(x, NamedSharding(mesh, P(*spec)))
      return jax.device_put(x, NamedSharding(mesh, P()))

    sharded = jax.tree.map(shard, params)
    assert any(len(x.sharding.device_set) == 4 and not x.sharding.is_fully_replicated
               for x in jax.tree.leaves(sharded))
    prompts = [[1, 5, 6, 7], [1, 9, 3], [1, 4, 4, 4, 4, 12]]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=5, seeds=[3, 4, 5])):
      a = generate(params, config, prompts, 12, **kw)
      b = generate(sharded, config, prompts, 12, **kw)
      assert a.tokens == b.tokens, (a.tokens, b.tokens)
      np.testing.assert_allclose(np.concatenate(a.logprobs), np.concatenate(b.logprobs),
                                 rtol=1e-5, atol=1e-5)
    print('ok')
''')


def test_sampler_with_fsdp_sharded_params():
  env = dict(os.environ, XLA_FLAGS='--xla_force_host_platform_device_count=4',
             PYTHONPATH=ROOT, JAX_PLATFORMS='cpu')
  out = subprocess.run([sys.executable, '-c', SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0 and out.stdout.strip().endswith('ok'), out.stderr[-3000:]
