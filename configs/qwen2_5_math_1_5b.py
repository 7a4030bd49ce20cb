"""The paper's main 1.5B run (docs/method.md §5-§7): Qwen2.5-Math-1.5B on DAPO-Math with LoGRA.

NEEDS GPUS AND WEIGHTS (not runnable on a laptop CPU): the paper used one node of 8xH100 80GB
(4 training with FSDP, 4 generating). The weights must be on disk; nothing is downloaded.

Command:
  python experiments/train.py --config=configs/qwen2_5_math_1_5b.py --workdir=runs/qwen15b \
      --config.model.path=/path/to/Qwen2.5-Math-1.5B \
      --config.data.path=/path/to/dapo_math.jsonl --config.data.eval_path=/path/to/math500.jsonl
Dense-Adam baseline (AdamW lr 1e-6, betas (0.9, 0.95), warm-up 9, cosine to 0.1x over 300):
  python experiments/train.py --config=configs/qwen2_5_math_1_5b.py:adam --workdir=runs/qwen15b_adam ...

What it runs: model.path is an HF checkpoint directory (config.json, safetensors, tokenizer);
a missing path stops the run at start with an error naming config key model.path. data.path is
a JSONL/Parquet file of DAPO-Math prompts with fields `problem` and `answer` (the authors:
7,500 deduplicated prompts; convert DAPO-Math-17k's prompt / reward_model.ground_truth to
problem / answer); data.eval_path is MATH-500 (500 problems, `problem`/`answer`, as in
HuggingFaceH4/MATH-500), held out. Prompts go through the model's chat template with the
Qwen-Math system prompt (step by step, final answer in \\boxed{}). Reward: math_verify,
1 correct / -0.01 otherwise. RL: one response per prompt, 128 prompts per step, advantage =
reward - running baseline (EMA 0.1 over previous batches), REINFORCE with truncated importance
sampling (cap 2.0) against the generator's log-probs, no reference KL, temperature 1.0.
Context <= 4,096 tokens (the model's max_position_embeddings): 3,584 new tokens after a prompt
bucket of <= 512. LoGRA: rank 256 on every q/k/v/o/gate/up/down kernel, Rademacher A refreshed
every step, RowAdam (b2 0.95), the authors' relative step (update_ratio 6e-5, lr 1.0), alpha
from the predicted KL (JVP on 8 sequences) with the budget cosine-annealed 2e-4 -> 2e-5 over
300 steps minus the mismatch EMA (0.3), alpha_max 3. bf16 compute and bf16 weights
(model.param_dtype; the :adam baseline keeps fp32 master weights; docs/memory.md on bf16
rounding of small updates), full rematerialisation, 16 micro-batches of 8 sequences.
Memory: blockwise attention (blocks of 512), losses and KL probes over vocabulary chunks of
8,192, params and optimizer state FSDP over every device (mesh.fsdp = -1); the per-device
plan is docs/memory.md (python experiments/memory_plan.py). Eval: 4 samples per MATH-500
problem at T = 1.0 (Pass@1 = mean correctness of the 2,000 answers, Pass@4) every 20 steps.

Should reach (docs/method.md §6, Table 1, mean of 3 seeds): peak MATH-500 Pass@1 67.87%, Pass@4
82.47% (dense Adam: 63.77% / 80.33%); training memory avg 7.18 / peak 8.66 GiB per GPU (dense
9.18 / 9.19); 55.44 updates per hour. The KL-budget ablation measured Pass@1 at steps 700-800
(annealed budget, SGD sketch: 71.47%): extend with --config.total_steps=800.
"""
from logra_jax.train.config import default_config, switch_method

QWEN_MATH_SYSTEM_PROMPT = ('Please reason step by step, and put your final answer within '
                           '\\boxed{}.')


