"""How well a KL probe on a subset of the batch predicts the step's KL (issue 11's probe study).

Both the predicted-KL coefficient q and the realised KL are means over positions of
per-position terms (`sketch.position_variance`, `sketch.position_kl`), and a row's terms do
not depend on the other rows. So one JVP over ALL rows of a batch gives every subset's
estimate exactly: a subset's q is the mean of its positions' variances. These functions take
those per-position arrays (numpy, (N, T)) for a batch and score subsets of n rows (spread
over the prompts, as the trainer's `kl_sequences` rows are) and a fraction f of their
positions against the KL the applied step really caused on the whole batch; `layout_study`
scores probes of k prompts × s samples each (rows that share a prompt: their forward packs
the prompt once) next to the positions their forward runs.

For a step along D = α·AᵀU (the applied update) a subset predicts KL_S = q_S(D), so the step
size it would have chosen is α_S = min(α_max, α·sqrt(δ/KL_S)) (the trainer's rule,
`sketch.step_scale`, with q_S(U) = KL_S/α²), while the one that meets the budget δ on the
whole batch is α* = min(α_max, α·sqrt(δ/KL_all)) with KL_all the realised KL. ``alpha_error``
is |α_S/α* − 1|: the subset's sampling error plus the second-order expansion's own error
(`expansion_error`, the all-rows probe, shows the latter alone).
"""
from typing import Optional, Sequence

import numpy as np


def spread_rows(group_size: int, n_rows: int, n: int, rng: np.random.Generator) -> np.ndarray:
  """n row indices of a batch whose prompts' ``group_size`` samples are contiguous: distinct
  prompts first (groups in a random order, a random sample of each), then round robin."""
  if not 1 <= n <= n_rows:
    raise ValueError(f'probe rows must lie in [1, {n_rows}], got {n}')
  groups = [rng.permutation(np.arange(g, min(g + group_size, n_rows)))
            for g in range(0, n_rows, group_size)]
  order = rng.permutation(len(groups))
  picked = [groups[g][k] for k in range(group_size) for g in order if k < len(groups[g])]
  return np.asarray(picked[:n])


