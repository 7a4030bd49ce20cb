"""The CPU default and the README's main job: a ~0.5M-parameter Llama-style model learns
2-digit addition ("12+34=" → "46") by RL with LoGRA.

The model starts random, so the run begins with a SHORT SUPERVISED WARM START on the training
answers (warm_start.steps) that brings held-out accuracy to roughly 0.2-0.4; everything after
that is RL: GRPO advantages, REINFORCE with truncated importance sampling, LoGRA sketches with
RowAdam and the predicted-KL step size.

Command (also `make run`):
  python experiments/train.py --config=configs/tiny.py --workdir=runs/tiny
Dense-Adam baseline, side by side:
  python experiments/train.py --config=configs/tiny.py --workdir=runs/tiny_adam \
      --config.optim.name=adam
Should reach: held-out accuracy (eval_accuracy, pass@1) rising by more than 0.3 and ending
at 0.7 or more, in under 10 minutes on a 2-core CPU (see README for the measured curves).
"""
from logra_jax.train.config import default_config


def get_config():
  cfg = default_config()
  cfg.model.preset = 'tiny'
  cfg.data.source = 'tiny'
  cfg.data.eval_size = 256
  cfg.data.prompts_per_step = 32
  cfg.data.samples_per_prompt = 8
  cfg.rollout.max_new_tokens = 4
  cfg.rollout.temperature = 1.0
  cfg.reward.verifier = 'exact'
  cfg.reward.workers = 0  # exact match is instant: score in-process
  cfg.rl.advantage = 'grpo'
  cfg.optim.name = 'logra'
  cfg.optim.rank = 64              # of d_in = 128 (256 for down_proj)
  cfg.optim.projection = 'rademacher'
  cfg.optim.refresh = True         # a new A every step, as in the paper
  cfg.optim.sketch_optimizer = 'row_adam'
  # The step size is set by the KL budget: the learning rate only fixes the candidate's scale.
  cfg.optim.learning_rate = 1.0
  cfg.optim.kl_control = True
  cfg.optim.kl_budget_init = 1e-2  # per-step predicted KL, cosine-annealed (the paper: 2e-4 → 2e-5
  cfg.optim.kl_budget_final = 1e-3  # for 1.5B-27B models; a 0.45M model moves in larger steps)
  cfg.optim.kl_budget_steps = 1500
  cfg.optim.adam_learning_rate = 1e-4  # the dense-Adam baseline (--config.optim.name=adam)
  cfg.warm_start.steps = 300       # supervised warm start: held-out pass@1 ~0.23 before RL
  cfg.warm_start.learning_rate = 1e-3
  cfg.total_steps = 1500
  cfg.eval_every = 100
  cfg.checkpoint_every = 500
  return cfg
