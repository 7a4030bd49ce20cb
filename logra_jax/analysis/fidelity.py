"""Sketch fidelity and compressor cost: the library behind `experiments/sketch_fidelity.py`,
`experiments/compressor_cost.py` and `notebooks/01_sketches.ipynb`.

Shapes: B batch, L length, K kernel input (k_in), D kernel output (d_out), R rank.

Reconstruction cosine. For a kernel gradient G (K×D, Flax layout) and A (R×K) the sketch is
S = A G and its expansion Ĝ = Aᵀ S = AᵀA G, so cos(Ĝ, G) = ‖AG‖² / (‖AᵀAG‖ ‖G‖). For ANY G
(structure does not enter the expectations):

  E‖AG‖²   = ‖G‖²                          (E[AᵀA] = I)
  E‖AᵀAG‖² = c ‖G‖²,  c = (R+K+1)/R        (Gaussian: E[W M W] = R(R+1)M + R tr(M) I for
                                            W = R·AᵀA Wishart, M = GGᵀ)
                      c = (R+K−1)/R        (Rademacher: the ±1 fourth moment drops 2 diag M)

so cos ≈ 1/sqrt(c) = sqrt(R/(R+K±1)) ≈ sqrt(R/K) for R ≪ K (the paper's Fig. 5b: ~0.05 at
r=4, ~0.35 at r=256 for K of 1.5-9k). At R = K the cosine is ≈ 1/√2, not 1: AᵀA = I only in
expectation (a single draw is orthogonal only up to its Wishart spread).

Compressor cost. The randomized-SVD compressor needs the dense G of every kernel; the sketch
never forms it. `compressor_cost` compiles both paths for one batch and reports XLA's memory
analysis and the median wall time.
"""
import dataclasses
import statistics
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from logra_jax.models import transformer
from logra_jax.models.presets import get_preset
from logra_jax.sketch.compress import randomized_svd_compress, sparse_mask_tree
from logra_jax.sketch.projection import KINDS
from logra_jax.sketch.rank import RankRules
from logra_jax.analysis.tiny_lm import TinyLM, init_params, token_nll
from logra_jax.sketch.tree import (make_projections, path_str, select, sketch_value_and_grad,
                                   target_paths)
from logra_jax.sketch.update import expand_update


@dataclasses.dataclass(frozen=True)
class Problem:
  """One model and one batch: ``loss(variables, tokens_BxL)`` is the next-token NLL."""
  model: Any
  params: Any
  tokens_BxL: jax.Array

  def loss(self, variables, tokens_BxL):
    out = self.model.apply(variables, tokens_BxL)
    logits_BxLxV = out[0] if isinstance(out, tuple) else out  # Transformer: (logits, cache)
    return token_nll(logits_BxLxV, tokens_BxL)

  @property
  def dtype(self):
    """The compute dtype (TinyLM's `dtype`, the Transformer's `config.dtype`)."""
    config = getattr(self.model, 'config', None)
    return jnp.dtype(config.dtype if config is not None else self.model.dtype)


def tiny_problem(vocab=64, d=256, f=1024, layers=2, batch=4, length=32, seed=0,
                 dtype=jnp.float32) -> Problem:
  """A `TinyLM` with random tokens (the default sketch targets q/k/v/o/gate/up/down)."""
  model = TinyLM(vocab=vocab, d=d, f=f, layers=layers, dtype=dtype)
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length), 0, vocab)
  params = jax.jit(lambda key, t: init_params(model, key, t))(jax.random.key(seed), tokens)
  return Problem(model, params, tokens)


def decoder_problem(preset='tiny', batch=4, length=24, seed=0, dtype='float32') -> Problem:
  """The library's decoder (`models.Transformer`, a preset at random init), random tokens."""
  config = get_preset(preset, dtype=jnp.dtype(dtype).name, param_dtype=jnp.dtype(dtype).name)
  tokens = jax.random.randint(jax.random.key(seed + 1), (batch, length), 0, config.vocab_size)
  params = jax.jit(lambda key: transformer.init_params(config, key))(jax.random.key(seed))
  return Problem(transformer.Transformer(config), params, tokens)


