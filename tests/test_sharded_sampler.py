"""The sampler on FSDP-sharded params (4 simulated CPU devices) gives the same samples.

The params are placed by the real logical-axis rules (`logra_jax.parallel`, the default
`mesh.rules`), exactly as the trainer places them, not by hand.
"""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import jax, numpy as np
    from logra_jax import parallel
    from logra_jax.models import get_preset, init_params, generate
    from logra_jax.train.config import default_config, from_config_dict
    assert jax.device_count() == 4, jax.devices()
    config = get_preset('tiny', vocab_size=32)
    params = init_params(config, jax.random.key(0))
    layout = parallel.layout_from_config(from_config_dict(default_config()).mesh)
    assert dict(layout.mesh.shape) == {'data': 1, 'fsdp': 4}
    sharded = parallel.put(jax.device_get(params), parallel.param_shardings(layout, config))
    # The same sharded params as the trainer's: created in place from the logical axes.
    created = parallel.init_params(config, jax.random.key(0),
                                   parallel.param_shardings(layout, config))
    for a, b, c in zip(*(jax.tree.leaves(t) for t in (params, sharded, created))):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
      np.testing.assert_array_equal(np.asarray(c), np.asarray(a))
      assert b.sharding == c.sharding
      assert len(b.sharding.device_set) == 4 and not b.sharding.is_fully_replicated, b.sharding
      assert sum(s.data.nbytes for s in b.addressable_shards) == a.nbytes  # split, not copied
    prompts = [[1, 5, 6, 7], [1, 9, 3], [1, 4, 4, 4, 4, 12]]
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=5, seeds=[3, 4, 5])):
      a = generate(params, config, prompts, 12, **kw)
      b = generate(sharded, config, prompts, 12, **kw)
      assert a.tokens == b.tokens, (a.tokens, b.tokens)
      # fp32 logits summed in another order across 4 shards: a few ulp of O(10) logits.
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
