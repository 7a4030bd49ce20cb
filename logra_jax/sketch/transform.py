"""optax GradientTransformations over the sketch tree (RowAdam, sketch Adam, SGD, the
relative step).

Layout: a sketch leaf is S (…, R, D) — rank axis -2, output units on the last axis (and on
any leading layer axis). One RowAdam second moment per output unit (docs/method.md §3, §7);
sketch Adam keeps one per entry of S, or Adafactor's row × column factors (§12).
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


class SketchAdamState(NamedTuple):
  """count: steps taken (int32). nu: per leaf the second moments of S's entries (fp32), or
  Adafactor's (row (…, R), column (…, D)) means. basis: the projection step they belong to."""
  count: jax.Array
  nu: Any
  basis: jax.Array


def _is_factored(x, factored):
  return factored and x.ndim >= 2


def _entry_moment(s, factored):
  """This step's statistic: S² per entry, or its means over columns (…, R) and rows (…, D)."""
  s = s.astype(_state_dtype(s.dtype))
  sq = s * s
  return (jnp.mean(sq, axis=-1), jnp.mean(sq, axis=-2)) if _is_factored(s, factored) else sq


def _per_entry(v):
  """v̂ per entry of S: itself, or Adafactor's row·column / mean(row) (a rank-1 estimate)."""
  if not isinstance(v, tuple):
    return v
  row, col = v
  mean_row = jnp.mean(row, axis=-1)[..., None, None]
  return row[..., :, None] * col[..., None, :] / jnp.maximum(mean_row, TINY)


def _rows_forgotten(v):
  """At a change of A: keep each output unit's mean over the rank axis (RowAdam's statistic,
  about what any basis of the same rank sees), drop the per-row detail (the old rows')."""
  if isinstance(v, tuple):
    row, col = v
    return (jnp.broadcast_to(jnp.mean(row, axis=-1, keepdims=True), row.shape), col)
  if v.ndim < 2:
    return v
  return jnp.broadcast_to(jnp.mean(v, axis=-2, keepdims=True), v.shape)


def _sketch_adam_leaf(s, v, count, b2, eps, preserve_norm):
  """D = S / (root + eps · mean root) per entry, root = sqrt(v̂ / (1 − b2^t))."""
  v_hat = _per_entry(v)
  s32 = s.astype(v_hat.dtype)
  root = jnp.sqrt(v_hat / (1.0 - b2 ** count.astype(v_hat.dtype)))
  m_axes = _matrix_axes(s32)
  mean_root = jnp.mean(root, axis=m_axes, keepdims=True) if m_axes else root
  d = s32 / (root + jnp.maximum(eps * mean_root, TINY))
  if not preserve_norm:
    return d.astype(s.dtype)
  s_norm = jnp.sqrt(jnp.sum(s32 * s32, axis=m_axes, keepdims=True))
  d_norm = jnp.sqrt(jnp.sum(d * d, axis=m_axes, keepdims=True))
  return (d * (s_norm / jnp.maximum(d_norm, TINY))).astype(s.dtype)


