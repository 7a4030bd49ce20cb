"""optax GradientTransformations over the sketch tree (RowAdam, SGD, the relative step).

Layout: a sketch leaf is S (…, R, D) — rank axis -2, output units on the last axis (and on
any leading layer axis). One RowAdam second moment per output unit (docs/method.md §3, §7).
1-D leaves and scalars are accepted too: there each element is its own output unit.
"""
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
from optax import tree as otu

from logra_jax.sketch.momentum import scale_by_sketch_momentum
from logra_jax.sketch.update import update_sq_norm

TINY = 1e-30


class RowAdamState(NamedTuple):
  """count: steps taken (int32). nu: per-output-unit second moments (fp32)."""
  count: jax.Array
  nu: Any


def _unit_axes(x):
  """The axes averaged into one output unit: the rank axis for matrices, none otherwise."""
  return (x.ndim - 2,) if x.ndim >= 2 else ()


def _matrix_axes(x):
  """The axes of one matrix (Frobenius renormalisation); the whole leaf below 2-D."""
  return (x.ndim - 2, x.ndim - 1) if x.ndim >= 2 else tuple(range(x.ndim))


def _state_dtype(dtype):
  """RowAdam's state and arithmetic: fp32, or fp64 for fp64 sketches."""
  return jnp.promote_types(jnp.float32, dtype)


def _row_moment(s):
  s = s.astype(_state_dtype(s.dtype))
  axes = _unit_axes(s)
  return jnp.mean(s * s, axis=axes) if axes else s * s


def _row_adam_leaf(s, nu, count, b2, eps, preserve_norm=True):
  """One leaf: D = S / denom (per unit), rescaled to ‖S‖_F per matrix if preserve_norm."""
  s32 = s.astype(nu.dtype)
  root = jnp.sqrt(nu / (1.0 - b2 ** count.astype(nu.dtype)))
  # The mean root over the units of one matrix (its last axis); a scalar is its own mean.
  mean_root = jnp.mean(root, axis=-1, keepdims=True) if root.ndim else root
  denom = root + jnp.maximum(eps * mean_root, TINY)
  axes = _unit_axes(s32)
  d = s32 / (jnp.expand_dims(denom, axes) if axes else denom)
  if not preserve_norm:
    return d.astype(s.dtype)
  m_axes = _matrix_axes(s32)
  s_norm = jnp.sqrt(jnp.sum(s32 * s32, axis=m_axes, keepdims=True))
  d_norm = jnp.sqrt(jnp.sum(d * d, axis=m_axes, keepdims=True))
  return (d * (s_norm / jnp.maximum(d_norm, TINY))).astype(s.dtype)


def scale_by_row_adam(b2: float = 0.95, eps: float = 1e-8,
                      preserve_norm: bool = True) -> optax.GradientTransformationExtraArgs:
  """RowAdam: a second moment per output unit, bias-corrected, norm-preserving.

  For a sketch S (R, D), per output unit j (a column here, the paper's row of S ∈ R^{D×R}):
    v_j ← b2 v_j + (1 − b2) mean_i S_ij²,   root_j = sqrt(v_j / (1 − b2^t)),
    denom_j = root_j + max(eps · mean_j root_j, tiny),   D = S / denom,
    D ← D · ‖S‖_F / ‖D‖_F            (per matrix, if preserve_norm; no first moment).

  Args:
    b2: second-moment decay.
    eps: relative epsilon (times the mean root of the matrix).
    preserve_norm: rescale each matrix to its sketch's Frobenius norm (the paper). False
      keeps D = S / denom: entries of size ~1 whatever the gradient's scale, like Adam's,
      so a plain learning rate sets the step (the tiny config's rule).

  Returns:
    An ``optax.GradientTransformationExtraArgs``; updates keep each leaf's dtype.

  Example:
    >>> opt = optax.chain(scale_by_row_adam(), optax.scale(-1e-2))
  """
  if isinstance(b2, (int, float)) and not 0.0 <= b2 < 1.0:  # traced under inject_hyperparams
    raise ValueError(f'b2 must be in [0, 1), got {b2}')
  if isinstance(eps, (int, float)) and eps < 0:
    raise ValueError(f'eps must be >= 0, got {eps}')

  def init_fn(params):
    nu = jax.tree.map(lambda p: jnp.zeros(_row_moment(p).shape, _state_dtype(p.dtype)), params)
    return RowAdamState(count=jnp.zeros([], jnp.int32), nu=nu)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    count = optax.safe_increment(state.count)
    nu = jax.tree.map(lambda s, v: (b2 * v + (1.0 - b2) * _row_moment(s)).astype(v.dtype),
                      updates, state.nu)
    out = jax.tree.map(lambda s, v: _row_adam_leaf(s, v, count, b2, eps, preserve_norm),
                       updates, nu)
    return out, RowAdamState(count=count, nu=nu)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scale_by_sketch_sgd() -> optax.GradientTransformationExtraArgs:
  """Plain SGD on the sketch: U = S (the paper's SGD-sketch runs)."""
  return optax.with_extra_args_support(optax.identity())


