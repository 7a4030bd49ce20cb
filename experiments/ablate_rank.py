r"""Rank x projection ablation (the paper's Fig. 5a/5b/5c) with the library's trainer.

  python experiments/ablate_rank.py --config=configs/ablate_rank.py:tiny --workdir=runs/ablate_rank

Every arm (rank x {fixed Rademacher, refreshed Rademacher, refreshed Gaussian, refreshed
orthogonal}, from the config's `ablation(arg)`) is the base config with optim.logra.rank,
optim.logra.projection and optim.logra.refresh set, trained by `loop.train` from one shared step-0 start
(experiments/ablation_start.py) in WORKDIR/arms/NAME; a rerun resumes finished arms.

Fig. 5a: each arm's final held-out pass@1. Fig. 5b/5c: the reconstruction cosine
cos(AᵀA G, G) of every sketched matrix, layer by layer (`fidelity.layer_cosines`), on the
starting policy, G the dense gradient of the reference answers' NLL (the answer tokens of
`cosine_sequences` training prompts), with the i.i.d./orthogonal theory beside it.
Writes WORKDIR/results.md, results.json and ablate_rank.png.
"""
import time

from absl import app, logging
import numpy as np

import ablation_io
import ablation_start

NAME = 'ablate_rank'
_FLAGS = ablation_start.define_flags(NAME)


def arms(s: dict) -> list:
  return [dict(name=f'{v}_r{rank}', variant=v, rank=int(rank), projection=kind,
               refresh=bool(refresh))
          for rank in s['ranks'] for v, kind, refresh in s['variants']]


def run_arm(base, arm: dict, workdir: str, start_dir: str, log) -> dict:
  """Trains one arm from the shared start; its final pass@1 and per-step summaries."""
  res = ablation_start.run_arm(base, arm['name'], {'optim.logra.rank': arm['rank'],
                                                   'optim.logra.projection': arm['projection'],
                                                   'optim.logra.refresh': arm['refresh']},
                               workdir, start_dir, log)
  rl = [r for r in res.history if r['step'] > 0]
  mean = lambda k: float(np.mean([r[k] for r in rl if r.get(k) is not None] or [np.nan]))
  return dict(arm, pass_at_1=res.final.get('eval_accuracy'),
              pass_at_k=res.final.get('eval_pass_at_k'), final_step=res.final.get('step'),
              start_pass_at_1=res.history[0].get('eval_accuracy'),
              train_accuracy_mean=mean('accuracy'), realized_kl_mean=mean('realized_kl'),
              eval_curve=[(r['step'], r['eval_accuracy']) for r in res.history
                          if r.get('eval_accuracy') is not None],
              wall_s=res.wall_s)


def answer_batch(task, n: int) -> dict:
  """`prompt answer stop` of the first n training records; loss_mask on the answer + stop."""
  from logra_jax import data  # pylint: disable=g-import-not-at-top
  seqs, masks = [], []
  for r in task.train_records[:n]:
    text = task.reference(r)
    ids = (task.tokenizer.encode(text) if isinstance(task.tokenizer, data.CharTokenizer)
           else task.tokenizer(text, add_special_tokens=False)['input_ids'])
    prompt, answer = list(task.prompt_ids(r)), list(ids) + [task.stop_ids[0]]
    seqs.append(prompt + answer)
    masks.append([0] * len(prompt) + [1] * len(answer))
  length = max(len(s) for s in seqs)
  tokens = np.full((len(seqs), length), task.pad_id, np.int32)
  mask = np.zeros((len(seqs), length), np.float32)
  for i, (s, m) in enumerate(zip(seqs, masks)):
    tokens[i, :len(s)], mask[i, :len(m)] = s, m
  return {'tokens': tokens, 'loss_mask': mask}


