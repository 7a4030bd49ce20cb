"""Which values a program forms: the check that a backward pass never forms a dense gradient.

The primary tool walks the jaxpr. `dependent_values(fn, args, sources)` traces `fn(*args)` and
lists every equation output (recursing into scan, while, cond, jit/pjit, remat/checkpoint,
custom_jvp/custom_vjp and any other sub-jaxpr) that depends on the arguments `sources`.
`backward_values(loss_fn, args)` does so for the pullback of `loss_fn` seeded with a traced
cotangent: a value depends on that cotangent exactly when it belongs to the backward pass.

Why the jaxpr, and why dependence rather than "every dot":
  * It is the program as written, the same on every backend. Optimised HLO is not: XLA fuses
    dots, rewrites small ones into multiply+reduce, and on GPU turns them into gemm
    custom-calls, so "no (K, D) dot in the HLO" is weaker than it sounds.
  * Every primitive is seen, not only dot_general: a gradient formed as sum(x[:, :, None] *
    g[:, None, :]) has no dot, but its product and its sum are (K, D) values of the backward.
  * Kernel-shaped values that are not gradients do not count: casts or slices of the kernel,
    the zero kernel cotangent of a custom_vjp, the forward recomputed under remat. None of
    them depends on the cotangent.
`compiled_dot_shapes` reads the compiled HLO as a second opinion: that the compiler did not
re-associate a sketch into a dense gradient. It lists dot and gemm/matmul custom-call shapes.

`kernel_shaped(values, kernel_shapes)` keeps the values whose last two dims are a kernel's
(K, D) or (D, K): this covers stacked (N, K, D) and per-example (B, K, D) gradients. Shapes
can only be told apart if K, D and every other size of the program (batch, length, layers,
rank, heads) differ, so choose test sizes that way. Typical use:

    assert hlo.kernel_shaped(hlo.backward_values(loss, (probes, x)), [w.shape]) == []
"""
import re
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np
from jax.extend import core


class Value(NamedTuple):
  """One equation output: its primitive, shape, and where it sits ('scan/remat2/...')."""
  primitive: str
  shape: tuple
  where: str


def _jaxprs_of(params):
  """(name, open jaxpr) for every sub-jaxpr in an equation's params (tuples included)."""
  for name, p in params.items():
    for j in p if isinstance(p, (tuple, list)) else (p,):
      if isinstance(j, core.ClosedJaxpr):
        yield name, j.jaxpr
      elif isinstance(j, core.Jaxpr):
        yield name, j


