"""TRL's GRPOTrainer on the bench_vs_trl workload; run by experiments/bench_vs_trl.py in the TRL
venv (.venv-trl), never imported by the library or its tests.

  .venv-trl/bin/python experiments/bench_trl_worker.py --model=HF_DIR --prompts=FILE.jsonl \
      --out=RESULT.json [--steps=8 --prompts_per_step=4 --samples=4 --new_tokens=64]

FILE.jsonl rows: {"system": ..., "question": ..., "answer": ...}. The reward is the same rule
as ours on this task: 1 when the <answer> tag, else the last number, equals the answer, else
-0.01. Writes per-step wall times, the generation part of each step, and this process's peak
RSS to RESULT.json.
"""
import argparse
import json
import re
import resource
import time


def _answer(text: str):
  tag = re.findall(r'<answer>(.*?)</answer>', text, re.S)
  if tag:
    return tag[-1].strip()
  numbers = re.findall(r'-?\d+(?:\.\d+)?', text)
  return numbers[-1] if numbers else None


def reward(completions, answer, **kwargs):
  del kwargs
  texts = [c[-1]['content'] if isinstance(c, list) else c for c in completions]
  return [1.0 if _answer(t) == str(a) else -0.01 for t, a in zip(texts, answer)]


def main():
  p = argparse.ArgumentParser()
  for flag in ('--model', '--prompts', '--out'):
    p.add_argument(flag, required=True)
  p.add_argument('--steps', type=int, default=8)
  p.add_argument('--prompts_per_step', type=int, default=4)
  p.add_argument('--samples', type=int, default=4)
  p.add_argument('--new_tokens', type=int, default=64)
  args = p.parse_args()
  import datasets  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top

  rows = [json.loads(line) for line in open(args.prompts) if line.strip()]
  ds = datasets.Dataset.from_list([
      {'prompt': [{'role': 'system', 'content': r['system']},
                  {'role': 'user', 'content': r['question']}], 'answer': r['answer']}
      for r in rows])
  n = args.prompts_per_step * args.samples
  cfg = trl.GRPOConfig(
      output_dir=args.out + '.trainer', per_device_train_batch_size=n,
      num_generations=args.samples, max_completion_length=args.new_tokens, temperature=1.0,
      learning_rate=1e-6, optim='adamw_torch', max_steps=args.steps, logging_steps=1,
      save_strategy='no', report_to='none', use_cpu=True, bf16=False, fp16=False, beta=0.0,
      gradient_accumulation_steps=1, seed=0, dataloader_num_workers=0)
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(args.model)
  timing = {'gen': [], 'step': []}

  class Timed(trl.GRPOTrainer):
    def _generate_and_score_completions(self, *a, **k):
      start = time.perf_counter()
      out = super()._generate_and_score_completions(*a, **k)
      timing['gen'].append(time.perf_counter() - start)
      return out

  class StepTimes(transformers.TrainerCallback):
    def on_step_begin(self, *a, **k):
      timing['t0'] = time.perf_counter()

    def on_step_end(self, *a, **k):
      timing['step'].append(time.perf_counter() - timing['t0'])

  trainer = Timed(model=model, reward_funcs=reward, args=cfg, train_dataset=ds,
                  processing_class=tok, callbacks=[StepTimes()])
  trainer.train()
  peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
  json.dump({'step_s': timing['step'], 'generate_s': timing['gen'], 'peak_rss_gib': peak_gib,
             'trl': trl.__version__, 'torch': torch.__version__,
             'threads': torch.get_num_threads()}, open(args.out, 'w'))


if __name__ == '__main__':
  main()
