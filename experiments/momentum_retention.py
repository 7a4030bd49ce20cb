r"""What an adaptive subspace's refresh keeps of LoGRA's sketch momentum.

At a refresh step t (t % optim.logra.refresh_every = 0) an adaptive-subspace LoGRA run builds
the next projections A_new from the step's co-sketches, and from step t + 1 its sketch-space
momentum m (R, D), expressed in the basis of the A_old it was built on, moves to A_new's basis
by m ← A_new A_old⁺ m (`sketch.basis_transfer`). The momentum's dense form is
Z = A_old⁺ m (K, D); after the transfer it is A_new⁺ A_new Z = P_new Z, its projection on
A_new's row space. Per sketched kernel this reports

  kept      ‖P_new Z‖² / ‖Z‖²: the share of the momentum's energy the refresh carries over;
  random    R / K: what a uniformly random R-dimensional subspace keeps on average;
  top_j     the share of ‖Z‖² in Z's j leading singular directions: what j rows of A_new set
            to those directions would keep at least;

and over all kernels, the energy-weighted means (Σ kept energy / Σ energy). Everything is
computed on the host in float64 from R × R and R × D matrices: ‖Z‖² = tr(mᵀ Γ_old⁻¹ m) with
Γ = A Aᵀ, ‖P_new Z‖² = tr((M m)ᵀ Γ_new⁻¹ (M m)) with M = A_new A_oldᵀ Γ_old⁻¹, and Z's squared
singular values are the eigenvalues of Γ_old^{-½} m mᵀ Γ_old^{-½}. Z is never formed.

The checkpoint of a refresh step holds A_new (`projections`), A_old (`prev_projections`) and
the momentum after step t, still in A_old's basis (its `basis` = A_old's version; checked).

  python experiments/momentum_retention.py --config=configs/compare_methods.py:ARM \
      --config.seed=5 --from_workdir=RUN --steps=10,20,30 [--out=FILE.json]

The LAST line is the JSON: {"steps": [{"step", "kept", "random", "top_j": {j: share},
"kernels": {path: {...}}}], "top_j": [...]}.

``--adam_workdir=ADAM_RUN`` (an AdamW run of the same task and seed) measures instead whether
what AdamW remembers lies in LoGRA's subspace: at each of ``--steps``, per sketched kernel, the
share of the energy of AdamW's first moment m (K, D), and of its update direction
m̂/(√v̂ + ε), in the row space of the A LoGRA uses after that step, next to R/K and to the share
in m's own top R input directions (the most a rank-R input subspace could hold); and the
overlap tr(P_s P_t)/R of LoGRA's A between the refresh steps among ``--steps``. JSON:
{"steps": [{"step", "first_moment": {...}, "update": {...}}], "subspace_overlap": [...]}.
"""
import json
import os
import sys

from absl import app, flags
from flax import traverse_util
import jax
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import direction_quality  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.train import methods  # noqa: E402  pylint: disable=g-import-not-at-top
from logra_jax.train.steps import logra_step  # noqa: E402  pylint: disable=g-import-not-at-top

TOP_J = (4, 8)


def retention(m, a_old, a_new, top_j=TOP_J) -> dict:
  """What the transfer m ← A_new A_old⁺ m keeps of the dense moment Z = A_old⁺ m, for one
  matrix (m (R, D), A (R, K), float64 on the host): {'energy': ‖Z‖², 'kept': ‖P_new Z‖²,
  'random': R/K · ‖Z‖², 'top_j': {j: energy of Z's j leading singular directions}}. A stack
  of matrices (leading axes, e.g. layers) sums over them."""
  m, a_old, a_new = (np.asarray(x, np.float64) for x in (m, a_old, a_new))
  m, a_old, a_new = (x.reshape((-1,) + x.shape[-2:]) for x in (m, a_old, a_new))
  out = {'energy': 0.0, 'kept': 0.0, 'random': 0.0, 'top_j': {j: 0.0 for j in top_j}}
  for mm, ao, an in zip(m, a_old, a_new):
    g_old, g_new = ao @ ao.T, an @ an.T
    w, v = np.linalg.eigh(g_old)
    inv_sqrt = (v / np.sqrt(w)) @ v.T  # Γ_old^{-1/2}
    energy = float(np.sum(mm * np.linalg.solve(g_old, mm)))
    moved = an @ ao.T @ np.linalg.solve(g_old, mm)  # A_new Z = M m
    out['energy'] += energy
    out['kept'] += float(np.sum(moved * np.linalg.solve(g_new, moved)))
    out['random'] += energy * ao.shape[0] / ao.shape[1]
    sigma2 = np.sort(np.linalg.eigvalsh(inv_sqrt @ mm @ mm.T @ inv_sqrt))[::-1]
    for j in top_j:
      out['top_j'][j] += float(np.sum(sigma2[:j]))
  return out


