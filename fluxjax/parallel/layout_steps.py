"""Sequences to a placed batch, with one compiled step per plan layout.

Both trainers of a run (the GRPO stream trainer and the SFT warm-up) take a
list of `TrainSequence`s through the same path: the strategy plans them from
their lengths, `materialize` packs the host buffers (pixels from the patch
source), and `to_device` places them on the mesh. A plan's static layout (its
buffer sections and microbatch count) fixes every array shape, so each
layout needs its own compiled step; `LayoutSteps` builds it the first time a
layout appears and reuses it after. Flex levels and bucketed capacities keep
the number of distinct layouts small.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

import jax

from fluxjax.models.config import ModelConfig
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel.strategies import Strategy
from fluxjax.planning.plan import Plan
from fluxjax.sharding import mesh as mesh_lib

StepT = TypeVar("StepT")


def layout_key(plan: Plan) -> Hashable:
  """What a compiled step depends on: the buffer sections and the microbatch count."""
  return (plan.level_layout(), plan.num_microbatches)


@dataclasses.dataclass(frozen=True)
class Placed(Generic[StepT]):
  """A batch on the mesh and the step compiled for its layout.

  Attributes:
    plan: the strategy's plan of the sequences.
    host: the materialized host buffers.
    batch: `host` placed on the mesh.
    step: the compiled step of `plan`'s layout.
  """

  plan: Plan
  host: batch_lib.TrainBatch
  batch: batch_lib.TrainBatch
  step: StepT


class LayoutSteps(Generic[StepT]):
  """Plans, materializes and places batches; keeps one step per plan layout.

  Args:
    model_cfg: the model configuration (materialize reads its vision shapes).
    mesh: the training mesh.
    strategy: plans each batch and decides vision balancing.
    compile: (plan, placed batch) -> the step for the plan's layout; called
      once per layout (the batch gives shardings, e.g. where reference
      logprobs land).
    patch_buckets: static patch-buffer sizes; None: the open ladder of
      powers of two (batch.SMALLEST_PATCH_BUCKET).
    patch_source: item -> patches, or None when the sequences carry theirs.
    sequence_slots: the most sequences one step holds; > 0 gives batches
      `sequence_ids` for per-sequence metrics (batch.materialize).
  """

  def __init__(
    self,
    model_cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    strategy: Strategy,
    compile: Callable[[Plan, batch_lib.TrainBatch], StepT],
    *,
    patch_buckets: Sequence[int] | None = None,
    patch_source=None,
    sequence_slots: int = 0,
  ):
    self.cfg = model_cfg
    self.sequence_slots = int(sequence_slots)
    self.mesh = mesh
    self.strategy = strategy
    self.patch_buckets = None if patch_buckets is None else tuple(patch_buckets)
    self.patch_source = patch_source
    # A process of a multi-controller run fills only its own devices' vision
    # rows (to_device places only those).
    self._devices = mesh_lib.local_device_indices(mesh) if jax.process_count() > 1 else None
    self._compile = compile
    self._steps: dict[Hashable, StepT] = {}

  @property
  def num_layouts(self) -> int:
    """Layouts compiled so far."""
    return len(self._steps)

  def prepare(
    self, seqs: Sequence[batch_lib.TrainSequence], first_sequence: int = 0
  ) -> tuple[Plan, batch_lib.TrainBatch]:
    """(plan, host buffers) of `seqs`: planned from lengths, then materialized;
    `first_sequence` is the index of `seqs[0]` among its step's sequences."""
    plan = self.strategy.plan([len(s) for s in seqs], self.mesh.size)
    host = batch_lib.materialize(
      plan,
      seqs,
      self.cfg,
      self.patch_buckets,
      patch_source=self.patch_source,
      balance_vision=self.strategy.balance_vision,
      devices=self._devices,
      first_sequence=first_sequence,
      sequence_slots=self.sequence_slots,
    )
    return plan, host

  def step_for(self, plan: Plan, batch: batch_lib.TrainBatch) -> StepT:
    """The step of `plan`'s layout, compiled on first use."""
    key = layout_key(plan)
    if key not in self._steps:
      self._steps[key] = self._compile(plan, batch)
    return self._steps[key]

  def place(
    self, seqs: Sequence[batch_lib.TrainSequence], first_sequence: int = 0
  ) -> Placed[StepT]:
    """`seqs` planned, materialized and placed, with the step of their layout."""
    plan, host = self.prepare(seqs, first_sequence)
    with jax.set_mesh(self.mesh):
      batch = batch_lib.to_device(host, self.mesh)
      step = self.step_for(plan, batch)
    return Placed(plan, host, batch, step)
