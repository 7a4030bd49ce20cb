"""Rank x projection ablation (the paper's Fig. 5a/5b/5c): experiments/ablate_rank.py.

  python experiments/ablate_rank.py --config=configs/ablate_rank.py:tiny --workdir=runs/ablate_rank
  python experiments/ablate_rank.py --config=configs/ablate_rank.py --workdir=runs/ablate_rank_15b \
      --config.model.path=/path/to/Qwen2.5-Math-1.5B --config.data.path=... \
      --config.data.eval_path=...

`get_config(arg)` is the base run every arm starts from; `ablation(arg)` the arms. Each arm is
the base with optim.logra.rank, optim.logra.projection and optim.logra.refresh set (docs/ablations.md).

Full (no arg; GPUs and weights, as configs/qwen2_5_math_1_5b.py): the paper's 1.5B recipe
(RowAdam, annealed predicted-KL budget), ranks 4/16/64/256 x {fixed Rademacher, refreshed
Rademacher, refreshed Gaussian, refreshed orthogonal}. The paper (docs/method.md §6): rank
4 -> 256 adds 3.0-4.0 Pass@1 points; at rank 256 fixed Rademacher 68.50%, refreshed
Rademacher 68.31%, refreshed Gaussian 67.42%; mean reconstruction cosine ~0.046 (r=4) to
~0.348 (r=256).

`:tiny` (this CPU, a few minutes): configs/tiny.py's addition task and warm start, ranks 4 and
64 of d_in 128 (256 for down_proj), a handful of RL steps per arm, reconstruction cosines at
ranks 4/16/64/128 on the shared starting policy. What it should reach there: the mean cosine
rising with rank on the theory line sqrt(R/(R+K)) (sqrt(R/K) orthogonal; measured 0.17 -> 0.65
Rademacher, 0.17 -> 0.87 orthogonal at R = 4 -> 128); pass@1 after so few steps is within noise.
"""
import importlib.util
import os

VARIANTS = (  # (name, optim.logra.projection, optim.logra.refresh)
    ('fixed_rademacher', 'rademacher', False),
    ('refreshed_rademacher', 'rademacher', True),
    ('refreshed_gaussian', 'gaussian', True),
    ('refreshed_orthogonal', 'orthogonal', True),
)


def _sibling(name):
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f'{name}.py')
  spec = importlib.util.spec_from_file_location(f'_configs_{name}', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def tiny_base():
  """configs/tiny.py at ablation size: fewer prompts and held-out problems, a few steps."""
  cfg = _sibling('tiny').get_config('paper')  # the paper's LoGRA (A every step)
  cfg.data.prompts_per_step = 16
  cfg.data.eval_size = 64
  cfg.total_steps = 8
  cfg.eval_every = 8            # held-out eval at the start and the end only
  cfg.checkpoint_every = 1000  # only the last step's checkpoint (a rerun resumes it)
  return cfg


def get_config(arg=None):
  if arg == 'tiny':
    return tiny_base()
  if arg:
    raise ValueError(f"configs/ablate_rank.py: unknown variant {arg!r} (use ':tiny' or none)")
  cfg = _sibling('qwen2_5_math_1_5b').get_config()
  cfg.checkpoint_every = 100
  return cfg


def ablation(arg=None):
  """The arms (rank x variant) and the reconstruction-cosine settings."""
  tiny = arg == 'tiny'
  return dict(
      ranks=(4, 64) if tiny else (4, 16, 64, 256),
      variants=VARIANTS,
      cosine_ranks=(4, 16, 64, 128) if tiny else (4, 16, 64, 256),
      cosine_kinds=('rademacher', 'gaussian', 'orthogonal'),
      cosine_seeds=(0, 1) if tiny else (0, 1, 2),
      cosine_sequences=32 if tiny else 4,  # answer-NLL batch for the dense G
  )
