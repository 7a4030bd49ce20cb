"""The one config schema: frozen dataclasses, turned into an ml_collections ConfigDict.

`configs/*.py` start from `default_config()` (every key declared, typed, locked) and override
values; `from_config_dict` converts back at the boundary and validates: an unknown key is an
error that names it (with the closest valid key), a value of the wrong type or out of range
is an error that names the key.
"""
import dataclasses
import difflib
import json
import os
import typing
from typing import Any

from ml_collections import config_dict

from logra_jax.parallel import parse_axis_rules


@dataclasses.dataclass(frozen=True)
class ModelSection:
  preset: str = 'tiny'      # a preset name (random init), unless `path` is set
  path: str = ''            # an HF checkpoint directory or a .gguf file
  dtype: str = 'float32'    # compute dtype
  param_dtype: str = 'float32'  # storage dtype of the params (init and checkpoint load)
  remat_policy: str = 'none'
  attention: str = 'dense'  # | 'blockwise' (online softmax, no L×L scores)
  attention_block: int = 512  # query/key block of blockwise attention
  vocab_chunk: int = 0      # > 0: losses and KL probes over vocab chunks of this size (0: off)


@dataclasses.dataclass(frozen=True)
class DataSection:
  source: str = 'tiny'      # 'tiny' | 'reasoning_gym' | 'file'
  name: str = ''            # reasoning-gym dataset name
  options: str = '{}'       # reasoning-gym options, JSON
  path: str = ''            # JSONL/Parquet with `problem` and `answer` (source='file')
  eval_path: str = ''       # held-out file (default: a split of `path`)
  train_size: int = 2000
  eval_size: int = 128
  prompts_per_step: int = 32
  samples_per_prompt: int = 8
  chat_template: bool = True
  system_prompt: str = ''


@dataclasses.dataclass(frozen=True)
class RolloutSection:
  engine: str = 'embedded'  # the in-process JAX sampler | 'http': a fleet of servers
  max_new_tokens: int = 8
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  # engine='http' (docs/bridge.md): existing servers, or N JAX-engine servers launched here
  urls: str = ''            # comma-separated base URLs (token: $LOGRA_BRIDGE_TOKEN)
  launch: int = 0           # local JAX-engine servers the trainer starts and stops
  launch_platform: str = ''  # JAX_PLATFORMS of launched servers ('': the trainer's own)
  full_sync_every: int = 0  # a full-weight anchor every K steps (0: only when needed)
  blob_dir: str = ''        # where update blobs are written for the servers to read: a
  #   directory they share (servers on other hosts; docs/bridge.md); '': shared memory/temp
  u_dtype: str = 'fp32'     # low-rank U on the wire: fp32 | bf16 | fp8-e4m3 | int4
  # every K steps each server's fingerprint of the weights it serves (GET /weight_info) is
  # compared with the trainer's: generator_drift logged, a server past the tolerance re-synced
  # in full (generator_resyncs; docs/bridge.md). 0: never checked
  drift_check_every: int = 10
  # the client's timeouts, seconds (bridge/client.py `Timeouts`): a server that does not answer
  # in time is marked down after that one call (not repeated); docs/bridge.md
  connect_timeout_s: float = 10.0      # the TCP connection
  health_timeout_s: float = 10.0       # GET /health
  generation_timeout_s: float = 300.0  # one /v1/completions call
  update_timeout_s: float = 900.0      # each call of an update (pause … resume), /weight_info
  # 0: on-policy. s > 0: step t+s's rollouts are generated during step t's update, by the
  # weights before it (staleness s; TIS corrects it; train/rollout.py `Rollouts`)
  max_staleness: int = 0


@dataclasses.dataclass(frozen=True)
class RewardSection:
  verifier: str = 'exact'   # a name in logra_jax.rl.rewards
  correct: float = 1.0
  incorrect: float = -0.01
  timeout_s: float = 10.0
  workers: int = 2          # scoring processes (0: in-process)


