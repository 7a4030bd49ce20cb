"""From the config to the run's pieces: the prompt task (tokenised, grain-batched) and the model."""
import dataclasses
import json
import os
from typing import Any

import jax
import numpy as np

from logra_jax import data, parallel
from logra_jax.models import stops
from logra_jax.models.presets import get_preset
from logra_jax.models.sampler import bucket_size
from logra_jax.models.transformer import Transformer
from logra_jax.train import warm_start as sft
from logra_jax.train.config import TrainConfig


@dataclasses.dataclass
class Task:
  """Tokenised prompt records, the training iterator and the held-out split."""
  tokenizer: Any
  train_records: list
  eval_records: list
  train_iter: Any           # grain DatasetIterator of lists of records (get_state/set_state)
  pad_id: int
  stop_ids: tuple
  prompt_len: int           # every prompt fits: one compiled step for the whole run

  def prompt_ids(self, record):
    return record['prompt_ids']

  def reference(self, record):
    return record['reference']

  def decode(self, ids):
    if isinstance(self.tokenizer, data.CharTokenizer):
      return self.tokenizer.decode(ids)
    return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class _JsonState:
  """A grain iterator whose state is a JSON string (what the checkpoint's meta stores)."""

  def __init__(self, it):
    self.it = it

  def __next__(self):
    return next(self.it)

  def get_state(self):
    return data.state_to_json(self.it)

  def set_state(self, state):
    data.restore_from_json(self.it, state)


def _splits(cfg: TrainConfig):
  d = cfg.data
  if d.source == 'tiny':
    train, held = data.get_source('tiny_addition', seed=cfg.seed)
  elif d.source == 'reasoning_gym':
    name, options = reasoning_gym_spec(d.name, json.loads(d.options))
    train, held = _reasoning_gym_splits(d, name, options, cfg.seed)
  else:
    _check_data_files(cfg)
    train, held = data.get_source('file', path=d.path, heldout_path=d.eval_path or None,
                                  seed=cfg.seed)
  return train, held[:d.eval_size]


def _reasoning_gym_splits(d, name: str, options: dict, seed: int):
  """reasoning-gym's (train, held-out) with at least ``d.eval_size`` held-out problems.

  Held-out items also in train are dropped (small question spaces, e.g. 2-term arithmetic,
  repeat often: SmolLM2's easy arithmetic lost 261 of 512), so the pool starts at twice
  eval_size and doubles until eval_size is met. Item i is drawn from Random(seed + size + i)
  whatever the pool's size, so a larger pool only appends: the set is the first eval_size
  survivors either way."""
  pool = 2 * d.eval_size
  while True:
    train, held = data.get_source('reasoning_gym', dataset=name, size=d.train_size, seed=seed,
                                  heldout_size=pool, **options)
    if len(held) >= d.eval_size or pool >= MAX_HELDOUT_POOL * d.eval_size:
      break
    pool *= 2
  if len(held) < d.eval_size:
    raise ValueError(f'config key data.eval_size={d.eval_size}: only {len(held)} of {pool} '
                     f'held-out problems of {name!r} are not also training questions; lower '
                     'data.eval_size or data.train_size, or widen data.options')
  return train, held


MAX_HELDOUT_POOL = 16  # the largest held-out pool tried, in multiples of data.eval_size


def _check_data_files(cfg: TrainConfig):
  """A missing prompt file is an error naming its config key (before any model loads)."""
  if cfg.data.source != 'file':
    return
  for key, path in (('data.path', cfg.data.path), ('data.eval_path', cfg.data.eval_path)):
    if path and not os.path.isfile(path):
      raise FileNotFoundError(f'config key {key}={path!r}: no such file (a JSONL/Parquet '
                              f'file with `problem` and `answer` fields; --config.{key}=...)')