def answer_nll(model):
  """``loss(variables, batch)``: mean NLL of the masked (answer) tokens."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  def loss(variables, batch):
    logits_BxLxV, _ = model.apply(variables, batch['tokens'])
    logp = jax.nn.log_softmax(logits_BxLxV[:, :-1], -1)
    nll_BxL = -jnp.take_along_axis(logp, batch['tokens'][:, 1:, None], -1)[..., 0]
    m_BxL = batch['loss_mask'][:, 1:]
    return jnp.sum(nll_BxL * m_BxL) / jnp.maximum(jnp.sum(m_BxL), 1.0)
  return loss


def cosines(base, start_dir: str, s: dict, log) -> list:
  """`fidelity.layer_cosines` of the starting policy (restored from the start checkpoint)."""
  from logra_jax.analysis import fidelity  # pylint: disable=g-import-not-at-top
  from logra_jax.train import loop  # pylint: disable=g-import-not-at-top
  trainer = loop.Trainer(base, start_dir, log)
  try:
    params = trainer.method.policy_params(trainer.state)
    batch = answer_batch(trainer.task, s['cosine_sequences'])
    return fidelity.layer_cosines(answer_nll(trainer.model), params, batch, s['cosine_ranks'],
                                  s['cosine_kinds'], s['cosine_seeds'])
  finally:
    trainer.close()


def cosine_summary(rows: list) -> list:
  """Mean over matrices and layers per (kind, rank): measured and predicted (Fig. 5b)."""
  keys = list(dict.fromkeys((r['kind'], r['rank']) for r in rows))
  out = []
  for kind, rank in keys:
    rr = [r for r in rows if (r['kind'], r['rank']) == (kind, rank)]
    out.append(dict(kind=kind, rank=rank, cos_mean=float(np.mean([r['cos'] for r in rr])),
                    predicted=float(np.mean([r['predicted'] for r in rr])), n=len(rr)))
  return out


def heatmap(rows: list, kind: str):
  """(labels 'L{layer} {module}', ranks, cos[label, rank]) of one projection kind."""
  rr = [r for r in rows if r['kind'] == kind]
  labels = sorted({(r['layer'], r['module']) for r in rr})
  ranks = sorted({r['rank'] for r in rr})
  grid = np.full((len(labels), len(ranks)), np.nan)
  for r in rr:
    grid[labels.index((r['layer'], r['module'])), ranks.index(r['rank'])] = r['cos']
  return [f'L{l} {m}' for l, m in labels], ranks, grid


def markdown(arm_rows: list, summary: list, cos_rows: list, meta: dict) -> str:
  ranks = sorted({a['rank'] for a in arm_rows})
  table = [dict(variant=v, **{f'r={k}': next(a['pass_at_1'] for a in arm_rows
                                              if a['variant'] == v and a['rank'] == k)
                              for k in ranks})
           for v in dict.fromkeys(a['variant'] for a in arm_rows)]
  parts = [f'# {NAME}: rank x projection (Fig. 5)', '',
           f"Command: `{meta['command']}`  ", f"Machine: {meta['machine']}; "
           f"{meta['wall_s']:.0f} s. Start pass@1 (every arm): {meta['start_pass_at_1']}", '',
           f"## Final held-out pass@1 after {arm_rows[0]['final_step']} RL steps (Fig. 5a)", '',
           ablation_io.markdown_table(table, ['variant'] + [f'r={k}' for k in ranks]), '',
           '## Mean reconstruction cosine cos(AᵀA G, G) on the start policy (Fig. 5b)', '',
           ablation_io.markdown_table(summary, ['kind', 'rank', 'cos_mean', 'predicted', 'n'])]
  for kind in dict.fromkeys(r['kind'] for r in cos_rows):
    labels, cranks, grid = heatmap(cos_rows, kind)
    rows = [dict(matrix=lab, **{f'r={k}': float(g) for k, g in zip(cranks, line)})
            for lab, line in zip(labels, grid)]
    parts += ['', f'## Layer-wise cosine, {kind} (Fig. 5c)', '',
              ablation_io.markdown_table(rows, ['matrix'] + [f'r={k}' for k in cranks])]
  return '\n'.join(parts)


def _rank_ticks(ax, ranks):
  ranks = sorted(set(ranks))
  ax.set_xticks(ranks, [str(r) for r in ranks])
  ax.set_xticks([], minor=True)


def figure(arm_rows: list, summary: list, cos_rows: list):
  kinds = list(dict.fromkeys(r['kind'] for r in cos_rows))
  fig, axes = ablation_io.new_figure(2 + len(kinds), width=4.2, height=4.6)
  for v in dict.fromkeys(a['variant'] for a in arm_rows):
    aa = [a for a in arm_rows if a['variant'] == v]
    axes[0].plot([a['rank'] for a in aa], [a['pass_at_1'] for a in aa], 'o-', label=v)
  axes[0].axhline(arm_rows[0]['start_pass_at_1'], color='gray', ls=':', label='start')
  axes[0].set(xscale='log', xlabel='rank', ylabel='held-out pass@1', title='(a) final pass@1')
  _rank_ticks(axes[0], [a['rank'] for a in arm_rows])
  axes[0].legend(fontsize=7)
  for kind in kinds:
    ss = [r for r in summary if r['kind'] == kind]
    line, = axes[1].plot([r['rank'] for r in ss], [r['cos_mean'] for r in ss], 'o-', label=kind)
    axes[1].plot([r['rank'] for r in ss], [r['predicted'] for r in ss], '--',
                 color=line.get_color(), alpha=0.6)
  axes[1].set(xscale='log', xlabel='rank', ylabel='mean cos (dashed: theory)', ylim=(0, 1),
              title='(b) reconstruction cosine')
  _rank_ticks(axes[1], [r['rank'] for r in summary])
  axes[1].legend(fontsize=7)
  for ax, kind in zip(axes[2:], kinds):
    labels, cranks, grid = heatmap(cos_rows, kind)
    im = ax.imshow(grid, vmin=0, vmax=1, cmap='viridis', aspect='auto')
    ax.set_xticks(range(len(cranks)), [str(k) for k in cranks])
    ax.set_yticks(range(len(labels)), labels if ax is axes[2] else [], fontsize=6)
    ax.set(xlabel='rank', title=f'(c) layer-wise cosine, {kind}')
  fig.colorbar(im, ax=axes[2:], shrink=0.8)
  return fig


def main(argv):
  del argv
  with ablation_start.started(NAME, _FLAGS) as ab:
    arm_rows = [run_arm(ab.base, a, ab.workdir, ab.start_dir, logging.warning)
                for a in arms(ab.settings)]
    cos_rows = cosines(ab.base, ab.start_dir, ab.settings, logging.warning)
  summary = cosine_summary(cos_rows)
  meta = dict(command=ab.command, machine=ablation_start.machine(),
              wall_s=time.perf_counter() - ab.started,
              start_pass_at_1=arm_rows[0]['start_pass_at_1'])
  results = dict(name=NAME, meta=meta, settings=ab.settings, arms=arm_rows,
                 cosine_summary=summary, cosines=cos_rows)
  paths = ablation_io.write_results(ab.workdir, NAME, results,
                                    markdown(arm_rows, summary, cos_rows, meta),
                                    figure(arm_rows, summary, cos_rows))
  print(open(paths['md']).read())


if __name__ == '__main__':
  app.run(main)