@dataclasses.dataclass(frozen=True)
class RLSection:
  advantage: str = 'grpo'   # 'running_baseline' | 'grpo' | 'rloo' | 'reinforce_pp'
  baseline_ema: float = 0.1
  loss: str = 'reinforce_tis'  # | 'ppo_clip'
  tis_cap: float = 2.0
  clip_eps: float = 0.2
  entropy_coef: float = 0.0
  kl_coef: float = 0.0      # KL-to-reference penalty (0: off, no reference forward)
  aggregation: str = 'token'  # | 'sequence'


@dataclasses.dataclass(frozen=True)
class LograSection:
  """optim.logra.*: the sketch, its optimizer and the predicted-KL step size (docs/method.md)."""
  learning_rate: float = 1e-2  # of the sketch optimizer
  sketch_optimizer: str = 'row_adam'  # | 'adam' (per entry of S) | 'adafactor' (S's rows x
  #   columns) | 'sgd' (docs/method.md section 12)
  rank: int = 16
  rank_rules: str = ''      # per-module ranks: 'regex=rank,regex=rank' (first match wins)
  rank_delta: int = 0       # dynamic rank r_t = rank + ceil(rank_delta·tanh(t/rank_tau))
  rank_tau: float = 1000.0
  projection: str = 'rademacher'  # | 'gaussian' | 'orthogonal' (block SRHT, rank <= d_in)
  refresh: bool = True      # redraw A (False: fixed A)
  refresh_every: int = 1    # ... every this many steps (A held in between)
  subspace: str = 'random'  # A at each refresh: 'random' (drawn from (seed, step)) |
  #   'adaptive' (built from the co-sketch G m^T of the refresh step, m the momentum:
  #   docs/method.md section 13; needs momentum > 0; the low-rank payload carries A)
  subspace_random_rows: int = 0  # adaptive: rows of A kept random (GoLore), of the rank
  momentum: float = 0.0     # sketch-space first moment of RowAdam's updates (0: off), carried
  #   across redraws of A as m <- A_new A_old+ m (needs rank_delta=0)
  b2: float = 0.95
  eps: float = 1e-8
  preserve_norm: bool = True  # RowAdam rescales each matrix to its sketch's Frobenius norm
  #   (the paper); False: entries of size ~1 like Adam's, so learning_rate is Adam-like
  update_ratio: float = 0.0  # the authors' relative global step (0: off)
  rest_learning_rate: float = 0.0  # > 0: the leaves LoGRA does not sketch (embeddings, head,
  #   norm scales) train densely by Adam (b1 0.9, b2 = b2) at this lr, in the same step and
  #   under the same KL budget; 0: frozen (the paper). Generators then get full weights.
  rest_step: str = 'budget'  # the rest's Adam step: 'budget' (scaled by the step's alpha with
  #   the kernels', one KL probe along both) | 'own' (at rest_learning_rate itself, alpha from
  #   the kernels' direction alone: with alpha ~0.01 'budget' moves the rest ~100x slower)
  sparse_mask: float = 0.0  # drop this fraction of output units per step (unbiased)
  param_rounding: str = 'stochastic'  # bf16 params: W + ΔW stochastically rounded | 'nearest'
  kl_control: bool = True   # α from the predicted KL (else α = 1)
  kl_probe: str = 'jvp'     # | 'fd' (finite difference)
  kl_budget_init: float = 2e-4
  kl_budget_final: float = 2e-5
  kl_budget_steps: int = 300
  alpha_max: float = 3.0    # 1.0 makes the budget a ceiling: steps are never enlarged
  mismatch_ema: float = 0.3  # EMA of the sampler/trainer mismatch that tightens the budget


@dataclasses.dataclass(frozen=True)
class _AdamW:
  """The AdamW keys the dense baseline and LoRA each have (their own copy)."""
  learning_rate: float = 1e-4
  b1: float = 0.9
  b2: float = 0.95
  weight_decay: float = 0.0
  max_grad_norm: float = 0.0  # global-norm clipping (0: off)


