"""Generation throughput of our JAX sampler against vLLM-CPU on the RL rollout shape.

  python experiments/bench_sampler.py --vllm_python=.venv-vllm/bin/python [--rounds=3]
  python experiments/bench_sampler.py --model=tiny --workdir=DIR --vllm_python=...  # the suite

Workload: SmolLM2-135M-Instruct fp32 (the packaged GGUF; ``--model=tiny``: bench_vs_trl's
random 2-layer copy with SmolLM2's tokenizer, at head_dim 64), `--prompts` chat prompts x `--samples` samples
each (the RL rollout: 4 x 4), `--max_new_tokens` (64) at temperature 1, EOS ignored (every row
generates exactly max_new_tokens, so both sides generate the same number of tokens), no
detokenisation on either side (ours returns ids; vLLM gets `detokenize=False`).

Ours is the trainer's own rollout path (`JaxGenerator.generate`: one prefill per prompt, its
KV cache forked into the samples). vLLM runs the same prompt token ids on the same weights (our
tree exported to an HF directory) in a worker process of its own interpreter (its venv: torch +
vllm, no jax), kept alive for the whole run; prompts go to it one call at a time. Both sides
first generate once on warm-up prompts (compilation, engine start), then run `--rounds`
interleaved rounds (ours, vLLM, ours, vLLM, ...), each round on prompts used nowhere else (no
prefix-cache hits between calls; the chat template's shared header excepted). Prints each
round's tokens/s; the LAST line is JSON: {"ratio": median over rounds of ours/vLLM tokens/s,
"ratio_range": [min, max], "rounds", "ours_tokens_per_s": [...], "vllm_tokens_per_s": [...],
"order": [...], "workload": {...}}.

This file's top level imports only the standard library: the vLLM worker (`--vllm_worker`)
runs it in vLLM's venv, where jax and logra_jax need not exist.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = [
    'What is the capital of France?', 'Write a short poem about the sea.',
    'Explain photosynthesis in two sentences.', 'What is 17 * 23?',
    'List three uses of a paperclip.', 'Who wrote Romeo and Juliet?',
    'Give me a tip for learning to code.', 'Why is the sky blue?',
    'Translate "good morning" into Spanish.', 'What is a prime number?',
    'Describe a cat to someone who has never seen one.', 'How do airplanes fly?',
    'Name the planets of the solar system.', 'What does a CPU do?',
    'Suggest a name for a bakery.', 'How many minutes are in a day?',
]
# --model=tiny: bench_vs_trl's tiny shape at head_dim 64 (vLLM's CPU attention has no kernel
# for head_dim 16).
TINY_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64)
DONE = 'BENCH_SAMPLER_DONE'  # the vLLM worker's line after each call's result file


def question(k: int) -> str:
  """The k-th prompt's text: distinct for every k, from its first token on."""
  return f'Question {k}: {QUESTIONS[k % len(QUESTIONS)]}'


def call_questions(call: int, prompts: int) -> list:
  """The questions of call ``call`` (0: the warm-up, 1..: the rounds): no two calls share one."""
  return [question(call * prompts + j) for j in range(prompts)]