def grouped_rows(group_size: int, n_rows: int, prompts: int, per_prompt: int,
                 rng: np.random.Generator) -> np.ndarray:
  """Row indices of ``prompts`` random prompts' groups, ``per_prompt`` random samples of each
  (a probe whose rows share prompts, so its forward packs each prompt once)."""
  groups = -(-n_rows // group_size)
  if not 1 <= prompts <= groups or not 1 <= per_prompt <= group_size:
    raise ValueError(f'probe layout {prompts} prompts x {per_prompt} samples must lie within '
                     f'{groups} prompts x {group_size} samples')
  picked = []
  for g in rng.choice(groups, size=prompts, replace=False):
    rows = np.arange(g * group_size, min((g + 1) * group_size, n_rows))
    picked.extend(rng.choice(rows, size=min(per_prompt, len(rows)), replace=False))
  return np.asarray(picked)


def subset_mask(mask: np.ndarray, rows: np.ndarray, fraction: float,
                rng: np.random.Generator) -> np.ndarray:
  """The mask of ``rows`` with each valid position kept with probability ``fraction`` (at
  least one position kept)."""
  if not 0 < fraction <= 1:
    raise ValueError(f'position fraction must lie in (0, 1], got {fraction}')
  out = np.zeros_like(mask, dtype=bool)
  out[rows] = mask[rows] > 0
  if fraction < 1:
    keep = rng.random(out.shape) < fraction
    kept = out & keep
    if not kept.any():
      kept.flat[np.flatnonzero(out)[0]] = True
    out = kept
  return out


def masked_mean(x: np.ndarray, mask: np.ndarray) -> float:
  m = mask.astype(np.float64)
  return float((x.astype(np.float64) * m).sum() / max(m.sum(), 1.0))


def predicted(var: np.ndarray, mask: np.ndarray, temperature: float = 1.0) -> float:
  """q over the masked positions: mean variance / 2T² (`sketch.kl_coefficient`)."""
  return masked_mean(var, mask) / (2.0 * temperature**2)


def chosen_alpha(kl_of_step: float, alpha: float, budget: float, alpha_max: float) -> float:
  """The step size a probe predicting KL ``kl_of_step`` for the step α·D chooses:
  min(α_max, α·sqrt(δ / KL)); 1.0 when it predicts none (as `sketch.step_scale`)."""
  if kl_of_step <= 0:
    return 1.0
  return min(alpha_max, alpha * float(np.sqrt(budget / kl_of_step)))


def alpha_error(x: dict, kl_subset: float, kl_reference: Optional[float] = None) -> float:
  """|α_S/α* − 1| for batch ``x`` (its ``alpha``, ``budget``, ``alpha_max``): α_S from the
  subset's predicted KL, α* from ``kl_reference`` (default: the realised KL, all rows)."""
  ref = masked_mean(x['kl'], x['mask']) if kl_reference is None else kl_reference
  hp = x['alpha'], x['budget'], x['alpha_max']
  return abs(chosen_alpha(kl_subset, *hp) / chosen_alpha(ref, *hp) - 1.0)


def _pearson(x, y) -> float:
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if len(x) < 3 or x.std() == 0 or y.std() == 0:
    return float('nan')
  return float(np.corrcoef(x, y)[0, 1])


def _score(batches: Sequence[dict], draw_mask, draws: int, temperature: float) -> dict:
  """α errors of ``draws`` subsets per batch, ``draw_mask(x)`` -> a subset's mask of batch x:
  RMS / median against the realised KL on the whole batch, RMS against the all-rows probe,
  and the mean correlation over batches of log KL_S with log KL_all."""
  realised = [masked_mean(x['kl'], x['mask']) for x in batches]
  errs, errs_all, pred = [], [], np.zeros((draws, len(batches)))
  for b, x in enumerate(batches):
    q_all = predicted(x['var'], x['mask'], temperature)
    for d in range(draws):
      pred[d, b] = predicted(x['var'], draw_mask(x), temperature)
      errs.append(alpha_error(x, pred[d, b], realised[b]))
      errs_all.append(alpha_error(x, pred[d, b], q_all))
  corr = [_pearson(np.log(np.maximum(p, 1e-30)), np.log(realised)) for p in pred]
  errs, errs_all = np.asarray(errs), np.asarray(errs_all)
  return dict(alpha_rms=float(np.sqrt(np.mean(errs**2))), alpha_median=float(np.median(errs)),
              alpha_rms_vs_all=float(np.sqrt(np.mean(errs_all**2))),
              kl_corr=float(np.mean(corr)))


def study(batches: Sequence[dict], rows: Sequence[int], fractions: Sequence[float],
          draws: int, group_size: int, temperature: float = 1.0, seed: int = 0) -> list:
  """One row per (n, f): the RMS and median α error over batches × draws, against the
  realised KL on the whole batch (``alpha_rms``) and against the all-rows probe
  (``alpha_rms_vs_all``: sampling error only), and the correlation over batches of
  log KL_S with log KL_all (``kl_corr``, mean over draws; NaN under 3 batches).

  ``batches``: dicts of (N, T) arrays ``var``, ``kl``, ``mask`` and the step's scalars
  ``alpha`` (applied), ``budget`` and ``alpha_max``.
  """
  rng = np.random.default_rng(seed)
  out = []
  for n in rows:
    for f in fractions:
      draw = lambda x, n=n, f=f: subset_mask(
          x['mask'], spread_rows(group_size, len(x['mask']), n, rng), f, rng)
      out.append(dict(rows=int(n), fraction=float(f),
                      **_score(batches, draw, draws, temperature)))
  return out


def packed_positions(prompts: int, per_prompt: int, prompt_len: int, completion: int) -> int:
  """Positions a probe's forward runs for ``prompts`` x ``per_prompt`` rows packed by prompt
  (`completion.pack_prompt_groups`: the prompt once, then each completion but its last
  token; one unpacked row, P + T, when per_prompt is 1)."""
  if per_prompt == 1:
    return prompts * (prompt_len + completion)
  return prompts * (prompt_len + per_prompt * (completion - 1))


def layout_study(batches: Sequence[dict], layouts: Sequence[tuple], draws: int,
                 group_size: int, temperature: float = 1.0, seed: int = 0) -> list:
  """One row per layout (prompts, per_prompt): `study`'s errors for probes of that many random
  prompts × random samples of each (all positions), and ``positions``, the mean over batches
  of the positions its packed forward runs (`packed_positions`; each batch's ``prompt_len``),
  the probe's cost: whether rows that share a prompt are worth what distinct prompts are."""
  rng = np.random.default_rng(seed)
  out = []
  for k, s in layouts:
    draw = lambda x, k=k, s=s: subset_mask(
        x['mask'], grouped_rows(group_size, len(x['mask']), k, s, rng), 1.0, rng)
    cost = np.mean([packed_positions(k, s, x['prompt_len'], x['mask'].shape[1])
                    for x in batches])
    out.append(dict(prompts=int(k), per_prompt=int(s), rows=int(k * s), positions=float(cost),
                    **_score(batches, draw, draws, temperature)))
  return out


def expansion_error(batches: Sequence[dict], temperature: float = 1.0) -> float:
  """RMS over batches of |sqrt(KL_all / q_all) − 1|: the second-order expansion's own α error
  (no sampling)."""
  e = [alpha_error(x, predicted(x['var'], x['mask'], temperature)) for x in batches]
  return float(np.sqrt(np.mean(np.square(e))))


def recommend(table: Sequence[dict], floor: float, tolerance: float = 0.1,
              fraction: float = 1.0) -> Optional[int]:
  """The fewest rows (at ``fraction``) whose RMS α error is within ``tolerance`` of the
  expansion's own error ``floor`` (rows ≥ that never do better than the floor), or None."""
  ok = [r['rows'] for r in table if r['fraction'] == fraction
        and r['alpha_rms'] <= floor + tolerance]
  return min(ok) if ok else None