@dataclasses.dataclass(frozen=True)
class AdamSection(_AdamW):
  """optim.adam.*: the dense AdamW baseline."""
  trainable: str = 'all'    # | 'sketched': only the kernels LoGRA sketches train (the rest
  #   frozen, no optimizer state): "fewer trained parameters" apart from "sketch noise"


@dataclasses.dataclass(frozen=True)
class LoraSection(_AdamW):
  """optim.lora.*: AdamW on LoRA adapters of the sketched kernels."""
  rank: int = 16
  alpha: float = 32.0


@dataclasses.dataclass(frozen=True)
class OptimSection:
  """optim.*: what every method shares; optim.<name>.* only the chosen method's keys."""
  name: str = 'logra'       # 'logra' | 'adam' | 'lora'
  lr_schedule: str = 'constant'  # | 'cosine' (to 0.1x over total_steps)
  warmup_steps: int = 0
  micro_batches: int = 1
  share_prompts: bool = True  # a prompt's samples compute its prompt once (packed rows,
  #   train/completion.py; same numbers): fewer positions forward and backward
  kl_sequences: int = 8     # rows of the batch the KL probe and telemetry run on (strided
  #   over prompts; docs/benchmarks.md "The KL probe's size", experiments/kl_probe_size.py)
  telemetry_every: int = 1  # realised-KL telemetry (an extra forward) every K steps (0: never);
  #   with logra.kl_control=False and 0 the step runs no KL probe at all
  logra: LograSection = LograSection()
  adam: AdamSection = AdamSection()
  lora: LoraSection = LoraSection()


METHOD_SECTIONS = {'logra': LograSection, 'adam': AdamSection, 'lora': LoraSection}

# The flat optim section's keys before per-method sections, and where they went.
RENAMED = {
    **{f'optim.{k}': f'optim.logra.{k}' for k in (
        'learning_rate', 'sketch_optimizer', 'rank', 'rank_rules', 'rank_delta', 'rank_tau',
        'projection', 'refresh', 'momentum', 'b2', 'eps', 'preserve_norm', 'update_ratio',
        'sparse_mask', 'param_rounding', 'kl_control', 'kl_probe', 'kl_budget_init',
        'kl_budget_final', 'kl_budget_steps', 'alpha_max', 'mismatch_ema')},
    'optim.adam_learning_rate': 'optim.adam.learning_rate (or optim.lora.learning_rate)',
    'optim.adam_b2': 'optim.adam.b2 (or optim.lora.b2)',
    'optim.b1': 'optim.adam.b1 (or optim.lora.b1)',
    'optim.weight_decay': 'optim.adam.weight_decay (or optim.lora.weight_decay)',
    'optim.max_grad_norm': 'optim.adam.max_grad_norm (or optim.lora.max_grad_norm)',
    'optim.lora_rank': 'optim.lora.rank',
    'optim.lora_alpha': 'optim.lora.alpha',
}
RENAMED['optim.learning_rate'] = ('optim.logra.learning_rate (or optim.adam.learning_rate / '
                                  'optim.lora.learning_rate)')
RENAMED['optim.b2'] = 'optim.logra.b2 (or optim.adam.b2 / optim.lora.b2)'


def method_section(o: OptimSection):
  """The chosen method's own section (``optim.<name>``)."""
  return getattr(o, o.name)


@dataclasses.dataclass(frozen=True)
class WarmStartSection:
  steps: int = 0            # supervised steps on the task before RL (0: none)
  learning_rate: float = 3e-3
  batch_size: int = 64
  cache_dir: str = ''       # keep warm-started policies here, keyed by what makes them
  #   (docs/warm_start_cache.md; '': no cache)


@dataclasses.dataclass(frozen=True)
class EvalSection:
  k: int = 4                # samples per held-out problem (pass@1 and pass@k)
  temperature: float = 1.0
  max_new_tokens: int = 0   # the held-out completions' limit (0: rollout.max_new_tokens)