def paper_math_config(preset: str, micro_batches: int, arg=None):
  """The §5/§7 recipe shared by the 1.5B and 7B configs; `arg` 'adam' is the dense baseline."""
  cfg = default_config()
  cfg.model.preset = preset  # the shape, for memory planning; the run loads model.path
  cfg.model.path = ''        # required: --config.model.path=/path/to/hf_dir
  cfg.model.dtype = 'bfloat16'
  cfg.model.param_dtype = 'bfloat16'  # bf16 weights, as docs/memory.md plans (:adam: fp32)
  cfg.model.remat_policy = 'full'
  cfg.model.attention = 'blockwise'  # no (L, L) scores per head at 4,096 tokens
  cfg.model.attention_block = 512
  cfg.model.vocab_chunk = 8192       # no (tokens, 151,936) fp32 logits (docs/memory.md)
  cfg.mesh.data = 1
  cfg.mesh.fsdp = -1                 # FSDP over every training device (the paper: 4 H100s)
  cfg.data.source = 'file'
  cfg.data.path = 'data/dapo_math.jsonl'    # override: --config.data.path=...
  cfg.data.eval_path = 'data/math500.jsonl'  # override: --config.data.eval_path=...
  cfg.data.eval_size = 500
  cfg.data.prompts_per_step = 128
  cfg.data.samples_per_prompt = 1
  cfg.data.chat_template = True
  cfg.data.system_prompt = QWEN_MATH_SYSTEM_PROMPT
  cfg.rollout.max_new_tokens = 3584  # + a prompt bucket of <= 512 = the 4,096-token context
  cfg.rollout.temperature = 1.0
  cfg.rollout.top_p = 1.0
  cfg.rollout.top_k = 0
  cfg.reward.verifier = 'math_verify'
  cfg.reward.correct = 1.0
  cfg.reward.incorrect = -0.01
  cfg.reward.timeout_s = 10.0
  cfg.reward.workers = 8
  cfg.rl.advantage = 'running_baseline'
  cfg.rl.baseline_ema = 0.1
  cfg.rl.loss = 'reinforce_tis'
  cfg.rl.tis_cap = 2.0
  cfg.rl.kl_coef = 0.0
  cfg.rl.entropy_coef = 0.0
  cfg.rl.aggregation = 'token'
  cfg.optim.name = 'logra'
  cfg.optim.micro_batches = micro_batches
  cfg.optim.logra.sketch_optimizer = 'row_adam'
  cfg.optim.logra.rank = 256
  cfg.optim.logra.projection = 'rademacher'
  cfg.optim.logra.refresh = True
  cfg.optim.logra.b2 = 0.95
  cfg.optim.logra.eps = 1e-8
  cfg.optim.logra.learning_rate = 1.0  # the step is update_ratio-relative, then scaled by alpha
  cfg.optim.lr_schedule = 'constant'
  cfg.optim.logra.update_ratio = 6e-5
  cfg.optim.logra.kl_control = True
  cfg.optim.logra.kl_probe = 'jvp'
  cfg.optim.logra.kl_budget_init = 2e-4
  cfg.optim.logra.kl_budget_final = 2e-5
  cfg.optim.logra.kl_budget_steps = 300
  cfg.optim.logra.alpha_max = 3.0
  cfg.optim.kl_sequences = 8
  cfg.optim.logra.mismatch_ema = 0.3
  cfg.eval.k = 4
  cfg.eval.temperature = 1.0
  cfg.total_steps = 300
  cfg.eval_every = 20
  cfg.checkpoint_every = 20
  if arg == 'adam':
    switch_method(cfg, 'adam')
    cfg.optim.adam.learning_rate = 1e-6  # the dense baseline's AdamW (docs/method.md §7)
    cfg.model.param_dtype = 'float32'  # fp32 master weights, bf16 compute
    cfg.optim.lr_schedule = 'cosine'
    cfg.optim.warmup_steps = 9
    cfg.optim.adam.b1 = 0.9
    cfg.optim.adam.b2 = 0.95
    cfg.optim.adam.weight_decay = 0.0
  elif arg:
    raise ValueError(f"unknown variant {arg!r} (use ':adam' for the dense baseline, or none)")
  return cfg


def get_config(arg=None):
  return paper_math_config('qwen2.5-math-1.5b', micro_batches=16, arg=arg)
