"""Our RL step against TRL's GRPOTrainer on the same work: interleaved rounds, spans, tokens.

  python experiments/bench_vs_trl.py [--workdir=runs/bench_vs_trl] [--steps=8] [--rounds=3]
  python experiments/bench_vs_trl.py --model=tiny --steps=2 --skip_steps=1 --rounds=2 \
      --prompts_per_step=4 --samples=2 --new_tokens=8 --no-adam   # the test suite's run

Workload (issue 11): SmolLM2-135M-Instruct fp32 (the packaged GGUF), reasoning-gym easy
arithmetic (configs/smollm2_rg.py's source and system prompt, under each side's chat
template), 4 prompts x 4 samples x 64 new tokens, temperature 1, top_p 1, top_k 0; TRL with
its AdamW (b2 0.999, clipping at 1.0), lr 1e-6, no reference model.

What is equal on both sides (issue 25):
  * the prompts: one file (``prompts.jsonl``, one id per line), taken in one order: the order
    our trainer's data pipeline takes it (``order.json``; TRL gets its dataset in that order,
    unshuffled). Each run records the ids it processed, step by step;
  * the sampling settings and max tokens; the tokens of each step are recorded on both sides
    (prompt, generated, trained);
  * the spans: generation = the rollouts only (TRL's `_generate`, our `Rollouts.take`);
    scoring = rewards, advantages and the batch (the rest of TRL's
    `_generate_and_score_completions`, the rest of our `Trainer.collect`); training = loss,
    backward and optimizer (the rest of the step);
  * each run is a fresh process; medians over its steps after ``--skip_steps`` warm-up steps.

Arms, one run each per round, in this order: TRL with gradient_checkpointing off (its
fastest) and on (its default, its smallest), ours (LoGRA, the config's defaults; the
experiments/bench_ours_worker.py process) at each ``--remat`` setting (default none and full;
'POLICY:M' also sets optim.micro_batches=M: TRL takes its batch in one pass),
then (``--adam``, default on) our dense AdamW with TRL's AdamW settings. ``--rounds`` rounds
(default 3) interleave the arms: TRL off, TRL on, ours none, ours full, adam, then the next
round. Every ratio is computed per round; the last line gives its median over rounds and its
min-max range. What it builds first:
  1. the TRL venv (``--venv``, default .venv-trl): a venv that sees the library venv's
     packages (torch, transformers) through a .pth file and gets trl==1.16.0 (and what it
     lacks) installed into itself; never a dependency of the library;
  2. the fp32 HF copy of the packaged GGUF for TRL: transformers loads (dequantizes) the GGUF
     but refuses `save_pretrained` on it, so the model is rebuilt from its config without
     `quantization_config` and given the state dict (``--model=tiny``: SmolLM2's config shrunk
     to 2 layers of width 64, random weights, SmolLM2's tokenizer and chat template; both sides
     then load that directory);
  3. the prompts file (and a held-out file our trainer needs, never evaluated here).
Writes WORKDIR/runs.json (the order the runs ran in and every run's summary) and each run's
raw per-step record as WORKDIR/round{i}_{arm}.json. The LAST line is one JSON object:
{"step_time_ratio": ours (fastest remat) / TRL without checkpointing, "peak_rss_ratio": ours
(smallest remat) / TRL with checkpointing, "tokens_per_s_ratio" (generated tokens per second
of step, ours fastest / TRL fastest), their "..._range": [lo, hi], "rounds",
"tokens_per_step": {"trl": {...}, "ours": {...}}, "trl_gradient_checkpointing": [false, true],
"ours_remat": [...], "ours_micro_batches": [...] (None: the config's), "ours_fastest",
"ours_smallest", and with the adam arm
"adam_step_time_ratio", "adam_peak_rss_ratio" (and ranges), "logra_over_adam"}.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_VERSION = '1.16.0'



def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default=os.path.join(ROOT, 'runs', 'bench_vs_trl'))
  p.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2',
                 help="smollm2: the packaged SmolLM2 in fp32; tiny: a random 2-layer width-64 "
                      "Llama with SmolLM2's tokenizer (seconds a step: the suite's run)")
  p.add_argument('--venv', default=os.path.join(ROOT, '.venv-trl'))
  p.add_argument('--steps', type=int, default=8)
  p.add_argument('--rounds', type=int, default=3, help='interleaved rounds (each arm once each)')
  p.add_argument('--remat', action='append', default=None,
                 help="our settings, one run each per round: a model.remat_policy, optionally "
                      "with ':M', optim.micro_batches=M (else the config's), e.g. none:2 "
                      "(default: none and full)")
  p.add_argument('--prompts_per_step', type=int, default=4)
  p.add_argument('--samples', type=int, default=4)
  p.add_argument('--new_tokens', type=int, default=64)
  p.add_argument('--skip_steps', type=int, default=2, help='warm-up steps left out of medians')
  p.add_argument('--ours', action='append', default=[],
                 help='extra --config.KEY=VALUE flags of our runs, e.g. optim.telemetry_every=0')
  p.add_argument('--only_venv', action='store_true',
                 help='build the TRL venv and exit (`make envs` does, for the test suite)')
  p.add_argument('--adam', action=argparse.BooleanOptionalAction, default=True,
                 help='also run our dense-AdamW baseline (--no-adam: LoGRA only)')
  args = p.parse_args(argv)
  args.remat = args.remat or ['none', 'full']
  if args.rounds < 1 or args.steps <= args.skip_steps:
    raise ValueError(f'--rounds={args.rounds} must be >= 1 and --steps={args.steps} above '
                     f'--skip_steps={args.skip_steps}')
  return args


def ensure_trl_venv(venv: str) -> str:
  """The TRL venv's python (created and installed once; a marker file records it)."""
  python = os.path.join(venv, 'bin', 'python')
  marker = os.path.join(venv, f'.installed-trl-{TRL_VERSION}')
  if os.path.exists(marker):
    return python
  subprocess.run([sys.executable, '-m', 'venv', venv], check=True)
  site = subprocess.run([python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
                        check=True, capture_output=True, text=True).stdout.strip()
  with open(os.path.join(site, '_library_venv.pth'), 'w') as f:
    f.write(sysconfig.get_paths()['purelib'] + '\n')  # torch, transformers: not installed twice
  subprocess.run([python, '-m', 'pip', 'install', '-q', f'trl=={TRL_VERSION}'], check=True)
  open(marker, 'w').close()
  return python


# --model=tiny: SmolLM2's architecture and vocabulary at a width that runs in seconds.
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def make_hf_copy(out_dir: str, tiny: bool = False, shape: dict = None) -> str:
  """The packaged SmolLM2 GGUF as an fp32 HF checkpoint directory (made once); ``tiny``: its
  config at ``shape`` (default `TINY_SHAPE`) with random weights (torch seed 0), the same
  tokenizer."""
  if os.path.exists(os.path.join(out_dir, 'config.json')):
    return out_dir
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from logra_jax.models.gguf_io import packaged_smollm2_gguf  # pylint: disable=g-import-not-at-top
  path = packaged_smollm2_gguf()
  where, name = os.path.dirname(path), os.path.basename(path)
  if tiny:
    config = transformers.AutoConfig.from_pretrained(where, gguf_file=name)
    for key, value in (shape or TINY_SHAPE).items():
      setattr(config, key, value)
    loaded = None
  else:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name,
                                                               dtype=torch.float32)
    config = loaded.config
  if hasattr(config, 'quantization_config'):
    del config.quantization_config
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  if loaded is not None:
    model.load_state_dict(loaded.state_dict())
  model.save_pretrained(out_dir)
  transformers.AutoTokenizer.from_pretrained(where, gguf_file=name).save_pretrained(out_dir)
  return out_dir