@dataclasses.dataclass(frozen=True)
class MeshSection:
  """Device mesh ('data', 'fsdp'): data * fsdp = jax.device_count(); -1 = the rest."""
  data: int = 1
  fsdp: int = -1            # -1: every device not taken by `data` (the default: all)
  # Logical axis -> mesh axis, first match per dimension ('name=' or 'name=none': replicated).
  rules: str = 'embed=fsdp,mlp=fsdp,q_heads=fsdp,kv_heads=fsdp,vocab=fsdp,layers='


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  model: ModelSection = ModelSection()
  data: DataSection = DataSection()
  rollout: RolloutSection = RolloutSection()
  reward: RewardSection = RewardSection()
  rl: RLSection = RLSection()
  optim: OptimSection = OptimSection()
  warm_start: WarmStartSection = WarmStartSection()
  eval: EvalSection = EvalSection()
  mesh: MeshSection = MeshSection()
  total_steps: int = 100
  eval_every: int = 20
  checkpoint_every: int = 50
  keep_checkpoints: int = 2  # the newest N checkpoints kept (0: every one)
  seed: int = 0

  def __post_init__(self):
    _check(self)


CHOICES = {
    'data.source': ('tiny', 'reasoning_gym', 'file'),
    'rollout.engine': ('embedded', 'http'),  # = logra_jax.train.loop.GENERATORS
    'rollout.u_dtype': ('fp32', 'bf16', 'fp8-e4m3', 'int4'),
    'rl.advantage': ('running_baseline', 'grpo', 'rloo', 'reinforce_pp'),
    'rl.loss': ('reinforce_tis', 'ppo_clip'),
    'rl.aggregation': ('token', 'sequence'),
    'optim.name': ('logra', 'adam', 'lora'),
    'optim.lr_schedule': ('constant', 'cosine'),
    # = sketch.SKETCH_OPTIMIZERS
    'optim.logra.sketch_optimizer': ('row_adam', 'adam', 'adafactor', 'sgd'),
    'optim.logra.projection': ('rademacher', 'gaussian', 'orthogonal'),
    'optim.logra.subspace': ('random', 'adaptive'),
    'optim.logra.rest_step': ('budget', 'own'),
    'optim.logra.kl_probe': ('jvp', 'fd'),
    'optim.logra.param_rounding': ('stochastic', 'nearest'),  # = train.steps.PARAM_ROUNDINGS
    'optim.adam.trainable': ('all', 'sketched'),
    'model.dtype': ('float32', 'bfloat16', 'float64'),
    'model.param_dtype': ('float32', 'bfloat16', 'float64'),
    'model.attention': ('dense', 'blockwise'),
}
POSITIVE = ('data.prompts_per_step', 'data.samples_per_prompt', 'rollout.max_new_tokens',
            'optim.micro_batches', 'optim.logra.rank', 'optim.logra.refresh_every',
            'optim.kl_sequences', 'optim.lora.rank',
            'eval.k', 'total_steps', 'eval_every', 'checkpoint_every',
            'optim.logra.learning_rate', 'optim.adam.learning_rate', 'optim.lora.learning_rate',
            'optim.logra.alpha_max', 'optim.logra.kl_budget_init', 'optim.logra.kl_budget_steps',
            'optim.logra.rank_tau',
            'rollout.temperature', 'model.attention_block')


def _get(cfg, key):
  for part in key.split('.'):
    cfg = getattr(cfg, part)
  return cfg