def subspace_share(x, a, top: int) -> dict:
  """How much of x (K, D) lies in A's (R, K) row space, float64 on the host: {'energy': ‖x‖²,
  'in_subspace': ‖P_A x‖² (P_A = A⁺ A), 'random': R/K · ‖x‖², 'top': the energy of x's
  ``top`` leading singular directions (the most any rank-``top`` input subspace holds)}. A
  stack of matrices (leading axes) sums over them."""
  x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
  x, a = x.reshape((-1,) + x.shape[-2:]), a.reshape((-1,) + a.shape[-2:])
  out = {'energy': 0.0, 'in_subspace': 0.0, 'random': 0.0, 'top': 0.0}
  for xx, aa in zip(x, a):
    ax = aa @ xx
    energy = float(np.sum(xx * xx))
    out['energy'] += energy
    out['in_subspace'] += float(np.sum(ax * np.linalg.solve(aa @ aa.T, ax)))
    out['random'] += energy * aa.shape[0] / aa.shape[1]
    gram = xx @ xx.T if xx.shape[0] <= xx.shape[1] else xx.T @ xx
    out['top'] += float(np.sum(np.sort(np.linalg.eigvalsh(gram))[::-1][:top]))
  return out


def overlap(a, b) -> float:
  """tr(P_A P_B) / min(R_A, R_B) of two projections' row spaces (1: one holds the other; R/K
  on average for independent random ones), averaged over a stack's matrices."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  a, b = a.reshape((-1,) + a.shape[-2:]), b.reshape((-1,) + b.shape[-2:])
  vals = []
  for aa, bb in zip(a, b):
    cross = aa @ bb.T
    t = np.trace(np.linalg.solve(aa @ aa.T, cross) @ np.linalg.solve(bb @ bb.T, cross.T))
    vals.append(t / min(aa.shape[0], bb.shape[0]))
  return float(np.mean(vals))


def shares(parts: dict) -> dict:
  """Energies → shares of the energy: {'kept', 'random', 'top_j': {j: share}}."""
  e = parts['energy']
  return {'kept': parts['kept'] / e, 'random': parts['random'] / e,
          'top_j': {j: x / e for j, x in parts['top_j'].items()}}


def refresh_retention(state, top_j=TOP_J) -> dict:
  """`retention` of every sketched kernel in an adaptive LoGRA state restored at a refresh
  step, and the energy-weighted totals: {'kernels': {path: shares}, 'kept', 'random',
  'top_j'}."""
  # The one sketch momentum anywhere in the state (with a trained rest, beside its Adam state).
  mu = logra_step.sketch_momentum_state(state['opt_state']).mu
  mu, a_old, a_new = (flat_arrays(t) for t in (mu, state['prev_projections'],
                                                state['projections']))
  total = {'energy': 0.0, 'kept': 0.0, 'random': 0.0, 'top_j': {j: 0.0 for j in top_j}}
  kernels = {}
  for path in sorted(mu):
    parts = retention(mu[path], a_old[path], a_new[path], top_j)
    kernels[path] = shares(parts)
    for k in ('energy', 'kept', 'random'):
      total[k] += parts[k]
    for j in top_j:
      total['top_j'][j] += parts['top_j'][j]
  return dict(shares(total), kernels=kernels)


def momentum_basis(state) -> int:
  """The version of A the restored sketch momentum is expressed in."""
  return int(jax.device_get(logra_step.sketch_momentum_state(state['opt_state']).basis))


def check_refresh_step(o, step: int, basis: int):
  """A refresh step of an adaptive run, whose momentum is still in A_old's basis."""
  if o.subspace != 'adaptive':
    raise ValueError("momentum_retention reads an adaptive subspace's refresh "
                     f"(optim.logra.subspace='adaptive'), not {o.subspace!r}")
  if step <= 0 or step % o.refresh_every:
    raise ValueError(f'step {step} is not a refresh step (a positive multiple of '
                     f'optim.logra.refresh_every={o.refresh_every})')
  if basis != methods.active_version(o, step):
    raise ValueError(f"step {step}'s momentum is in basis {basis}, not the refreshed A's "
                     f'{methods.active_version(o, step)}: not the state right after a refresh')