def _merge(params, sub):
  flat = traverse_util.flatten_dict(params)
  flat.update(traverse_util.flatten_dict(sub))
  return traverse_util.unflatten_dict(flat)


def dense_kernel_grads(problem: Problem, params, tokens_BxL):
  """Dense dL/dW of the sketched kernels only (everything else frozen, as in LoGRA)."""
  kernels = select(params, target_paths(params))
  loss = lambda k: problem.loss({'params': _merge(params, k)}, tokens_BxL)
  return jax.grad(loss)(kernels)


def reconstruction_cosine(projection, sketch, grad):
  """cos(Aᵀ S, G) per matrix: (…, R, K), (…, R, D), (…, K, D) -> (…)."""
  g_hat = expand_update(projection, sketch)
  g = grad.astype(g_hat.dtype)
  dot = jnp.sum(g_hat * g, axis=(-2, -1))
  return dot / (jnp.linalg.norm(g_hat, axis=(-2, -1)) * jnp.linalg.norm(g, axis=(-2, -1)))


def predicted_cosine(rank: int, dim: int, kind: str = 'rademacher') -> float:
  """1/sqrt(E‖AᵀAG‖²/‖G‖²): sqrt(R/(R+K+1)) (Gaussian), sqrt(R/(R+K−1)) (Rademacher).

  Orthogonal rows: AᵀA = (K/R)·P with E[P] = (R/K)·I, so E‖AᵀAG‖² = (K/R)‖G‖² and the
  cosine ‖PG‖/‖G‖ concentrates at sqrt(R/K) (exactly 1 at R = K).
  """
  if kind not in KINDS:
    raise ValueError(f'projection kind must be one of {KINDS}, got {kind!r}')
  if kind == 'orthogonal':
    return float(np.sqrt(rank / dim))
  return float(np.sqrt(rank / (rank + dim + (1 if kind == 'gaussian' else -1))))


def _cosines_one_draw(sketch_fn, problem, grads, rank, kind, seed):
  """Per (matrix, layer): (module, cosine, R, K) for one projection draw."""
  a = make_projections(problem.params, seed, 0, rank, kind, dtype=problem.dtype)
  _, s = sketch_fn(problem.params, a, problem.tokens_BxL)
  cos = jax.tree.map(reconstruction_cosine, a, s, grads)
  out = []
  for path, c in traverse_util.flatten_dict(cos).items():
    r, k = traverse_util.flatten_dict(a)[path].shape[-2:]
    out += [(path[-2], float(ci), r, k) for ci in np.ravel(np.asarray(c))]
  return out


def fidelity_sweep(problem: Problem, ranks: Sequence[int] = (4, 16, 64, 256),
                   kinds: Sequence[str] = KINDS, seeds: Sequence[int] = (0, 1, 2)):
  """Mean reconstruction cosine per (kind, rank) over the sketched matrices and seeds.

  Each rank is capped per matrix at min(K, D) (as `RankRules`). The sketch comes from
  `sketch_value_and_grad` (the probe gradient); G from a separate dense `jax.grad`.

  Returns:
    A list of dicts: kind, rank, cos_mean, cos_sem, predicted (mean of `predicted_cosine`
    at each matrix's own R, K), sqrt_r_over_k (mean of sqrt(R/K)), n, by_module.
  """
  grads = jax.jit(lambda p, t: dense_kernel_grads(problem, p, t))(
      problem.params, problem.tokens_BxL)
  sketch_fn = jax.jit(sketch_value_and_grad(problem.loss))
  rows = []
  for kind in kinds:
    for rank in ranks:
      draws = [x for seed in seeds
               for x in _cosines_one_draw(sketch_fn, problem, grads, rank, kind, seed)]
      cos = np.array([c for _, c, _, _ in draws])
      modules = sorted({m for m, _, _, _ in draws})
      rows.append(dict(
          kind=kind, rank=int(rank), n=len(cos), cos_mean=float(cos.mean()),
          cos_sem=float(cos.std(ddof=1) / np.sqrt(len(cos))) if len(cos) > 1 else 0.0,
          predicted=float(np.mean([predicted_cosine(r, k, kind) for _, _, r, k in draws])),
          sqrt_r_over_k=float(np.mean([np.sqrt(r / k) for _, _, r, k in draws])),
          by_module={m: float(np.mean([c for mm, c, _, _ in draws if mm == m]))
                     for m in modules}))
  return rows