def _check(cfg: TrainConfig):
  for key, allowed in CHOICES.items():
    if _get(cfg, key) not in allowed:
      raise ValueError(f'config key {key}={_get(cfg, key)!r} must be one of {allowed}')
  for key in POSITIVE:
    if not _get(cfg, key) > 0:
      raise ValueError(f'config key {key} must be > 0, got {_get(cfg, key)!r}')
  _check_method_keys(cfg.optim)
  if cfg.eval.max_new_tokens < 0:
    raise ValueError(f'config key eval.max_new_tokens must be >= 0 (0: rollout.max_new_tokens), '
                     f'got {cfg.eval.max_new_tokens}')
  lg = cfg.optim.logra
  if lg.momentum and lg.rank_delta:
    raise ValueError('config key optim.logra.momentum needs constant ranks (the moments keep '
                     'their shape across redraws of A): set optim.logra.rank_delta=0')
  if lg.sketch_optimizer in ('adam', 'adafactor') and lg.rank_delta:
    raise ValueError(f'config key optim.logra.sketch_optimizer={lg.sketch_optimizer!r} needs '
                     'constant ranks (its second moments have a rank axis): set '
                     'optim.logra.rank_delta=0')
  if lg.subspace == 'adaptive':
    _check_adaptive(lg)
  if not 0 <= lg.momentum < 1:
    raise ValueError(f'config key optim.logra.momentum must be in [0, 1) (0: off), '
                     f'got {lg.momentum}')
  if lg.rest_learning_rate < 0:
    raise ValueError(f'config key optim.logra.rest_learning_rate must be >= 0 (0: the rest '
                     f'frozen), got {lg.rest_learning_rate}')
  if lg.rest_step == 'own' and not lg.rest_learning_rate:
    raise ValueError("config key optim.logra.rest_step='own' needs a trained rest "
                     '(optim.logra.rest_learning_rate > 0)')
  if lg.kl_budget_final < 0:
    raise ValueError(f'config key optim.logra.kl_budget_final must be >= 0, '
                     f'got {lg.kl_budget_final}')
  if cfg.keep_checkpoints < 0:
    raise ValueError(f'config key keep_checkpoints must be >= 0 (0: every checkpoint), '
                     f'got {cfg.keep_checkpoints}')
  if cfg.optim.telemetry_every < 0:
    raise ValueError(f'config key optim.telemetry_every must be >= 0 (0: never), '
                     f'got {cfg.optim.telemetry_every}')
  if cfg.model.vocab_chunk < 0:
    raise ValueError(f'config key model.vocab_chunk must be >= 0 (0: off), '
                     f'got {cfg.model.vocab_chunk}')
  r = cfg.rollout
  if r.engine == 'http' and bool(r.urls.strip()) == bool(r.launch):
    raise ValueError('rollout.engine=http needs exactly one of config keys rollout.urls '
                     f'(existing servers) and rollout.launch (servers to start), got '
                     f'urls={r.urls!r}, launch={r.launch}')
  if r.launch < 0 or r.full_sync_every < 0:
    raise ValueError('config keys rollout.launch and rollout.full_sync_every must be >= 0')
  for key in ('connect_timeout_s', 'health_timeout_s', 'generation_timeout_s',
              'update_timeout_s'):
    if not getattr(r, key) > 0:
      raise ValueError(f'config key rollout.{key} must be > 0, got {getattr(r, key)!r}')
  if r.max_staleness < 0:
    raise ValueError(f'config key rollout.max_staleness must be >= 0 (0: on-policy), '
                     f'got {r.max_staleness}')
  if cfg.reward.workers < 0:
    raise ValueError(f'config key reward.workers must be >= 0 (0: score in-process), '
                     f'got {cfg.reward.workers}')
  if not 0 <= lg.sparse_mask < 1:
    raise ValueError(f'config key optim.logra.sparse_mask must be in [0, 1), got {lg.sparse_mask}')
  try:
    json.loads(cfg.data.options)
  except json.JSONDecodeError as e:
    raise ValueError(f'config key data.options is not valid JSON: {e}') from None
  if cfg.data.source == 'reasoning_gym' and not cfg.data.name:
    raise ValueError('config key data.name must name a reasoning-gym dataset')
  if cfg.data.source == 'file' and not cfg.data.path:
    raise ValueError('config key data.path must point at a JSONL/Parquet file')
  _check_dense_param_dtype(cfg)
  _check_mesh(cfg.mesh)
  if cfg.data.prompts_per_step * cfg.data.samples_per_prompt % cfg.optim.micro_batches:
    raise ValueError('config key optim.micro_batches must divide '
                     'data.prompts_per_step * data.samples_per_prompt')