def measure(cfg, run_dir: str, steps, top_j=TOP_J, log=print, state_at=None) -> dict:
  """Measurement M at ``steps`` (refresh steps) of ``run_dir``; ``state_at``: the run's
  `loop.checkpoint_states` reader when the caller has one (else built here)."""
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  steps = loop.checkpoint_steps(run_dir, steps)
  state_at = state_at or loop.checkpoint_states(cfg, run_dir)[-1]
  out = []
  for step in steps:
    state = state_at(step)
    check_refresh_step(cfg.optim.logra, step, momentum_basis(state))
    r = dict(refresh_retention(state, top_j), step=int(step))
    log(f"step {step}: kept {r['kept']:.3f} (random subspace {r['random']:.3f}; "
        + ', '.join(f'top {j} {s:.3f}' for j, s in r['top_j'].items()) + ')')
    out.append(r)
  return {'steps': out, 'top_j': list(top_j)}


def flat_arrays(tree) -> dict:
  return {k: np.asarray(jax.device_get(v))
          for k, v in traverse_util.flatten_dict(tree, sep='/').items()}


def adam_moments_of(state, b1: float, b2: float, eps: float = direction_quality.ADAM_EPS):
  """(m, m̂/(√v̂ + ε)) of a restored AdamW state, flat by path: its first moment and the
  direction its next step would take without a new gradient (bias-corrected as optax's
  Adam)."""
  adam = direction_quality.adam_state(state['opt_state'])
  count = int(jax.device_get(adam.count))
  mu, nu = flat_arrays(adam.mu), flat_arrays(adam.nu)
  step = {k: (mu[k] / (1 - b1 ** count)) / (np.sqrt(nu[k] / (1 - b2 ** count)) + eps)
          for k in mu}
  return mu, step


def adam_in_subspace(cfg, logra_dir: str, adam_dir: str, steps, log=print, logra_at=None,
                     adam_at=None) -> dict:
  """Measurement M2 (module docstring): per step, the share of AdamW's first moment and of
  its update direction in the row space of LoGRA's A after that step, per kernel and
  energy-weighted, and the overlap of LoGRA's A between the refresh steps among ``steps``.
  ``logra_at``, ``adam_at``: the runs' `loop.checkpoint_states` readers, when the caller has
  them (else built here)."""
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  adam_cfg = direction_quality.probe_config(cfg, adam_dir)
  steps = loop.checkpoint_steps(logra_dir, steps)
  loop.checkpoint_steps(adam_dir, steps)
  logra_at = logra_at or loop.checkpoint_states(cfg, logra_dir)[-1]
  adam_at = adam_at or loop.checkpoint_states(adam_cfg, adam_dir)[-1]
  out, subspaces = [], {}
  for step in steps:
    a = flat_arrays(logra_at(step)['projections'])
    subspaces[step] = a
    moments = adam_moments_of(adam_at(step), adam_cfg.optim.adam.b1, adam_cfg.optim.adam.b2)
    row = {'step': int(step)}
    for name, tree in zip(('first_moment', 'update'), moments):
      total = {'energy': 0.0, 'in_subspace': 0.0, 'random': 0.0, 'top': 0.0}
      kernels = {}
      for path in sorted(a):
        parts = subspace_share(tree[path], a[path], a[path].shape[-2])
        kernels[path] = {k: parts[k] / parts['energy'] for k in
                         ('in_subspace', 'random', 'top')}
        for k in total:
          total[k] += parts[k]
      row[name] = dict({k: total[k] / total['energy'] for k in ('in_subspace', 'random', 'top')},
                       kernels=kernels)
      log(f"step {step}, AdamW's {name}: in LoGRA's subspace {row[name]['in_subspace']:.3f} "
          f"(random {row[name]['random']:.3f}; its own top R {row[name]['top']:.3f})")
    out.append(row)
  refreshes = [t for t in steps if t % cfg.optim.logra.refresh_every == 0]
  drift = []
  for i, s in enumerate(refreshes):
    for t in refreshes[i + 1:]:
      per = {p: overlap(subspaces[s][p], subspaces[t][p]) for p in subspaces[s]}
      drift.append({'steps': [int(s), int(t)], 'overlap': float(np.mean(list(per.values()))),
                    'kernels': per})
      log(f"LoGRA's A after steps {s} and {t}: overlap {drift[-1]['overlap']:.3f}")
  return {'steps': out, 'subspace_overlap': drift}


def project_rows(x, a):
  """P_A x for x (…, K, D), A (…, R, K): x's columns projected on A's row space (float64)."""
  x, a = np.asarray(x, np.float64), np.asarray(a, np.float64)
  shape = x.shape
  x, a = x.reshape((-1,) + shape[-2:]), a.reshape((-1,) + a.shape[-2:])
  return np.stack([aa.T @ np.linalg.solve(aa @ aa.T, aa @ xx)
                   for xx, aa in zip(x, a)]).reshape(shape)


