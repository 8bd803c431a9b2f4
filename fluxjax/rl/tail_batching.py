"""Flexes tail batching: speculative short rounds, deferred long prompts.

A short round launches ceil(eta*P) prompts with ceil(eta*R) responses each,
keeps the first P prompts to finish their first R responses, and aborts the
rest. Prompts that lose the race go to a long-prompt queue; once it holds P
prompts a long round runs them without speculation. Each prompt of an epoch is
trained exactly once: a deferred prompt is retrained from scratch in its long
round, and at the end of the epoch whatever is left runs without speculation.

The scheduling (`TailBatcher`, `Round`) is pure and synchronous so that it can
be property-tested; `run_round` is the asyncio driver that talks to a rollout
backend (a `backend.Sampler`: `generate(body, group)`, `abort(rid)`, and
`slot_stats()` where the backend has slot counters).
eta = 1.0 disables speculation and gives plain batching in dataset order.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from fluxjax.rollout.backend import Sampler, SlotStats

PromptId = Hashable  # int or str: it goes into JSON checkpoints
Key = tuple[Any, int]  # (prompt id, response index)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  """What one round launches and what it keeps.

  Attributes:
    kind: "short" (speculative) or "long" (every launched request is kept).
    prompts: launched prompt ids, in queue order.
    responses: responses launched per prompt.
    keep_prompts: the round ends when this many prompts are complete.
    keep_responses: a prompt is complete with this many finished responses.
    epoch: the epoch the round belongs to.
    index: the round's index within the epoch.
  """

  kind: str
  prompts: tuple
  responses: int
  keep_prompts: int
  keep_responses: int
  epoch: int
  index: int

  def requests(self) -> list[Key]:
    return [(p, j) for p in self.prompts for j in range(self.responses)]


class Round:
  """The race inside one round: feed finished requests, get aborts back."""

  def __init__(self, plan: RoundPlan):
    self.plan = plan
    self.outstanding: set[Key] = set(plan.requests())
    self.got: dict[Any, list[int]] = {p: [] for p in plan.prompts}
    self.kept: dict[Any, list[int]] = {}  # prompt -> response indices, finish order
    self.done = not plan.prompts

  def finish(self, prompt: PromptId, index: int) -> list[Key]:
    """Records a finished (not aborted) response.

    Returns:
      The requests to abort now. A request that finishes after it was told to
      abort (a race with the backend) is ignored: its output is discarded.
    """
    key = (prompt, index)
    if self.done or key not in self.outstanding:
      return []
    self.outstanding.discard(key)
    if prompt in self.kept:
      return []
    got = self.got[prompt]
    got.append(index)
    if len(got) < self.plan.keep_responses:
      return []
    self.kept[prompt] = list(got)
    if len(self.kept) == self.plan.keep_prompts:
      self.done = True
      abort = sorted(self.outstanding, key=repr)
    else:
      abort = sorted((k for k in self.outstanding if k[0] == prompt), key=repr)
    self.outstanding.difference_update(abort)
    return abort

  @property
  def deferred(self) -> list:
    """Launched prompts that did not make the cut (only after `done`)."""
    return [p for p in self.plan.prompts if p not in self.kept]


class TailBatcher:
  """Prompt queue, long-prompt queue and per-epoch bookkeeping.

  `plan_round` does not change the state; `commit` applies a finished round.
  A checkpoint taken between the two therefore replays the interrupted round
  instead of losing its prompts.
  """

  def __init__(self, prompts_per_round: int, responses_per_prompt: int, eta: float = 1.25):
    if prompts_per_round < 1 or responses_per_prompt < 1:
      raise ValueError("prompts_per_round and responses_per_prompt must be >= 1")
    if eta < 1.0:
      raise ValueError(f"tail_batching.eta must be >= 1.0 (1.0 disables it), got {eta}")
    self.P = prompts_per_round
    self.R = responses_per_prompt
    self.eta = float(eta)
    self.epoch = -1
    self.round_index = 0
    self.fresh: list = []  # not yet tried this epoch, in dataset order
    self.long: list = []  # lost a short round; waits for a long round
    self.trained: list = []  # kept this epoch, in training order

  # The launch widths; the small epsilon keeps eta*P = 10.000000001 at 10.
  @property
  def launch_prompts(self) -> int:
    return max(self.P, math.ceil(self.eta * self.P - 1e-9))

  @property
  def launch_responses(self) -> int:
    return max(self.R, math.ceil(self.eta * self.R - 1e-9))

  @property
  def epoch_done(self) -> bool:
    return not self.fresh and not self.long

  def start_epoch(self, prompt_ids: Sequence[PromptId]) -> None:
    """Begins an epoch over `prompt_ids` (already shuffled by the caller)."""
    if not self.epoch_done:
      raise RuntimeError(
        f"epoch {self.epoch} still has {len(self.fresh)} fresh and {len(self.long)} long prompts"
      )
    if len(set(prompt_ids)) != len(prompt_ids):
      raise ValueError("an epoch lists a prompt twice")
    self.epoch += 1
    self.round_index = 0
    self.fresh = list(prompt_ids)
    self.long = []
    self.trained = []

  def extend(self, prompt_ids: Sequence[PromptId]) -> None:
    """Appends prompts to the current epoch (a streamed epoch: the coordinator
    tops the queue up from the data loader instead of listing the epoch first).
    """
    queued = set(self.fresh) | set(self.long) | set(self.trained)
    new = list(prompt_ids)
    if len(set(new)) != len(new) or queued.intersection(new):
      raise ValueError("extend() would queue a prompt twice in one epoch")
    self.fresh.extend(new)

  def plan_round(self, limit: int | None = None) -> RoundPlan | None:
    """The next round, or None when the epoch is exhausted.

    `limit` caps the prompts the round keeps (default P): a coordinator that
    is owed fewer than P groups (DAPO refills, a round that failed part way)
    runs a smaller round of the same kind, as eta-wide as a full one.
    """
    k = self.P if limit is None else max(1, min(int(limit), self.P))
    mk = lambda kind, prompts, r, kp: RoundPlan(
      kind, tuple(prompts), r, kp, self.R, self.epoch, self.round_index
    )
    if len(self.long) >= self.P:
      return mk("long", self.long[:k], self.R, k)
    if len(self.fresh) >= k and (k < self.P or len(self.fresh) >= self.P):
      width = self.launch_prompts if k == self.P else math.ceil(self.eta * k - 1e-9)
      n = min(width, len(self.fresh))
      return mk("short", self.fresh[:n], self.launch_responses, k)
    if self.epoch_done:
      return None
    # End of the epoch: too few prompts for a race, so run what is left with
    # no speculation rather than drop it or carry it into the next epoch.
    rest = (self.long + self.fresh)[:k]
    return mk("long", rest, self.R, len(rest))

  def commit(self, rnd: Round, *, partial: bool = False) -> list:
    """Applies a round. Returns the prompt ids trained, in finish order.

    `partial=True` applies a round that failed part way (a backend error):
    its kept prompts count as trained (the caller has them), the others go
    back to the front of the queue they came from, not to the long queue,
    since they did not lose a race.
    """
    plan = rnd.plan
    if not rnd.done and not partial:
      raise RuntimeError("commit of an unfinished round")
    if (plan.epoch, plan.index) != (self.epoch, self.round_index):
      raise RuntimeError(
        f"round {plan.epoch}/{plan.index} is not the current one ({self.epoch}/{self.round_index})"
      )
    launched = set(plan.prompts)
    missing = launched - set(self.fresh) - set(self.long)
    if missing:
      raise RuntimeError(
        f"round launched prompts not queued this epoch: {sorted(missing, key=repr)}"
      )
    kept = list(rnd.kept)
    for p in kept:
      if len(rnd.kept[p]) != self.R:
        raise RuntimeError(f"prompt {p!r} kept {len(rnd.kept[p])} responses, want {self.R}")
    if partial and not rnd.done:
      kept_set = set(kept)
      self.fresh = [p for p in self.fresh if p not in kept_set]
      self.long = [p for p in self.long if p not in kept_set]
      self.trained.extend(kept)
      self.round_index += 1
      return kept
    self.fresh = [p for p in self.fresh if p not in launched]
    # Deferred prompts join the back of the long queue; ones already there
    # (never deferred twice: long rounds keep everything) keep their place.
    self.long = [p for p in self.long if p not in launched] + rnd.deferred
    self.trained.extend(kept)
    self.round_index += 1
    return kept

  def get_state(self) -> dict:
    return {
      "P": self.P,
      "R": self.R,
      "eta": self.eta,
      "epoch": self.epoch,
      "round_index": self.round_index,
      "fresh": list(self.fresh),
      "long": list(self.long),
      "trained": list(self.trained),
    }

  def set_state(self, state: dict) -> None:
    if (state["P"], state["R"]) != (self.P, self.R):
      raise ValueError(
        f"checkpoint has P={state['P']} R={state['R']}, configured P={self.P} R={self.R}"
      )
    # eta may change on resume: it only shapes future rounds.
    self.epoch = int(state["epoch"])
    self.round_index = int(state["round_index"])
    self.fresh = list(state["fresh"])
    self.long = list(state["long"])
    self.trained = list(state["trained"])


# --- the asyncio driver -------------------------------------------------------------


@dataclasses.dataclass
class RoundResult:
  """A committed round.

  Attributes:
    plan: what was launched.
    groups: prompt id -> its R kept completions (finish order), training order.
    deferred: prompts moved to the long-prompt queue.
    stats: wall_s, requests, aborted, retried, tokens_kept, tokens_discarded,
      max_kept_len, and with a slot-reporting backend decode_steps and
      slot_idle_fraction.
  """

  plan: RoundPlan
  groups: dict
  deferred: list
  stats: dict


class RoundFailed(RuntimeError):
  """A round stopped by a backend error; its kept prompts were committed.

  Attributes:
    kept: prompt ids kept (and handed to `on_kept`) before the failure.
  """

  def __init__(self, message: str, kept: list):
    super().__init__(message)
    self.kept = kept


async def run_round(
  rollout: Sampler,
  batcher: TailBatcher,
  make_body: Callable[[PromptId, int], dict],
  *,
  rid_prefix: str = "tb",
  max_retries: int = 2,
  abort_grace_s: float = 30.0,
  on_kept: Callable[[PromptId, list], None] | None = None,
  plan: RoundPlan | None = None,
) -> RoundResult | None:
  """Plans, runs and commits one round on `rollout`.

  Args:
    rollout: the backend (`EmbeddedRollout`, `Fleet`, or what wraps one).
    batcher: the scheduler; committed only if the round succeeds, so a failed
      round loses no prompt.
    make_body: (prompt id, response index) -> SGLang /generate body; `rid` is
      set here.
    rid_prefix: request ids are `{prefix}-{epoch}-{round}-{prompt}-{index}-{try}`.
    max_retries: re-launches of a response that the backend aborted on its own
      (pause, engine error) before the round fails.
    abort_grace_s: how long to wait for aborted requests to come back before
      cancelling their tasks.
    on_kept: called with (prompt id, its R completions) the moment a prompt is
      kept, so a stream trainer can start on it while the round runs.
    plan: the round to run (default: `batcher.plan_round()`).

  Returns:
    The result, or None if the epoch is exhausted (call `start_epoch`).

  Raises:
    RoundFailed: a backend error stopped the round; what was kept is
      committed (`commit(partial=True)`), the rest is queued again.
  """
  plan = plan or batcher.plan_round()
  if plan is None:
    return None
  rnd = Round(plan)
  slots0 = rollout.slot_stats()
  t0 = time.perf_counter()
  tasks: dict[asyncio.Task, tuple[Key, str]] = {}
  tries: dict[Key, int] = {}
  finished: dict[Key, Any] = {}
  all_outputs: list = []  # every completion, aborted ones included (slot accounting)
  aborted_rids: set[str] = set()

  def launch(key: Key) -> None:
    n = tries.get(key, 0)
    tries[key] = n + 1
    rid = f"{rid_prefix}-{plan.epoch}-{plan.index}-{key[0]}-{key[1]}-{n}"
    body = {**make_body(*key), "rid": rid}
    tasks[asyncio.ensure_future(rollout.generate(body, str(key[0])))] = (key, rid)

  async def abort(keys: list[Key]) -> None:
    live = {k: rid for k, rid in tasks.values()}
    rids = [live[k] for k in keys if k in live and live[k] not in aborted_rids]
    aborted_rids.update(rids)
    await asyncio.gather(*(rollout.abort(r) for r in rids), return_exceptions=True)

  for key in plan.requests():
    launch(key)
  try:
    while not rnd.done:
      done, _ = await asyncio.wait(list(tasks), return_when=asyncio.FIRST_COMPLETED)
      for t in done:
        key, rid = tasks.pop(t)
        out = t.result()  # RequestRejected / NoServerAvailable fail the round
        all_outputs.append(out)
        if out.finish_type == "abort" and rid not in aborted_rids:
          if key not in rnd.outstanding:
            continue
          if tries[key] > max_retries:
            raise RuntimeError(
              f"request {rid} aborted by the backend {tries[key]} times: {out.finish_reason}"
            )
          launch(key)
          continue
        if out.finish_type != "abort" and key in rnd.outstanding:
          finished[key] = out
          kept_before = len(rnd.kept)
          await abort(rnd.finish(*key))
          if on_kept is not None and len(rnd.kept) > kept_before:
            on_kept(key[0], [finished[(key[0], j)] for j in rnd.kept[key[0]]])
  except Exception as e:
    failure: Exception | None = e
  else:
    failure = None
  finally:
    # Whatever is still running is speculation to discard (or a failed
    # round's leftovers): abort it and wait, so the next round starts on free
    # slots and no stray request outlives its round.
    if tasks:
      await abort([k for k, _ in tasks.values()])
      _, pending = await asyncio.wait(list(tasks), timeout=abort_grace_s)
      for t in pending:
        t.cancel()
      for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is None:
          all_outputs.append(t.result())
  wall = time.perf_counter() - t0
  if failure is not None:
    kept = batcher.commit(rnd, partial=True)
    raise RoundFailed(
      f"round {plan.epoch}/{plan.index} failed after keeping {len(kept)} of "
      f"{plan.keep_prompts} prompts: {failure!r}",
      kept,
    ) from failure

  kept = batcher.commit(rnd)
  groups = {p: [finished[(p, j)] for j in rnd.kept[p]] for p in kept}
  kept_ids = {id(c) for g in groups.values() for c in g}
  tokens_kept = sum(len(c.output_ids) for g in groups.values() for c in g)
  stats = {
    "kind": plan.kind,
    "wall_s": wall,
    "prompts": len(plan.prompts),
    "requests": sum(tries.values()),
    "aborted": len(aborted_rids),
    "retried": sum(tries.values()) - len(tries),
    "deferred": len(rnd.deferred),
    "tokens_kept": tokens_kept,
    "tokens_discarded": sum(len(c.output_ids) for c in all_outputs if id(c) not in kept_ids),
    "max_kept_len": max((len(c.output_ids) for g in groups.values() for c in g), default=0),
  }
  slots1 = rollout.slot_stats()
  if slots0 is not None and slots1 is not None:
    stats.update(_slot_usage(slots0, slots1, all_outputs))
  return RoundResult(plan, groups, rnd.deferred, stats)


def _slot_usage(before: SlotStats, after: SlotStats, outputs: Sequence) -> dict:
  """decode_steps and slot_idle_fraction of a round from the engine's counters.

  Slot-steps: every decode step computes all slots; a slot is busy for one
  step per token after its first (the first comes from the prefill). This
  assumes the round has the engine to itself.
  """
  steps = after.decode_steps - before.decode_steps
  busy = sum(max(len(c.output_ids) - 1, 0) for c in outputs)
  idle = 1.0 - busy / (steps * after.num_slots) if steps else 0.0
  return {"decode_steps": steps, "slot_idle_fraction": idle}
