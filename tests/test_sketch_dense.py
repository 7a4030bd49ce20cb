"""The sketch equals A @ (dense kernel gradient), for every sketched matrix, in float64."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from logra_jax import sketch
from logra_jax.analysis.tiny_lm import TinyLM, init_params, token_nll

jax.config.update('jax_enable_x64', True)
# float64 end to end: the identity is exact algebra, so only rounding separates the two sides.
TOL = 1e-10


def _setup(remat=False, rank=3, dtype=jnp.float64):
  model = TinyLM(remat=remat, dtype=dtype)
  tokens = jax.random.randint(jax.random.key(1), (4, 6), 0, 11)
  params = init_params(model, jax.random.key(0), tokens)
  a = sketch.make_projections(params, seed=7, step=3, ranks=rank, dtype=dtype)
  return model, tokens, params, a


def _loss(model, tokens):
  return lambda variables: token_nll(model.apply(variables, tokens), tokens)


def _dense_reference(model, tokens, params, a):
  g = jax.grad(lambda p: token_nll(model.apply({'params': p}, tokens), tokens))(params)
  return jax.tree.map(lambda aa, gg: jnp.einsum('...rk,...kd->...rd', aa, gg),
                      a, sketch.kernels_of(g, a))


@pytest.mark.parametrize('remat', [False, True])
def test_sketch_equals_projected_dense_gradient(remat):
  model, tokens, params, a = _setup(remat)
  f = jax.jit(sketch.sketch_value_and_grad(_loss(model, tokens)))
  loss, s = f(params, a)
  want = _dense_reference(model, tokens, params, a)
  flat_s, flat_w = traverse_util.flatten_dict(s), traverse_util.flatten_dict(want)
  assert len(flat_s) == 7  # q k v o gate up down, each stacked over 2 layers
  for path in flat_w:
    assert flat_s[path].shape == flat_w[path].shape == (2, 3, flat_s[path].shape[-1])
    np.testing.assert_allclose(flat_s[path], flat_w[path], rtol=0, atol=TOL)
  assert np.isclose(loss, token_nll(model.apply({'params': params}, tokens), tokens))


def test_microbatch_sketches_sum_to_batch_sketch():
  model, tokens, params, a = _setup()
  f = sketch.sketch_value_and_grad(
      lambda v, t: jnp.sum(jax.vmap(lambda r: token_nll(model.apply(v, r[None]), r[None]))(t)))
  _, whole = f(params, a, tokens)
  parts = [f(params, a, tokens[i:i + 2])[1] for i in (0, 2)]
  summed = jax.tree.map(lambda x, y: x + y, *parts)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=TOL), whole, summed)


def test_linear_form_jvp_equals_kernel_jvp():
  model, tokens, params, a = _setup()
  lin = model.clone(sketch_mode='linear')
  probes = sketch.zero_probes(params, a, jnp.float64)
  u = jax.tree.map(lambda p: jax.random.normal(jax.random.key(3), p.shape), probes)
  fwd = lambda p: lin.apply(sketch.sketch_variables(params, a, p), tokens)
  y0, dy = jax.jvp(fwd, (probes,), (u,))
  delta = sketch.apply_sketch_updates(jax.tree.map(jnp.zeros_like, params), u, a)
  y1, dy_ref = jax.jvp(lambda p: model.apply({'params': p}, tokens), (params,), (delta,))
  np.testing.assert_allclose(y0, y1, atol=TOL)
  np.testing.assert_allclose(dy, dy_ref, atol=TOL)


def test_plain_dense_without_sketch_and_bf16_sketch_in_fp32():
  layer = sketch.SketchDense(5)
  x = jax.random.normal(jax.random.key(0), (3, 4), jnp.bfloat16)
  v = nn.unbox(layer.init(jax.random.key(1), x))
  assert set(v) == {'params'}
  dense = nn.Dense(5, use_bias=False).apply({'params': v['params']}, x)  # the ordinary Dense
  np.testing.assert_allclose(layer.apply(v, x), dense, rtol=1e-6)
  a = jnp.asarray(sketch.sample_projection(0, 0, 'k', 2, 4))
  probe = jnp.zeros((2, 5), jnp.float32)
  s = jax.grad(lambda p: jnp.sum(
      layer.apply({**v, 'projection': {'kernel': a}, 'probe': {'kernel': p}}, x)
      .astype(jnp.float32)))(probe)
  assert s.dtype == jnp.float32
  want = a @ (x.astype(jnp.float64).T @ np.ones((3, 5)))  # dL/dW = xᵀ 1 for L = Σ y
  # bf16 inputs are exact in fp32; the fp32 accumulation of 3x4 products is exact to ~1e-6.
  np.testing.assert_allclose(s, want, rtol=1e-5)


def test_sketch_matmul_under_scan_over_layers_and_no_dense_gradient():
  x = jax.random.normal(jax.random.key(0), (5, 4))
  w = jax.random.normal(jax.random.key(1), (3, 4, 4))
  a = jax.random.normal(jax.random.key(2), (3, 2, 4))

  def loss(p):
    def body(h, wap):
      return jnp.tanh(sketch.sketch_matmul(h, *wap)), None
    return jnp.sum(jax.lax.scan(body, x, (w, a, p))[0])

  s = jax.grad(loss)(jnp.zeros((3, 2, 4)))

  def dense_loss(w):
    return jnp.sum(jax.lax.scan(lambda h, wl: (jnp.tanh(h @ wl), None), x, w)[0])
  want = jnp.einsum('lrk,lkd->lrd', a, jax.grad(dense_loss)(w))
  np.testing.assert_allclose(s, want, atol=TOL)
  # No (K, D)-shaped dot is formed in the backward pass: only x Aᵀ and the (R, D) sketch.
  hlo = jax.jit(jax.grad(loss)).lower(jnp.zeros((3, 2, 4))).as_text()
  assert 'f64[4,4]' not in hlo.replace('f64[3,4,4]', '')
