"""LoGRA vs LoRA vs dense AdamW at the same rank (docs/method.md §6 "vs LoRA", Table 2).

The comparison (experiments/compare_lora.py): the XLA compiled memory of each method's jitted
training step, its step time (median, the three side by side in one process) and held-out
pass@1 after a training run of each through the library's trainer:
  python experiments/compare_lora.py --config=configs/compare_lora.py:tiny \
      --workdir=runs/compare_lora_tiny
  python experiments/compare_lora.py --config=configs/compare_lora.py --workdir=runs/compare_lora \
      --config.model.path=/path/to/Qwen2.5-Math-1.5B \
      --config.data.path=/path/to/dapo_math.jsonl --config.data.eval_path=/path/to/math500.jsonl
`get_config` is the LoGRA arm; `ablation` lists every arm's overrides. One arm alone:
  python experiments/train.py --config=configs/compare_lora.py:tiny --workdir=runs/cl_logra

The full variant (GPUs and weights; nothing is downloaded) is the paper's 1.5B recipe
(configs/qwen2_5_math_1_5b.py): LoGRA rank 256; LoRA rank 256 on the same q/k/v/o/gate/up/down
kernels, alpha 512 (scale 2); dense AdamW lr 1e-6, warm-up 9, cosine. The paper does not give
its LoRA optimizer settings: AdamW lr 1e-5 with the dense schedule is OUR choice.
`:tiny` is configs/tiny.py cut to a few minutes on a 2-core CPU: 20 RL steps of 16 prompts x 8
samples after its 300-step warm start; every arm at rank 16 (of d_in 128 / 256: at tiny.py's
rank 64 the adapters and their two Adam moments weigh as much as the kernels' dense Adam
state, so the tiny analogue of the paper's r = 256 of d = 1536 is a small rank); LoRA alpha 32,
lr 5e-4 (not tuned).

Should reach: full (docs/method.md §6, 1.5B, r = 256): train memory avg 7.18 (LoGRA) vs 13.21
GiB (LoRA), peak 8.66 vs 13.38; Pass@1 68.47 vs 70.45; 11.31 vs 10.63 s per update. Tiny: the
LoRA and LoGRA steps' argument and temp bytes below dense AdamW's (no dense optimizer state,
no dense gradient); pass@1 of every arm above its warm-started start is not promised in 20
steps (see the README's results for what was measured).
"""
import importlib.util
import os

_DIR = os.path.dirname(os.path.abspath(__file__))


def _sibling(name):
  """A config file next to this one, loaded by path (configs/ is no package)."""
  spec = importlib.util.spec_from_file_location(f'_{name}_config', os.path.join(_DIR, f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _check(arg):
  if arg not in (None, 'tiny'):
    raise ValueError(f"configs/compare_lora.py: unknown variant {arg!r} (use ':tiny' or none)")


def _tiny():
  cfg = _sibling('tiny').get_config('paper')  # the paper's LoGRA (A every step)
  cfg.data.prompts_per_step = 16
  cfg.data.eval_size = 128
  cfg.eval.k = 2
  cfg.total_steps = 20
  cfg.eval_every = 10
  cfg.checkpoint_every = 20
  return cfg


def get_config(arg=None):
  """The LoGRA arm (the base of every arm): the paper's 1.5B recipe, or ':tiny'."""
  _check(arg)
  if arg == 'tiny':
    return _tiny()
  return _sibling('qwen2_5_math_1_5b').get_config()


def ablation(arg=None) -> dict:
  """The arms ({name: config overrides}, in order) and the timed steps per method."""
  _check(arg)
  rank = 16 if arg == 'tiny' else 256
  # fp32 trainable weights for the dense arms (config.py refuses bf16 AdamW / LoRA updates)
  dense = {} if arg == 'tiny' else {'optim.lr_schedule': 'cosine', 'optim.warmup_steps': 9,
                                    'model.param_dtype': 'float32'}
  lora = {'optim.name': 'lora', 'optim.lora.rank': rank, 'optim.lora.alpha': 2.0 * rank,
          'optim.lora.learning_rate': 5e-4 if arg == 'tiny' else 1e-5, **dense}
  adam = {'optim.name': 'adam', 'optim.adam.learning_rate': 2e-4 if arg == 'tiny' else 1e-6,
          **dense}  # tiny.py's and the 1.5B recipe's dense-AdamW learning rates
  return {'arms': {'logra': {'optim.logra.rank': rank}, 'lora': lora, 'adam': adam},
          'timing_steps': 7 if arg == 'tiny' else 5}
