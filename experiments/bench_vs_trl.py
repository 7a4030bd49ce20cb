"""Our RL step against TRL's GRPOTrainer on the same workload, one run after the other.

  python experiments/bench_vs_trl.py [--workdir=runs/bench_vs_trl] [--steps=8]

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
     `quantization_config` and given the state dict;
  3. the prompts file both runs use, from the same reasoning-gym source as ours;
  4. TRL (experiments/bench_trl_worker.py in the TRL venv), then ours (experiments/train.py),
     each its own process; peak RSS is each process's own getrusage maximum.
The LAST line is one JSON object: {"step_time_ratio": ours/TRL, "peak_rss_ratio": ours/TRL,
"ours": {...}, "trl": {...}}.
"""
import argparse
import json
import os
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
  p.add_argument('--venv', default=os.path.join(ROOT, '.venv-trl'))
  p.add_argument('--steps', type=int, default=8)
  p.add_argument('--prompts_per_step', type=int, default=4)
  p.add_argument('--samples', type=int, default=4)
  p.add_argument('--new_tokens', type=int, default=64)
  p.add_argument('--skip_steps', type=int, default=2, help='warm-up steps left out of medians')
  p.add_argument('--ours', action='append', default=[],
                 help='extra --config.KEY=VALUE flags of our run, e.g. optim.telemetry_every=0')
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


def make_hf_copy(out_dir: str) -> str:
  """The packaged SmolLM2 GGUF as an fp32 HF checkpoint directory (made once)."""
  if os.path.exists(os.path.join(out_dir, 'config.json')):
    return out_dir
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from logra_jax.models.gguf_io import packaged_smollm2_gguf  # pylint: disable=g-import-not-at-top
  path = packaged_smollm2_gguf()
  where, name = os.path.dirname(path), os.path.basename(path)
  loaded = transformers.AutoModelForCausalLM.from_pretrained(where, gguf_file=name,
                                                             dtype=torch.float32)
  config = loaded.config
  if hasattr(config, 'quantization_config'):
    del config.quantization_config
  model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
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


def ours_flags(args, run_dir) -> list:
  """experiments/train.py on configs/smollm2_rg.py with the workload's batch; evaluation
  only on a few problems (it is not timed, but the last step always evaluates)."""
  c = {'data.prompts_per_step': args.prompts_per_step, 'data.samples_per_prompt': args.samples,
       'rollout.max_new_tokens': args.new_tokens, 'rollout.temperature': 1.0,
       'total_steps': args.steps, 'eval_every': args.steps, 'checkpoint_every': args.steps,
       'data.eval_size': 4}
  flags = [f'--config.{k}={v}' for k, v in c.items()] + [f'--config.{o}' for o in args.ours]
  return [f"--config={os.path.join(ROOT, 'configs', 'smollm2_rg.py')}",
          f'--workdir={run_dir}'] + flags


def run_ours(workdir, args, flags=None) -> dict:
  run_dir = os.path.join(workdir, 'ours')
  rss = os.path.join(workdir, 'ours_rss.json')
  flags = flags or ours_flags(args, run_dir)
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
  model_dir = make_hf_copy(os.path.join(args.workdir, 'smollm2_fp32_hf'))
  prompts = write_prompts(os.path.join(args.workdir, 'prompts.jsonl'),
                          args.steps * args.prompts_per_step * 4)
  trl_s = summarize(run_trl(python, model_dir, prompts, args.workdir, args), args.skip_steps)
  ours_s = summarize(run_ours(args.workdir, args), args.skip_steps)
  for name, s in (('TRL GRPOTrainer', trl_s), ('ours', ours_s)):
    print(f"{name:16s} step {s['step_s']:7.2f} s  generation {s['generate_s']:7.2f} s  "
          f"training {s['train_s']:7.2f} s  peak RSS {s['peak_rss_gib']:5.2f} GiB")
  print(json.dumps({'step_time_ratio': ours_s['step_s'] / trl_s['step_s'],
                    'peak_rss_ratio': ours_s['peak_rss_gib'] / trl_s['peak_rss_gib'],
                    'ours': ours_s, 'trl': trl_s}))


if __name__ == '__main__':
  main()
