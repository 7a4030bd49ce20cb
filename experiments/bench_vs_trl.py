"""Our RL step against TRL's GRPOTrainer on the same workload, one run after the other.

  python experiments/bench_vs_trl.py [--workdir=runs/bench_vs_trl] [--steps=8]
  python experiments/bench_vs_trl.py --model=tiny --steps=3 --skip_steps=1 \
      --prompts_per_step=4 --samples=2 --new_tokens=8    # the test suite's end-to-end run

Workload (issue 11): SmolLM2-135M-Instruct fp32 (the packaged GGUF), reasoning-gym easy
arithmetic (configs/smollm2_rg.py: its prompts, system prompt and chat template), 4 prompts x
4 samples x 64 new tokens, temperature 1; TRL with dense AdamW lr 1e-6, no reference model.
Steps: ``--steps`` of each, medians over steps 3.. (the first two hold compilation / warm-up).

What it does:
  1. the TRL venv (``--venv``, default .venv-trl): a venv that sees the library venv's
     packages (torch, transformers) through a .pth file and gets trl==1.16.0 (and what it
     lacks) installed into itself; never a dependency of the library;
  2. the fp32 HF copy of the packaged GGUF: transformers loads (dequantizes) the GGUF but
     refuses `save_pretrained` on it, so the model is rebuilt from its config without
     `quantization_config` and given the state dict (``--model=tiny``: SmolLM2's config
     shrunk to 2 layers of width 64, random weights, SmolLM2's tokenizer and chat template;
     both sides then load that directory);
  3. the prompts file both runs use, from the same reasoning-gym source as ours;
  4. TRL (experiments/bench_trl_worker.py in the TRL venv), then ours (experiments/train.py,
     LoGRA: the config's defaults), then our dense-AdamW baseline (the same algorithm as TRL's,
     its lr 1e-6; ``--noadam`` leaves it out), each its own process; peak RSS is each
     process's own getrusage maximum.
The LAST line is one JSON object: {"step_time_ratio": ours/TRL, "peak_rss_ratio": ours/TRL,
"adam_step_time_ratio": adam/TRL, "adam_peak_rss_ratio": adam/TRL, "logra_over_adam": ours/adam,
"ours": {...}, "adam": {...}, "trl": {...}} (the adam keys only with the baseline).
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
# Runs experiments/train.py and writes this process's peak RSS (GiB) next to its metrics.
_PEAK_RSS_RUN = ('import atexit, json, resource, runpy, sys; out = sys.argv.pop(1); '
                 'atexit.register(lambda: json.dump({"peak_rss_gib": resource.getrusage('
                 'resource.RUSAGE_SELF).ru_maxrss / 2**20}, open(out, "w"))); '
                 'sys.argv[0] = sys.argv[1]; del sys.argv[1]; '
                 'runpy.run_path(sys.argv[0], run_name="__main__")')


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  p.add_argument('--workdir', default=os.path.join(ROOT, 'runs', 'bench_vs_trl'))
  p.add_argument('--model', choices=('smollm2', 'tiny'), default='smollm2',
                 help="smollm2: the packaged SmolLM2 in fp32; tiny: a random 2-layer width-64 "
                      "Llama with SmolLM2's tokenizer (seconds a step: the suite's run)")
  p.add_argument('--venv', default=os.path.join(ROOT, '.venv-trl'))
  p.add_argument('--steps', type=int, default=8)
  p.add_argument('--prompts_per_step', type=int, default=4)
  p.add_argument('--samples', type=int, default=4)
  p.add_argument('--new_tokens', type=int, default=64)
  p.add_argument('--skip_steps', type=int, default=2, help='warm-up steps left out of medians')
  p.add_argument('--ours', action='append', default=[],
                 help='extra --config.KEY=VALUE flags of our runs, e.g. optim.telemetry_every=0')
  p.add_argument('--only_venv', action='store_true',
                 help='build the TRL venv and exit (`make envs` does, for the test suite)')
  p.add_argument('--adam', action=argparse.BooleanOptionalAction, default=True,
                 help='also run our dense-AdamW baseline (--noadam: LoGRA only)')
  return p.parse_args(argv)


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


def make_hf_copy(out_dir: str, tiny: bool = False) -> str:
  """The packaged SmolLM2 GGUF as an fp32 HF checkpoint directory (made once); ``tiny``: its
  config at `TINY_SHAPE` with random weights (torch seed 0), the same tokenizer."""
  if os.path.exists(os.path.join(out_dir, 'config.json')):
    return out_dir
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from logra_jax.models.gguf_io import packaged_smollm2_gguf  # pylint: disable=g-import-not-at-top
  path = packaged_smollm2_gguf()
  where, name = os.path.dirname(path), os.path.basename(path)
  if tiny:
    config = transformers.AutoConfig.from_pretrained(where, gguf_file=name)
    for key, value in TINY_SHAPE.items():
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


def write_prompts(path: str, n: int) -> str:
  """n training problems of configs/smollm2_rg.py's source, with its system prompt."""
  sys.path.insert(0, ROOT)
  from configs import smollm2_rg  # pylint: disable=g-import-not-at-top
  from logra_jax.train import tasks  # pylint: disable=g-import-not-at-top
  from logra_jax.train.config import from_config_dict  # pylint: disable=g-import-not-at-top
  cfg = smollm2_rg.get_config()
  cfg.data.train_size = n
  train, _ = tasks._splits(from_config_dict(cfg))  # pylint: disable=protected-access
  with open(path, 'w') as f:
    for r in train:
      f.write(json.dumps({'system': cfg.data.system_prompt, 'question': r['question'],
                          'answer': r['answer']}) + '\n')
  return path


