"""The KL probe's forward shared with the loss's (`optim.logra.kl_probe='linearized'`).

With kl_probe='jvp' the probe runs a forward of its n rows of its own (the primal of its JVP),
though the loss's forward already ran those rows at the same θ. Here the n probe rows are a
micro-batch of their own, and one `jax.linearize` of (their loss, their completion logits) at
the zero probe point gives
  * their part of the sketch (and of the rest's gradient, and of the co-sketch) by
    `jax.linear_transpose` of the linear map: that micro-batch's backward;
  * the logits' tangent along the update, once the optimizer has made U: the same linear map
    applied to U, the tangent pass alone.
So the probe rows' forward runs once, not twice. The other N − n rows accumulate as before,
in micro-batches of their own (`other_micro_batches`), weighted as parts of the whole batch.
The step equals the 'jvp' step up to summation order (tests/test_linearized_probe.py, in
float64). The price: the probe rows' residuals live from the loss until q.

Shape key: N sequences in the step's batch, n probed rows, M micro-batches.
"""
import jax
import jax.numpy as jnp

from logra_jax.train.steps import micro_batches
from logra_jax.train.steps.kl_probe import kl_rows


def other_rows(total: int, n: int) -> list:
  """The rows of a batch of ``total`` that the probe (`kl_rows`) does not read, in order."""
  probed = set(kl_rows(total, n))
  return [i for i in range(total) if i not in probed]


def other_micro_batches(rows: int, m: int) -> int:
  """Micro-batches for the ``rows`` unprobed rows: the fewest, at least m, that split them
  evenly (none holds more rows than the step's own micro-batches); 0 for no rows."""
  return next((d for d in range(min(m, rows), rows + 1) if d and rows % d == 0), 0)


def other_batch(batch, n: int, m: int, sh=None, group: int = 1):
  """(the unprobed rows, their micro-batches, their `prompt_share`, their micro-batch
  sharding); (None, 0, 1, None) when the probe reads every row."""
  rows = other_rows(jax.tree.leaves(batch)[0].shape[0], n)
  if not rows:
    return None, 0, 1, None
  sub = jax.tree.map(lambda x: x[jnp.asarray(rows)], batch)
  m_o = other_micro_batches(len(rows), m)
  mb_sh = micro_batches.micro_batch_sharding(sh and sh.batch, len(rows), m_o)
  split = micro_batches.split_size(sh.batch) if mb_sh is not None else 1
  share = micro_batches.prompt_share(rows, group, split, divides=len(rows) // m_o)
  return sub, m_o, share, mb_sh


def probe_rows_weight(probe_batch, whole, aggregation: str):
  """(loss weight, token share) of the probe rows as a part of the whole batch (`whole_of`)."""
  total, rows = whole
  share = jnp.sum(probe_batch['target_mask']) / jnp.maximum(total, 1.0)
  n = jax.tree.leaves(probe_batch)[0].shape[0]
  return (share if aggregation == 'token' else jnp.asarray(n / rows, share.dtype)), share


def linearize_rows(fn, point):
  """One `jax.linearize` of ``fn(point)`` -> ((weighted loss, out), metrics).

  Returns ((loss, metrics), d loss / d point, out, tangent): ``tangent(d)`` is the JVP of
  ``out`` along ``d`` (a tree like ``point``), from the same linearization.
  """
  (value, out), lin, metrics = jax.linearize(fn, point, has_aux=True)
  grads, = jax.linear_transpose(lambda t: lin(t)[0], point)(jnp.ones_like(value))
  return (value, metrics), grads, out, lambda d: lin(d)[1]


def add_rows(grads, metrics, row_grads, row_loss, row_metrics, weight, share):
  """The batch's sums with the probe rows' part added: (grads, metrics); ``grads`` and
  ``metrics`` are the other rows' (`micro_batches.accumulate`'s, or None for none)."""
  grads = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grads, row_grads)
  weighted = micro_batches.weigh_metrics(row_metrics, weight, share)
  metrics = metrics or {}
  out = {k: metrics.get(k, 0.0) + v for k, v in weighted.items()}
  out['loss'] = metrics.get('loss', 0.0) + row_loss
  return grads, out
