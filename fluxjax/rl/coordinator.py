"""The coordinator: GRPO steps from prompts to applied updates, rollout running ahead.

`Coordinator` runs on the leader only and decides which groups a step trains, when it
updates and what it checkpoints. It composes one-concern parts: the producer
(rl/producer.py), the publisher (rl/publisher.py), the evaluator (rl/evaluation.py), the
run's `Requests` (rl/requests.py) and what a step reports (rl/step_metrics.py); after each
step the batch's staleness sets the allowed lag (rl/async_control.py). The run loop
(rl/loop.py) builds and closes its collaborators. docs/design.md, section 3, tells one
step whole.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Sequence

import jax

from fluxjax import faults as faults_lib
from fluxjax import settings as settings_lib
from fluxjax.data import meta as meta_lib
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import train_step
from fluxjax.rl import advantages as adv_lib
from fluxjax.rl import (
  async_control,
  evaluation,
  records,
  reward_pool,
  round_driver,
  step_metrics,
  trajectories,
)
from fluxjax.rl import producer as producer_lib
from fluxjax.rl import publisher as publisher_lib
from fluxjax.rl.policy import Policy
from fluxjax.rl.requests import Requests
from fluxjax.rollout.backend import LoopThread, RolloutBackend
from fluxjax.rollout.protocol import Completion, NonFiniteLogits

log = logging.getLogger(__name__)


@dataclasses.dataclass
class StepResult:
  groups: list[trajectories.Group]
  metrics: dict  # host floats
  trained: list[str]  # sample ids trained this step, in order
  # One per trained response, with coordinator.response_records on.
  responses: list[records.ResponseRecord] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Batch:
  """A step's groups as they were collected, and what the wait for them saw."""

  refills: int  # DAPO refills left
  kept: list[producer_lib.KeptGroup] = dataclasses.field(default_factory=list)
  rounds: list[round_driver.RoundStats] = dataclasses.field(default_factory=list)
  filtered: int = 0  # groups DAPO dropped
  unrefilled: int = 0  # of those, the ones no refill replaced
  requeued: int = 0  # groups that waited past the lag bound, generated again
  wait_s: float = 0.0
  trained_gap: dict = dataclasses.field(default_factory=dict)  # async_control.version_gap
  admitted_gap: dict = dataclasses.field(default_factory=dict)  # async_control.admission_gap


@dataclasses.dataclass
class _Update:
  """A step's update as the host sees it."""

  metrics: dict[str, float]  # the update's own (train/*)
  lr: float  # of its first optimizer update
  responses: list[records.ResponseRecord]
  publish_wait: dict[str, float]  # Publisher.settle_reads
  seconds: float  # applying it, after the collection

  @property
  def applied(self) -> bool:
    """Some optimizer update of the step applied (the device refuses non-finite ones)."""
    return self.metrics.get("nonfinite", 0.0) < 1.0


