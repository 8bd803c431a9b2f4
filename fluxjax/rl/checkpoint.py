"""One Orbax checkpoint per saved step: everything a run needs to resume exactly.

`Checkpointer` saves the items `ITEMS` under `workdir/checkpoints`. Saves are asynchronous
and atomic: `latest_step` is the newest step committed on disk, and a failed background
write raises `CheckpointWriteError`. How that holds is told in docs/reliability.md,
"Resume".
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

# The items of a checkpoint and how each is written: the PRNG key data as a
# one-leaf pytree (Orbax's array handler warns at every save of a one-process run).
_HANDLERS = {
  "state": ocp.StandardCheckpointHandler,
  "rng": ocp.StandardCheckpointHandler,
  "coordinator": ocp.JsonCheckpointHandler,
  "data": ocp.JsonCheckpointHandler,
}
ITEMS = tuple(_HANDLERS)
_ARRAY_HANDLER = "ArrayCheckpointHandler"


class CheckpointWriteError(RuntimeError):
  """A checkpoint was not saved (its write failed); earlier ones are intact."""


class Checkpointer:
  """Saves and restores run state under `workdir/checkpoints`.

  The items: the TrainState (parameters, optimizer state and step), saved from its shards
  and restored onto an abstract target with the current shardings (`abstract_like`), so a
  restore also reshards; the PRNG key data; the coordinator's state as JSON (long-prompt
  queue, prompts in flight to re-issue, async controller state, policy versions,
  counters); the Grain iterator's state as JSON, so a resumed run continues with the next
  unseen sample.
  """

  def __init__(
    self, workdir: str, *, max_to_keep: int = 3, save_every: int = 1, async_save: bool = True
  ):
    if save_every < 0:
      raise ValueError(
        f"checkpoint.every must be >= 0 (0: at the last step only), got {save_every}"
      )
    self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      create=True,
      enable_async_checkpointing=async_save,
      # Temporary folders of saves that were killed or failed; cleared before the first save.
      cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(
      self.directory,
      options=options,
      item_handlers={name: handler() for name, handler in _HANDLERS.items()},
    )
    self._writing: int | None = None  # the step whose write may still be in the background

  def latest_step(self) -> int | None:
    """The newest step committed on disk; one still being written, or whose
    write failed, is not (Orbax's own list counts a save from its start)."""
    latest = ocp.path.step.latest_step_metadata(
      self.directory, ocp.path.step.standard_name_format()
    )
    return None if latest is None else latest.step

  def steps(self) -> list[int]:
    """The steps committed on disk, oldest first."""
    return sorted(ocp.utils.checkpoint_steps(self.directory))

  def should_save(self, step: int) -> bool:
    """Whether `step` is a periodic save (every `save_every` steps; 0: none,
    the caller's own saves, such as the last step's, only)."""
    return self.save_every > 0 and step % self.save_every == 0

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
    """Queues a save (written in the background); returns whether one was made.

    Raises:
      CheckpointWriteError: the previous save's write failed (then this one
        is not made), or this one could not start.
    """
    if not force and not self.should_save(step):
      return False
    self.wait()
    args = ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      rng=ocp.args.StandardSave({"key_data": np.asarray(jax.random.key_data(rng))}),
      coordinator=ocp.args.JsonSave(coordinator),
      data=ocp.args.JsonSave(data),
    )
    try:
      saved = self.manager.save(step, args=args, force=force)
    except Exception as e:
      raise self._not_saved(step, e) from e
    if saved:
      self._writing = step
    return saved

  def restore(self, abstract_state: Any, step: int | None = None):
    """(step, state, rng, coordinator, data) of `step` (default: the latest).

    Args:
      abstract_state: a pytree of jax.ShapeDtypeStruct with the target
        shardings (e.g. `jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape,
        x.dtype, sharding=x.sharding), state)`).
      step: which checkpoint; None = the latest.
    """
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"no checkpoint in {self.directory}")
    elif step not in (kept := self.steps()):
      raise FileNotFoundError(
        f"no checkpoint of step {step} in {self.directory}; it keeps steps "
        f"{', '.join(map(str, kept)) or 'none'}"
      )
    array_key = self.manager.metadata(step).item_handlers["rng"].endswith(_ARRAY_HANDLER)
    items = {
      "state": ocp.args.StandardRestore(abstract_state),
      "coordinator": ocp.args.JsonRestore(),
      "data": ocp.args.JsonRestore(),
    }
    if not array_key:
      items["rng"] = ocp.args.StandardRestore()
    out = self.manager.restore(step, args=ocp.args.Composite(**items))
    key_data = self._array_key_data(step) if array_key else out.rng["key_data"]
    rng = jax.random.wrap_key_data(jnp.asarray(key_data))
    return step, out.state, rng, out.coordinator, out.data

  def _array_key_data(self, step: int) -> np.ndarray:
    """Step `step`'s PRNG key data written as an Orbax array item (`ocp.args.ArraySave`)."""
    with ocp.Checkpointer(ocp.ArrayCheckpointHandler()) as checkpointer:
      path = os.path.join(self.directory, str(step), "rng")
      return np.asarray(checkpointer.restore(path, args=ocp.args.ArrayRestore()))

  def wait(self) -> None:
    """Blocks until background saves are on disk (call before exiting).

    Raises:
      CheckpointWriteError: the background write failed.
    """
    step, self._writing = self._writing, None
    try:
      self.manager.wait_until_finished()
    except Exception as e:
      raise self._not_saved(step, e) from e

  def close(self) -> None:
    """Waits for the background save (raising if it failed), then closes."""
    try:
      self.wait()
    finally:
      self.manager.close()

  def _not_saved(self, step: int | None, cause: Exception) -> CheckpointWriteError:
    which = "a checkpoint" if step is None else f"checkpoint step {step}"
    return CheckpointWriteError(
      f"{which} was not saved ({type(cause).__name__}: {cause}); "
      f"the latest complete checkpoint in {self.directory} is step {self.latest_step()}"
    )


def abstract_like(tree: Any) -> Any:
  """ShapeDtypeStructs with the same shardings: a restore target."""
  return jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=x.sharding if isinstance(x, jax.Array) else None
    ),
    tree,
  )
