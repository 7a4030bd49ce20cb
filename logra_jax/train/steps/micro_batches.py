"""Micro-batches: splitting a step's batch, placing its rows, summing over it in a scan.

Shape key: N sequences in the step's batch, M micro-batches.

Micro-batch losses are weighted so that their sum equals the loss of the whole batch; the
sketches (or gradients) are summed over micro-batches in a `lax.scan`, in fp32. Rows that
share a prompt can be packed so the prompt is computed once (`prompt_share`).
"""
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

# Metrics aggregated like the loss (token or sequence mean); every other metric of
# `losses.loss_fn` is a masked token mean.
LOSS_LIKE_METRICS = ('loss', 'loss/policy')


def split_micro_batches(batch, m: int, aggregation: str):
  """(M, N/M, …) micro-batches, their loss weights (token or sequence share) and token shares."""
  mbs = jax.tree.map(lambda x: x.reshape((m, -1) + x.shape[1:]), batch)
  tokens = jnp.sum(mbs['target_mask'], axis=(1, 2))
  shares = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
  weights = shares if aggregation == 'token' else jnp.full((m,), 1.0 / m)
  return mbs, weights, shares


def split_size(batch_sharding) -> int:
  """How many ways a batch sharding splits the leading axis (1: replicated or none)."""
  if batch_sharding is None or not batch_sharding.spec or batch_sharding.spec[0] is None:
    return 1
  axes = batch_sharding.spec[0]
  return int(np.prod([batch_sharding.mesh.shape[a]
                      for a in (axes if isinstance(axes, tuple) else (axes,))]))


def micro_batch_sharding(batch_sharding, n: int, m: int):
  """(M, N/M, …) micro-batches split over the batch's devices along N/M, or None.

  The batch arrives split along N; reshaped to (M, N/M) that split falls on M (whole
  micro-batches per device), and every device would compute each micro-batch in full.
  """
  size = split_size(batch_sharding)
  if size == 1 or (n // m) % size:
    return None
  return NamedSharding(batch_sharding.mesh, P(None, batch_sharding.spec[0]))


def rows_sharding(batch_sharding, n: int):
  """``batch_sharding`` for a batch of n rows if they split evenly over it, else None."""
  size = split_size(batch_sharding)
  return None if size == 1 or n % size else batch_sharding


def accumulate(grad_fn: Callable, zeros, batch, m: int, aggregation: str, mb_sharding=None):
  """Σ over micro-batches of grad_fn(mb, weight) -> ((loss, metrics), grads), in a scan.

  Micro-batch metrics are combined into whole-batch values: token means by token share,
  `LOSS_LIKE_METRICS` by the loss weights (so they do not depend on ``m``). ``mb_sharding``
  (`micro_batch_sharding`) places each micro-batch's rows over the devices.
  """
  mbs, weights, shares = split_micro_batches(batch, m, aggregation)
  if mb_sharding is not None:
    mbs = jax.lax.with_sharding_constraint(mbs, jax.tree.map(lambda _: mb_sharding, mbs))

  def body(acc, xs):
    mb, w, share = xs
    (loss, metrics), g = grad_fn(mb, w)
    acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
    metrics = {k: v * (w if k in LOSS_LIKE_METRICS else share) for k, v in metrics.items()}
    return acc, (loss, metrics)

  total, (losses, metrics) = jax.lax.scan(body, zeros, (mbs, weights, shares))
  metrics = jax.tree.map(jnp.sum, metrics)
  metrics['loss'] = jnp.sum(losses)
  return total, metrics


def all_finite(tree):
  """Whether every element of every leaf is finite (a step skips its update otherwise)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def constrain(tree, shardings):
  """``tree`` under a sharding constraint, or unchanged where ``shardings`` is None."""
  return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def micro_batch_sharding_of(sh, batch, m):
  """`micro_batch_sharding` of a step's batch under its `StepShardings` ``sh`` (or None)."""
  n = jax.tree.leaves(batch)[0].shape[0]
  return micro_batch_sharding(sh and sh.batch, n, m)


def prompt_share(rows, group: int, split: int = 1, divides: Optional[int] = None) -> int:
  """How many consecutive ``rows`` (batch row indices) one packed row can hold: the largest s
  whose runs rows[k·s : (k+1)·s] each lie in one prompt group (rows g·group … g·group +
  group − 1 share a prompt), s dividing ``divides`` (the rows of one call: a micro-batch; else
  all of them), and that call's packed rows a multiple of ``split`` (the devices its rows are
  split over stay busy). 1: no sharing.
  """
  n = len(rows)
  per_call = divides or n
  for s in range(min(group, n), 1, -1):
    if n % s or per_call % s or (per_call // s) % split:
      continue
    if all(len({r // group for r in rows[k:k + s]}) == 1 for k in range(0, n, s)):
      return s
  return 1


def mb_share(sc, batch, sh) -> int:
  """`prompt_share` of the micro-batches' rows: N/M each, split over the batch's devices
  where `micro_batch_sharding` splits them (its spec splits axis 1, the rows)."""
  n = jax.tree.leaves(batch)[0].shape[0]
  split = split_size(sh.batch) if micro_batch_sharding_of(sh, batch, sc.micro_batches) else 1
  return prompt_share(range(n), sc.prompt_group, split, divides=n // sc.micro_batches)
