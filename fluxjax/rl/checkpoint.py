"""One Orbax checkpoint per saved step: everything a run needs to resume exactly.

Items:
  state        model parameters, optimizer state and step (TrainState), saved
               from their shards and restored onto an abstract target that
               carries the *current* shardings (so a restore also reshards);
  rng          the run's PRNG key data;
  coordinator  JSON: long-prompt queue, prompts in flight to re-issue, async
               controller state, policy versions, counters;
  data         JSON: the data iterator's state (Grain), so a resumed run
               continues with the next unseen sample.
A killed run resumes from the latest complete checkpoint in its work
directory; Orbax writes into a temporary folder and renames it when complete,
so a half-written checkpoint is never picked up.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

ITEMS = ("state", "rng", "coordinator", "data")


class Checkpointer:
  """Saves and restores run state under `workdir/checkpoints`."""

  def __init__(
    self, workdir: str, *, max_to_keep: int = 3, save_every: int = 1, async_save: bool = True
  ):
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep, create=True, enable_async_checkpointing=async_save
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int) -> bool:
    return step % self.save_every == 0

  def save(
    self,
    step: int,
    state: Any,
    rng: jax.Array,
    coordinator: dict,
    data: dict,
    *,
    force: bool = False,
  ) -> bool:
    """Queues a save (written in the background); returns whether one was made."""
    if not force and not self.should_save(step):
      return False
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      rng=ocp.args.ArraySave(np.asarray(jax.random.key_data(rng))),
      coordinator=ocp.args.JsonSave(coordinator),
      data=ocp.args.JsonSave(data),
    )
    return self.manager.save(step, args=args, force=force)

  def restore(self, abstract_state: Any, step: int | None = None):
    """(step, state, rng, coordinator, data) of `step` (default: the latest).

    Args:
      abstract_state: a pytree of jax.ShapeDtypeStruct with the target
        shardings (e.g. `jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape,
        x.dtype, sharding=x.sharding), state)`).
      step: which checkpoint; None = the latest.
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    out = self.manager.restore(
      step,
      args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        rng=ocp.args.ArrayRestore(),
        coordinator=ocp.args.JsonRestore(),
        data=ocp.args.JsonRestore(),
      ),
    )
    rng = jax.random.wrap_key_data(jnp.asarray(out.rng))
    return step, out.state, rng, out.coordinator, out.data

  def wait(self) -> None:
    """Blocks until background saves are on disk (call before exiting)."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs with the same shardings: a restore target."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=x.sharding if isinstance(x, jax.Array) else None
    ),
    tree,
  )
