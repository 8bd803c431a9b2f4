"""The stream trainer: gradients of finished groups accumulate while rollout runs.

A GRPO group is complete (its advantages known) as soon as its R responses are scored,
long before the slowest group of the batch. `StreamTrainer.add` takes finished groups in
parts and sums their gradients on device; `apply` then makes the same update as the
synchronous step on the whole batch (tests/test_stream_trainer.py holds them to 1e-6), so
streaming changes when the work happens, not what is learned.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import optax

from fluxjax.models.config import ModelConfig
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import train_step
from fluxjax.parallel.layout_steps import LayoutSteps
from fluxjax.parallel.strategies import Strategy
from fluxjax.planning.plan import Plan


class StreamTrainer:
  """Owns the train state; `add` parts of a batch, then `apply` once.

  Each part is planned by the strategy (lengths only), materialized and pushed through
  the jitted `add`, which sums its unnormalized loss, gradients and metric sums into an
  accumulator on device. When the batch is complete, `apply` divides by the batch's token
  weight and applies one optimizer update. With a reference model (`ref_params` or
  `set_reference`, for the KL term), each part's reference logprobs are computed in the
  same program as its gradients, by the reference's forward over the part's own layout:
  they never leave the devices. Planning, materializing, placing and the compiled `add`
  of each plan layout are `LayoutSteps`' (parallel/layout_steps.py), shared with the SFT
  warm-up.

  Args:
    model_cfg: the model configuration (materialize needs its vision shapes).
    mesh: the training mesh.
    strategy: the sharding strategy (plans each part, supplies accumulation).
    graphdef: the model's graph definition.
    state: the sharded TrainState (donated to each update).
    state_shardings: its shardings.
    tx: the optimizer.
    loss_fn: the token loss (rl/losses.make_loss_fn).
    patch_source: item -> patches (the loader's Materializer), or None for
      text-only sequences.
    patch_buckets: static patch-buffer sizes; None: the open ladder
      (layout_steps.LayoutSteps).
    ref_params: the reference model's parameters (sharded like the policy's),
      or None when the loss has no KL term; settable later (`set_reference`).
    temperature: the sampling temperature; policy and reference logprobs are
      of softmax(logits / temperature), as the engine's behaviour logprobs.
    updates_per_batch: optimizer updates per batch (PPO epochs). The first
      is streamed as parts arrive; each later one passes over the stored
      parts again with the updated parameters, clipped around the policy
      before the first (the parts' `prox_logprobs`), so the clip acts.
    loss_normalizer: what the summed token losses are divided by (a
      constant, rl/advantages.loss_normalizer), or None for the batch's
      summed loss weights.
    sequence_slots: the most sequences a batch holds; > 0 adds per-sequence
      sums of every loss metric to `apply`'s metrics
      (train_step.PER_SEQUENCE), in the order the sequences were added.
  """

  def __init__(
    self,
    model_cfg: ModelConfig,
    mesh,
    strategy: Strategy,
    graphdef,
    state,
    state_shardings,
    tx: optax.GradientTransformation,
    loss_fn,
    *,
    patch_source=None,
    patch_buckets: Sequence[int] | None = None,
    ref_params=None,
    temperature: float = 1.0,
    updates_per_batch: int = 1,
    loss_normalizer: float | None = None,
    sequence_slots: int = 0,
    check_state: bool = True,
  ):
    if updates_per_batch < 1:
      raise ValueError(f"updates_per_batch must be >= 1, got {updates_per_batch}")
    self.mesh = mesh
    self.temperature = float(temperature)
    self.updates_per_batch = int(updates_per_batch)
    # (add, part) of the batch so far, for the updates after the first.
    self._stored: list[tuple] = []
    self.strategy = strategy
    self.graphdef = graphdef
    self.state_shardings = state_shardings
    self.loss_fn = loss_fn
    self._state = state
    self._ref_params = ref_params
    self._apply = train_step.make_stream_apply(tx, state_shardings, loss_normalizer, check_state)
    # A compiled `add` per plan layout (flex levels change shapes).
    self._layouts = LayoutSteps(
      model_cfg,
      mesh,
      strategy,
      self._compile_add,
      patch_buckets=patch_buckets,
      patch_source=patch_source,
      sequence_slots=sequence_slots,
    )
    self._sums_shape = None
    self._acc = None
    self.parts = 0
    self.sequences = 0

  @property
  def state(self) -> train_step.TrainState:
    """The train state (donated to each update: read it again after `apply`)."""
    return self._state

  @property
  def ref_params(self):
    """The reference model's parameters, or None."""
    return self._ref_params

  def load_state(self, state: train_step.TrainState) -> None:
    """Replaces the train state (a restore, new parameters); nothing may be pending."""
    if self._acc is not None:
      raise RuntimeError("load_state() with a partial batch added")
    self._state = state

  def set_reference(self, params) -> None:
    """The reference parameters of the KL term, sharded like the policy's."""
    self._ref_params = params

  def _compile_add(self, plan: Plan, batch: batch_lib.TrainBatch):
    assert isinstance(batch.ref_logprobs, jax.Array), "a placed batch"
    accumulate = self.strategy.accumulate_fn(
      self.mesh,
      plan,
      self.graphdef,
      self.state_shardings.params,
      self.loss_fn,
      temperature=self.temperature,
    )
    return accumulate, train_step.make_stream_add(
      accumulate,
      self.state_shardings.params,
      self.strategy.logprobs_fn(self.mesh, plan, self.graphdef, temperature=self.temperature),
      batch.ref_logprobs.sharding,  # reference and prox logprobs land in the batch's layout
    )

  def _zeros(self, accumulate, batch):
    if self._sums_shape is None:  # traced once: the loss's metric names
      self._sums_shape = jax.eval_shape(
        lambda p, b: accumulate(p, b, 1.0)[2], self._state.params, batch
      )
    zeros = jax.tree.map(
      lambda p: jax.numpy.zeros(p.shape, p.dtype, device=p.sharding), self._state.params
    )
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    sums = jax.tree.map(
      lambda v: jax.numpy.zeros(v.shape, v.dtype, device=replicated), self._sums_shape
    )
    return (jax.numpy.zeros((), jax.numpy.float32, device=replicated), zeros, sums)

  def add(self, seqs: Sequence[batch_lib.TrainSequence]) -> None:
    """Adds the gradients of `seqs` (dispatched; returns before they finish)."""
    if not seqs:
      return
    placed = self._layouts.place(seqs, first_sequence=self.sequences)
    accumulate, add = placed.step
    with jax.set_mesh(self.mesh):
      if self._acc is None:
        self._acc = self._zeros(accumulate, placed.batch)
      prox = self._state.params if self.updates_per_batch > 1 else None
      self._acc, part = add(self._state.params, self._acc, placed.batch, self._ref_params, prox)
    if self.updates_per_batch > 1:
      self._stored.append((accumulate, add, part))
    self.parts += 1
    self.sequences += len(seqs)

  @property
  def pending(self) -> bool:
    return self._acc is not None

  def apply(self) -> dict:
    """`updates_per_batch` optimizer updates from everything added.

    Returns device metrics: each the mean over the updates (the first is
    on-policy: ratio 1, nothing clipped), plus `updates`.
    """
    if self._acc is None:
      raise RuntimeError("apply() with nothing added")
    with jax.set_mesh(self.mesh):
      self._state, metrics = self._apply(self._state, self._acc)
      per_update = [metrics]
      for _ in range(self.updates_per_batch - 1):
        acc = None
        for accumulate, add, part in self._stored:
          if acc is None:
            acc = self._zeros(accumulate, part)
          # The stored part already holds its reference and prox logprobs.
          acc, _ = add(self._state.params, acc, part)
        self._state, metrics = self._apply(self._state, acc)
        per_update.append(metrics)
    self._acc = None
    self._stored = []
    metrics = jax.tree.map(lambda *xs: sum(xs) / len(xs), *per_update)
    metrics = dict(metrics, parts=self.parts, sequences=self.sequences, updates=len(per_update))
    self.parts = self.sequences = 0
    return metrics

  def discard(self) -> None:
    """Drops a partial batch (a failed step is replayed from its prompts)."""
    self._acc = None
    self._stored = []
    self.parts = self.sequences = 0
