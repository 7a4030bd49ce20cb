"""How many rows and positions the predicted-KL probe needs: α error and KL correlation vs size.

  python experiments/kl_probe_size.py                      # SmolLM2 (configs/smollm2_rg.py:paper)
  python experiments/kl_probe_size.py --model=tiny         # the tiny config (CI: a minute)

Runs the trainer's own steps (`loop.Trainer`, the config's defaults, `--config` overrides) for
``--batches`` steps. After each step it takes the step's batch, the weights before and after
(D = the applied update α·AᵀU) and computes on ALL rows, in one jitted function, the
per-position variance of the logit tangent along D (one JVP; `sketch.position_variance`) and
the per-position KL(π_old ‖ π_new) the step really caused (`sketch.position_kl`). Every
subset's predicted KL follows from those exactly (`logra_jax.analysis.probe_size`): the
table scores n rows (distinct prompts first, random draws) × a fraction f of their positions
by the RMS error of the step size they would choose, against the one that meets the budget
on the whole batch; a second table scores layouts of k prompts x s samples each (``--layouts``:
rows that share a prompt, whose forward packs it once) next to the positions that forward
runs, the probe's cost. It also checks that the strided rows the trainer probed reproduce its
logged `predicted_kl` (a different code path: the sketch-linear JVP along U).

The LAST line is one JSON object: {"table": [...], "layouts": [...], "expansion_alpha_error": e,
"recommended_rows": n, "trainer_probe": {...}, "workload": {...}}.
"""
import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from experiments.bench_step import _override  # pylint: disable=g-import-not-at-top
from logra_jax import sketch  # pylint: disable=g-import-not-at-top
from logra_jax.analysis import probe_size  # pylint: disable=g-import-not-at-top
from logra_jax.train import completion, loop  # pylint: disable=g-import-not-at-top
from logra_jax.train.steps import kl_probe  # pylint: disable=g-import-not-at-top
from logra_jax.train import config as config_lib  # pylint: disable=g-import-not-at-top


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2')
  p.add_argument('--batches', type=int, default=8, help='trainer steps (batches) to score')
  p.add_argument('--rows', default='1,2,4,8,16,32', help='probe sizes (rows; capped at N)')
  p.add_argument('--fractions', default='1,0.5,0.25,0.1', help='fractions of positions kept')
  p.add_argument('--layouts', default='8x1,4x2,2x4,8x2,4x4',
                 help='probe layouts PROMPTSxSAMPLES (rows sharing prompts), capped to the batch')
  p.add_argument('--draws', type=int, default=200, help='random subsets per size and batch')
  p.add_argument('--tolerance', type=float, default=0.1,
                 help='recommend the fewest rows within this of the expansion error')
  p.add_argument('--config', action='append', default=[],
                 help="extra overrides 'section.key=value' (JSON values)")
  return p.parse_args(argv)


def make_config(args) -> config_lib.TrainConfig:
  from configs import smollm2_rg, tiny  # pylint: disable=g-import-not-at-top
  # SmolLM2: the paper's rule (smollm2_rg.py's default when the recorded figures ran).
  cfg = smollm2_rg.get_config('paper') if args.model == 'smollm2' else tiny.get_config()
  for text in args.config:
    _override(cfg, text)
  cfg = config_lib.from_config_dict(cfg)
  if cfg.optim.name != 'logra' or not cfg.optim.logra.kl_control or cfg.model.vocab_chunk:
    raise ValueError('kl_probe_size.py needs optim.name=logra, optim.logra.kl_control=True and '
                     'model.vocab_chunk=0 (it takes per-position terms of full logits)')
  return cfg


def make_stats(model, prompt_len: int, temperature: float):
  """jitted (old, new, batch) -> (variance of ż along new − old, KL(old ‖ new)), each (N, T)."""
  def stats(old, new, batch):
    fwd = lambda w: completion.forward(model, {'params': w}, batch, prompt_len)
    delta = jax.tree.map(lambda a, b: b - a, old, new)
    base, tangent = jax.jvp(fwd, (old,), (delta,))
    return (sketch.position_variance(base, tangent, temperature),
            sketch.position_kl(base, fwd(new), temperature))
  return jax.jit(stats)


def _keep_batch(collect, seen: list):
  """`Trainer.collect` that also appends its (host batch, prompt length) to ``seen``."""
  def wrapped(t):
    out = collect(t)
    seen.append(out[:2])
    return out
  return wrapped