def layer_cosines(loss_fn, params, batch, ranks: Sequence[int], kinds: Sequence[str] = KINDS,
                  seeds: Sequence[int] = (0, 1), dtype=jnp.float32):
  """Reconstruction cosine of every sketched matrix, layer by layer (the paper's Fig. 5c).

  ``loss_fn(variables, batch)`` is any scalar loss of a model built from `SketchDense`
  layers (e.g. the trainer's `Transformer`). The sketch comes from one probe gradient, G from
  a dense `jax.grad` of the sketched kernels; each rank is capped per matrix at min(K, D).

  Returns:
    A list of dicts: kind, rank (as asked), module ('q_proj', ...), layer (0 for an unstacked
    kernel), r and k (the matrix's own R, K), cos (mean over ``seeds``), predicted.
  """
  kernels = select(params, target_paths(params))
  grads = jax.jit(jax.grad(lambda k, b: loss_fn({'params': _merge(params, k)}, b)))(
      kernels, batch)
  sketch_fn = jax.jit(sketch_value_and_grad(loss_fn))
  rows = []
  for kind in kinds:
    for rank in ranks:
      per_seed = []
      for seed in seeds:
        a = make_projections(params, seed, 0, rank, kind, dtype=dtype)
        _, s = sketch_fn(params, a, batch)
        cos = traverse_util.flatten_dict(jax.tree.map(reconstruction_cosine, a, s, grads))
        per_seed.append({p: np.atleast_1d(np.asarray(c)) for p, c in cos.items()})
      for path, a_k in traverse_util.flatten_dict(a).items():
        r, k = a_k.shape[-2:]
        mean_L = np.mean([c[path] for c in per_seed], axis=0)
        rows += [dict(kind=kind, rank=int(rank), module=str(path[-2]), layer=layer, r=int(r),
                      k=int(k), cos=float(c), predicted=predicted_cosine(r, k, kind))
                 for layer, c in enumerate(mean_L)]
  return rows


def format_fidelity_table(rows) -> str:
  lines = [f'{"kind":<11}{"rank":>6}{"cos":>9}{"±sem":>8}{"pred":>9}{"sqrt(r/K)":>11}{"n":>5}']
  for r in rows:
    lines.append(f'{r["kind"]:<11}{r["rank"]:>6}{r["cos_mean"]:>9.4f}{r["cos_sem"]:>8.4f}'
                 f'{r["predicted"]:>9.4f}{r["sqrt_r_over_k"]:>11.4f}{r["n"]:>5}')
  return '\n'.join(lines)


def plot_fidelity(rows, path):
  """Cosine vs rank (log x), one line per kind, the sqrt(R/(R+K±1)) prediction dashed."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(5, 3.5))
  for kind in dict.fromkeys(r['kind'] for r in rows):
    rr = [r for r in rows if r['kind'] == kind]
    line, = ax.plot([r['rank'] for r in rr], [r['cos_mean'] for r in rr], 'o-', label=kind)
    ax.plot([r['rank'] for r in rr], [r['predicted'] for r in rr], '--',
            color=line.get_color(), alpha=0.6, label=f'{kind} predicted')
  ranks = sorted({r['rank'] for r in rows})
  ax.set_xscale('log')
  ax.set_xticks(ranks, [str(r) for r in ranks])
  ax.set(xlabel='rank r', ylabel='cos(AᵀA G, G)', ylim=(0, 1),
         title='Sketch reconstruction fidelity')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


# ---------------------------------------------------------------- compressor cost

def compiled_memory(fn, *args) -> dict:
  """XLA's memory analysis of ``jax.jit(fn)`` at ``args`` (bytes); peak = arg+out+temp−alias."""
  m = jax.jit(fn).lower(*args).compile().memory_analysis()
  out = dict(temp=m.temp_size_in_bytes, argument=m.argument_size_in_bytes,
             output=m.output_size_in_bytes, alias=m.alias_size_in_bytes)
  out['peak'] = out['argument'] + out['output'] + out['temp'] - out['alias']
  return out