def _check_adaptive(lg: LograSection):
  """An adaptive subspace builds A from the momentum at each refresh (docs/method.md §13)."""
  needs = {'optim.logra.momentum > 0 (A is built from the sketch-space moment)': lg.momentum > 0,
           'optim.logra.refresh=True (A changes at each refresh)': lg.refresh,
           'optim.logra.rank_delta=0 (constant ranks)': not lg.rank_delta,
           f'0 <= optim.logra.subspace_random_rows <= the rank ({lg.rank}) and no rank_rules':
               0 <= lg.subspace_random_rows <= lg.rank and not lg.rank_rules}
  missing = [k for k, ok in needs.items() if not ok]
  if missing:
    raise ValueError("config key optim.logra.subspace='adaptive' needs " + '; '.join(missing))


def _check_method_keys(o: OptimSection):
  """A key of a method other than ``optim.name`` (changed from its default) is an error."""
  for name, cls in METHOD_SECTIONS.items():
    if name == o.name:
      continue
    section, default = getattr(o, name), cls()
    changed = [f'optim.{name}.{f.name}={getattr(section, f.name)!r}'
               for f in dataclasses.fields(cls)
               if getattr(section, f.name) != getattr(default, f.name)]
    if changed:
      raise ValueError(
          f"config key {changed[0]} belongs to method {name!r}, but optim.name={o.name!r}"
          f"{' (also: ' + ', '.join(changed[1:]) + ')' if changed[1:] else ''}: remove it, "
          f"or set optim.name={name!r}. A config file sets only its method's keys; take its "
          f"variant for another method (e.g. configs/tiny.py:adam) rather than overriding "
          f"optim.name on the command line.")


def with_method(cfg: 'TrainConfig', name: str, **keys) -> 'TrainConfig':
  """``cfg`` trained by method ``name``: that method's section from its defaults plus ``keys``
  (the other methods' sections at their defaults; the shared optim.* kept)."""
  o = dataclasses.replace(
      cfg.optim, name=name, **{m: c() for m, c in METHOD_SECTIONS.items()})
  o = dataclasses.replace(o, **{name: dataclasses.replace(getattr(o, name), **keys)})
  return dataclasses.replace(cfg, optim=o)


def apply_overrides(cfg: config_dict.ConfigDict, overrides: dict) -> None:
  """In place: {'section.key': value} overrides; an ``optim.name`` among them switches the
  method first (`switch_method`), so the arm is that method's defaults plus its own keys."""
  overrides = dict(overrides)
  name = overrides.pop('optim.name', cfg.optim.name)
  if name != cfg.optim.name:
    switch_method(cfg, name)
  for key, value in overrides.items():
    *parents, leaf = key.split('.')
    node = cfg
    for p in parents:
      if not isinstance(node.get(p), (dict, config_dict.ConfigDict)):
        raise ValueError(f'override {key!r}: no config section {p!r}')
      node = node[p]
    if leaf not in node:
      raise ValueError(f'override {key!r}: unknown config key {leaf!r}')
    node[leaf] = value


def switch_method(cfg: config_dict.ConfigDict, name: str) -> None:
  """In place: ``cfg.optim.name = name`` with every method section back at its defaults
  (an arm that changes method starts from that method's defaults, then its own keys)."""
  cfg.optim.name = name
  for m, cls in METHOD_SECTIONS.items():
    for key, value in dataclasses.asdict(cls()).items():
      cfg.optim[m][key] = value


def _check_dense_param_dtype(cfg: TrainConfig):
  """AdamW / LoRA write p + Δp back by nearest rounding: bf16 would drop most of each step."""
  if cfg.optim.name in ('adam', 'lora') and cfg.model.param_dtype == 'bfloat16':
    raise ValueError(
        f'config key model.param_dtype=bfloat16 with optim.name={cfg.optim.name!r}: the '
        'dense AdamW / LoRA update is rounded to nearest bf16, which drops most of a small '
        "step (docs/memory.md); use model.param_dtype='float32' (fp32 master weights; "
        "model.dtype='bfloat16' keeps bf16 compute). Only LoGRA rounds bf16 stochastically.")