def write_prompts(path: str, n: int, eval_path: str, n_eval: int = 4) -> str:
  """n training problems of configs/smollm2_rg.py's source, with its system prompt, one JSON
  row each ({"id": line number, "system", "problem", "answer"}: our file source's fields);
  ``eval_path`` gets n_eval more (our trainer's held-out file, never evaluated here)."""
  sys.path.insert(0, ROOT)
  from configs import smollm2_rg  # pylint: disable=g-import-not-at-top
  from logra_jax.train import tasks  # pylint: disable=g-import-not-at-top
  from logra_jax.train.config import from_config_dict  # pylint: disable=g-import-not-at-top
  cfg = smollm2_rg.get_config()
  cfg.data.train_size = n + n_eval
  train, _ = tasks._splits(from_config_dict(cfg))  # pylint: disable=protected-access
  for out, rows in ((path, train[:n]), (eval_path, train[n:])):
    with open(out, 'w') as f:
      for i, r in enumerate(rows):
        f.write(json.dumps({'id': i, 'system': cfg.data.system_prompt, 'problem': r['question'],
                            'answer': r['answer']}) + '\n')
  return path


def our_order(prompts: str, prompts_per_step: int, seed: int = 0) -> list:
  """The ids of the prompts file in the order our trainer takes them: the library's own
  pipeline (`tasks.build_task`'s `prompt_dataset` over the file's records, the config's seed)."""
  from logra_jax import data  # pylint: disable=g-import-not-at-top
  records = data.read_problems(prompts)
  batches = iter(data.prompt_dataset(records, prompts_per_step, seed=seed))
  return [r['index'] for _ in range(len(records) // prompts_per_step) for r in next(batches)]


def trl_arm(checkpointing: bool) -> dict:
  return {'side': 'trl', 'name': f"trl_gc_{'on' if checkpointing else 'off'}",
          'gradient_checkpointing': checkpointing}


def ours_arm(setting: str, adam: bool = False) -> dict:
  """Our arm at ``setting`` = 'POLICY' or 'POLICY:M' (remat policy, M micro-batches)."""
  remat, _, mb = setting.partition(':')
  name = f"{'adam' if adam else 'ours'}_remat_{remat}" + (f'_mb{int(mb)}' if mb else '')
  return {'side': 'ours', 'name': name, 'remat_policy': remat, 'adam': adam,
          'micro_batches': int(mb) if mb else None}


def arms(args) -> list:
  """One round's runs, in order: TRL without and with gradient checkpointing, ours at each
  remat policy, then (with --adam) the dense-AdamW arm at the first policy."""
  out = [trl_arm(False), trl_arm(True)] + [ours_arm(r) for r in args.remat]
  return out + ([ours_arm(args.remat[0], adam=True)] if args.adam else [])


def run_trl(python, model_dir, prompts, order, out, args, checkpointing: bool) -> dict:
  subprocess.run([python, os.path.join(ROOT, 'experiments', 'bench_trl_worker.py'),
                  f'--model={model_dir}', f'--prompts={prompts}', f'--order={order}',
                  f'--out={out}', f'--steps={args.steps}',
                  f'--prompts_per_step={args.prompts_per_step}', f'--samples={args.samples}',
                  f'--new_tokens={args.new_tokens}',
                  '--gradient_checkpointing' if checkpointing else '--no-gradient_checkpointing'],
                 check=True, cwd=ROOT)
  return json.load(open(out))


# Our dense-AdamW arm: configs/smollm2_rg.py:adam with TRL's AdamW (lr 1e-6, b2 0.999, global
# norm clipping at 1.0, no weight decay) on all params.
ADAM_VARIANT = 'adam'
# Our LoGRA arm: the paper's rule (smollm2_rg.py's default until session 22; every recorded
# figure ran with it), not the parity study's pick that is the default now.
LOGRA_VARIANT = 'paper'
ADAM_FLAGS = ('optim.adam.learning_rate=1e-6', 'optim.adam.b2=0.999',
              'optim.adam.max_grad_norm=1.0', 'optim.adam.weight_decay=0.0')


def arm_overrides(arm: dict) -> tuple:
  """The config overrides of one of our arms: TRL's AdamW settings for the adam arm, and the
  setting's micro-batches where it names them."""
  mb = (f"optim.micro_batches={arm['micro_batches']}",) if arm['micro_batches'] else ()
  return (ADAM_FLAGS if arm['adam'] else ()) + mb


def ours_flags(args, run_dir, prompts, eval_prompts, remat='none', extra=(), model_dir=None,
               variant=LOGRA_VARIANT) -> list:
  """bench_ours_worker.py's flags: configs/smollm2_rg.py on the prompts file, with the
  workload's batch, sampling and remat policy (on the HF directory ``model_dir`` where given,
  else the config's GGUF)."""
  c = {'data.source': 'file', 'data.path': prompts, 'data.eval_path': eval_prompts,
       'data.prompts_per_step': args.prompts_per_step, 'data.samples_per_prompt': args.samples,
       'rollout.max_new_tokens': args.new_tokens, 'rollout.temperature': 1.0,
       'rollout.top_p': 1.0, 'rollout.top_k': 0, 'model.remat_policy': remat,
       'total_steps': args.steps, 'seed': 0}
  if model_dir:
    c['model.path'] = model_dir
  flags = [f'--config.{k}={v}' for k, v in c.items()]
  flags += [f'--config.{o}' for o in tuple(extra) + tuple(args.ours)]
  config = os.path.join(ROOT, 'configs', 'smollm2_rg.py') + (f':{variant}' if variant else '')
  return [f'--config={config}', f'--workdir={run_dir}'] + flags


def run_ours(out, flags) -> dict:
  """One run of bench_ours_worker.py (a fresh process and run directory)."""
  run_dir = flags[1].split('=', 1)[1]
  shutil.rmtree(run_dir, ignore_errors=True)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  subprocess.run([sys.executable, os.path.join(ROOT, 'experiments', 'bench_ours_worker.py'),
                  f'--out={out}'] + flags, check=True, cwd=ROOT, env=env)
  return json.load(open(out))


SPANS = ('step_s', 'generate_s', 'score_s', 'train_s', 'other_s')
TOKENS = ('tokens_prompt', 'tokens_generated', 'tokens_trained')


def summarize(result: dict, skip: int) -> dict:
  """Medians over steps skip+1.. of each span and token count, the run's peak RSS, and the
  ids of every prompt it processed (warm-up steps included), step by step."""
  med = lambda xs: float(statistics.median(xs)) if xs else float('nan')
  out = {k: med(result[k][skip:]) for k in SPANS + TOKENS}
  out['tokens_per_s'] = out['tokens_generated'] / out['step_s']
  return dict(out, peak_rss_gib=result['peak_rss_gib'], steps=len(result['step_s'][skip:]),
              prompt_ids=result['prompt_ids'])


def spread(xs) -> dict:
  return {'median': float(statistics.median(xs)), 'range': [min(xs), max(xs)]}


def best_arm(rounds: list, names: list, key: str) -> str:
  """Of ``names``, the one whose median of ``key`` over rounds is smallest."""
  return min(names, key=lambda n: statistics.median(r[n][key] for r in rounds))


def ratios(rounds: list, ours_names: list, adam_name=None) -> dict:
  """The last line from rounds ({arm name: summary}): each ratio per round, its median over
  rounds and its min-max range. Time: ours at its fastest remat policy over TRL without
  checkpointing (TRL's fastest); RSS: ours at its smallest over TRL with checkpointing (TRL's
  smallest); tokens/s (generated tokens per step second): ours' fastest over TRL's fastest."""
  fast = best_arm(rounds, ours_names, 'step_s')
  small = best_arm(rounds, ours_names, 'peak_rss_gib')
  per = lambda a, b, key: spread([r[a][key] / r[b][key] for r in rounds])
  time, rss = per(fast, 'trl_gc_off', 'step_s'), per(small, 'trl_gc_on', 'peak_rss_gib')
  tps = per(fast, 'trl_gc_off', 'tokens_per_s')
  out = {'step_time_ratio': time['median'], 'peak_rss_ratio': rss['median'],
         'tokens_per_s_ratio': tps['median'], 'step_time_ratio_range': time['range'],
         'peak_rss_ratio_range': rss['range'], 'tokens_per_s_ratio_range': tps['range'],
         'rounds': len(rounds),
         'tokens_per_step': {'trl': _tokens(rounds, 'trl_gc_off'), 'ours': _tokens(rounds, fast)},
         'trl_gradient_checkpointing': [False, True],
         'ours_remat': [rounds[0][n]['remat_policy'] for n in ours_names],
         'ours_micro_batches': [rounds[0][n].get('micro_batches') for n in ours_names],
         'ours_fastest': fast, 'ours_smallest': small}
  if adam_name:
    a_time = per(adam_name, 'trl_gc_off', 'step_s')
    a_rss = per(adam_name, 'trl_gc_on', 'peak_rss_gib')
    out.update(adam_step_time_ratio=a_time['median'], adam_step_time_ratio_range=a_time['range'],
               adam_peak_rss_ratio=a_rss['median'], adam_peak_rss_ratio_range=a_rss['range'],
               logra_over_adam=per(fast, adam_name, 'step_s')['median'])
  return out


def _tokens(rounds, name) -> dict:
  """Median tokens per step of one arm over rounds: prompt, generated and trained."""
  return {k[len('tokens_'):]: float(statistics.median(r[name][k] for r in rounds))
          for k in TOKENS}


def run_round(i, args, python, model_dir, prompts, eval_prompts, order, log: list) -> dict:
  """One round: every arm once, each its own fresh process, in `arms`' order."""
  out, ours_model = {}, model_dir if args.model == 'tiny' else None  # SmolLM2: the GGUF
  for arm in arms(args):
    result = os.path.join(args.workdir, f"round{i}_{arm['name']}.json")
    if arm['side'] == 'trl':
      raw = run_trl(python, model_dir, prompts, order, result, args,
                    arm['gradient_checkpointing'])
    else:
      flags = ours_flags(args, os.path.join(args.workdir, f"round{i}_{arm['name']}"), prompts,
                         eval_prompts, arm['remat_policy'], arm_overrides(arm), ours_model,
                         ADAM_VARIANT if arm['adam'] else LOGRA_VARIANT)
      raw = run_ours(result, flags)
    out[arm['name']] = dict(summarize(raw, args.skip_steps), **{
        k: raw[k] for k in ('gradient_checkpointing', 'remat_policy', 'micro_batches')
        if k in raw})
    log.append({'round': i, 'arm': arm['name']})
  return out


def print_round(i: int, summaries: dict) -> None:
  for name, s in summaries.items():
    print(f"round {i} {name:18s} step {s['step_s']:7.2f} s  generation {s['generate_s']:7.2f} s"
          f"  scoring {s['score_s']:6.2f} s  training {s['train_s']:7.2f} s  peak RSS "
          f"{s['peak_rss_gib']:5.2f} GiB  tokens gen/trained {s['tokens_generated']:.0f}/"
          f"{s['tokens_trained']:.0f}", flush=True)


def main(argv=None):
  args = parse_args(argv)
  os.makedirs(args.workdir, exist_ok=True)
  python = ensure_trl_venv(args.venv)
  if args.only_venv:
    return
  tiny = args.model == 'tiny'
  model_dir = make_hf_copy(os.path.join(args.workdir, 'tiny_hf' if tiny else 'smollm2_fp32_hf'),
                           tiny=tiny)
  prompts = write_prompts(os.path.join(args.workdir, 'prompts.jsonl'),
                          args.steps * args.prompts_per_step,
                          os.path.join(args.workdir, 'eval_prompts.jsonl'))
  order = os.path.join(args.workdir, 'order.json')
  json.dump(our_order(prompts, args.prompts_per_step), open(order, 'w'))
  rounds, log = [], []
  for i in range(args.rounds):
    rounds.append(run_round(i, args, python, model_dir, prompts,
                            os.path.join(args.workdir, 'eval_prompts.jsonl'), order, log))
    print_round(i, rounds[-1])
  json.dump({'order': log, 'rounds': rounds}, open(os.path.join(args.workdir, 'runs.json'), 'w'))
  ours_names = [a['name'] for a in arms(args) if a['side'] == 'ours' and not a['adam']]
  print(json.dumps(ratios(rounds, ours_names,
                          ours_arm(args.remat[0], adam=True)['name'] if args.adam else None)))


if __name__ == '__main__':
  main()
