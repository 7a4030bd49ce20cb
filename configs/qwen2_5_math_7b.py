"""The paper's main 7B run (docs/method.md §5-§7): Qwen2.5-Math-7B on DAPO-Math with LoGRA.

NEEDS GPUS AND WEIGHTS (not runnable on a laptop CPU): the paper used one node of 8xH100 80GB
(4 training with FSDP, 4 generating). The weights must be on disk; nothing is downloaded.

Command:
  python experiments/train.py --config=configs/qwen2_5_math_7b.py --workdir=runs/qwen7b \
      --config.model.path=/path/to/Qwen2.5-Math-7B \
      --config.data.path=/path/to/dapo_math.jsonl --config.data.eval_path=/path/to/math500.jsonl
Dense-Adam baseline (AdamW lr 1e-6, betas (0.9, 0.95), warm-up 9, cosine to 0.1x over 300):
  python experiments/train.py --config=configs/qwen2_5_math_7b.py:adam --workdir=runs/qwen7b_adam ...

What it runs: exactly the 1.5B recipe (configs/qwen2_5_math_1_5b.py, whose docstring lists every
setting): DAPO-Math prompts from data.path, MATH-500 held out from data.eval_path, math_verify
reward 1 / -0.01, running-baseline REINFORCE with one response per prompt and TIS cap 2.0,
128 prompts per step, context <= 4,096 tokens (3,584 new), temperature 1.0; LoGRA rank 256,
Rademacher refreshed every step, RowAdam, update_ratio 6e-5, predicted-KL budget cosine
2e-4 -> 2e-5 over 300 steps, alpha_max 3; bf16 compute, full remat, blockwise attention,
vocabulary chunks of 8,192, FSDP over every device (docs/memory.md); eval k = 4. Only the
model and the micro-batching differ: 32 micro-batches of 4 sequences (one per training GPU).
A missing model.path stops the run at start with an error naming config key model.path.

Should reach (docs/method.md §6, Table 1, mean of 3 seeds): peak MATH-500 Pass@1 72.33%, Pass@4
85.13% (dense Adam: 72.48% / 85.33%, i.e. unchanged accuracy); training memory avg 17.29 /
peak 22.26 GiB per GPU vs dense 31.82 / 31.85 (-45.7% average); 25.73 updates per hour.
"""
import importlib.util
import os


def _recipe():
  """The shared paper recipe from the sibling 1.5B config (loaded by path: configs/ is no package)."""
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'qwen2_5_math_1_5b.py')
  spec = importlib.util.spec_from_file_location('_qwen2_5_math_1_5b_config', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.paper_math_config


def get_config(arg=None):
  return _recipe()('qwen2.5-math-7b', micro_batches=32, arg=arg)
