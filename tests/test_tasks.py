"""`tasks`: the checkpoint at model.path is passed explicitly, never kept in a module global.

`build_task` reads the tokenizer and stop ids of a model.path checkpoint (loaded there unless
given) and `build_model` its params; once the caller drops the checkpoint, nothing holds its
host copy (0.5 GiB for SmolLM2 in fp32, 6 GiB for a 1.5B model).
"""
import dataclasses
import gc
import json
import weakref

import jax
import numpy as np
import pytest
import tokenizers
import transformers

from logra_jax import models
from logra_jax.models import hf_io
from logra_jax.train import tasks
from logra_jax.train.config import TrainConfig


def chat_tokenizer():
  """A word-level tokenizer: eos <|endoftext|> (2), turns end with <|im_end|> (4)."""
  words = ['<unk>', '<s>', '<|endoftext|>', '<|im_start|>', '<|im_end|>', 'user', 'assistant']
  word = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token='<unk>'))
  word.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  word.add_special_tokens(['<|endoftext|>', '<|im_start|>', '<|im_end|>'])
  tok = transformers.PreTrainedTokenizerFast(tokenizer_object=word, eos_token='<|endoftext|>',
                                             unk_token='<unk>', pad_token='<unk>')
  tok.chat_template = ('{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}'
                       '<|im_end|>\n{% endfor %}'
                       '{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')
  return tok


@pytest.fixture
def cfg(tmp_path):
  """A file task on a random 2-layer checkpoint (with the tokenizer above) at model.path."""
  config = models.ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                              num_kv_heads=2, intermediate_size=48, max_position_embeddings=64,
                              bos_token_id=1, eos_token_ids=(2,), pad_token_id=0)
  directory = str(tmp_path / 'hf')
  hf_io.save_hf_checkpoint(directory, models.init_params(config, jax.random.key(3)), config,
                           tokenizer=chat_tokenizer())
  problems = tmp_path / 'problems.jsonl'
  problems.write_text(''.join(json.dumps({'problem': f'what is {i}', 'answer': str(i)}) + '\n'
                              for i in range(8)))
  c = TrainConfig()
  return dataclasses.replace(
      c, data=dataclasses.replace(c.data, source='file', path=str(problems), prompts_per_step=2),
      model=dataclasses.replace(c.model, path=directory))


def _watched_loads(monkeypatch):
  """Patches `tasks.load_checkpoint` to record weak references to each checkpoint it loads
  (the Model and one of its host arrays)."""
  refs, load = [], tasks.load_checkpoint

  def watched(c):
    checkpoint = load(c)
    refs.append((weakref.ref(checkpoint), weakref.ref(jax.tree.leaves(checkpoint.params)[0])))
    return checkpoint
  monkeypatch.setattr(tasks, 'load_checkpoint', watched)
  return refs


def _assert_freed_or_adopted(refs, params):
  """The loaded Model is gone, and so is its host array, unless XLA:CPU adopted that array
  zero-copy as the device buffer of a param (it does for a suitably aligned numpy buffer, by
  chance of the allocator): then it is the param itself, not a second copy."""
  model_ref, array_ref = refs
  assert model_ref() is None
  kept = array_ref()
  if kept is not None:
    assert kept.ctypes.data in {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}


def test_build_task_alone_leaves_no_checkpoint_behind(cfg, monkeypatch):
  refs = _watched_loads(monkeypatch)
  task = tasks.build_task(cfg)
  assert task.stop_ids == (2, 4)  # from the checkpoint: its eos and the template's <|im_end|>
  assert len(refs) == 1
  gc.collect()
  assert [ref() is None for ref in refs[0]] == [True, True]  # the Model, a host array


def test_a_given_checkpoint_is_used_and_not_kept(cfg, monkeypatch):
  """The trainer's way: one load, passed to both builders, freed once the caller drops it."""
  refs = _watched_loads(monkeypatch)
  checkpoint = tasks.load_checkpoint(cfg)
  host = jax.tree.leaves(checkpoint.params)
  task = tasks.build_task(cfg, checkpoint=checkpoint)
  _, mc, params = tasks.build_model(cfg, task, checkpoint=checkpoint)
  assert len(refs) == 1  # neither builder loaded it again
  assert mc.num_layers == 2 and task.stop_ids == (2, 4)
  for a, b in zip(host, jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, np.asarray(b))
  del checkpoint, host
  gc.collect()
  _assert_freed_or_adopted(refs[0], params)
  # Without a checkpoint, build_model loads its own, and it too is gone afterwards.
  _, _, again = tasks.build_model(cfg, task)
  assert len(refs) == 2
  gc.collect()
  _assert_freed_or_adopted(refs[1], again)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