def form_gradient(model, task, params, chunk: int = 32) -> dict:
  """g_F = ∇(J_terse − J_template) at ``params`` over the task's held-out problems (as the
  form probe computes it), flat by path, float64 on the host."""
  records = task.eval_records[:len(task.eval_records) // chunk * chunk]
  grads = {}
  for form in ('terse', 'template'):
    batch, p = direction_quality.form_batch(task, form, records)
    grads[form] = flat_arrays(direction_quality.chunked_loglik_and_grad(
        model, params, batch, p, chunk)[1])
  return {k: grads['terse'][k].astype(np.float64) - grads['template'][k] for k in grads['terse']}


def gain_split(g_form: dict, direction: dict, a: dict) -> dict:
  """The form gain ⟨g_F, D⟩ of D (flat by path) on the sketched kernels (the paths of ``a``),
  inside A's row space (⟨g_F, P_A D⟩) and outside it, and on the rest; per kernel kind too."""
  out = {'kernels': 0.0, 'inside': 0.0, 'rest': 0.0, 'per_kernel': {}}
  for path, d in direction.items():
    g = g_form[path]
    total = float(np.sum(g * d))
    if path not in a:
      out['rest'] += total
      continue
    inside = float(np.sum(g * project_rows(d, a[path])))
    out['kernels'] += total
    out['inside'] += inside
    out['per_kernel'][path] = {'kernels': total, 'inside': inside}
  out['outside'] = out['kernels'] - out['inside']
  out['inside_share'] = out['inside'] / out['kernels'] if out['kernels'] else float('nan')
  return out


def adam_form_gain_split(cfg, logra_dir: str, adam_dir: str, steps, chunk: int = 32,
                         log=print) -> dict:
  """Measurement M3: at AdamW's policy of each of ``steps``, the form gain of what it remembers
  (−m) and of its update direction (−m̂/(√v̂ + ε)), split by LoGRA's subspace (`gain_split`)."""
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  adam_cfg = direction_quality.probe_config(cfg, adam_dir)
  steps = loop.checkpoint_steps(logra_dir, steps)
  loop.checkpoint_steps(adam_dir, steps)
  *_, logra_at = loop.checkpoint_states(cfg, logra_dir)
  task, model, _, method, adam_at = loop.checkpoint_states(adam_cfg, adam_dir)
  out = []
  for step in steps:
    a = flat_arrays(logra_at(step)['projections'])
    state = adam_at(step)
    g_form = form_gradient(model, task, method.policy_params(state), chunk)
    moments = adam_moments_of(state, adam_cfg.optim.adam.b1, adam_cfg.optim.adam.b2)
    row = {'step': int(step)}
    for name, tree in zip(('first_moment', 'update'), moments):
      row[name] = gain_split(g_form, {k: -np.asarray(v, np.float64) for k, v in tree.items()}, a)
      r = row[name]
      log(f"step {step}, −AdamW's {name}: form gain on the kernels {r['kernels']:.4g}, inside "
          f"LoGRA's subspace {r['inside']:.4g} (share {r['inside_share']:.3f}), outside "
          f"{r['outside']:.4g}; on the rest {r['rest']:.4g}")
    out.append(row)
  return {'steps': out}


FLAGS = flags.FLAGS


def define_flags():
  config_flags.DEFINE_config_file('config', None, 'The run\'s config (an adaptive LoGRA arm).')
  flags.DEFINE_string('from_workdir', None, 'The run\'s workdir (its checkpoints are read).')
  flags.DEFINE_list('steps', [], 'Refresh steps whose checkpoints to read.')
  flags.DEFINE_string('adam_workdir', '', 'An AdamW run of the same task and seed: measure its '
                      "moments' share in LoGRA's subspace (M2) instead.")
  flags.DEFINE_bool('form_gain', False, 'With --adam_workdir: the form objective\'s gain of '
                    "AdamW's moment and update, split by LoGRA's subspace (M3).")
  flags.DEFINE_string('out', '', 'Also write the JSON here.')


def main(argv):
  del argv
  from logra_jax.train.config import from_config_dict  # pylint: disable=g-import-not-at-top
  cfg = from_config_dict(FLAGS.config)
  steps = [int(s) for s in FLAGS.steps]
  if FLAGS.form_gain:
    if not FLAGS.adam_workdir:
      raise app.UsageError('--form_gain needs --adam_workdir')
    result = adam_form_gain_split(cfg, FLAGS.from_workdir, FLAGS.adam_workdir, steps)
  elif FLAGS.adam_workdir:
    result = adam_in_subspace(cfg, FLAGS.from_workdir, FLAGS.adam_workdir, steps)
  else:
    result = measure(cfg, FLAGS.from_workdir, steps)
  if FLAGS.out:
    with open(FLAGS.out, 'w') as f:
      json.dump(result, f, indent=1)
  print(json.dumps(result))


if __name__ == '__main__':
  define_flags()
  app.run(main)