def vllm_worker(model_dir: str) -> None:
  """Runs in vLLM's interpreter: one engine; per stdin line (a request JSON) one timed
  generate, its result JSON written to the request's result_path, then a DONE line."""
  import vllm  # pylint: disable=import-outside-toplevel
  llm = None
  for line in sys.stdin:
    req = json.loads(line)
    if llm is None:
      # On the CPU backend gpu_memory_utilization is the fraction of host memory vLLM reserves
      # for its KV cache; the default 0.92 fails on a shared machine and a small model needs
      # little.
      llm = vllm.LLM(model=model_dir, dtype='float32', seed=0, gpu_memory_utilization=0.2,
                     max_model_len=req['max_model_len'])
    params = vllm.SamplingParams(n=req['samples'], temperature=1.0, top_p=1.0, top_k=0,
                                 max_tokens=req['max_new_tokens'], ignore_eos=True,
                                 detokenize=False, seed=req['seed'])
    start = time.perf_counter()
    outs = llm.generate([{'prompt_token_ids': ids} for ids in req['prompts']], params,
                        use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    with open(req['result_path'], 'w') as f:
      json.dump({'seconds': seconds, 'tokens': tokens, 'vllm_version': vllm.__version__,
                 'texts_decoded': any(c.text for o in outs for c in o.outputs)}, f)
    print(DONE, flush=True)


class VllmSide:
  """The vLLM worker process, alive across calls."""

  def __init__(self, python: str, model_dir: str, workdir: str, max_model_len: int):
    self.workdir, self.calls, self.max_model_len = workdir, 0, max_model_len
    self.proc = subprocess.Popen([python, os.path.abspath(__file__),
                                  f'--vllm_worker={model_dir}'], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)

  def generate(self, prompts, samples: int, max_new_tokens: int, seed: int) -> dict:
    result = os.path.join(self.workdir, f'vllm_call{self.calls}.json')
    self.calls += 1
    req = {'prompts': prompts, 'samples': samples, 'max_new_tokens': max_new_tokens,
           'seed': seed, 'result_path': result,
           'max_model_len': self.max_model_len}
    self.proc.stdin.write(json.dumps(req) + '\n')
    self.proc.stdin.flush()
    for line in self.proc.stdout:
      if line.strip() == DONE:
        with open(result) as f:
          return json.load(f)
      sys.stderr.write(line)
    raise RuntimeError(f'the vLLM worker exited with code {self.proc.wait()} before answering')

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


class OursSide:
  """The trainer's rollout engine (`JaxGenerator`) on the loaded model."""

  def __init__(self, model):
    from logra_jax.models.generator import JaxGenerator  # pylint: disable=g-import-not-at-top
    pad = getattr(model.tokenizer, 'pad_token_id', None) or 0
    self.gen = JaxGenerator(model.config, model.params, pad_id=pad)

  def generate(self, prompts, samples: int, max_new_tokens: int, seed: int) -> dict:
    from logra_jax.rl import types  # pylint: disable=g-import-not-at-top
    params = types.SamplingParams(temperature=1.0, top_p=1.0, top_k=0, n=samples, seed=seed,
                                  max_new_tokens=max_new_tokens, stop_token_ids=())
    reqs = [types.GenerationRequest(tuple(ids), params, request_id=str(i))
            for i, ids in enumerate(prompts)]
    start = time.perf_counter()
    results = self.gen.generate(reqs)  # returns host arrays: the generation has finished
    seconds = time.perf_counter() - start
    return {'seconds': seconds, 'tokens': sum(len(r.completion_token_ids) for r in results)}


def run_rounds(sides: dict, calls: list, args) -> dict:
  """Warm-up on calls[0]'s prompts (token ids), then a round on each further call's, each side
  once per round in the order of ``sides``. Returns tokens/s per side and the order."""
  tps, order = {name: [] for name in sides}, []
  for call, prompts in enumerate(calls):
    for name, side in sides.items():
      out = side.generate(prompts, args.samples, args.max_new_tokens, seed=call)
      expected = args.prompts * args.samples * args.max_new_tokens
      if out['tokens'] != expected:
        raise RuntimeError(f'{name} generated {out["tokens"]} tokens, not {expected}')
      if out.get('texts_decoded'):
        raise RuntimeError(f'{name} detokenised its output (ours does not)')
      if call:
        tps[name].append(out['tokens'] / out['seconds'])
        order.append({'round': call - 1, 'side': name, 'seconds': out['seconds']})
        print(f"round {call - 1} {name:5s} {out['seconds']:7.2f} s = "
              f"{tps[name][-1]:7.1f} tok/s", flush=True)
  return {'tps': tps, 'order': order}


def summary(tps: dict, order: list, args) -> dict:
  ratios = [o / v for o, v in zip(tps['ours'], tps['vllm'])]
  return {'ratio': float(statistics.median(ratios)), 'ratio_range': [min(ratios), max(ratios)],
          'rounds': len(ratios), 'ours_tokens_per_s': tps['ours'],
          'vllm_tokens_per_s': tps['vllm'], 'order': order,
          'workload': {'prompts': args.prompts, 'samples': args.samples,
                       'max_new_tokens': args.max_new_tokens, 'temperature': 1.0,
                       'model': args.model}}


def load_model(args):
  """Our model: the packaged GGUF, bench_vs_trl's tiny HF copy, or a GGUF / HF directory."""
  from logra_jax import models  # pylint: disable=import-outside-toplevel
  if args.model == 'smollm2':
    from logra_jax.models.gguf_io import packaged_smollm2_gguf  # pylint: disable=g-import-not-at-top
    return models.load(packaged_smollm2_gguf())
  if args.model == 'tiny':
    sys.path.insert(0, os.path.join(ROOT, 'experiments'))
    import bench_vs_trl  # pylint: disable=g-import-not-at-top,import-outside-toplevel
    return models.load(bench_vs_trl.make_hf_copy(os.path.join(args.workdir, 'tiny_hf'), True,
                                                 TINY_SHAPE))
  return models.load(args.model)


def parse_args(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default='smollm2', help="'smollm2' (the packaged GGUF), "
                      "'tiny' (bench_vs_trl's random 2-layer copy), or a GGUF file / HF dir")
  parser.add_argument('--workdir', default=os.path.join(ROOT, 'runs', 'bench_sampler'))
  parser.add_argument('--prompts', type=int, default=4)
  parser.add_argument('--samples', type=int, default=4)
  parser.add_argument('--max_new_tokens', type=int, default=64)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--vllm_python', default=None, help="interpreter of vLLM's venv "
                      '(without it: ours only, no ratio)')
  parser.add_argument('--vllm_worker', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.rounds < 1 or args.prompts < 1 or args.samples < 1 or args.max_new_tokens < 1:
    raise ValueError('--rounds, --prompts, --samples and --max_new_tokens must be >= 1')
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.vllm_worker:
    return vllm_worker(args.vllm_worker)
  os.makedirs(args.workdir, exist_ok=True)
  model = load_model(args)
  tokenize = lambda q: model.tokenizer.apply_chat_template(
      [{'role': 'user', 'content': q}], add_generation_prompt=True, return_dict=False)
  calls = [[tokenize(q) for q in call_questions(c, args.prompts)]
           for c in range(args.rounds + 1)]
  sides = {'ours': OursSide(model)}
  if args.vllm_python:
    export = os.path.join(args.workdir, 'hf_export')
    model.save(export)
    longest = max(len(ids) for prompts in calls for ids in prompts)
    sides['vllm'] = VllmSide(args.vllm_python, export, args.workdir,
                             longest + args.max_new_tokens + 8)
  try:
    out = run_rounds(sides, calls, args)
  finally:
    if 'vllm' in sides:
      sides['vllm'].close()
  if 'vllm' not in sides:
    print('vLLM: not run (pass --vllm_python=PATH to an interpreter that has vllm)')
    return
  print(json.dumps(summary(out['tps'], out['order'], args)))


if __name__ == '__main__':
  main()