def scale_by_sketch_adam(b2: float = 0.95, eps: float = 1e-8, preserve_norm: bool = True,
                         factored: bool = False) -> optax.GradientTransformationExtraArgs:
  """Adam's per-coordinate scaling in sketch space (GaLore's rule in A's subspace), or its
  Adafactor factorisation: row (rank direction) × column (output unit) scales.

  For a sketch S (…, R, D):
    v ← b2 v + (1 − b2) S²  (per entry; factored: r ← b2 r + (1 − b2) mean_j S²,
                              c ← b2 c + (1 − b2) mean_i S², v̂ = r cᵀ / mean(r)),
    root = sqrt(v̂ / (1 − b2^t)),  D = S / (root + max(eps · mean root, tiny)),
    D ← D · ‖S‖_F / ‖D‖_F   (per matrix, if preserve_norm).
  Its column statistic is RowAdam's; the rows add a scale per direction of A's subspace,
  meaningful while A is held (`optim.logra.refresh_every`). When A changes (``basis``, A's
  projection step, differs from the state's), each unit's moments are first reset to their
  mean over the rank axis (`_rows_forgotten`): the new rows start from RowAdam's scaling.

  Args:
    b2, eps, preserve_norm: as `scale_by_row_adam` (eps relative to the matrix's mean root).
    factored: Adafactor's (R + D) moments per matrix instead of R·D.

  Returns:
    An ``optax.GradientTransformationExtraArgs``; ``update`` takes ``basis=`` (optional).

  Example:
    >>> opt = optax.chain(scale_by_sketch_adam(), optax.scale(-1e-2))
  """
  if isinstance(b2, (int, float)) and not 0.0 <= b2 < 1.0:
    raise ValueError(f'b2 must be in [0, 1), got {b2}')
  if isinstance(eps, (int, float)) and eps < 0:
    raise ValueError(f'eps must be >= 0, got {eps}')

  def init_fn(params):
    nu = jax.tree.map(lambda p: jax.tree.map(jnp.zeros_like, _entry_moment(p, factored)),
                      params)
    return SketchAdamState(count=jnp.zeros([], jnp.int32), nu=nu,
                           basis=jnp.zeros([], jnp.uint32))

  def update_fn(updates, state, params=None, basis: Optional[jax.Array] = None, **extra_args):
    del params, extra_args
    nu, new_basis = state.nu, state.basis
    if basis is not None:
      new_basis = jnp.asarray(basis, jnp.uint32)
      moved = (new_basis != state.basis) & (state.count > 0)
      nu = jax.lax.cond(moved, lambda n: jax.tree.map(lambda s, v: _rows_forgotten(v), updates, n),
                        lambda n: n, nu)
    count = optax.safe_increment(state.count)
    ema = lambda v, x: (b2 * v + (1.0 - b2) * x).astype(v.dtype)
    nu = jax.tree.map(lambda s, v: jax.tree.map(ema, v, _entry_moment(s, factored)),
                      updates, nu)
    out = jax.tree.map(lambda s, v: _sketch_adam_leaf(s, v, count, b2, eps, preserve_norm),
                       updates, nu)
    return out, SketchAdamState(count=count, nu=nu, basis=new_basis)

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
    w_sq = sum(jnp.sum(jnp.square(w.astype(_state_dtype(w.dtype))))
               for w in jax.tree.leaves(params))
    d_sq = sum(jax.tree.leaves(jax.tree.map(update_sq_norm, projections, updates)))
    factor = update_ratio * jnp.sqrt(w_sq / jnp.maximum(d_sq, TINY))
    out = jax.tree.map(lambda u: (u * factor).astype(u.dtype), updates)
    return out, RelativeStepState(count=optax.safe_increment(state.count))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


SKETCH_OPTIMIZERS = ('row_adam', 'adam', 'adafactor', 'sgd')


def logra(learning_rate: optax.ScalarOrSchedule, optimizer: str = 'row_adam',
          b2: float = 0.95, eps: float = 1e-8,
          update_ratio: Optional[float] = None,
          momentum: Optional[float] = None,
          preserve_norm: bool = True) -> optax.GradientTransformationExtraArgs:
  """The LoGRA sketch optimizer: (RowAdam | sketch Adam | SGD) [→ momentum] [→ relative step]
  → −lr.

  Args:
    learning_rate: a float or an optax schedule.
    optimizer: 'row_adam', 'adam' (per entry of S), 'adafactor' (S's rows × columns; both
      `scale_by_sketch_adam`) or 'sgd'.
    b2, eps, preserve_norm: the scaling's hyper-parameters (see ``scale_by_row_adam``).
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
  if optimizer == 'row_adam':
    base = scale_by_row_adam(b2, eps, preserve_norm)
  elif optimizer == 'sgd':
    base = scale_by_sketch_sgd()
  else:
    base = scale_by_sketch_adam(b2, eps, preserve_norm, factored=optimizer == 'adafactor')
  parts = [base]
  # None (not 0) means off, so that inject_hyperparams leaves the structure static.
  if momentum is not None:
    parts.append(scale_by_sketch_momentum(momentum))
  if update_ratio is not None:
    parts.append(scale_by_relative_step(update_ratio))
  parts.append(optax.scale_by_learning_rate(learning_rate))
  return optax.chain(*parts)
