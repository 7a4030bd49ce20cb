"""TRL's GRPOTrainer on the bench_vs_trl workload; run by experiments/bench_vs_trl.py in the TRL
venv (.venv-trl), never imported by the library or its tests.

  .venv-trl/bin/python experiments/bench_trl_worker.py --model=HF_DIR --prompts=FILE.jsonl \
      --order=IDS.json --out=RESULT.json [--steps=8 --prompts_per_step=4 --samples=4 \
      --new_tokens=64 --gradient_checkpointing]

FILE.jsonl rows: {"id", "system", "problem", "answer"}; IDS.json: the ids in the order our
trainer takes them (the dataset is built in that order and not shuffled, so both sides process
the same prompts in the same order). The reward is the same rule as ours on this task: 1 when
the <answer> tag, else the last number, equals the answer, else -0.01. Sampling: temperature 1,
top_p 1, top_k 0 (ours: the same keys of rollout.*). Optimizer: TRL's AdamW (adamw_torch,
b2 0.999, max_grad_norm 1.0), lr 1e-6, no reference model (beta 0).

Spans per step, the same as bench_ours_worker's: generation = `GRPOTrainer._generate` (the
rollouts only), scoring = the rest of `_generate_and_score_completions` (rewards, advantages,
the batch), training = the rest of the step (loss, backward, clipping, optimizer), the step
from the Trainer's `on_step_begin` to `on_step_end`. Also per step: the ids of the prompts it
processed, and its tokens (prompt, generated, trained = the completion mask). RESULT.json gets
those lists, the gradient_checkpointing setting and this process's peak RSS.
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


def unique_in_order(ids) -> list:
  """The distinct ids of a batch whose rows repeat each prompt (its samples), in order."""
  return list(dict.fromkeys(ids))


def timed_trainer(trl, rec: dict):
  """GRPOTrainer with its generation, generation + scoring and tokens recorded per step."""

  class Timed(trl.GRPOTrainer):
    def _generate(self, prompts):
      start = time.perf_counter()
      out = super()._generate(prompts)
      rec['generate_s'].append(time.perf_counter() - start)
      prompt_ids, completion_ids = out[0], out[1]
      rec['tokens_prompt'].append(sum(len(p) for p in prompt_ids))
      rec['tokens_generated'].append(sum(len(c) for c in completion_ids))
      return out

    def _generate_and_score_completions(self, inputs):
      start = time.perf_counter()
      rec['prompt_ids'].append(unique_in_order(int(x['id']) for x in inputs))
      out = super()._generate_and_score_completions(inputs)
      rec['gen_and_score_s'].append(time.perf_counter() - start)
      rec['tokens_trained'].append(int(out['completion_mask'].sum()))
      return out

  return Timed


def main():
  p = argparse.ArgumentParser()
  for flag in ('--model', '--prompts', '--order', '--out'):
    p.add_argument(flag, required=True)
  p.add_argument('--steps', type=int, default=8)
  p.add_argument('--prompts_per_step', type=int, default=4)
  p.add_argument('--samples', type=int, default=4)
  p.add_argument('--new_tokens', type=int, default=64)
  p.add_argument('--gradient_checkpointing', action=argparse.BooleanOptionalAction,
                 default=False)
  args = p.parse_args()
  import datasets  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  import trl  # pylint: disable=g-import-not-at-top

  rows = {r['id']: r for r in map(json.loads, open(args.prompts)) if r}
  order = json.load(open(args.order))
  ds = datasets.Dataset.from_list([
      {'prompt': [{'role': 'system', 'content': rows[i]['system']},
                  {'role': 'user', 'content': rows[i]['problem']}],
       'answer': rows[i]['answer'], 'id': i} for i in order])
  n = args.prompts_per_step * args.samples
  cfg = trl.GRPOConfig(
      output_dir=args.out + '.trainer', per_device_train_batch_size=n,
      num_generations=args.samples, max_completion_length=args.new_tokens, temperature=1.0,
      top_p=1.0, top_k=0, learning_rate=1e-6, optim='adamw_torch', adam_beta2=0.999,
      max_grad_norm=1.0, weight_decay=0.0, max_steps=args.steps, logging_steps=1,
      save_strategy='no', report_to='none', use_cpu=True, bf16=False, fp16=False, beta=0.0,
      gradient_accumulation_steps=1, seed=0, dataloader_num_workers=0, shuffle_dataset=False,
      gradient_checkpointing=args.gradient_checkpointing)
  model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
  tok = transformers.AutoTokenizer.from_pretrained(args.model)
  rec = {k: [] for k in ('step_s', 'generate_s', 'gen_and_score_s', 'prompt_ids',
                         'tokens_prompt', 'tokens_generated', 'tokens_trained')}

  class StepTimes(transformers.TrainerCallback):
    def on_step_begin(self, *a, **k):
      rec['t0'] = time.perf_counter()

    def on_step_end(self, *a, **k):
      rec['step_s'].append(time.perf_counter() - rec.pop('t0'))

  trainer = timed_trainer(trl, rec)(model=model, reward_funcs=reward, args=cfg,
                                    train_dataset=ds, processing_class=tok,
                                    callbacks=[StepTimes()])
  trainer.train()
  gs = rec.pop('gen_and_score_s')
  rec['score_s'] = [a - g for a, g in zip(gs, rec['generate_s'])]
  rec['train_s'] = [s - a for s, a in zip(rec['step_s'], gs)]
  rec['other_s'] = [0.0] * len(rec['step_s'])
  rec.update(peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # KiB
             gradient_checkpointing=bool(trainer.args.gradient_checkpointing),
             trl=trl.__version__, torch=torch.__version__, threads=torch.get_num_threads())
  json.dump(rec, open(args.out, 'w'))


if __name__ == '__main__':
  main()
