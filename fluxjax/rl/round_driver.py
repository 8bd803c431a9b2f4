"""The asyncio driver of tail batching: one round on a rollout backend.

`run_round` plans a round with the pure scheduler (rl/tail_batching.py `TailBatcher`,
`Round`), launches its requests on a `backend.Sampler` (`generate(request, group)`,
`abort(rid)`, and `slot_stats()` where the backend has slot counters), feeds each
finished request to the `Round`, aborts what the round no longer needs, and commits the
round to the batcher: whole on success, its kept prompts only on failure (the rest is
queued again, with its responses so far when recycling). `RoundDriver` is one round.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from fluxjax.rl.tail_batching import Carried, Key, PromptId, Round, RoundPlan, TailBatcher
from fluxjax.rollout import protocol
from fluxjax.rollout.backend import Sampler, SlotStats
from fluxjax.rollout.client import RequestRejected
from fluxjax.rollout.protocol import Completion, GenerateRequest

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RoundStats:
  """What one committed round did.

  Attributes:
    kind: "short" (speculative) or "long".
    wall_s: the round's wall time in seconds.
    prompts: prompts launched.
    requests: requests sent, retries and continuations included.
    aborted: requests the round aborted.
    retried: requests sent again after the backend aborted them.
    deferred: launched prompts not kept.
    resumed: requests that continued a response.
    restarted: continuations the backend refused, generated again from scratch.
    rejected: prompts the backend refused (dropped from the epoch).
    tokens_kept: every token of the kept responses.
    tokens_generated: tokens decoded in this round.
    tokens_resumed: tokens carried into the round by the responses it continued.
    tokens_carried: tokens carried out of it.
    tokens_discarded: tokens decoded, in this round or, for a restarted
      response, before it, and neither kept nor carried.
    max_kept_len: the longest kept response, in tokens.
    decode_steps, slot_idle_fraction: the engine's decode steps in the round
      and the share of its slot-steps idle (`_slot_usage`); None where the
      backend reports no slot counters.
  """

  # The statistics that are counts, summed over rounds into run totals.
  COUNTED: ClassVar[tuple[str, ...]] = (
    "aborted",
    "deferred",
    "resumed",
    "restarted",
    "tokens_discarded",
    "tokens_carried",
  )

  kind: str
  wall_s: float
  prompts: int
  requests: int
  aborted: int
  retried: int
  deferred: int
  resumed: int
  restarted: int
  rejected: int
  tokens_kept: int
  tokens_generated: int
  tokens_resumed: int
  tokens_carried: int
  tokens_discarded: int
  max_kept_len: int
  decode_steps: int | None = None
  slot_idle_fraction: float | None = None

  def counts(self) -> dict[str, int]:
    """The counted statistics (`COUNTED`) by name."""
    return {name: getattr(self, name) for name in self.COUNTED}


@dataclasses.dataclass
class RoundResult:
  """A committed round.

  Attributes:
    plan: what was launched.
    groups: prompt id -> its R kept completions (index order), in the order
      the prompts completed.
    deferred: launched prompts not kept (to the long-prompt queue, or with
      continue_in="next_round" to the front of the fresh queue).
    stats: what the round did.
    rejected: launched prompts a backend refused (RequestRejected on a fresh
      request: it cannot succeed on any server); dropped from the epoch, for
      the caller to count and release.
  """

  plan: RoundPlan
  groups: dict
  deferred: list
  stats: RoundStats
  rejected: list = dataclasses.field(default_factory=list)


class RoundFailed(RuntimeError):
  """A round stopped by a backend error; its kept prompts were committed.

  Attributes:
    kept: prompt ids kept (and handed to `on_kept`) before the failure.
    rejected: prompt ids the backend refused before it (dropped, as in
      `RoundResult`).
  """

  def __init__(self, message: str, kept: list, rejected: list | None = None):
    super().__init__(message)
    self.kept = kept
    self.rejected = list(rejected or [])


async def run_round(
  rollout: Sampler,
  batcher: TailBatcher,
  make_request: Callable[[PromptId, int], GenerateRequest],
  *,
  rid_prefix: str = "tb",
  max_retries: int = 2,
  abort_grace_s: float = 30.0,
  on_kept: Callable[[PromptId, list], None] | None = None,
  on_finished: Callable[[PromptId, Completion], None] | None = None,
  plan: RoundPlan | None = None,
  version: str | None = None,
  decode: Callable[..., str] | None = None,
) -> RoundResult | None:
  """Plans, runs and commits one round on `rollout`.

  Args:
    rollout: the backend (`EmbeddedRollout`, `Fleet`, or what wraps one).
    batcher: the scheduler; committed only if the round succeeds, so a failed
      round loses no prompt.
    make_request: (prompt id, response index) -> its request (by input_ids
      when recycling); `rid` is set here, and a continued response gets the
      request's `continued` form.
    rid_prefix: request ids are `{prefix}-{epoch}-{round}-{prompt}-{index}-{try}`.
    max_retries: re-launches of a response that the backend aborted on its own
      (pause, engine error) before the round fails; with recycling, an abort
      after which the response had gained tokens does not count.
    abort_grace_s: how long to wait for aborted requests to come back before
      cancelling their tasks.
    on_kept: called with (prompt id, its R completions) the moment a prompt is
      kept, so a stream trainer can start on it while the round runs.
    on_finished: called with (prompt id, completion) for each response that
      finishes and counts for this round (whole, when it was continued), e.g.
      to score it while the round goes on.
    plan: the round to run (default: `batcher.plan_round()`).
    version: the policy version the round's requests start from; tokens of a
      backend that reports no per-token versions are pinned to it.
    decode: a tokenizer's `decode(ids, skip_special_tokens=...)`, for the text
      of a continued response; required when recycling.

  Returns:
    The result, or None if the epoch is exhausted (call `start_epoch`).

  Raises:
    RoundFailed: a backend error stopped the round; what was kept is
      committed (`commit(partial=True)`), the rest is queued again (with its
      responses so far, when recycling).
  """
  plan = plan or batcher.plan_round()
  if plan is None:
    return None
  if batcher.recycle and decode is None:
    raise ValueError("recycling continues responses: run_round needs `decode`")
  driver = RoundDriver(
    rollout,
    batcher,
    plan,
    make_request,
    rid_prefix=rid_prefix,
    max_retries=max_retries,
    abort_grace_s=abort_grace_s,
    on_kept=on_kept,
    on_finished=on_finished,
    version=version,
    decode=decode,
  )
  return await driver.run()


class RoundDriver:
  """One round's requests, from launch to commit (see `run_round`'s arguments).

  Every response of the round has a key (prompt id, response index). A
  response is in at most one of `finished` (whole) and `so_far` (unfinished:
  carried in, or aborted here, when recycling); `tasks` maps each request in
  flight to its key, rid and request.

  Ties (requests that finish in the same event-loop turn) are broken by the round's
  request order (prompt order, then response index), never by set iteration order.
  """

  def __init__(
    self,
    rollout: Sampler,
    batcher: TailBatcher,
    plan: RoundPlan,
    make_request: Callable[[PromptId, int], GenerateRequest],
    *,
    rid_prefix: str,
    max_retries: int,
    abort_grace_s: float,
    on_kept: Callable[[PromptId, list], None] | None,
    on_finished: Callable[[PromptId, Completion], None] | None,
    version: str | None,
    decode: Callable[..., str] | None,
  ):
    self.rollout, self.batcher, self.plan = rollout, batcher, plan
    self.make_request = make_request
    self.rid_prefix, self.max_retries, self.abort_grace_s = rid_prefix, max_retries, abort_grace_s
    self.on_kept, self.on_finished = on_kept, on_finished
    self.version, self.decode = version, decode
    self.recycle = batcher.recycle
    self.rnd = Round(plan)
    self.order = {k: i for i, k in enumerate(plan.keys())}
    self.tasks: dict[asyncio.Task, tuple[Key, str, GenerateRequest]] = {}
    self.tries: dict[Key, int] = {}
    self.finished: dict[Key, Completion] = {}
    self.so_far: dict[Key, Completion] = {}
    for p in plan.prompts:
      for j, c in batcher.carried.get(p, {}).items():
        (self.finished if c.finished else self.so_far)[(p, j)] = Completion.from_dict(c.completion)
    self.tokens_resumed = sum(
      len(c.output_ids) for k, c in self.so_far.items() if k in self.rnd.outstanding
    )
    self.new_tokens: dict[Key, int] = {}  # decoded in this round by each response's attempt
    self.segments: list[Completion] = []  # every request's output, aborted ones included
    self.aborted_rids: set[str] = set()
    # resumed: requests that continued a response; restarted: continuations
    # the backend refused, run again from scratch; lost_tokens: what those
    # had decoded before this round.
    self.events: collections.Counter = collections.Counter()
    self.stalls: dict[Key, int] = {}  # backend aborts of a response that gained no tokens
    self.progress: dict[Key, int] = {}  # its new tokens at its last backend abort

  async def run(self) -> RoundResult:
    slots0 = self.rollout.slot_stats()
    t0 = time.perf_counter()
    self._keep_news(0)  # prompts whose responses all finished in earlier rounds
    for key in sorted(self.rnd.outstanding, key=self.order.__getitem__):
      self._launch(key)
    failure: Exception | None = None
    try:
      while not self.rnd.done:
        done, _ = await asyncio.wait(list(self.tasks), return_when=asyncio.FIRST_COMPLETED)
        for t in sorted(done, key=lambda t: self.order[self.tasks[t][0]]):
          await self._on_done(t)
    except Exception as e:
      failure = e
    finally:
      await self._stop_the_rest()
    wall = time.perf_counter() - t0
    carry = self._carry()
    if failure is not None:
      kept = self.batcher.commit(self.rnd, partial=True, carry=carry)
      raise RoundFailed(
        f"round {self.plan.epoch}/{self.plan.index} failed after keeping {len(kept)} of "
        f"{self.plan.keep_prompts} prompts: {failure!r}",
        kept,
        self.rnd.rejected,
      ) from failure
    kept = self.batcher.commit(self.rnd, carry=carry)
    groups = {p: [self.finished[(p, j)] for j in self.rnd.kept[p]] for p in kept}
    stats = self._stats(kept, groups, carry, wall)
    slots1 = self.rollout.slot_stats()
    if slots0 is not None and slots1 is not None:
      stats = dataclasses.replace(stats, **_slot_usage(slots0, slots1, self.segments))
    return RoundResult(self.plan, groups, self.rnd.deferred, stats, list(self.rnd.rejected))

  # --- requests ---------------------------------------------------------------------

  def _launch(self, key: Key) -> None:
    n = self.tries.get(key, 0)
    self.tries[key] = n + 1
    rid = f"{self.rid_prefix}-{self.plan.epoch}-{self.plan.index}-{key[0]}-{key[1]}-{n}"
    request = dataclasses.replace(self.make_request(*key), rid=rid)
    prefix = self.so_far.get(key)
    if prefix is not None and prefix.output_ids:
      request = request.continued(prefix.output_ids)
      self.events["resumed"] += 1
    task = asyncio.ensure_future(self.rollout.generate(request, str(key[0])))
    self.tasks[task] = (key, rid, request)

  def _record(self, key: Key, out: Completion, request: GenerateRequest) -> Completion:
    """The whole response so far, from this request's output."""
    self.segments.append(out)
    out = out.pinned(self.version)
    prefix = self.so_far.get(key)  # only ever set when recycling
    if prefix is None or not prefix.output_ids:
      self.new_tokens[key] = len(out.output_ids)
      return out
    assert self.decode is not None, "checked by run_round"
    self.new_tokens[key] = self.new_tokens.get(key, 0) + len(out.output_ids)
    ids = prefix.output_ids + out.output_ids
    text = protocol.output_text(ids, out.finish_reason, request.sampling, self.decode)
    return prefix.continued_by(out, text)

  async def _abort(self, keys: list[Key]) -> None:
    live = {k: rid for k, rid, _ in self.tasks.values()}
    rids = [live[k] for k in keys if k in live and live[k] not in self.aborted_rids]
    self.aborted_rids.update(rids)
    await asyncio.gather(*(self.rollout.abort(r) for r in rids), return_exceptions=True)

  def _keep_news(self, before: int) -> None:
    if self.on_kept is None:
      return
    for p in list(self.rnd.kept)[before:]:
      self.on_kept(p, [self.finished[(p, j)] for j in self.rnd.kept[p]])

  # --- one finished request ---------------------------------------------------------

  async def _on_done(self, t: asyncio.Task) -> None:
    key, rid, request = self.tasks.pop(t)
    error = t.exception()
    if isinstance(error, RequestRejected):
      prefix = self.so_far.get(key)
      if prefix is not None and prefix.output_ids:
        if key in self.rnd.outstanding:
          self._restart(key, error)
      else:
        await self._reject(key, error)
      return
    whole = self._record(key, t.result(), request)  # other errors fail the round
    if whole.finish_type == "abort":
      self._on_aborted(key, rid, whole)
      return
    self.so_far.pop(key, None)
    if key not in self.rnd.outstanding:
      if self.recycle:  # finished as its abort went out: carried whole
        self.finished[key] = whole
      return
    self.finished[key] = whole
    if self.on_finished is not None:
      self.on_finished(key[0], whole)
    kept_before = len(self.rnd.kept)
    await self._abort(self.rnd.finish(*key))
    self._keep_news(kept_before)

  def _restart(self, key: Key, why: BaseException) -> None:
    """A continuation the backend refused: the response starts again from scratch.

    It happens when the partial tokens cannot be a prompt (a vision pad id
    without its media: requests stop at vision ids, Tokenizer.response_stop_ids,
    so only a backend that ignores stop_token_ids gets there); those tokens
    are discarded.
    """
    prefix = self.so_far.pop(key)
    earlier = len(prefix.output_ids) - self.new_tokens.pop(key, 0)
    self.events["lost_tokens"] += earlier
    self.events["restarted"] += 1
    log.warning("continuation of %s refused (%s); generating it again from scratch", key, why)
    self._launch(key)

  async def _reject(self, key: Key, why: BaseException) -> None:
    """A fresh request no server can serve (over its context, too large): the
    prompt is dropped, not retried round after round."""
    if key[0] not in self.rnd.rejected:
      log.warning("prompt %s refused by the backend, dropped: %s", key[0], why)
    kept_before = len(self.rnd.kept)
    await self._abort(self.rnd.reject(key[0]))
    self._keep_news(kept_before)

  def _on_aborted(self, key: Key, rid: str, whole: Completion) -> None:
    """An aborted request: ours (nothing to do), or the backend's own (a
    weight-update pause, an engine error), continued (recycling) or rerun.
    One that made progress is not a failure when it is continued."""
    if self.recycle:
      self.so_far[key] = whole
    if rid in self.aborted_rids or key not in self.rnd.outstanding:
      return
    new = self.new_tokens.get(key, 0)
    if not (self.recycle and new > self.progress.get(key, 0)):
      self.stalls[key] = self.stalls.get(key, 0) + 1
    self.progress[key] = new
    if self.stalls.get(key, 0) > self.max_retries:
      raise RuntimeError(
        f"request {rid} aborted by the backend {self.stalls[key]} times without "
        f"progress: {whole.finish_reason}"
      )
    self._launch(key)

  # --- the end of the round ---------------------------------------------------------

  async def _stop_the_rest(self) -> None:
    """Whatever is still running is speculation to stop (or a failed round's
    leftovers): abort it and wait, so the next round starts on free slots,
    no stray request outlives its round, and (recycling) what it decoded is
    carried."""
    if not self.tasks:
      return
    await self._abort([k for k, _, _ in self.tasks.values()])
    _, pending = await asyncio.wait(list(self.tasks), timeout=self.abort_grace_s)
    for t in pending:
      t.cancel()
    for t, (key, _, request) in sorted(self.tasks.items(), key=lambda kv: self.order[kv[1][0]]):
      if t.done() and not t.cancelled() and t.exception() is None:
        whole = self._record(key, t.result(), request)
        if self.recycle:
          if whole.finish_type == "abort":
            self.so_far[key] = whole
          else:
            self.so_far.pop(key, None)
            self.finished[key] = whole

  def _carry(self) -> dict[Key, Carried]:
    """Recycling: the responses of prompts neither kept nor rejected, as they stand."""
    carry: dict[Key, Carried] = {}
    if not self.recycle:
      return carry
    for p in self.plan.prompts:
      if p in self.rnd.kept or p in self.rnd.rejected:
        continue
      for j in range(self.plan.responses):
        if (p, j) in self.finished:
          carry[(p, j)] = Carried(True, self.finished[(p, j)].to_dict())
        elif (p, j) in self.so_far and self.so_far[(p, j)].output_ids:
          carry[(p, j)] = Carried(False, self.so_far[(p, j)].to_dict())
    return carry

  def _stats(self, kept: list, groups: dict, carry: dict[Key, Carried], wall: float) -> RoundStats:
    saved = [(p, j) for p in kept for j in self.rnd.kept[p]] + list(carry)
    generated = sum(len(c.output_ids) for c in self.segments)
    new_saved = sum(self.new_tokens.get(k, 0) for k in saved)
    kept_lens = [len(c.output_ids) for g in groups.values() for c in g]
    requests = sum(self.tries.values())
    return RoundStats(
      kind=self.plan.kind,
      wall_s=wall,
      prompts=len(self.plan.prompts),
      requests=requests,
      aborted=len(self.aborted_rids),
      retried=requests - len(self.tries),
      deferred=len(self.rnd.deferred),
      resumed=self.events["resumed"],
      restarted=self.events["restarted"],
      rejected=len(self.rnd.rejected),
      tokens_kept=sum(kept_lens),
      tokens_generated=generated,
      tokens_resumed=self.tokens_resumed,
      tokens_carried=sum(len(c.completion["output_ids"]) for c in carry.values()),
      tokens_discarded=generated - new_saved + self.events["lost_tokens"],
      max_kept_len=max(kept_lens, default=0),
    )


def _slot_usage(before: SlotStats, after: SlotStats, outputs: Sequence) -> dict[str, Any]:
  """decode_steps and slot_idle_fraction of a round from the engine's counters.

  Slot-steps: every decode step computes all slots; a slot is busy for one
  step per token after its first (the first comes from the prefill). This
  assumes the round has the engine to itself.
  """
  steps = after.decode_steps - before.decode_steps
  busy = sum(max(len(c.output_ids) - 1, 0) for c in outputs)
  idle = 1.0 - busy / (steps * after.num_slots) if steps else 0.0
  return {"decode_steps": steps, "slot_idle_fraction": idle}