def collect(cfg, n_batches: int, workdir: str, log=print):
  """[{var, kl, mask}] over ``n_batches`` trainer steps, and each step's logged metrics."""
  trainer = loop.Trainer(cfg, workdir, log=lambda *_: None)
  seen = []
  trainer.collect = _keep_batch(trainer.collect, seen)
  stats_fns, batches, logged = {}, [], []
  try:
    for _ in range(n_batches):
      old = jax.tree.map(jnp.copy, trainer.method.policy_params(trainer.state))
      start = time.perf_counter()
      metrics = trainer.train_step()
      batch, p = seen.pop()  # the host batch the update saw
      if p not in stats_fns:
        stats_fns[p] = make_stats(trainer.model, p, cfg.rollout.temperature)
      new = trainer.method.policy_params(trainer.state)
      var, kl = jax.device_get(stats_fns[p](old, new, trainer.method.put_batch(batch)))
      del old
      batches.append(dict(var=np.asarray(var), kl=np.asarray(kl), prompt_len=int(p),
                          mask=np.asarray(batch['target_mask']), alpha=metrics['alpha'],
                          budget=metrics['kl_budget'], alpha_max=cfg.optim.logra.alpha_max))
      logged.append(metrics)
      log(f'step {trainer.step}: alpha {metrics["alpha"]:.4g} predicted_kl '
          f'{metrics["predicted_kl"]:.4g} realised (all rows) '
          f'{probe_size.masked_mean(batches[-1]["kl"], batches[-1]["mask"]):.4g} '
          f'({time.perf_counter() - start:.0f} s)')
  finally:
    trainer.close()
  return batches, logged


def trainer_probe(cfg, batches, logged) -> dict:
  """The trainer's own probe (strided `kl_sequences` rows, all positions): its α error and
  the relative difference of its q(D) here from the logged predicted_kl."""
  n, t = cfg.optim.kl_sequences, cfg.rollout.temperature
  errs, gaps = [], []
  for x, m in zip(batches, logged):
    rows = np.asarray(kl_probe.kl_rows(len(x['mask']), n))
    sub = probe_size.subset_mask(x['mask'], rows, 1.0, None)
    pred = probe_size.predicted(x['var'], sub, t)
    errs.append(probe_size.alpha_error(x, pred))
    if m['skipped'] == 0 and m['predicted_kl'] > 0:
      gaps.append(abs(pred / m['predicted_kl'] - 1))
  return dict(rows=n, alpha_rms=float(np.sqrt(np.mean(np.square(errs)))),
              max_gap_to_logged_predicted_kl=float(max(gaps)) if gaps else float('nan'))


def main(argv=None):
  args = parse_args(argv)
  cfg = make_config(args)
  n_rows = cfg.data.prompts_per_step * cfg.data.samples_per_prompt
  rows = sorted({min(int(r), n_rows) for r in args.rows.split(',')})
  fractions = [float(f) for f in args.fractions.split(',')]
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as workdir:
    batches, logged = collect(cfg, args.batches, workdir)
  table = probe_size.study(batches, rows, fractions, args.draws, cfg.data.samples_per_prompt,
                           cfg.rollout.temperature)
  floor = probe_size.expansion_error(batches, cfg.rollout.temperature)
  print(f'{"rows":>5} {"pos":>5} {"alpha_rms":>10} {"median":>8} {"vs_all":>8} {"kl_corr":>8}')
  for r in table:
    print(f'{r["rows"]:>5} {r["fraction"]:>5.2f} {r["alpha_rms"]:>10.4f} '
          f'{r["alpha_median"]:>8.4f} {r["alpha_rms_vs_all"]:>8.4f} {r["kl_corr"]:>8.3f}')
  group = cfg.data.samples_per_prompt
  layouts = sorted({(min(int(k), cfg.data.prompts_per_step), min(int(g), group))
                    for k, g in (t.split('x') for t in args.layouts.split(','))})
  by_layout = probe_size.layout_study(batches, layouts, args.draws, group,
                                      cfg.rollout.temperature)
  print(f'{"prompts":>7} {"x":>3} {"rows":>5} {"positions":>9} {"alpha_rms":>10} {"vs_all":>8}')
  for r in by_layout:
    print(f'{r["prompts"]:>7} {r["per_prompt"]:>3} {r["rows"]:>5} {r["positions"]:>9.0f} '
          f'{r["alpha_rms"]:>10.4f} {r["alpha_rms_vs_all"]:>8.4f}')
  probe = trainer_probe(cfg, batches, logged)
  print(f'expansion error (all rows) {floor:.4f}; the trainer\'s probe ({probe["rows"]} strided '
        f'rows) alpha_rms {probe["alpha_rms"]:.4f}; {time.perf_counter() - start:.0f} s')
  print(json.dumps(dict(
      table=table, layouts=by_layout, expansion_alpha_error=floor,
      recommended_rows=probe_size.recommend(table, floor, args.tolerance),
      trainer_probe=probe,
      workload=dict(model=args.model, batches=len(batches), rows=n_rows,
                    group_size=cfg.data.samples_per_prompt,
                    new_tokens=cfg.rollout.max_new_tokens, draws=args.draws,
                    tolerance=args.tolerance))))


if __name__ == '__main__':
  main()