def median_seconds(fn, *args, repeats=5, warmup=2) -> float:
  """Median wall time of the jitted ``fn`` after ``warmup`` calls (compile excluded)."""
  f = jax.jit(fn)
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


def dense_rsvd_path(problem: Problem, rank: int):
  """``(params, tokens, key) -> factors``: dense G of every kernel, then a randomized SVD."""
  rules = RankRules(default=rank)

  def compress(path, g, key):
    r = rules.rank(path_str(path), *g.shape[-2:])
    if g.ndim == 2:
      return randomized_svd_compress(g, r, key)
    # One unbatched QR/SVD per layer: jaxlib's batched CPU LAPACK kernels (vmap) can deadlock
    # XLA's intra-op pool when several run at once on a 2-core machine.
    keys = jax.random.split(key, g.shape[0])
    return [randomized_svd_compress(g[l], r, keys[l]) for l in range(g.shape[0])]

  def f(params, tokens_BxL, key):
    flat = traverse_util.flatten_dict(dense_kernel_grads(problem, params, tokens_BxL))
    keys = jax.random.split(key, len(flat))
    return {path_str(p): compress(p, g, k) for (p, g), k in zip(flat.items(), keys)}
  return f


def sketch_path(problem: Problem, mask_fraction: float = 0.0):
  """``(params, projections, tokens, key) -> sketches``, optionally sparse-masked."""
  grad = sketch_value_and_grad(problem.loss)

  def f(params, projections, tokens_BxL, key):
    _, s = grad(params, projections, tokens_BxL)
    return sparse_mask_tree(s, key, mask_fraction) if mask_fraction else s
  return f


def compressor_cost(problem: Problem, rank=64, mask_fraction=0.5, repeats=5, seed=0):
  """Memory (bytes) and median seconds of: sketch, sparse-masked sketch, dense G + rSVD.

  Returns:
    {'sketch' | 'masked_sketch' | 'dense_rsvd': {'temp', 'argument', 'output', 'alias',
    'peak', 'seconds'}, 'ratios': {...}} with dense/sketch and masked/sketch ratios.
  """
  key = jax.random.key(seed)
  a = make_projections(problem.params, seed, 0, rank, dtype=problem.dtype)
  p, t = problem.params, problem.tokens_BxL
  paths = {'sketch': (sketch_path(problem), (p, a, t, key)),
           'masked_sketch': (sketch_path(problem, mask_fraction), (p, a, t, key)),
           'dense_rsvd': (dense_rsvd_path(problem, rank), (p, t, key))}
  out = {}
  for name, (fn, args) in paths.items():
    out[name] = compiled_memory(fn, *args)
    out[name]['seconds'] = median_seconds(fn, *args, repeats=repeats)
  nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  out['sizes'] = {'dense_kernel_grads': nbytes(select(p, target_paths(p))),
                  'sketches': nbytes(jax.eval_shape(sketch_path(problem), p, a, t, key))}
  ratio = lambda x, y, k: out[x][k] / max(out[y][k], 1e-30)
  out['ratios'] = {f'{x}/sketch {k}': ratio(x, 'sketch', k)
                   for x in ('dense_rsvd', 'masked_sketch') for k in ('temp', 'peak', 'seconds')}
  return out


def format_cost_table(cost) -> str:
  keys = ('temp', 'argument', 'output', 'peak')
  lines = [f'{"path":<15}' + ''.join(f'{k + " MiB":>14}' for k in keys) + f'{"ms":>10}']
  for name in ('sketch', 'masked_sketch', 'dense_rsvd'):
    c = cost[name]
    lines.append(f'{name:<15}' + ''.join(f'{c[k] / 2**20:>14.3f}' for k in keys)
                 + f'{c["seconds"] * 1e3:>10.2f}')
  lines += [f'{k:<28}{v:>8.2f}x' for k, v in cost['ratios'].items()]
  lines += [f'{k} MiB: {v / 2**20:.3f}' for k, v in cost['sizes'].items()]
  return '\n'.join(lines)