class RelativeStepState(NamedTuple):
  count: jax.Array


def scale_by_relative_step(update_ratio: float) -> optax.GradientTransformationExtraArgs:
  """The authors' global relative step: U ← U · update_ratio · sqrt(Σ‖W‖² / Σ‖AᵀU‖²).

  Needs ``params`` = the sketched kernels (a tree shaped like the sketch tree) and the extra
  argument ``projections`` (A). Applied to the whole tree at once (one global factor).
  """
  if isinstance(update_ratio, (int, float)) and update_ratio <= 0:
    raise ValueError(f'update_ratio must be > 0, got {update_ratio}')

  def init_fn(params):
    del params
    return RelativeStepState(count=jnp.zeros([], jnp.int32))

  def update_fn(updates, state, params=None, projections=None, **extra_args):
    del extra_args
    if params is None or projections is None:
      raise ValueError('scale_by_relative_step needs params (the sketched kernels) and '
                       'projections=A passed to update()')
    w_sq = sum(jnp.sum(jnp.square(w.astype(_state_dtype(w.dtype)))) for w in jax.tree.leaves(params))
    d_sq = sum(jax.tree.leaves(jax.tree.map(update_sq_norm, projections, updates)))
    factor = update_ratio * jnp.sqrt(w_sq / jnp.maximum(d_sq, TINY))
    out = jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)
    return out, RelativeStepState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


SKETCH_OPTIMIZERS = {'row_adam': scale_by_row_adam, 'sgd': scale_by_sketch_sgd}


def logra(learning_rate: optax.ScalarOrSchedule, optimizer: str = 'row_adam',
          b2: float = 0.95, eps: float = 1e-8,
          update_ratio: Optional[float] = None,
          momentum: Optional[float] = None,
          preserve_norm: bool = True) -> optax.GradientTransformationExtraArgs:
  """The LoGRA sketch optimizer: (RowAdam | SGD) [→ momentum] [→ relative step] → −lr.

  Args:
    learning_rate: a float or an optax schedule.
    optimizer: 'row_adam' or 'sgd'.
    b2, eps, preserve_norm: RowAdam's hyper-parameters (see ``scale_by_row_adam``).
    update_ratio: if set, the authors' relative global step (needs ``projections=`` and the
      sketched kernels as ``params`` in ``update``).
    momentum: if set, a debiased EMA of RowAdam's normalised updates (SGD's: the sketches),
      Adam's m̂/√v̂ in sketch space (`scale_by_sketch_momentum`). Pass ``basis`` (A's
      projection step) and ``basis_change`` to ``update`` when A is redrawn: the moments are
      then carried into the new A's basis (``m ← A_new A_old⁺ m``); without them A must be
      fixed.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` over the sketch tree; its output U is added
    to the kernels as ``kernel += Aᵀ U`` by ``apply_sketch_updates``.

  Example:
    >>> opt = logra(1e-2)
    >>> state = opt.init(sketches)
    >>> u, state = opt.update(sketches, state)
  """
  if optimizer not in SKETCH_OPTIMIZERS:
    raise ValueError(f'optimizer must be one of {sorted(SKETCH_OPTIMIZERS)}, got {optimizer!r}')
  base = (scale_by_row_adam(b2, eps, preserve_norm) if optimizer == 'row_adam'
          else scale_by_sketch_sgd())
  parts = [base]
  # None (not 0) means off, so that inject_hyperparams leaves the structure static.
  if momentum is not None:
    parts.append(scale_by_sketch_momentum(momentum))
  if update_ratio is not None:
    parts.append(scale_by_relative_step(update_ratio))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)
