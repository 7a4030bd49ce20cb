"""Orbax checkpoints of the whole run state; a rerun with the same workdir resumes.

Saved every `checkpoint_every` steps and at the end: `state` (params, optimizer state and,
for LoRA, the adapters: a pytree of arrays) and `meta` (JSON: step, data-iterator state,
advantage-baseline state, mismatch EMA, RNG seed). The newest `keep_checkpoints` are kept (0:
all of them, e.g. to probe a run at every checkpoint). Orbax writes each step into a temporary
directory and commits it with a rename, so a crash while writing leaves the previous
checkpoint as the latest valid one.
"""
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


def abstract_like(tree: Any) -> Any:
  """``tree``'s structure, shapes, dtypes and shardings, without its arrays (a restore's target;
  an abstract tree is returned as it is)."""
  return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)


class Checkpointer:
  """Thin wrapper over `ocp.CheckpointManager` with a fixed item layout.

  ``max_to_keep``: how many of the newest checkpoints a save keeps (None: all); opening a
  run's checkpoints to read them deletes none.
  """

  def __init__(self, workdir: str, max_to_keep: Optional[int] = 2):
    self.directory = os.path.abspath(os.path.join(workdir, 'checkpoints'))
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             enable_async_checkpointing=False))

  def latest_step(self) -> Optional[int]:
    self.manager.reload()
    return self.manager.latest_step()

  def steps(self) -> list:
    """Every saved step, in order."""
    self.manager.reload()
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: Any, meta: dict):
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore(self, step: int, like: Any):
    """(state, meta) at ``step``; ``like`` gives the state's structure, shapes and dtypes."""
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_like(like)), meta=ocp.args.JsonRestore()))
    return out['state'], out['meta']

  def close(self):
    self.manager.close()