def reasoning_gym_spec(name: str, options: dict) -> tuple[str, dict]:
  """(dataset, options) for `reasoning_gym.create_dataset` from data.name and data.options.

  One name: that dataset, `options` its keyword arguments. A comma-separated list
  ('countdown,arc_1d:2,...', an optional ':weight' each, default 1) is a reasoning-gym
  'composite' mixture; `options` then maps each listed name to its own options (a name left
  out uses the dataset's defaults). Every record keeps its source dataset, so the
  'reasoning_gym' verifier scores it with that dataset's own `score_answer`.
  """
  names = [n.strip() for n in name.split(',') if n.strip()]
  if len(names) == 1 and ':' not in names[0]:
    return names[0], options
  from reasoning_gym.composite import DatasetSpec  # pylint: disable=g-import-not-at-top
  specs = []
  for item in names:
    ds, _, weight = item.partition(':')
    try:
      w = float(weight) if weight else 1.0
    except ValueError:
      raise ValueError(f"config key data.name: bad weight in {item!r} (expected 'name:weight')"
                       ) from None
    specs.append((ds.strip(), w))
  listed = [ds for ds, _ in specs]
  if len(set(listed)) != len(listed):
    raise ValueError(f'config key data.name lists a dataset twice: {name!r}')
  unknown = sorted(set(options) - set(listed))
  if unknown:
    raise ValueError(f'config key data.options: for a mixture it maps dataset names to their '
                     f'options; {unknown} not in data.name ({listed})')
  for ds, opts in options.items():
    if not isinstance(opts, dict):
      raise ValueError(f'config key data.options[{ds!r}] must be a JSON object, got {opts!r}')
  return 'composite', {'datasets': [DatasetSpec(ds, w, dict(options.get(ds, {})))
                                    for ds, w in specs]}


def _tokenize(records, tokenizer, cfg: TrainConfig):
  if isinstance(tokenizer, data.CharTokenizer):
    return [dict(r, prompt_ids=tokenizer.encode(r['question'], add_bos=True)) for r in records]
  fmt = {'system_prompt': cfg.data.system_prompt or None}
  tok = tokenizer if cfg.data.chat_template else None
  return [dict(r, prompt_ids=tokenizer(data.format_prompt(r['question'], tok, **fmt),
                                       add_special_tokens=False)['input_ids'])
          for r in records]


def build_task(cfg: TrainConfig, tokenizer=None, stop_ids=(), checkpoint=None) -> Task:
  """Records (tokenised once), the seeded grain iterator and the held-out split.

  The tokenizer and stop ids of a model.path come from ``checkpoint`` (`load_checkpoint`'s);
  without it the checkpoint is loaded here and dropped on return.
  """
  _check_data_files(cfg)
  wanted = tokenizer is None or not (stop_ids or isinstance(tokenizer, data.CharTokenizer))
  if checkpoint is None and wanted:
    checkpoint = load_checkpoint(cfg)  # None without model.path
  if tokenizer is None:
    if cfg.data.source != 'tiny' and not cfg.model.path:
      raise ValueError('config key model.path must name a model (its tokenizer) for '
                       f'data.source={cfg.data.source!r}')
    tokenizer = data.CharTokenizer() if not cfg.model.path else checkpoint.tokenizer
    if tokenizer is None:
      raise ValueError(f'config key model.path={cfg.model.path!r} has no tokenizer files '
                       '(tokenizer.json / tokenizer_config.json): copy them from the release')
  train, held = _splits(cfg)
  train, held = _tokenize(train, tokenizer, cfg), _tokenize(held, tokenizer, cfg)
  it = iter(data.prompt_dataset(train, cfg.data.prompts_per_step, seed=cfg.seed))
  is_char = isinstance(tokenizer, data.CharTokenizer)
  pad = tokenizer.pad_id if is_char else (tokenizer.pad_token_id or 0)
  stop_set = tuple(stop_ids) or _stop_ids(tokenizer, checkpoint)
  longest = max(len(r['prompt_ids']) for r in train + held)
  return Task(tokenizer, train, held, _JsonState(it), pad, stop_set, bucket_size(longest, 8))


