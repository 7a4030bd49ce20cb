"""SketchDense: a Dense layer whose backward pass emits a low-rank gradient sketch.

Shapes: B batch, L sequence, K input features (k_in), D output features (d_out), R rank.
A projection `A_RxK` and a zero probe `P_RxD` ride along with the kernel `W_KxD`:

* `sketch_matmul` (a `jax.custom_vjp`): forward `x @ W`; backward returns the usual input
  cotangent and, as the probe's cotangent, the sketch `S = A @ G_W = (x Aᵀ)ᵀ g`. The dense
  kernel gradient `G_W` (K×D) is never formed; the residual is `x Aᵀ` (tokens × R), fp32.
* `cosketch_matmul`: the same, and with an output-space B_R'xD and a zero coprobe (K, R')
  also the co-sketch `G_W Bᵀ = xᵀ (g Bᵀ)` as the coprobe's cotangent (an adaptive subspace's
  power-iteration step; it keeps x for the backward).
* `sketch_matmul_linear`: `x @ W + (x Aᵀ) @ P`, the same layer written so that forward-mode
  AD works (custom_vjp functions cannot be JVP'd). Its JVP along a probe tangent U equals
  the JVP along the kernel tangent Aᵀ U, which is what the predicted-KL estimate needs.

`SketchDense` (Flax Linen) reads A and P from the `projection` and `probe` variable
collections under the name `kernel` (B and the coprobe from `coprojection` / `coprobe`), so
the projection/probe/sketch trees have exactly the paths of the sketched kernels in the
`params` tree. Without them it is an ordinary Dense.
Given a `kernel_t` collection instead (the kernel transposed, (D, K): a sampler's decode
copy), it computes the same product as `matmul_t` and reads no kernel from `params`.
"""
from typing import Any, Callable, Optional, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

PROJECTION = 'projection'
PROBE = 'probe'
COPROJECTION = 'coprojection'
COPROBE = 'coprobe'
KERNEL_T = 'kernel_t'
SKETCH_MODES = ('vjp', 'linear')


def _acc_dtype(dtype):
  """Sketch accumulation dtype: at least fp32 (bf16 activations accumulate in fp32)."""
  return jnp.promote_types(jnp.float32, dtype)


def _xa(x, projection):
  """x Aᵀ in (at least) fp32: (..., K) x (R, K) -> (..., R)."""
  return jnp.einsum('...k,rk->...r', x, projection.astype(x.dtype),
                    preferred_element_type=_acc_dtype(x.dtype))


def _matmul(x, kernel):
  """`x @ kernel` over x's flattened leading axes: (..., K) x (K, D) -> (..., D).

  The 2-D form matters for the backward: JAX transposes it to the plain (N, K)ᵀ (N, D) dot for
  the kernel gradient, which XLA:CPU runs at ~2x the speed of the transpose of the batched
  einsum (docs/benchmarks.md, "Why the dense backward is slow").
  """
  y_NxD = jnp.dot(x.reshape(-1, x.shape[-1]), kernel.astype(x.dtype))
  return y_NxD.reshape(*x.shape[:-1], kernel.shape[-1])


def matmul_t(x, kernel_t):
  """`x @ kernel_tᵀ` computed as `(kernel_t @ xᵀ)ᵀ`: (..., K) x (D, K) -> (..., D).

  For few rows (decoding): XLA:CPU's dot runs a 16-row product 2-3x faster with the (D, K)
  weight as the left operand than `x @ W` (docs/benchmarks.md, "The embedded sampler's
  decode").
  """
  barrier = jax.lax.optimization_barrier  # else XLA folds the transposes back into x @ W
  x_KxN = barrier(x.reshape(-1, x.shape[-1]).T)
  y_DxN = barrier(jnp.dot(kernel_t.astype(x.dtype), x_KxN))
  return y_DxN.T.reshape(*x.shape[:-1], kernel_t.shape[0])


@jax.custom_vjp
def sketch_matmul(x, kernel, projection, probe):
  """`x @ kernel`; the probe's cotangent is the rank-R sketch `A @ dL/dkernel`.

  Args:
    x: activations (..., K).
    kernel: weight (K, D).
    projection: A, (R, K); E[AᵀA] = I.
    probe: zeros (R, D), fp32. Differentiate w.r.t. it to get the sketch.

  Returns:
    (..., D) = x @ kernel, in the dtype of x.
  """
  del projection, probe
  return _matmul(x, kernel)


def _sketch_matmul_fwd(x, kernel, projection, probe):
  y = _matmul(x, kernel)
  return y, (_xa(x, projection), kernel, projection, probe)