class Coordinator:
  """Owns the per-step flow; the run loop (rl/loop.py) owns the schedule.

  A context manager: leaving it stops rollout (`close`).

  Args:
    settings: the run's settings.
    tokenizer: the run's tokenizer (prompts, stop tokens).
    policy: the policy worker (rl/worker.py): the train state and the
      programs that change it.
    loader: the training data (a ShadowLoader).
    rollout: the backend, already started on `thread`'s loop.
    reward_scheduler: scores responses.
    thread: the rollout thread's loop; every backend call runs on it.
  """

  def __init__(
    self,
    settings: settings_lib.Settings,
    tokenizer: Tokenizer,
    policy: Policy,
    loader: producer_lib.Loader,
    rollout: RolloutBackend,
    reward_scheduler: reward_pool.RewardScheduler,
    *,
    thread: LoopThread,
  ):
    self._settings = settings
    self._policy = policy
    self._loader = loader
    self._rollout = rollout
    self._rewards = reward_scheduler
    self._requests = Requests.of(settings, tokenizer, policy.cfg, policy.strategy)
    self._steps = 0  # RL steps taken
    self._updates = 0  # optimizer updates applied (the learning-rate schedule's count)
    self._lr = train_step.lr_schedule(settings.optim)
    # Every counted fault of the run (fluxjax/faults.py), checkpointed together.
    self.faults = faults_lib.Faults(settings.faults.limits())
    self._P = settings.rl.prompts_per_step
    # The trainer's one wait while a deferred publish gathers: a rollout item or room.
    self._wake = threading.Event()
    self._producer = producer_lib.Producer.of(
      settings, rollout, reward_scheduler, loader, self._requests, self.faults, thread, self._wake
    )
    # The most versions a group may trail the policy it trains, queue time included.
    self._max_gap = self._producer.admission.max_gap
    self._publisher = publisher_lib.Publisher(
      policy, rollout, thread, self._producer, self.faults, self._wake
    )
    self._evaluator = evaluation.Evaluator(
      settings, self._requests, rollout, reward_scheduler, thread
    )
    # Trained sample uids of the (streamed) epoch, for exactly-once on resume.
    self._consumed: set[int] = set()
    self._filtered = 0
    self._nonfinite = train_step.NonFiniteGuard(self.faults.streak("nonfinite_steps"))
    self._started = False
    # Every backend call runs on the rollout thread's loop (a fleet's HTTP
    # session belongs to one loop); rounds start only with `start()`.
    self._producer.start_loop()

  # -- read-only views -------------------------------------------------------
  @property
  def policy(self) -> Policy:
    """The policy worker (every process runs its ops)."""
    return self._policy

  @property
  def requests(self) -> Requests:
    """Each sample's prompt and requests, as rollout gets them."""
    return self._requests

  @property
  def version(self) -> int:
    """The policy version last published to rollout."""
    return self._publisher.version

  @property
  def steps(self) -> int:
    """RL updates applied."""
    return self._steps

  def start(self) -> None:
    """Starts rollout (after any restore)."""
    if not self._started:
      self._producer.set_version(self._publisher.version, self._steps)
      self._producer.start()
      self._started = True

  # -- one step --------------------------------------------------------------
  def step(self) -> StepResult:
    """One GRPO step: collect P groups as they finish, train once, publish, observe.

    Raises:
      StopIteration: the data is exhausted and nothing is left to train.
    """
    self.start()
    t0 = time.perf_counter()
    batch = self._collect()
    update = self._train(batch)
    publish_s = self._publish(update)
    staleness, control = self._observe(batch, update)
    facts = step_metrics.StepFacts(
      groups=[k.group for k in batch.kept],
      rounds=batch.rounds,
      update=update.metrics,
      lr=update.lr,
      memory=step_metrics.device_memory_metrics(),
      version=self._publisher.version,
      wait_s=batch.wait_s,
      update_s=update.seconds,
      step_s=time.perf_counter() - t0,
      publish_s=publish_s,
      publish_wait=update.publish_wait,
      filtered=batch.filtered,
      requeued=batch.requeued,
      staleness=staleness,
      trained_gap=batch.trained_gap,
      control=control,
      totals=self.fault_counts(),
    )
    metrics = step_metrics.step_metrics(facts, self._settings, self._policy.cfg)
    trained = [k.sample.id for k in batch.kept]
    return StepResult([k.group for k in batch.kept], metrics, trained, update.responses)

  def _collect(self) -> _Batch:
    """The step's P groups, each run of `coordinator.stream_groups` added to
    the pending update as it arrives (rollout goes on meanwhile)."""
    t = time.perf_counter()
    rl = self._settings.rl
    chunk = max(1, self._settings.coordinator.stream_groups or math.ceil(self._P / 2))
    batch = _Batch(refills=rl.max_refill_rounds * self._P if rl.dynamic_sampling else 0)
    pending: list[producer_lib.KeptGroup] = []
    while len(batch.kept) + batch.unrefilled < self._P:
      match self._next_item():
        case producer_lib.DataEnd():
          if batch.kept:
            break
          raise StopIteration
        case producer_lib.Stopped(error=error):
          raise self._rollout_failed(error) from error
        case producer_lib.RoundEnd(stats=stats):
          batch.rounds.append(stats)
        case producer_lib.KeptGroup() as item:
          if not self._trains(item, batch):
            continue
          batch.kept.append(item)
          pending.append(item)
          if len(pending) >= chunk:
            self._policy.add(self.sequences([k.group for k in pending]))
            pending = []
    if pending:
      self._policy.add(self.sequences([k.group for k in pending]))
    if not batch.kept:
      raise RuntimeError(
        "dynamic sampling filtered every group of the step; raise rl.max_refill_rounds"
      )
    batch.wait_s = time.perf_counter() - t
    responses = [(c, k.launch_version) for k in batch.kept for c in k.group.completions]
    batch.trained_gap, batch.admitted_gap = async_control.batch_gaps(
      responses, self._publisher.version
    )
    return batch

  def _next_item(self) -> producer_lib.RolloutItem:
    """The rollout thread's next item. Meanwhile a deferred publish's gathers
    run here, each as its consumer makes room; `_wake` is set by either event."""
    while True:
      self._wake.clear()
      gathering = self._publisher.pump()
      try:
        return self._producer.out.get(block=not gathering, timeout=5.0)
      except queue.Empty:
        if not self._producer.alive:
          raise RuntimeError("the rollout thread died") from None
      if gathering:
        self._wake.wait(5.0)

  def _trains(self, item: producer_lib.KeptGroup, batch: _Batch) -> bool:
    """Whether a kept group trains this step. One that waited in the queue
    until it is staler than admission allows is generated again; with DAPO,
    one whose rewards are all equal has no gradient: it is dropped and one
    more prompt let through admission while the refills last."""
    gap = self._publisher.version - item.launch_version
    if gap > self._max_gap:
      log.warning(
        "sample %s waited %d versions (more than %d) before training; generating it again",
        item.sample.id,
        gap,
        self._max_gap,
      )
      self._producer.requeue(item.sample.uid)
      batch.requeued += 1
      return False
    if self._settings.rl.dynamic_sampling and adv_lib.is_degenerate_group(item.group.rewards):
      batch.filtered += 1
      self._consumed.add(item.sample.uid)
      self._done_with([item])
      if batch.refills > 0:
        batch.refills -= 1
        self._producer.give_back(1)
      else:
        batch.unrefilled += 1
      return False
    return True

  def _rollout_failed(self, error: BaseException) -> Exception:
    """The error to stop on when the producer stopped on `error`."""
    refusal = NonFiniteLogits.among_causes(error)
    if refusal is not None:
      return self._publisher.nonfinite_error(refusal.weight_version, "the engine refused to sample")
    return RuntimeError("rollout failed")

  def sequences(self, groups: Sequence[trajectories.Group]) -> list[batch_lib.TrainSequence]:
    """The groups' GRPO sequences (advantages, aggregation weights, behaviour logprobs)."""
    rl = self._settings.rl
    out = []
    for g in groups:
      try:
        seqs = trajectories.group_sequences(
          g, std_normalize=rl.adv_std_normalize, agg_mode=rl.loss_agg_mode, eps=rl.adv_eps
        )
      except trajectories.MissingLogprobs as e:
        if e.nonfinite:  # the symptom of a non-finite policy: name the step
          raise self._publisher.nonfinite_error(e.versions[0], str(e)) from e
        raise
      out.extend(seqs)
    return out

  def _train(self, batch: _Batch) -> _Update:
    """Applies the step's update (its parts were added as the groups came);
    the batch's samples are then consumed. Refused (non-finite) updates
    count, and too many in a row raise here, before anything is checkpointed."""
    t0 = time.perf_counter()
    publish_wait = self._publisher.settle_reads()  # the update donates what a publish reads
    device_metrics = self._policy.apply()
    self._steps += 1
    train = jax.device_get(device_metrics)
    per_sequence = train.pop(train_step.PER_SEQUENCE, None)
    train = {k: float(v) for k, v in train.items()}
    responses = [] if per_sequence is None else self._records(batch.kept, per_sequence, train)
    self._nonfinite.observe(self._steps, train, [k.sample.id for k in batch.kept])
    lr = float(self._lr(self._updates))
    self._updates += round(train.get("updates", 1.0) * (1.0 - train.get("nonfinite", 0.0)))
    self._consumed.update(k.sample.uid for k in batch.kept)
    self._done_with(batch.kept)
    self._filtered += batch.filtered
    return _Update(train, lr, responses, publish_wait, time.perf_counter() - t0)

  def _records(self, kept, per_sequence, train) -> list[records.ResponseRecord]:
    rl = self._settings.rl
    normalizer = adv_lib.loss_normalizer(
      rl.loss_agg_mode, self._P * rl.responses_per_prompt, rl.max_new_tokens
    )
    return records.response_records(
      [k.group for k in kept],
      [k.launch_version for k in kept],
      per_sequence,
      normalizer or train["tokens"],
      self._publisher.version,
    )

  def _publish(self, update: _Update) -> float:
    """Publishes an applied update; seconds taken. A refused one left the
    policy as it was: nothing new to publish, but admission counts the step."""
    if update.applied:
      return self.publish()
    self._publisher.unchanged(self._steps)
    return 0.0

  def _observe(self, batch: _Batch, update: _Update) -> tuple[dict, dict]:
    """(the batch's staleness, admission's control after it): the allowed
    lag of the next rounds."""
    stale = async_control.trained_staleness(
      batch.admitted_gap, update.metrics, self._settings.coordinator.lag
    )
    return stale, self._producer.observe(stale["staleness"], self._steps)

  def _done_with(self, kept: list[producer_lib.KeptGroup]) -> None:
    self._loader.release([k.sample for k in kept])
    self._producer.done_with([k.sample.uid for k in kept])

  def fault_counts(self) -> dict:
    """Counted events of the run so far (faults, skips, reward failures, the backend's)."""
    out = {k: float(v) for k, v in self._producer.counts.items()}
    out["rollout/filtered_groups_total"] = float(self._filtered)
    out.update(self.faults.totals())
    out.update(self._rewards.metrics())
    out.update(self._rollout.metrics())
    return out

  # -- publishing and evaluation ---------------------------------------------
  def publish(self, new_version: bool = True) -> float:
    """Hands the weights to rollout (`Publisher.publish`); returns seconds taken."""
    return self._publisher.publish(self._steps, new_version)

  def settle_publish(self) -> None:
    """Waits for a deferred publish's servers to load it (`Publisher.settle`)."""
    self._publisher.settle()

  def sample(
    self, samples: Sequence[meta_lib.SampleMeta], responses: int, *, greedy: bool = False
  ) -> list[list[Completion]]:
    """`responses` completions per sample from the latest policy version, outside
    the training stream: to look at a group by hand (notebooks/grpo.ipynb)."""
    self.settle_publish()
    return self._evaluator.sample(samples, responses, greedy=greedy)

  def evaluate(self, samples: Sequence[meta_lib.SampleMeta]) -> dict[str, float]:
    """Held-out metrics of the latest policy version (rl/evaluation.py)."""
    self.settle_publish()
    return self._evaluator.evaluate(samples)

  # -- checkpointed state ----------------------------------------------------
  def get_state(self) -> tuple[dict, dict]:
    """(coordinator state, data state) for a checkpoint taken between steps."""
    snap = self._producer.snapshot(self._consumed)
    data = snap.pop("loader")
    return {
      "version": self._publisher.version,
      "steps": self._steps,
      "updates": self._updates,
      "filtered": self._filtered,
      "faults": self.faults.get_state(),
      **snap,
    }, data

  def restore(self, state: dict, data: dict) -> None:
    """Resumes from a checkpoint (before `start`); the policy restored its train state.

    Args:
      state, data: what `get_state()` returned when the checkpoint was taken.
    """
    if self._started:
      raise RuntimeError("restore() after rollout started")
    self._publisher.restore(int(state["version"]))
    self._steps = int(state.get("steps", 0))
    per_step = self._settings.rl.updates_per_batch  # a checkpoint from before "updates"
    self._updates = int(state.get("updates", self._steps * per_step))
    self._filtered = int(state.get("filtered", 0))
    self.faults.set_state(state.get("faults", {}))
    self._loader.set_state(data)
    if "batcher" in state:
      self._producer.restore(state, self._steps)
      self._consumed = set(int(u) for u in state["batcher"]["trained"])

  def close(self) -> None:
    """Stops rollout: the running round is cancelled and its requests aborted.

    The backend stays open: its owner closes it (after this).
    """
    try:
      if self._producer.alive:  # a dead loop would never finish the wait
        self.settle_publish()
    finally:
      self._producer.stop()

  def __enter__(self) -> Coordinator:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is not None:
      self._publisher.abandon()
    self.close()
