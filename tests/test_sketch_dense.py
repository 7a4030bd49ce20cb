"""SketchDense: the sketch is A @ (dense kernel gradient), and no dense gradient is formed.

Numerics compare against the dense gradient in float64 (`x64` fixture). Structure uses
`logra_jax.analysis.hlo`: no value of the backward pass is shaped like a sketched kernel. Sizes
are pairwise distinct (K=7, D=11, R=5, batch 2, length 3, layers 4; the decoder's below) so a
kernel shape cannot appear by accident; positive controls show the check does fire.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from logra_jax import sketch
from logra_jax.analysis import hlo
from logra_jax.analysis.tiny_lm import TinyLM, init_params, token_nll
from logra_jax.models import transformer
from logra_jax.models.config import ModelConfig

# float64 end to end: the identity is exact algebra, so only rounding separates the two sides.
# Values are O(1) and each entry sums < 10^3 products: rounding is ~1e-13, far below TOL.
TOL = 1e-10
N, B, L, R, K, D = 4, 2, 3, 5, 7, 11


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
def test_sketch_equals_projected_dense_gradient(x64, remat):
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


def test_microbatch_sketches_sum_to_batch_sketch(x64):
  model, tokens, params, a = _setup()
  f = sketch.sketch_value_and_grad(
      lambda v, t: jnp.sum(jax.vmap(lambda r: token_nll(model.apply(v, r[None]), r[None]))(t)))
  _, whole = f(params, a, tokens)
  parts = [f(params, a, tokens[i:i + 2])[1] for i in (0, 2)]
  summed = jax.tree.map(lambda x, y: x + y, *parts)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=TOL), whole, summed)


def test_linear_form_jvp_equals_kernel_jvp(x64):
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


def test_plain_dense_without_sketch_and_bf16_sketch_in_fp32(x64):
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


# --- Layer stacks of bare matmuls: h <- mm(tanh(mm(h, W1)), W2), W1 (K, D), W2 (D, K). ---

def _dense_then_project_bwd(res, g):
  """Same sketch, formed the expensive way: G_W = xᵀ g (K×D), then A @ G_W."""
  x, kernel, projection, probe = res
  g_w = jnp.einsum('...k,...d->kd', x, g)
  return (g @ kernel.T, jnp.zeros_like(kernel), jnp.zeros_like(projection),
          (projection @ g_w).astype(probe.dtype))


def _dot_free_bwd(res, g):
  """G_W as a broadcast product summed over tokens: no (K, D) dot, but (K, D) values."""
  x, kernel, projection, probe = res
  g_w = jnp.sum(x[..., :, None] * g[..., None, :], axis=tuple(range(x.ndim - 1)))
  return (g @ kernel.T, jnp.zeros_like(kernel), jnp.zeros_like(projection),
          (projection @ g_w).astype(probe.dtype))


def _custom_matmul(bwd):
  f = jax.custom_vjp(lambda x, kernel, projection, probe: x @ kernel)
  f.defvjp(lambda x, w, a, p: (x @ w, (x, w, a, p)), bwd)
  return f


MATMULS = {'sketch': sketch.sketch_matmul,
           'dense_then_project': _custom_matmul(_dense_then_project_bwd),
           'dot_free': _custom_matmul(_dot_free_bwd)}


def _stack_inputs(dtype=jnp.float32):
  rng = np.random.default_rng(0)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  w = (normal(N, K, D) / np.sqrt(K), normal(N, D, K) / np.sqrt(D))
  probes = (jnp.zeros((N, R, D), dtype), jnp.zeros((N, R, K), dtype))
  return normal(B, L, K), w, (normal(N, R, K), normal(N, R, D)), probes


def _stack_loss(matmul=sketch.sketch_matmul, layout='scan'):
  """loss(probes, x, w, a) of the two-matmul block: under lax.scan (opt. remat) or 1 layer."""
  def block(h, w1, w2, a1, a2, p1, p2):
    return matmul(jnp.tanh(matmul(h, w1, a1, p1)), w2, a2, p2)

  def loss(probes, x, w, a):
    if layout in ('plain', 'remat'):  # layer 0 only, no scan
      blk = jax.checkpoint(block) if layout == 'remat' else block
      return jnp.sum(blk(x, *(t[0] for t in (*w, *a, *probes))) ** 2)
    body = lambda h, xs: (block(h, *xs), None)
    body = jax.checkpoint(body) if layout == 'scan_remat' else body
    return jnp.sum(jax.lax.scan(body, x, (*w, *a, *probes))[0] ** 2)
  return loss


def _kernel_shapes(layout, w):
  return [t.shape[1:] if layout in ('plain', 'remat') else t.shape for t in w]


LAYOUTS = ('plain', 'remat', 'scan', 'scan_remat')


def _plain_matmul(h, kernel, *_):
  return h @ kernel


@pytest.mark.parametrize('layout', LAYOUTS)
def test_sketch_matmul_equals_projected_dense_gradient(x64, layout):
  x, w, a, probes = _stack_inputs(jnp.float64)
  s = jax.grad(_stack_loss(layout=layout))(probes, x, w, a)
  g = jax.grad(_stack_loss(_plain_matmul, layout), argnums=2)(probes, x, w, a)
  for s_l, a_l, g_l in zip(s, a, g):
    want = jnp.einsum('nrk,nkd->nrd', a_l, g_l)  # zero for the layers 'plain' does not use
    assert s_l.shape == want.shape and np.abs(want).max() > 1e-3
    np.testing.assert_allclose(s_l, want, rtol=0, atol=TOL)


@pytest.mark.parametrize('layout', LAYOUTS)
def test_sketch_backward_forms_no_kernel_shaped_value(layout):
  x, w, a, probes = _stack_inputs()
  loss, shapes = _stack_loss(layout=layout), _kernel_shapes(layout, w)
  values = hlo.backward_values(loss, (probes, x, w, a))
  assert any(v.primitive == 'dot_general' for v in values)  # the backward was seen
  assert hlo.kernel_shaped(values, shapes) == []
  assert not hlo.forms_kernel_gradient(loss, (probes, x, w, a), shapes)


@pytest.mark.parametrize('layout', LAYOUTS)
@pytest.mark.parametrize('name', ['dense_then_project', 'dot_free'])
def test_positive_control_sketch_via_dense_gradient_is_flagged(layout, name):
  x, w, a, probes = _stack_inputs()
  loss, shapes = _stack_loss(MATMULS[name], layout), _kernel_shapes(layout, w)
  assert hlo.forms_kernel_gradient(loss, (probes, x, w, a), shapes)
  dots = [v for v in hlo.backward_values(loss, (probes, x, w, a))
          if v.primitive == 'dot_general']
  # The dot-free variant hides from a dots-only check: why every value is inspected.
  assert bool(hlo.kernel_shaped(dots, shapes)) == (name == 'dense_then_project')


@pytest.mark.parametrize('layout', LAYOUTS)
def test_positive_control_autodiff_wrt_kernels_is_flagged(layout):
  x, w, a, probes = _stack_inputs()
  loss = lambda w, x, a, p: _stack_loss(_plain_matmul, layout)(p, x, w, a)
  shapes = _kernel_shapes(layout, w)
  flagged = hlo.kernel_shaped(hlo.backward_values(loss, (w, x, a, probes)), shapes)
  assert {v.shape[-2:] for v in flagged} == {(K, D), (D, K)}


@pytest.mark.parametrize('name', ['sketch', 'dense_then_project'])
def test_check_sees_through_jit_and_cond(name):
  x, w, a, probes = _stack_inputs()

  @jax.jit
  def loss(probes, x, w, a):
    layer = lambda h: MATMULS[name](h, w[0][0], a[0][0], probes[0][0])
    return jnp.sum(jax.lax.cond(jnp.sum(x) > 0, layer, lambda h: 2 * layer(h), x) ** 2)

  flagged = hlo.kernel_shaped(hlo.backward_values(loss, (probes, x, w, a)), [(K, D)])
  assert bool(flagged) == (name == 'dense_then_project')
  assert all('cond/' in v.where for v in flagged)


def test_compiled_hlo_has_no_kernel_shaped_dot():
  x, w, a, probes = _stack_inputs()
  shapes, args = _kernel_shapes('scan', w), (probes, x, w, a)
  dots = hlo.compiled_dot_shapes(jax.grad(_stack_loss()), args)
  assert dots and hlo.kernel_shaped(dots, shapes) == []
  dense = hlo.compiled_dot_shapes(jax.grad(_stack_loss(MATMULS['dense_then_project'])), args)
  assert hlo.kernel_shaped(dense, shapes)


# --- SketchDense in the real decoder: every projection's (k_in, d_out) is a distinct size. ---
# hidden 16, q 4x10=40, kv 2x10=20, MLP 28; vocab 19, batch 3, length 7, rank 6, layers 2,
# head dim 10 (RoPE half 5), groups 2: no other size equals 16, 20, 28 or 40.
DECODER = ModelConfig(vocab_size=19, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=10, intermediate_size=28, qkv_bias=True)
DECODER_KERNELS = {(2, 16, 40), (2, 16, 20), (2, 40, 16), (2, 16, 28), (2, 28, 16)}


def _decoder(remat_policy, dtype='float32'):
  cfg = DECODER.replace(remat_policy=remat_policy, dtype=dtype, param_dtype=dtype)
  params = transformer.init_params(cfg, jax.random.key(0))
  a = sketch.make_projections(params, seed=1, step=0, ranks=6, dtype=jnp.dtype(dtype))
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, 19, (3, 7)), jnp.int32)
  model = transformer.Transformer(cfg)
  # `scale` seeds the backward: every value that depends on it belongs to the backward pass.
  loss = lambda variables, t, scale: scale * token_nll(model.apply(variables, t)[0], t)
  return params, a, tokens, loss


@pytest.mark.parametrize('remat_policy', ['none', 'full'])
def test_decoder_sketch_backward_forms_no_kernel_gradient(remat_policy):
  params, a, tokens, loss = _decoder(remat_policy)
  kernels = traverse_util.flatten_dict(sketch.kernels_of(params, a))
  assert len(kernels) == 7 and {k.shape for k in kernels.values()} == DECODER_KERNELS
  args = (params, a, tokens, jnp.float32(1))
  values = hlo.dependent_values(sketch.sketch_value_and_grad(loss), args, sources=(3,))
  assert sum(v.primitive == 'dot_general' for v in values) > 7  # the backward was seen
  assert hlo.kernel_shaped(values, DECODER_KERNELS) == []
  # Positive control: the dense gradient of the same loss forms every stacked kernel gradient.
  dense = lambda p, t, scale: jax.grad(lambda q: loss({'params': q}, t, scale))(p)
  dense_values = hlo.dependent_values(dense, (params, tokens, jnp.float32(1)), sources=(2,))
  assert DECODER_KERNELS <= {v.shape for v in hlo.kernel_shaped(dense_values, DECODER_KERNELS)}


def test_decoder_sketch_equals_projected_dense_gradient(x64):
  params, a, tokens, loss = _decoder('full', 'float64')
  _, s = jax.jit(sketch.sketch_value_and_grad(loss))(params, a, tokens, 1.0)
  g = jax.jit(jax.grad(lambda p: loss({'params': p}, tokens, 1.0)))(params)
  want = jax.tree.map(lambda aa, gg: jnp.einsum('nrk,nkd->nrd', aa, gg), a,
                      sketch.kernels_of(g, a))
  flat_s, flat_w = traverse_util.flatten_dict(s), traverse_util.flatten_dict(want)
  assert set(flat_s) == set(flat_w) and len(flat_w) == 7
  for path, w in flat_w.items():
    assert flat_s[path].shape == w.shape and np.abs(w).max() > 1e-6, path
    np.testing.assert_allclose(flat_s[path], w, rtol=0, atol=TOL, err_msg=str(path))


def test_dense_kernel_gradient_is_a_plain_2d_dot():
  # Layout, not numerics: XLA:CPU runs the kernel gradient ~2x faster as (N, K)ᵀ (N, D) on
  # flattened tokens than as the transpose of a batched (B, L, K) einsum (docs/benchmarks.md).
  # Every kernel-gradient dot of the decoder's dense gradient must contract one flat token axis.
  params, _, tokens, loss = _decoder('none')
  grad = lambda p: jax.grad(lambda q: loss({'params': q}, tokens, jnp.float32(1)))(p)
  shapes = {s[1:] for s in DECODER_KERNELS} | {s[:0:-1] for s in DECODER_KERNELS}
  kernel_dots = [d for d in hlo.traced_dots(grad, params) if d.out in shapes]
  assert len(kernel_dots) == 7  # one per projection (some as (D, K)), inside the layer scan
  assert all(len(d.lhs) == len(d.rhs) == 2 and d.contracting == ((0,), (0,))
             for d in kernel_dots), kernel_dots
