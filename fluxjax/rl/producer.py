"""The rollout side of the coordinator: admission-gated tail-batched rounds in a thread.

`Producer` runs on the rollout thread's asyncio loop (`backend.LoopThread`): it tops a
`TailBatcher` up with prompts from the data loader, runs rounds on the rollout backend,
scores each response in the reward pool the moment it finishes, and hands every kept
group to the trainer through a queue as soon as its last reward is in, while the round
goes on (the queue's items: `RolloutItem`). Finished groups are never dropped. Its faults
are counted: docs/reliability.md, "Faults, counted in the metrics".
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from fluxjax import faults as faults_lib
from fluxjax import settings as settings_lib
from fluxjax.data import meta as meta_lib
from fluxjax.rl import async_control, reward_spec, round_driver, tail_batching, trajectories
from fluxjax.rl.requests import RequestSource
from fluxjax.rollout.backend import LoopThread, Sampler
from fluxjax.rollout.protocol import Completion, GenerateRequest

log = logging.getLogger(__name__)


class Loader(Protocol):
  """The training data (a ShadowLoader)."""

  def next_batch(self) -> list[meta_lib.SampleMeta]:
    """The next samples; [] or StopIteration once the data is exhausted."""
    ...

  def release(self, batch: Sequence[meta_lib.SampleMeta]) -> None:
    """Frees the media of samples that will not train."""
    ...

  def get_state(self) -> dict:
    """Where the data stands (JSON), to resume after the last sample handed out."""
    ...

  def set_state(self, state: dict) -> None: ...


@dataclasses.dataclass(frozen=True)
class KeptGroup:
  """A prompt's R scored responses, ready to train.

  Attributes:
    group: the prompt and its completions with rewards.
    sample: the data sample (for releasing its media after training).
    launch_version: the policy version when its round was admitted.
  """

  group: trajectories.Group
  sample: meta_lib.SampleMeta
  launch_version: int


@dataclasses.dataclass(frozen=True)
class RoundEnd:
  """A round ended; what it did."""

  stats: round_driver.RoundStats


@dataclasses.dataclass(frozen=True)
class DataEnd:
  """The data is exhausted: no round follows."""


@dataclasses.dataclass(frozen=True)
class Stopped:
  """The producer stopped on `error`: no item follows."""

  error: BaseException


# What the producer queues for the trainer, in order.
RolloutItem = KeptGroup | RoundEnd | DataEnd | Stopped


class Producer:
  """Runs rounds ahead of the trainer within the allowed lag.

  A round stopped by a backend error (a server killed mid-round, with no other server to
  retry on) keeps what it finished, re-queues the rest and is counted; the next round
  picks them up. A sample whose prompt cannot be built (the chat template or tokenizer
  raises) and a prompt too long for the rollout context are counted, logged skips before
  anything is sent (`_fits`). A reward call that raises, hangs or returns a non-finite
  value scores 0 and is counted by the reward scheduler (rl/reward_pool.py).

  Args:
    rollout: the backend (started; every call runs on `thread`).
    reward_scheduler: rl/reward_pool.RewardScheduler.
    batcher: the tail batcher (P prompts, R responses, eta).
    admission: the admission controller (batch size P prompts).
    loader: the training data; samples the producer drops (skips) are
      released to it.
    requests: each sample's prompt and requests; prompts longer than its
      `prompt_budget` are skipped (counted).
    faults: the run's fault streaks: `failed_rounds` (rounds a backend error
      stopped) and `prompt_errors` (samples whose prompt cannot be built, each a
      skip: that many in a row is a broken tokenizer or template, not bad
      samples); their limits stop the run.
    request_retries: backend aborts of one response without progress that are
      re-launched before its round fails (`run_round`'s max_retries).
    thread: the rollout thread's loop, shared with the backend's other
      callers; None = a loop of its own, stopped by `stop`.
  """

  def __init__(
    self,
    rollout: Sampler,
    reward_scheduler,
    batcher: tail_batching.TailBatcher,
    admission: async_control.AdmissionController,
    loader: Loader,
    requests: RequestSource,
    *,
    faults: faults_lib.Faults,
    request_retries: int,
    thread: LoopThread | None = None,
    wake: threading.Event | None = None,
  ):
    self.rollout = rollout
    self.scores: dict[str, Any] = {}  # rid -> reward future of a finished response
    self.rewards = reward_scheduler
    self.batcher = batcher
    self.admission = admission
    self.loader = loader
    self.requests = requests
    self.failed_rounds = faults.streak("failed_rounds")
    self.prompt_errors = faults.streak("prompt_errors")
    self.request_retries = request_retries
    self.samples: dict[int, meta_lib.SampleMeta] = {}
    self.prompts: dict[int, Any] = {}
    self.out: queue.Queue[RolloutItem] = queue.Queue()
    # Set on each item put on `out`, for a consumer that waits on other events too.
    self.wake = threading.Event() if wake is None else wake
    self.version = 0  # the weight version rollouts sample from (tags)
    self.step = 0  # updates applied by the trainer (admission)
    self.counts: collections.Counter = collections.Counter()
    self._owns_thread = thread is None
    self._thread = LoopThread("rollout") if thread is None else thread
    self._wake: asyncio.Event | None = None
    self._data_lock: asyncio.Lock | None = None
    self._task: asyncio.Task | None = None
    self._stop = False
    self._exhausted = False

  @classmethod
  def of(
    cls,
    settings: settings_lib.Settings,
    rollout: Sampler,
    reward_scheduler,
    loader: Loader,
    requests: RequestSource,
    faults: faults_lib.Faults,
    thread: LoopThread,
    wake: threading.Event | None = None,
  ) -> Producer:
    """The run's producer: its batcher (rollout.tail_batching) on a streamed
    epoch, its admission (coordinator.lag)."""
    P = settings.rl.prompts_per_step
    tail = settings.rollout.tail_batching
    batcher = tail_batching.TailBatcher(
      P,
      settings.rl.responses_per_prompt,
      tail.eta,
      recycle=tail.recycle,
      continue_in=tail.continue_in,
    )
    batcher.start_epoch([])  # a streamed epoch: topped up from the loader
    admission = async_control.AdmissionController.from_config(
      settings.coordinator.lag, P, total_steps=settings.total_steps
    )
    return cls(
      rollout,
      reward_scheduler,
      batcher,
      admission,
      loader,
      requests,
      faults=faults,
      request_retries=settings.faults.request_retries,
      thread=thread,
      wake=wake,
    )

  # -- thread plumbing -----------------------------------------------------------
  def _emit(self, item: RolloutItem) -> None:
    self.out.put(item)
    self.wake.set()

  def start_loop(self) -> None:
    """Starts the rollout thread's event loop (all backend calls run on it)."""
    self._thread.start()
    if self._wake is None:
      self.call(self._init_primitives())

  def start(self) -> None:
    """Starts producing rounds (after any `restore`)."""
    self.start_loop()
    if self._task is None:
      self._task = self.call(self._spawn())

  async def _spawn(self) -> asyncio.Task:
    return asyncio.ensure_future(self._produce())

  async def _cancel(self) -> None:
    if self._task is None:
      return
    self._task.cancel()
    await asyncio.gather(self._task, return_exceptions=True)

  @property
  def alive(self) -> bool:
    return self._thread.alive

  async def _init_primitives(self):
    self._wake = asyncio.Event()
    self._data_lock = asyncio.Lock()

  def call(self, coro, timeout: float | None = None):
    """Runs a coroutine on the rollout loop and waits for its result."""
    return self._thread.call(coro, timeout)

  def _notify(self) -> None:
    if self._wake is not None:
      self._thread.call_soon(self._wake.set)

  def set_version(self, version: int, step: int | None = None) -> None:
    """The trainer published `version` (after update `step`): admission may open.

    Admission counts training steps, not versions: a warm-up may publish
    versions without consuming rollouts.
    """
    self.version = version
    if step is not None:
      self.step = step
    self._notify()

  def observe(self, staleness: float, step: int) -> dict:
    """Admission's control after trainer step `step` of that staleness (on the
    rollout loop, where admission is read)."""

    async def observe() -> dict:
      return self.admission.observe(staleness, step)

    return self.call(observe())

  def give_back(self, n: int) -> None:
    """Returns admission for `n` prompts that will not train (DAPO refill)."""
    self._thread.call_soon(self.admission.on_cancelled, n)
    self._notify()

  def requeue(self, uid: int) -> None:
    """From the trainer thread: a kept prompt whose group went stale before
    it was trained is launched again from scratch (its admission given back)."""

    def back() -> None:
      self.batcher.requeue([uid])
      self.admission.on_cancelled(1)

    self._thread.call_soon(back)
    self._notify()

  def stop(self) -> None:
    """Stops producing: the running round is cancelled (its requests aborted).

    The loop stops too when it is the producer's own.
    """
    self._stop = True
    self._notify()
    if self._task is not None and self._thread.alive:
      try:  # cancel on the loop and wait there, so the round's aborts run
        self.call(self._cancel(), timeout=60)
      except Exception:
        log.exception("stopping the rollout producer")
    if self._owns_thread:
      self._thread.stop()

  # -- state ---------------------------------------------------------------------
  def snapshot(self, consumed: set) -> dict:
    """Coordinator state for a checkpoint, consistent with the loader's.

    Prompts the producer kept but the trainer has not consumed go back to the
    front of the queue: on resume they are re-issued, so each trains once.
    Prompts of a round still running stay queued unless the trainer already
    consumed them. The batcher changes only in synchronous code on the
    rollout loop (a round's commit, a top-up under the data lock), so taking
    the snapshot there sees it whole.

    Args:
      consumed: uids of this epoch the trainer has trained (updates applied).
    """

    async def take():
      async with self._data_lock:
        b = self.batcher.get_state()
        requeue = [u for u in b["trained"] if u not in consumed]
        b["fresh"] = requeue + [u for u in b["fresh"] if u not in consumed]
        b["long"] = [u for u in b["long"] if u not in consumed]
        b["trained"] = sorted(consumed)
        live = set(b["fresh"]) | set(b["long"])
        return {
          "batcher": b,
          "loader": self.loader.get_state(),
          "admission": self.admission.get_state(),
          "samples": {str(u): sample_to_dict(self.samples[u]) for u in live},
          "counts": dict(self.counts),
        }

    return self.call(take())

  def restore(self, state: dict, step: int) -> None:
    """Before `start`: the queues and samples of `snapshot` taken after `step`.

    Rounds that were running are re-issued, so admission restarts from what
    the trained steps consumed: P per step (DAPO refills were given back).
    """
    self.batcher.set_state(state["batcher"])
    self.admission.set_state(state["admission"])
    self.admission.started = step * self.batcher.P
    self.step = step
    self.samples = {int(u): sample_from_dict(d) for u, d in state["samples"].items()}
    self.counts.update(state.get("counts", {}))

  # -- the producer loop ---------------------------------------------------------
  def _score(self, uid: int, completion: Completion) -> None:
    """Starts scoring a finished response while its round goes on."""
    sample = self.samples.get(uid)
    if sample is not None:
      self.scores[completion.rid] = self._submit(sample, completion.text)

  def _submit(self, sample: meta_lib.SampleMeta, response: str):
    """A Future of the response's RewardResult (the prompt id anchors its timeout)."""
    context = reward_spec.RewardContext.of(sample)
    return self.rewards.submit(response, sample.answer or "", key=sample.id, context=context)

  def _prompt(self, uid: int):
    if uid not in self.prompts:
      self.prompts[uid] = self.requests.prompt(self.samples[uid])
    return self.prompts[uid]

  async def _top_up(self) -> None:
    """Pulls loader batches until a short round can launch (or data ends)."""
    loop = asyncio.get_running_loop()
    while (
      not self._exhausted
      and len(self.batcher.fresh) < self.batcher.launch_prompts
      and len(self.batcher.long) < self.batcher.P
    ):
      batch = await loop.run_in_executor(None, self._next_or_none)
      if not batch:
        self._exhausted = True
        break
      fresh: list[meta_lib.SampleMeta] = []
      skipped: list[meta_lib.SampleMeta] = []
      for sample in batch:
        self.samples[sample.uid] = sample
        try:
          fits = self._fits(sample)
        except RuntimeError:  # the run stops: the skips so far are freed first
          self.loader.release(skipped + [sample])
          raise
        (fresh if fits else skipped).append(sample)
      if skipped:
        self.loader.release(skipped)
      self.batcher.extend([s.uid for s in fresh])

  def _fits(self, sample: meta_lib.SampleMeta) -> bool:
    """Whether the sample can be asked for: a prompt that cannot be built or is
    over the budget is a counted, logged skip (forgotten); too many prompts in
    a row that cannot be built raise."""
    try:
      n = len(self._prompt(sample.uid))
    except Exception as e:
      # Whatever the chat template or tokenizer raises on this sample's
      # prompt is the sample's fault: a counted skip, not a stopped run.
      stop = self.prompt_errors.fail()
      log.warning(
        "skipping sample %s (uid %d): cannot build its prompt: %s: %s",
        sample.id,
        sample.uid,
        type(e).__name__,
        e,
      )
      self.forget(sample.uid)
      if stop:
        raise RuntimeError(
          f"{self.prompt_errors.in_a_row} prompts in a row failed to build"
          f" (last: sample {sample.id}: {type(e).__name__}: {e})"
        ) from e
      return False
    self.prompt_errors.ok()
    if n <= self.requests.prompt_budget:
      return True
    # The engine would reject it; a counted skip, not a failed round.
    log.warning(
      "skipping sample %s: prompt of %d tokens > %d (config_rules.prompt_budget)",
      sample.id,
      n,
      self.requests.prompt_budget,
    )
    self.counts["data/skipped/prompt_too_long"] += 1
    self.forget(sample.uid)
    return False

  def _next_or_none(self) -> list:
    """The loader's next batch, [] once it is exhausted: a StopIteration
    cannot cross an executor's future (asyncio would hang on it)."""
    try:
      return self.loader.next_batch()
    except StopIteration:
      return []

  def _drop_rejected(self, uids) -> None:
    """Counts and releases prompts the backend refused (they leave the epoch)."""
    samples = [self.samples[u] for u in uids if u in self.samples]
    for sample in samples:
      log.warning("skipping sample %s: the rollout backend refused its request", sample.id)
      self.counts["data/skipped/rejected"] += 1
      self.forget(sample.uid)
    if samples:
      self.loader.release(samples)

  def forget(self, uid: int) -> None:
    """Drops a sample the trainer is done with (call on the rollout loop)."""
    self.samples.pop(uid, None)
    self.prompts.pop(uid, None)

  def done_with(self, uids) -> None:
    """From the trainer thread: these samples are trained; drop them."""
    for u in list(uids):
      self._thread.call_soon(self.forget, u)

  async def _admission(self) -> int:
    """Waits until admission allows a prompt; returns how many it allows.

    At trainer step s (updates applied) at most (s + lag + 1) * P prompts may have
    started, so with lag 0 (sync) a round starts only after the previous batch's update,
    and with lag k rollout runs up to k batches ahead.

    Usually P at a time (each trainer step opens P); fewer after a DAPO
    give-back or a round that failed part way, which then runs smaller.
    """
    wake = self._wake
    assert wake is not None, "made on the loop by start_loop"
    while not self._stop and self.admission.capacity(self.step) < 1:
      wake.clear()
      if self.admission.capacity(self.step) >= 1:
        break
      await wake.wait()
    return self.admission.capacity(self.step)

  async def _produce(self) -> None:
    data_lock = self._data_lock
    assert data_lock is not None, "made on the loop by start_loop"
    try:
      while not self._stop:
        allowed = await self._admission()
        if self._stop:
          return
        async with data_lock:
          await self._top_up()
          plan = self.batcher.plan_round(limit=allowed)
        if plan is None:
          self._emit(DataEnd())
          return
        await self._round(plan)
    except asyncio.CancelledError:
      raise
    except BaseException as e:
      log.exception("rollout producer stopped")
      self._emit(Stopped(e))

  async def _round(self, plan: tail_batching.RoundPlan) -> None:
    """Runs one admitted round; each kept group is queued as its rewards come in."""
    self.admission.on_started(plan.keep_prompts)
    launch_version = self.version
    pending: list[asyncio.Task] = []

    def on_kept(uid, completions):
      pending.append(asyncio.ensure_future(self._deliver(uid, completions, launch_version)))

    def request(uid: tail_batching.PromptId, j: int) -> GenerateRequest:
      assert isinstance(uid, int), "the producer's prompt ids are sample uids"
      return self.requests.request(self.samples[uid], self._prompt(uid), j)

    def on_finished(uid: tail_batching.PromptId, completion: Completion) -> None:
      assert isinstance(uid, int), "the producer's prompt ids are sample uids"
      self._score(uid, completion)

    try:
      result = await round_driver.run_round(
        self.rollout,
        self.batcher,
        request,
        on_kept=on_kept,
        on_finished=on_finished,
        plan=plan,
        version=str(launch_version),
        decode=self.requests.decode,
        max_retries=self.request_retries,
      )
    except round_driver.RoundFailed as e:
      await self._failed(plan, e, pending)
      return
    self.failed_rounds.ok()
    assert result is not None, "a round with a plan always returns"
    # Admission a round could not use: prompts the backend refused left
    # it fewer than it reserved.
    self.admission.on_cancelled(plan.keep_prompts - len(result.groups))
    self._drop_rejected(result.rejected)
    await asyncio.gather(*pending)
    # Responses that finished but were not kept (their prompt was already
    # complete, or lost the race): a carried one is scored when it is kept.
    self.scores.clear()
    for key, n in result.stats.counts().items():
      self.counts[f"rollout/{key}_total"] += n
    self._emit(RoundEnd(result.stats))

  async def _failed(
    self, plan: tail_batching.RoundPlan, e: round_driver.RoundFailed, pending: list[asyncio.Task]
  ) -> None:
    """A round a backend error stopped: counted, what it kept delivered, then
    a pause before the next; too many in a row raise."""
    stop = self.failed_rounds.fail()
    self.admission.on_cancelled(plan.keep_prompts - len(e.kept))
    self._drop_rejected(e.rejected)
    log.warning("rollout round failed (%d in a row): %s", self.failed_rounds.in_a_row, e)
    await asyncio.gather(*pending)
    self.scores.clear()
    if stop:
      raise e
    await asyncio.sleep(min(2.0**self.failed_rounds.in_a_row, 30.0))

  async def _deliver(self, uid: int, completions: list, launch_version: int) -> None:
    sample = self.samples[uid]
    # Responses that finished in an earlier round (carried) are scored now.
    futures = [self.scores.pop(c.rid, None) or self._submit(sample, c.text) for c in completions]
    scored = await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    group = trajectories.Group(
      sample.id,
      self._prompt(uid),
      list(completions),
      [s.reward for s in scored],
      sample.answer,
      [s.terms for s in scored],
    )
    self.prompts.pop(uid, None)
    self._emit(KeptGroup(group, sample, launch_version))


def sample_to_dict(sample: meta_lib.SampleMeta) -> dict:
  """A JSON-able SampleMeta (checkpointed queues)."""
  return dataclasses.asdict(sample)


def sample_from_dict(d: dict) -> meta_lib.SampleMeta:
  media = tuple(
    meta_lib.MediaRef(**{**m, "full_grid": tuple(m["full_grid"])}) for m in d.get("media", ())
  )
  return meta_lib.SampleMeta(**{**d, "media": media, "turns": tuple(d.get("turns", ()))})