def run_trl(python, model_dir, prompts, workdir, args) -> dict:
  out = os.path.join(workdir, 'trl.json')
  subprocess.run([python, os.path.join(ROOT, 'experiments', 'bench_trl_worker.py'),
                  f'--model={model_dir}', f'--prompts={prompts}', f'--out={out}',
                  f'--steps={args.steps}', f'--prompts_per_step={args.prompts_per_step}',
                  f'--samples={args.samples}', f'--new_tokens={args.new_tokens}'],
                 check=True, cwd=ROOT)
  return json.load(open(out))


# Our dense-AdamW baseline: configs/smollm2_rg.py:adam with TRL's lr on all params (--ours
# follows, so it applies to both runs: shared keys only, a LoGRA key is refused there).
ADAM_VARIANT, ADAM_FLAGS = 'adam', ('optim.adam.learning_rate=1e-6',)


def ours_flags(args, run_dir, extra=(), model_dir=None, variant='') -> list:
  """experiments/train.py on configs/smollm2_rg.py with the workload's batch (on the HF
  directory ``model_dir`` where given, else the config's GGUF); evaluation only on a few
  problems (it is not timed, but the last step always evaluates)."""
  c = {'data.prompts_per_step': args.prompts_per_step, 'data.samples_per_prompt': args.samples,
       'rollout.max_new_tokens': args.new_tokens, 'rollout.temperature': 1.0,
       'total_steps': args.steps, 'eval_every': args.steps, 'checkpoint_every': args.steps,
       'data.eval_size': 4}
  if model_dir:
    c['model.path'] = model_dir
  flags = [f'--config.{k}={v}' for k, v in c.items()]
  flags += [f'--config.{o}' for o in tuple(extra) + tuple(args.ours)]
  config = os.path.join(ROOT, 'configs', 'smollm2_rg.py') + (f':{variant}' if variant else '')
  return [f'--config={config}',
          f'--workdir={run_dir}'] + flags


def run_ours(workdir, args, flags=None, name='ours', extra=(), model_dir=None,
             variant='') -> dict:
  """One run of ours in ``workdir/name``: per-step times from its metrics, its peak RSS."""
  run_dir = os.path.join(workdir, name)
  rss = os.path.join(workdir, f'{name}_rss.json')
  flags = flags or ours_flags(args, run_dir, extra, model_dir, variant)
  shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run (train.py would resume a checkpoint)
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get('PYTHONPATH', ''))
  subprocess.run([sys.executable, '-c', _PEAK_RSS_RUN, rss,
                  os.path.join(ROOT, 'experiments', 'train.py')] + flags,
                 check=True, cwd=ROOT, env=env)
  from logra_jax.train.metrics import read_metrics  # pylint: disable=g-import-not-at-top
  rows = [r for r in read_metrics(run_dir) if r.get('step_time_s') is not None]
  return {'step_s': [r['step_time_s'] for r in rows],
          'generate_s': [r['generate_s'] for r in rows],
          'peak_rss_gib': json.load(open(rss))['peak_rss_gib']}


def summarize(result: dict, skip: int) -> dict:
  """Medians over steps skip+1.. of step, generation and training (= step − generation)."""
  step, gen = result['step_s'][skip:], result['generate_s'][skip:]
  train = [s - g for s, g in zip(step, gen)]
  med = lambda xs: float(statistics.median(xs)) if xs else float('nan')
  return {'step_s': med(step), 'generate_s': med(gen), 'train_s': med(train),
          'peak_rss_gib': result['peak_rss_gib'], 'steps': len(step)}


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
                          args.steps * args.prompts_per_step * 4)
  trl_s = summarize(run_trl(python, model_dir, prompts, args.workdir, args), args.skip_steps)
  ours_dir = model_dir if tiny else None  # SmolLM2: ours reads the GGUF itself
  runs = {'TRL GRPOTrainer': trl_s,
          'ours': summarize(run_ours(args.workdir, args, model_dir=ours_dir), args.skip_steps)}
  if args.adam:
    runs['ours, dense AdamW'] = summarize(
        run_ours(args.workdir, args, name='ours_adam', extra=ADAM_FLAGS, model_dir=ours_dir,
                 variant=ADAM_VARIANT),
        args.skip_steps)
  for name, s in runs.items():
    print(f"{name:18s} step {s['step_s']:7.2f} s  generation {s['generate_s']:7.2f} s  "
          f"training {s['train_s']:7.2f} s  peak RSS {s['peak_rss_gib']:5.2f} GiB")
  print(json.dumps(ratios(runs['ours'], trl_s, runs.get('ours, dense AdamW'))))


def ratios(ours: dict, trl: dict, adam=None) -> dict:
  """The benchmark's last line: ours (and the dense-AdamW baseline) over TRL."""
  out = {'step_time_ratio': ours['step_s'] / trl['step_s'],
         'peak_rss_ratio': ours['peak_rss_gib'] / trl['peak_rss_gib']}
  if adam is not None:
    out.update(adam_step_time_ratio=adam['step_s'] / trl['step_s'],
               adam_peak_rss_ratio=adam['peak_rss_gib'] / trl['peak_rss_gib'],
               logra_over_adam=ours['step_s'] / adam['step_s'], adam=adam)
  return dict(out, ours=ours, trl=trl)


if __name__ == '__main__':
  main()
