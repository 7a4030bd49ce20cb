"""The paper's 27B long run (docs/method.md §6): RL on 8 hard reasoning-gym tasks with LoGRA,
SGD sketch, rank 256, 16,384-token context and a tightening predicted-KL budget.

NEEDS GPUS AND WEIGHTS (not runnable on a laptop CPU): a 27B-class model on one node of
8xH100 80GB (4 training with FSDP, 4 generating); dense Adam does not fit (OOM at the first
optimizer-state allocation). The weights must be on disk; nothing is downloaded.

Command:
  python experiments/train.py --config=configs/paper_27b_reasoning_gym.py --workdir=runs/rg27b \
      --config.model.path=/path/to/hf_checkpoint_dir

What it runs: the paper's 27B model is not a Qwen2/Llama release we can name, so model.preset
is the stand-in 'qwen2.5-32b' (the nearest Qwen2-architecture shape, for memory planning);
the run itself loads whatever HF checkpoint model.path names (Llama/Qwen2 architecture), and a
missing path stops it at start with an error naming config key model.path. Data: a
reasoning-gym 'composite' mixture (data.name is a comma-separated list, equal weights; give
'name:weight' to change one, and data.options as {"name": {options}} for per-task settings)
of 8 tasks, 38,948 training items and 193 held out, as in the paper. The paper's task list
is not in our notes: these 8 are hard, verifiable by their own score_answer, and fast to
generate (zebra_puzzles / word_ladder / sokoban take ~1 s or more per item here).
Prompts: chat template with a system prompt asking to think, then answer in <answer> tags;
reward: the 'reasoning_gym' verifier (1 if the dataset's score_answer is 1, else -0.01).
RL as in the main runs (assumed; the notes give no batch for this run): 128 prompts per step,
one response each, running-baseline REINFORCE with TIS cap 2.0, temperature 1.0. LoGRA:
rank 256, Rademacher refreshed every step, SGD sketch (no RowAdam), update_ratio 6e-5,
alpha from the finite-difference KL probe (as the 27B run did) on 4 sequences, budget
cosine 2e-4 -> 2e-5 over the whole 1,200-step run minus the mismatch EMA, alpha_max 3.
Context 16,384 tokens: 15,360 new tokens after a prompt bucket of <= 1,024. bf16 compute,
full remat, 32 micro-batches of 4 sequences, blockwise attention, vocabulary chunks of 8,192,
FSDP over every device; per-device memory plan: docs/memory.md.

Should reach (docs/method.md §6): held-out macro score 39.69% -> 62.94% (peak 65.52% at step
1,060); mean answer length 8,312 -> 4,705 tokens; truncation 34.72% -> 12.95%; Table 1 (on
DAPO-Math): avg 51.54 / peak 53.88 GiB per training GPU, 6.99 updates per hour. Our eval
logs the micro-averaged held-out accuracy (eval_accuracy), response_length and
truncation_rate; a per-task macro average is not computed by the loop yet.
"""
from logra_jax.train.config import default_config

TASKS = ('arc_1d', 'countdown', 'cryptarithm', 'futoshiki', 'knights_knaves', 'mini_sudoku',
         'self_reference', 'tower_of_hanoi')
SYSTEM_PROMPT = ('Think the problem through step by step. Then give your final answer, '
                 'exactly in the format the problem asks for, inside <answer></answer> tags.')


def get_config():
  cfg = default_config()
  cfg.model.preset = 'qwen2.5-32b'  # stand-in shape of the paper's 27B (memory planning only)
  cfg.model.path = ''               # required: --config.model.path=/path/to/hf_dir
  cfg.model.dtype = 'bfloat16'
  cfg.model.param_dtype = 'bfloat16'  # bf16 weights (docs/memory.md plans the same)
  cfg.model.remat_policy = 'full'
  cfg.model.attention = 'blockwise'  # no (L, L) scores per head at 16,384 tokens
  cfg.model.attention_block = 512
  cfg.model.vocab_chunk = 8192       # no (tokens, 152,064) fp32 logits (docs/memory.md)
  cfg.mesh.data = 1
  cfg.mesh.fsdp = -1                 # FSDP over every training device (the paper: 4 H100s)
  cfg.data.source = 'reasoning_gym'
  cfg.data.name = ','.join(TASKS)
  cfg.data.options = '{}'
  cfg.data.train_size = 38948
  cfg.data.eval_size = 193
  cfg.data.prompts_per_step = 128
  cfg.data.samples_per_prompt = 1
  cfg.data.chat_template = True
  cfg.data.system_prompt = SYSTEM_PROMPT
  cfg.rollout.max_new_tokens = 15360  # + a prompt bucket of <= 1,024 = 16,384 tokens
  cfg.rollout.temperature = 1.0
  cfg.reward.verifier = 'reasoning_gym'
  cfg.reward.correct = 1.0
  cfg.reward.incorrect = -0.01
  cfg.reward.timeout_s = 10.0
  cfg.reward.workers = 8
  cfg.rl.advantage = 'running_baseline'
  cfg.rl.baseline_ema = 0.1
  cfg.rl.loss = 'reinforce_tis'
  cfg.rl.tis_cap = 2.0
  cfg.rl.kl_coef = 0.0
  cfg.rl.aggregation = 'token'
  cfg.optim.name = 'logra'
  cfg.optim.micro_batches = 32
  cfg.optim.logra.sketch_optimizer = 'sgd'
  cfg.optim.logra.rank = 256
  cfg.optim.logra.projection = 'rademacher'
  cfg.optim.logra.refresh = True
  cfg.optim.logra.learning_rate = 1.0
  cfg.optim.logra.update_ratio = 6e-5
  cfg.optim.logra.kl_control = True
  cfg.optim.logra.kl_probe = 'fd'
  cfg.optim.logra.kl_budget_init = 2e-4
  cfg.optim.logra.kl_budget_final = 2e-5
  cfg.optim.logra.kl_budget_steps = 1200
  cfg.optim.logra.alpha_max = 3.0
  cfg.optim.kl_sequences = 4
  cfg.optim.logra.mismatch_ema = 0.3
  cfg.eval.k = 1
  cfg.eval.temperature = 1.0
  cfg.total_steps = 1200
  cfg.eval_every = 20
  cfg.checkpoint_every = 20
  return cfg
