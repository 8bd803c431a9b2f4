"""The run's policy as its users see it: typed seams, no implementation.

The run's `PolicyWorker` (rl/worker.py; leading the others with several
processes) implements all of them; the coordinator drives a `Policy`, the
SFT warm-up's trainer reads and replaces a `PolicyState`, and the warm-up
runs its steps through `WarmUpOps` on every process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import jax
from flax import nnx

from fluxjax.models.config import ModelConfig
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import train_step
from fluxjax.parallel.strategies import Strategy


class PolicyView(Protocol):
  """The run's policy as its trainers read it: model, mesh, strategy, train state."""

  @property
  def cfg(self) -> ModelConfig: ...

  @property
  def mesh(self) -> jax.sharding.Mesh: ...

  @property
  def strategy(self) -> Strategy: ...

  @property
  def graphdef(self) -> nnx.GraphDef: ...

  @property
  def state(self) -> train_step.TrainState: ...


class PolicyState(PolicyView, Protocol):
  """What the warm-up's trainer reads from the run's policy, and how it hands weights back."""

  def load_params(self, params: nnx.State) -> None:
    """Makes `params` the policy's parameters (optimizer state and step kept)."""
    ...


class WarmUpOps(Protocol):
  """The warm-up's ops on the run's policy worker (every process runs them)."""

  def sft_begin(
    self, patch_source: Callable | None = None, step: int | None = None
  ) -> tuple[int, dict] | None:
    """Starts the warm-up (from its checkpoint `step`, default the latest);
    returns the (step, data state) it resumed from, or None."""
    ...

  def sft_train(self, seqs: Sequence[batch_lib.TrainSequence]) -> dict: ...

  def sft_save(self, step: int, data: dict) -> None: ...

  def sft_finish(self, copy: bool = False) -> None: ...

  def sft_end(self) -> None: ...

  def export(self, path: str, files: dict[str, bytes]) -> None:
    """The policy as an HF folder with `files` beside its weights."""
    ...


class Policy(PolicyView, WarmUpOps, Protocol):
  """The policy as the coordinator and the warm-up drive it (the run's PolicyWorker)."""

  @property
  def state_shardings(self) -> train_step.TrainState: ...

  def add(self, seqs: Sequence[batch_lib.TrainSequence]) -> None: ...

  def apply(self) -> dict: ...

  def stage(self, version: int | None = None) -> nnx.State | None: ...

  def announce_gathers(self, n: int) -> None:
    """Has the other processes run their next `n` gathers of a deferred
    publish that this process's main thread feeds (rollout/tensor_feed.py)."""
    ...
