"""On-device projections: bit-identical to projection.py for every kind, inside jit and scan."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import traverse_util
from jax import lax

from logra_jax.sketch import projection as P
from logra_jax.sketch import projection_jax as PJ
from logra_jax.sketch.rank import RankRules
from logra_jax.sketch.tree import make_projections

# Shapes: R < K, R = K, R > K (not orthogonal), one entry, K = 576 = 512 + 64 (two blocks).
SHAPES = {'rademacher': [(16, 24), (3, 7), (5, 576), (1, 1), (64, 9)],
          'gaussian': [(16, 24), (3, 7), (5, 576), (1, 1)],
          'orthogonal': [(16, 24), (3, 7), (5, 576), (12, 12)]}
# (seed, step, name): steps across the uint32 range, a non-ASCII name.
DRAWS = [(0, 0, 'w'), (42, 7, 'layers/mlp/up_proj/kernel/2'), (7, 2**31 + 5, 'q/0'),
         (2**32 - 1, 2**32 - 1, 'ä/ü')]


def bits(a):
  return np.asarray(a).view(np.uint32)


@pytest.mark.parametrize('kind', P.KINDS)
def test_bit_identical_to_numpy_every_shape_and_step(kind):
  """One compile per kind: traced seed, step and name hash, vmapped over the draws."""
  @jax.jit
  @jax.vmap
  def draw(seed, step, name_hash):
    return [PJ.sample_projection_jax(seed, step, name_hash, r, k, kind) for r, k in SHAPES[kind]]
  seeds, steps, names = zip(*DRAWS)
  got = draw(np.array(seeds, np.uint32), np.array(steps, np.uint32),
             np.stack([PJ.name_hash_array(n) for n in names]))
  for (r, k), a_NxRxK in zip(SHAPES[kind], got):
    assert a_NxRxK.dtype == jnp.float32
    for a, (seed, step, name) in zip(a_NxRxK, DRAWS):
      want = P.sample_projection(seed, step, name, r, k, kind)
      np.testing.assert_array_equal(bits(a), bits(want), err_msg=f'{kind} {r}x{k} {name}')


def _params():
  sds = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  return {'layers': {'attn': {'q_proj': {'kernel': sds(3, 12, 8)}}, 'norm': {'scale': sds(12)}},
          'mlp': {'up_proj': {'kernel': sds(20, 6)}, 'v_proj': {'kernel': sds(12, 5)},
                  'k_proj': {'kernel': sds(2, 12, 7)}}}


def test_tree_under_jit_one_compile_for_every_step():
  """make_projections_jax == make_projections at every step; bfloat16 only where exact.

  q, k (stacked) and v (2-D) share R = 4, K = 12, so one vmapped draw makes all three.
  """
  params, traces = _params(), []
  rules = RankRules((('[qkv]_proj', 4),), default=3)  # R = 4: 1/2 in bf16; R = 3: float32

  @jax.jit
  def tree_at(seed, step):
    traces.append(1)
    return PJ.make_projections_jax(params, seed, step, rules, 'rademacher',
                                   dtype=jnp.bfloat16)
  shapes = {('layers', 'attn', 'q_proj', 'kernel'): ((3, 4, 12), jnp.bfloat16),
            ('mlp', 'k_proj', 'kernel'): ((2, 4, 12), jnp.bfloat16),
            ('mlp', 'v_proj', 'kernel'): ((4, 12), jnp.bfloat16),
            ('mlp', 'up_proj', 'kernel'): ((3, 20), jnp.float32)}
  for step in (0, 1, 9, 2**31 - 1):
    got = traverse_util.flatten_dict(tree_at(jnp.int32(5), jnp.int32(step)))
    want = traverse_util.flatten_dict(make_projections(params, 5, step, rules, 'rademacher'))
    assert {p: (a.shape, a.dtype) for p, a in got.items()} == shapes
    for path, a in got.items():
      np.testing.assert_array_equal(bits(a.astype(jnp.float32)), bits(want[path]))
  assert len(traces) == 1 and tree_at._cache_size() == 1


def test_scan_over_stacked_layers_with_traced_layer_index():
  """A lax.scan over the layer index rebuilds the stacked (L, R, K) A of make_projections."""
  n_layers, r, k = 12, 3, 10  # two-digit layer names: f'{name}/{l}' for l = 0 … 11
  name = 'layers/mlp/down_proj/kernel'
  params = {'layers': {'mlp': {'down_proj': {'kernel': jnp.zeros((n_layers, k, 4))}}}}

  @jax.jit
  def stacked(seed, step):
    def body(carry, layer):
      nh = PJ.layer_name_hash_jax(name, layer, n_layers)
      return carry, PJ.sample_projection_jax(seed, step, nh, r, k, 'gaussian')
    return lax.scan(body, None, jnp.arange(n_layers))[1]
  for step in (0, 3):
    want = make_projections(params, 11, step, r, 'gaussian')['layers']['mlp']['down_proj']
    np.testing.assert_array_equal(bits(stacked(jnp.uint32(11), jnp.uint32(step))),
                                  bits(want['kernel']))
  assert stacked._cache_size() == 1
  # The traced-index hash equals the host's for 1-, 2- and 3-digit layers.
  got = jax.jit(jax.vmap(lambda l: PJ.layer_name_hash_jax('a/b', l, 120)))(jnp.arange(120))
  np.testing.assert_array_equal(got, PJ.layer_name_hashes('a/b', 120))


def test_mulhi32_and_mix64_on_uint32_words():
  rng = np.random.default_rng(0)
  edge = np.array([0, 1, 0xFFFF, 0x10000, 2**31 - 1, 2**31, 2**32 - 1], np.uint64)
  a = np.concatenate([np.repeat(edge, 7), rng.integers(0, 2**32, 500, dtype=np.uint64)])
  b = np.concatenate([np.tile(edge, 7), rng.integers(0, 2**32, 500, dtype=np.uint64)])
  got = jax.jit(PJ.mulhi32)(a.astype(np.uint32), b.astype(np.uint32))
  np.testing.assert_array_equal(np.asarray(got, np.uint64), (a * b) >> np.uint64(32))
  z = (a << np.uint64(32)) | b
  hi, lo = jax.jit(PJ.mix64)((a.astype(np.uint32), b.astype(np.uint32)))
  want = P._mix64(z)
  hi, lo = np.asarray(hi, np.uint64), np.asarray(lo, np.uint64)
  np.testing.assert_array_equal((hi << np.uint64(32)) | lo, want)


def test_float64_under_x64(x64):
  """Under x64 (int64 loop counters, float64 A) the bits are the same."""
  draw = jax.jit(lambda seed, step: [
      PJ.sample_projection_jax(seed, step, P.name_hash('w'), 4, 6, kind, jnp.float64)
      for kind in P.KINDS])
  for kind, a in zip(P.KINDS, draw(3, 4)):
    assert a.dtype == jnp.float64
    np.testing.assert_array_equal(a, P.sample_projection(3, 4, 'w', 4, 6, kind, np.float64))


def test_bad_arguments():
  nh = P.name_hash('w')
  for args, match in [((0, 0, nh, 2, 2, 'uniform'), 'kind'), ((0, 0, nh, 0, 2), 'rank'),
                      ((0, 0, nh, 9, 8, 'orthogonal'), 'rank <= dim'),
                      ((-1, 0, nh, 2, 2), 'seed'), ((0, 2**32, nh, 2, 2), 'step'),
                      ((0, 0, 2**64, 2, 2), 'name_hash'),
                      ((0, 0, np.zeros(3, np.uint32), 2, 2), r'uint32 \[hi, lo\]'),
                      ((0.5, 0, nh, 2, 2), 'integer scalar'),
                      ((0, 0, nh, 3, 2, 'rademacher', ml_dtypes.bfloat16), 'not exact'),
                      ((0, 0, nh, 4, 2, 'gaussian', ml_dtypes.bfloat16), 'not exact'),
                      ((0, 0, nh, 4, 2, 'rademacher', np.float64), 'x64')]:
    with pytest.raises(ValueError, match=match):
      PJ.sample_projection_jax(*args)