def _stop_ids(tokenizer, checkpoint) -> tuple:
  """The model's full stop set: the tokenizer's EOS, the EOS ids of the checkpoint at
  model.path (config.json / generation_config.json / GGUF) and the chat template's
  end-of-turn token (e.g. `<|im_end|>` where eos is `<|endoftext|>`)."""
  if isinstance(tokenizer, data.CharTokenizer):
    return (tokenizer.eos_id,)
  model_eos = checkpoint.config.eos_token_ids if checkpoint is not None else ()
  return stops.stop_token_ids(tokenizer, model_eos)


def load_checkpoint(cfg: TrainConfig):
  """The checkpoint at model.path as host numpy in model.param_dtype (a `models.Model`), or
  None without a model.path. Pass it to `build_task` and `build_model`, then drop it: the
  host copy is 0.5 GiB for SmolLM2 in fp32, 6 GiB for a 1.5B model."""
  from logra_jax.models import load  # pylint: disable=g-import-not-at-top
  path = cfg.model.path
  if not path:
    return None
  if not os.path.exists(path):
    raise FileNotFoundError(
        f'config key model.path={path!r} does not exist on this machine: point it at an HF '
        'checkpoint directory (config.json + safetensors + tokenizer) or a .gguf file, '
        'e.g. --config.model.path=/path/to/Qwen2.5-Math-7B')
  return load(path, dtype=cfg.model.param_dtype, on_host=True)


# The model.* keys that set how the model computes, not its weights: `build_model` applies them
# as a ModelConfig replace on a loaded checkpoint's config too.
MODEL_MEMORY_KEYS = ('remat_policy', 'attention', 'attention_block', 'vocab_chunk')


def build_model(cfg: TrainConfig, task: Task, layout: parallel.Layout = None,
                checkpoint=None):
  """(Transformer, ModelConfig, params): a checkpoint at model.path or a fresh preset.

  The params are created (or placed from the host numpy of ``checkpoint``, `load_checkpoint`'s;
  loaded here when None) straight into their shardings on ``layout`` (default: the mesh of
  ``cfg.mesh``).
  """
  m = cfg.model
  layout = layout or parallel.layout_from_config(cfg.mesh)
  memory = {k: getattr(m, k) for k in MODEL_MEMORY_KEYS}
  if m.path:
    loaded = checkpoint if checkpoint is not None else load_checkpoint(cfg)
    mc = loaded.config.replace(dtype=m.dtype, param_dtype=m.param_dtype, **memory)
    params = parallel.put(loaded.params, parallel.param_shardings(layout, mc))
  else:
    mc = get_preset(m.preset, vocab_size=_vocab(task.tokenizer), dtype=m.dtype,
                    param_dtype=m.param_dtype, **memory,
                    pad_token_id=task.pad_id,
                    eos_token_ids=task.stop_ids)
    params = parallel.init_params(mc, jax.random.key(cfg.seed),
                                  parallel.param_shardings(layout, mc))
  return Transformer(mc), mc, params


def _vocab(tokenizer):
  return tokenizer.vocab_size if isinstance(tokenizer, data.CharTokenizer) else len(tokenizer)


def warm_start_line(steps: int, loss: float, source: str = '') -> str:
  """The warm start's log line (``source``: where a cached one came from)."""
  return (f'supervised warm start: {steps} steps of cross-entropy on the training answers '
          f'(final loss {loss:.3f}{source}); RL starts from this model')


def warm_start(cfg: TrainConfig, task: Task, model, params, log=print):
  """The supervised warm start on the training split (the tiny default uses it)."""
  w = cfg.warm_start
  batch = data.warm_start_batch(task.train_records, task.tokenizer)
  params, loss = sft.warm_start(model, params, batch, w.steps, w.learning_rate, w.batch_size,
                                cfg.seed)
  log(warm_start_line(w.steps, loss))
  return params
