"""grain pipelines over prompt records: seeded shuffling, epochs, batches, resumable iterators.

A batch is a list of prompt records (dicts, see sources.py). The iterator's state
(`it.get_state()`) is a small JSON-serialisable dict; `it.set_state(state)` on a fresh
iterator of the same pipeline resumes exactly where the saved one was.
"""
import json
from typing import Any, Callable, Optional, Sequence

import grain

_READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # Records are cheap.


def prompt_dataset(records: Sequence[dict], batch_size: int, seed: int,
                   num_epochs: Optional[int] = None, shuffle: bool = True,
                   drop_remainder: bool = True,
                   map_fn: Optional[Callable[[dict], Any]] = None) -> grain.IterDataset:
  """Training batches: shuffle -> batch into lists -> repeat (reshuffled each epoch).

  Batches never straddle two epochs; with drop_remainder the last `len % batch_size`
  records of each epoch's order are skipped in that epoch (a different few each epoch).

  Args:
    records: the prompt records.
    batch_size: records per batch.
    seed: the shuffle seed.
    num_epochs: passes over the records; None repeats forever.
    shuffle: whether to shuffle.
    drop_remainder: drop each epoch's final short batch.
    map_fn: applied to each record first (e.g. tokenisation).

  Returns:
    a `grain.IterDataset`; `iter()` it for a resumable `grain.DatasetIterator`.

  Example:
    >>> it = iter(prompt_dataset(train, batch_size=32, seed=0))
    >>> batch = next(it); state = it.get_state()
  """
  if batch_size < 1:
    raise ValueError(f'batch_size must be >= 1, got {batch_size}.')
  if not records:
    raise ValueError('no records to build a pipeline from.')
  ds = grain.MapDataset.source(list(records))
  if map_fn is not None:
    ds = ds.map(map_fn)
  if shuffle:
    ds = ds.shuffle(seed=seed)
  ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
  ds = ds.repeat(num_epochs, reseed_each_epoch=True)
  return ds.to_iter_dataset(_READ)


def eval_dataset(records: Sequence[dict], batch_size: int,
                 map_fn: Optional[Callable[[dict], Any]] = None) -> grain.IterDataset:
  """Held-out batches: one pass, in order, the last batch may be short."""
  return prompt_dataset(records, batch_size, seed=0, num_epochs=1, shuffle=False,
                        drop_remainder=False, map_fn=map_fn)


def state_to_json(iterator: grain.DatasetIterator) -> str:
  """The iterator's state as a JSON string (for a checkpoint)."""
  return json.dumps(iterator.get_state())


def restore_from_json(iterator: grain.DatasetIterator, state_json: str):
  """Sets a fresh iterator of the same pipeline to a state from `state_to_json`."""
  iterator.set_state(json.loads(state_json))
  return iterator