def _check_mesh(m: MeshSection):
  """Mesh sizes and rules, checked without touching devices (the count is checked at build)."""
  for key, value in (('mesh.data', m.data), ('mesh.fsdp', m.fsdp)):
    if value != -1 and value < 1:
      raise ValueError(f'config key {key} must be >= 1 or -1 (all remaining devices), '
                       f'got {value}')
  if m.data == -1 and m.fsdp == -1:
    raise ValueError('config keys mesh.data and mesh.fsdp cannot both be -1')
  parse_axis_rules(m.rules)


def default_config() -> config_dict.ConfigDict:
  """Every key with its default, typed and locked (a typo cannot add a key)."""
  cfg = config_dict.ConfigDict(dataclasses.asdict(TrainConfig()))
  cfg.lock()
  return cfg


def _convert(cls, values: Any, prefix: str):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  values = dict(values)
  for key in values:
    if f'{prefix}{key}' in RENAMED:
      raise ValueError(f"config key '{prefix}{key}' is now {RENAMED[prefix + key]}")
    if key not in fields:
      close = difflib.get_close_matches(key, fields, n=1)
      hint = f"; did you mean '{prefix}{close[0]}'?" if close else ''
      raise ValueError(f"unknown config key '{prefix}{key}'{hint}")
  kwargs = {}
  hints = typing.get_type_hints(cls)
  for name, value in values.items():
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      kwargs[name] = _convert(typ, value, f'{prefix}{name}.')
    elif typ is float and isinstance(value, int) and not isinstance(value, bool):
      kwargs[name] = float(value)
    elif not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
      raise ValueError(f"config key '{prefix}{name}' must be {typ.__name__}, got {value!r}")
    else:
      kwargs[name] = value
  return cls(**kwargs)


def from_config_dict(cfg) -> TrainConfig:
  """Validates a ConfigDict (or a plain dict) and returns the frozen TrainConfig."""
  values = cfg.to_dict() if isinstance(cfg, config_dict.ConfigDict) else cfg
  return _convert(TrainConfig, values, '')


def machine_free(resolved: dict) -> dict:
  """A config as JSON (a run's recorded one) with its model file named by its base name only:
  the same GGUF installed on two machines (or copied into docs/) is the same model."""
  model = resolved.get('model')
  if not isinstance(model, dict) or not model.get('path'):
    return resolved
  return dict(resolved, model=dict(model, path=os.path.basename(model['path'])))


def with_defaults(resolved: dict, defaults: dict | None = None) -> dict:
  """A config as JSON with the keys it lacks taken from ``defaults`` (default: the whole
  default config): a key added to the schema after a run, at its default, is what it ran."""
  if defaults is None:
    defaults = json.loads(json.dumps(dataclasses.asdict(TrainConfig())))
  out = dict(resolved)
  for key, value in defaults.items():
    if key not in out:
      out[key] = value
    elif isinstance(value, dict) and isinstance(out[key], dict):
      out[key] = with_defaults(out[key], value)
  return out


def recorded_config(resolved: dict) -> TrainConfig:
  """A run's recorded config (run_info.json's 'config'), validated, with the keys added to
  the schema since the run at their defaults."""
  return from_config_dict(with_defaults(resolved))


def check_override_flags(argv) -> None:
  """An absl ``--config.KEY=VALUE`` flag that names a renamed key: an error with the new name
  (before ml_collections' own 'key does not exist')."""
  for arg in argv:
    if arg.startswith('--config.'):
      key = arg[len('--config.'):].partition('=')[0]
      if key in RENAMED:
        raise SystemExit(f'error: config key {key!r} is now {RENAMED[key]} (flag {arg!r})')


def parse_rank_rules(text: str):
  """'attn=64,mlp=128' -> (('attn', 64), ('mlp', 128))."""
  rules = []
  for item in filter(None, (s.strip() for s in text.split(','))):
    pattern, _, rank = item.rpartition('=')
    if not pattern or not rank.isdigit():
      raise ValueError(f"config key optim.logra.rank_rules: expected 'regex=rank', got {item!r}")
    rules.append((pattern, int(rank)))
  return tuple(rules)