def _sketch_matmul_bwd(res, g):
  xa, kernel, projection, probe = res
  dx = jnp.einsum('...d,kd->...k', g, kernel.astype(g.dtype))
  s = jnp.einsum('...r,...d->rd', xa, g.astype(xa.dtype),
                 preferred_element_type=xa.dtype)
  # The kernel and projection get zero cotangents: the sketch replaces the kernel gradient.
  return (dx, jnp.zeros_like(kernel), jnp.zeros_like(projection),
          s.astype(probe.dtype))


sketch_matmul.defvjp(_sketch_matmul_fwd, _sketch_matmul_bwd)


@jax.custom_vjp
def cosketch_matmul(x, kernel, projection, probe, coprojection, coprobe):
  """`sketch_matmul` that also returns the co-sketch `G_W Bᵀ` as the coprobe's cotangent.

  Args:
    x, kernel, projection, probe: as `sketch_matmul`.
    coprojection: B, (R', D): output-space directions (the trainer: the sketch-space moment).
    coprobe: zeros (K, R'), fp32.

  The co-sketch is `G_W Bᵀ = xᵀ (g Bᵀ)`, (K, R'), at O(N (K + D) R') like the sketch; G_W is
  never formed, but x itself (tokens × K) is kept for the backward (the dense backward's
  residual), so this is for the steps that need it (an adaptive subspace's refresh).
  """
  del projection, probe, coprojection, coprobe
  return _matmul(x, kernel)


def _cosketch_matmul_fwd(x, kernel, projection, probe, coprojection, coprobe):
  y = _matmul(x, kernel)
  return y, (x, _xa(x, projection), kernel, projection, probe, coprojection, coprobe)


def _cosketch_matmul_bwd(res, g):
  x, xa, kernel, projection, probe, coprojection, coprobe = res
  dx, dk, dp, s = _sketch_matmul_bwd((xa, kernel, projection, probe), g)
  acc = _acc_dtype(x.dtype)
  gb = jnp.einsum('...d,rd->...r', g.astype(acc), coprojection.astype(acc),
                  preferred_element_type=acc)
  c = jnp.einsum('...k,...r->kr', x.astype(acc), gb, preferred_element_type=acc)
  return dx, dk, dp, s, jnp.zeros_like(coprojection), c.astype(coprobe.dtype)


cosketch_matmul.defvjp(_cosketch_matmul_fwd, _cosketch_matmul_bwd)


def sketch_matmul_linear(x, kernel, projection, probe):
  """`x @ kernel + (x Aᵀ) @ probe`: JVP along probe tangent U == JVP along kernel Aᵀ U."""
  y = _matmul(x, kernel)
  delta = jnp.einsum('...r,rd->...d', _xa(x, projection), probe.astype(_acc_dtype(x.dtype)))
  return y + delta.astype(y.dtype)


class SketchDense(nn.Module):
  """Dense layer y = x W (+ b) that can emit a LoGRA sketch of dL/dW.

  Attributes:
    features: D.
    use_bias: add a bias (Qwen2's q/k/v).
    kernel_axes: logical axis names of the kernel (K, D), for sharding.
    sketch_mode: 'vjp' (training: custom_vjp sketch) or 'linear' (forward-mode / JVP).
    dtype: computation dtype; param_dtype: storage dtype.
  """
  features: int
  use_bias: bool = False
  kernel_axes: Sequence[Optional[str]] = ('embed', 'mlp')
  sketch_mode: str = 'vjp'
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, x):
    if self.sketch_mode not in SKETCH_MODES:
      raise ValueError(f'sketch_mode must be one of {SKETCH_MODES}, got {self.sketch_mode!r}')
    x = x.astype(self.dtype)
    if self.has_variable(KERNEL_T, 'kernel'):  # decoding from a (D, K) copy of the kernel
      y = matmul_t(x, self.get_variable(KERNEL_T, 'kernel'))
      return self._bias(y)
    kernel = self.param(
        'kernel', nn.with_logical_partitioning(self.kernel_init, tuple(self.kernel_axes)),
        (x.shape[-1], self.features), self.param_dtype)
    if self.has_variable(PROJECTION, 'kernel'):
      projection = self.get_variable(PROJECTION, 'kernel')
      probe = self.get_variable(PROBE, 'kernel')
      if self.has_variable(COPROJECTION, 'kernel') and self.sketch_mode == 'vjp':
        y = cosketch_matmul(x, kernel, projection, probe,
                            self.get_variable(COPROJECTION, 'kernel'),
                            self.get_variable(COPROBE, 'kernel'))
      else:
        fn = sketch_matmul if self.sketch_mode == 'vjp' else sketch_matmul_linear
        y = fn(x, kernel, projection, probe)
    else:
      y = _matmul(x, kernel)
    return self._bias(y)

  def _bias(self, y):
    if not self.use_bias:
      return y
    bias = self.param(
        'bias', nn.with_logical_partitioning(nn.initializers.zeros_init(),
                                             (self.kernel_axes[-1],)),
        (self.features,), self.param_dtype)
    return y + bias.astype(y.dtype)