def traced_shapes(fn: Callable, *args):
  """(shape, dtype) of every equation output of ``fn(*args)``'s jaxpr, sub-jaxprs included."""
  out = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      out.extend((v.aval.shape, v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, 'shape'))
      for _, sub in _jaxprs_of(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


class Dot(NamedTuple):
  """One dot_general of a jaxpr: operand and output shapes, contracting dims of each operand."""
  lhs: tuple
  rhs: tuple
  out: tuple
  contracting: tuple


def traced_dots(fn: Callable, *args):
  """Every dot_general in ``fn(*args)``'s jaxpr, sub-jaxprs included."""
  out = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == 'dot_general':
        (lc, rc), _ = eqn.params['dimension_numbers']
        out.append(Dot(eqn.invars[0].aval.shape, eqn.invars[1].aval.shape,
                       eqn.outvars[0].aval.shape, (tuple(lc), tuple(rc))))
      for _, sub in _jaxprs_of(eqn.params):
        walk(sub)
  walk(jax.make_jaxpr(fn)(*args).jaxpr)
  return out


def _walk(jaxpr, in_dep, out, where, record):
  """Propagates dependence through `jaxpr` given its invars' flags; returns the outvars'."""
  dep = dict(zip(jaxpr.invars, in_dep))
  read = lambda v: not isinstance(v, core.Literal) and dep.get(v, False)
  for eqn in jaxpr.eqns:
    flags = [read(v) for v in eqn.invars]
    out_dep = _eqn_dep(eqn, flags, out, f'{where}{eqn.primitive.name}/', record)
    for v, d in zip(eqn.outvars, out_dep):
      dep[v] = d
      shape = getattr(v.aval, 'shape', None)
      if record and d and shape is not None:
        out.append(Value(eqn.primitive.name, tuple(shape), where))
  return [read(v) for v in jaxpr.outvars]


def _fixpoint(body, consts, carry, xs, out, where, record):
  """Loop-body dependence (invars consts+carry+xs, outvars carry+ys): carry flags grow until
  stable. Returns (carry flags, all outvar flags)."""
  while True:
    flags = _walk(body, consts + carry + xs, out, where, False)
    new = [c or f for c, f in zip(carry, flags[:len(carry)])]
    if new == carry:
      return carry, _walk(body, consts + carry + xs, out, where, record)
    carry = new


def _eqn_dep(eqn, flags, out, where, record):
  """Which outputs of one equation depend on the sources (recursing into sub-jaxprs)."""
  name, p, n_out = eqn.primitive.name, eqn.params, len(eqn.outvars)
  if name == 'scan':
    c, k = p['num_consts'], p['num_carry']
    carry, res = _fixpoint(p['jaxpr'].jaxpr, flags[:c], flags[c:c + k], flags[c + k:], out,
                           where, record)
    return carry + res[k:]
  if name == 'while':
    cc, bc = p['cond_nconsts'], p['body_nconsts']
    carry, _ = _fixpoint(p['body_jaxpr'].jaxpr, flags[cc:cc + bc], flags[cc + bc:], [], out,
                         where, record)
    _walk(p['cond_jaxpr'].jaxpr, flags[:cc] + carry, out, where, record)
    return carry
  if name == 'cond':
    outs = [_walk(b.jaxpr, flags[1:], out, where, record) for b in p['branches']]
    return [flags[0] or any(o[i] for o in outs) for i in range(n_out)]
  subs = list(_jaxprs_of(p))
  if len(subs) == 1 and (len(subs[0][1].invars), len(subs[0][1].outvars)) == (len(flags), n_out):
    return _walk(subs[0][1], flags, out, where, record)  # jit, remat, custom_jvp/vjp, calls
  # Anything else: conservatively, every output depends on every input.
  for _, j in subs:
    _walk(j, [any(flags)] * len(j.invars), out, where, record)
  return [any(flags)] * n_out


def dependent_values(fn: Callable, args: Sequence[Any], sources: Sequence[int]):
  """Every value formed by `fn(*args)` that depends on `args[i]` for some i in `sources`.

  Args:
    fn: any traceable function (jitted or not); `args` are its positional arguments.
    sources: indices into `args`; every leaf of those arguments is a source.

  Returns:
    A list of `Value`, in program order, including those inside sub-jaxprs.

  Raises:
    ValueError: bad source indices, or no output of `fn` depends on the sources (the check
      would then be vacuous: e.g. the data were closed over instead of passed in).
  """
  args = tuple(args)
  bad = [i for i in sources if not 0 <= i < len(args)]
  if bad or not sources:
    raise ValueError(f'sources must be non-empty indices into {len(args)} args, got {sources}')
  closed = jax.make_jaxpr(fn)(*args)
  in_dep = [i in sources for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
  out = []
  out_dep = _walk(closed.jaxpr, in_dep, out, '', True)
  if not any(out_dep):
    raise ValueError(f'no output of {getattr(fn, "__name__", fn)} depends on args {sources}')
  return out


def backward_values(loss_fn: Callable, args: Sequence[Any], argnums: int = 0):
  """The values of the backward pass of `loss_fn` w.r.t. `args[argnums]` (see module doc)."""
  args = tuple(args)
  if not 0 <= argnums < len(args):
    raise ValueError(f'argnums must index the {len(args)} args, got {argnums}')
  cotangent = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), jax.eval_shape(loss_fn, *args))

  def pullback(*args_and_cotangent):
    *xs, ct = args_and_cotangent
    f = lambda x: loss_fn(*xs[:argnums], x, *xs[argnums + 1:])
    return jax.vjp(f, xs[argnums])[1](ct)

  return dependent_values(pullback, args + (cotangent,), (len(args),))


def kernel_shaped(values, kernel_shapes):
  """The values (or shapes) whose last two dims are some kernel's (K, D) or (D, K)."""
  bad = [s for s in kernel_shapes if len(s) < 2]
  if bad:
    raise ValueError(f'kernel_shapes must have >= 2 dims each, got {bad}')
  forbidden = {tuple(s[-2:]) for s in kernel_shapes} | {tuple(s[-2:])[::-1]
                                                        for s in kernel_shapes}
  shape = lambda v: tuple(v.shape) if hasattr(v, 'shape') else tuple(v)
  return [v for v in values if len(shape(v)) >= 2 and shape(v)[-2:] in forbidden]


def forms_kernel_gradient(loss_fn: Callable, args: Sequence[Any], kernel_shapes,
                          argnums: int = 0) -> bool:
  """Whether the backward of `loss_fn` w.r.t. `args[argnums]` forms any kernel-shaped value."""
  return bool(kernel_shaped(backward_values(loss_fn, args, argnums), kernel_shapes))


_SHAPE = r'[a-z]+[0-9]*\[([0-9,]*)\]'
_DOT = re.compile(r'=\s*' + _SHAPE + r'(?:\{[^}]*\})?\s+dot\(')
_GEMM = re.compile(r'=\s*\(?' + _SHAPE + r'.*custom-call\(.*custom_call_target="[^"]*'
                   r'(?:gemm|matmul)[^"]*"', re.IGNORECASE)


def compiled_dot_shapes(fn: Callable, args: Sequence[Any]):
  """Result shapes of every dot (and gemm/matmul custom-call) in the compiled HLO of `fn`.

  Reads `jax.jit(fn).lower(*args).compile().as_text()`, fusion and loop bodies included.
  Backend-dependent (see the module doc); use it next to `backward_values`, not instead:
  a dense gradient formed without a dot (multiply, then sum over tokens) passes it. The
  gemm/matmul custom-call pattern (GPU, oneDNN) has only been exercised on CPU text.
  """
  text = jax.jit(fn).lower(*args).compile().as_text()
  shapes = []
  for line in text.splitlines():
    m = _DOT.search(line) or _GEMM.search(line)
    if m:
      shapes.append(tuple(int(d) for d in m.group(1).split(',') if d))
  return shapes
