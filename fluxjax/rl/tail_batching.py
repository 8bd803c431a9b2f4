"""Flexes tail batching: speculative short rounds, deferred long prompts.

A short round launches ceil(eta*P) prompts, keeps the first P prompts to
finish and aborts the rest. Prompts that lose the race go to a long-prompt
queue; once it holds P prompts a long round runs them without speculation.
Each prompt of an epoch is trained exactly once; at the end of the epoch
whatever is left runs without speculation. eta = 1.0 disables speculation and
gives plain batching in dataset order.

Two modes (`recycle`):
  recycle=True, the default (partial rollouts: APRIL, the Flux design). eta
    widens the prompts only: every launched prompt runs exactly R responses
    and a kept prompt is all of them, so which responses train does not
    depend on their length. The responses of a prompt that loses the race
    are aborted and kept as they stand (tokens, behaviour logprobs, per-token
    versions: finished ones whole), and a later round continues each
    unfinished one from prompt + its tokens. A response the backend aborts on
    its own (a weight-update pause) is continued the same way. No decode work
    is discarded. The carried responses are part of the batcher's
    (checkpointed) state.
  recycle=False (Flexes as published): a short round also launches
    ceil(eta*R) responses per prompt and keeps a prompt's first R to finish;
    aborted work is discarded and a deferred prompt is generated again from
    scratch. The kept responses are biased towards short ones
    (bench/tail.py measures it).

`continue_in` says where a deferred prompt's carried responses go on:
"long_round" (Flexes' order: it waits in the long-prompt queue until P
have gathered, so its first tokens may be several policy versions old when
it trains) or "next_round" (APRIL's order: it goes to the front of the
fresh queue and races again, with its head start, in the very next short
round instead of waiting for P others).

Ties (requests that finish in the same event-loop turn) are broken by the
round's request order (prompt order, then response index), never by set
iteration order.

The scheduling (`TailBatcher`, `Round`) is pure and synchronous so that it can
be property-tested; `run_round` is the asyncio driver that talks to a rollout
backend (a `backend.Sampler`: `generate(body, group)`, `abort(rid)`, and
`slot_stats()` where the backend has slot counters).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from fluxjax.rollout import protocol
from fluxjax.rollout.backend import Sampler, SlotStats
from fluxjax.rollout.client import Completion, RequestRejected

log = logging.getLogger(__name__)

PromptId = Hashable  # int or str: it goes into JSON checkpoints
# Round statistics that are counts, summed over rounds into run totals.
COUNTED_STATS = (
  "aborted",
  "deferred",
  "resumed",
  "restarted",
  "tokens_discarded",
  "tokens_carried",
)
Key = tuple[Any, int]  # (prompt id, response index)


@dataclasses.dataclass(frozen=True)
class Carried:
  """A response of a prompt that was not kept, as it stood when its round ended.

  Attributes:
    finished: it ran to its end (it is not launched again).
    completion: `Completion.to_dict()`; for an unfinished one, the tokens so
      far, from which it is continued.
  """

  finished: bool
  completion: dict


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  """What one round launches and what it keeps.

  Attributes:
    kind: "short" (speculative) or "long" (every launched request is kept).
    prompts: launched prompt ids, in queue order.
    responses: responses per prompt (indices 0 .. responses - 1).
    keep_prompts: the round ends when this many prompts are complete.
    keep_responses: a prompt is complete with this many finished responses.
    epoch: the epoch the round belongs to.
    index: the round's index within the epoch.
    finished: responses that finished in an earlier round (carried): counted,
      not launched.
  """

  kind: str
  prompts: tuple
  responses: int
  keep_prompts: int
  keep_responses: int
  epoch: int
  index: int
  finished: frozenset = frozenset()

  def keys(self) -> list[Key]:
    """Every response of the round, in request order (ties break by it)."""
    return [(p, j) for p in self.prompts for j in range(self.responses)]

  def requests(self) -> list[Key]:
    """The responses the round launches."""
    return [k for k in self.keys() if k not in self.finished]


class Round:
  """The race inside one round: feed finished requests, get aborts back."""

  def __init__(self, plan: RoundPlan):
    self.plan = plan
    self.outstanding: set[Key] = set(plan.requests())
    self.got: dict[Any, list[int]] = {
      p: [j for j in range(plan.responses) if (p, j) in plan.finished] for p in plan.prompts
    }
    self.kept: dict[Any, list[int]] = {}  # prompt -> response indices, in index order
    # Prompts a backend refused (a request that cannot succeed on any server):
    # dropped from the round and the epoch, so the round wants fewer.
    self.rejected: list = []
    self.target = plan.keep_prompts
    # Prompts whose responses all finished in earlier rounds are complete now.
    for p in plan.prompts:
      if len(self.got[p]) >= plan.keep_responses and len(self.kept) < plan.keep_prompts:
        self._keep(p)
    self.done = not plan.prompts or len(self.kept) >= plan.keep_prompts
    if self.done:
      self.outstanding.clear()

  def _keep(self, prompt: PromptId) -> None:
    self.kept[prompt] = sorted(self.got[prompt])[: self.plan.keep_responses]
    self.outstanding.difference_update((prompt, j) for j in range(self.plan.responses))

  def finish(self, prompt: PromptId, index: int) -> list[Key]:
    """Records a finished (not aborted) response.

    Returns:
      The requests to abort now. A request that finishes after it was told to
      abort (a race with the backend) does not count for the round.
    """
    key = (prompt, index)
    if self.done or key not in self.outstanding:
      return []
    self.outstanding.discard(key)
    got = self.got[prompt]
    got.append(index)
    if len(got) < self.plan.keep_responses:
      return []
    before = set(self.outstanding)
    self._keep(prompt)
    return self._to_abort(before)

  def reject(self, prompt: PromptId) -> list[Key]:
    """Drops a prompt whose request the backend refused; returns the requests to abort.

    The round then wants min(P, launched - rejected) prompts: with fewer
    left it ends with what it kept.
    """
    if self.done or prompt in self.kept or prompt in self.rejected:
      return []
    self.rejected.append(prompt)
    before = set(self.outstanding)
    self.outstanding.difference_update((prompt, j) for j in range(self.plan.responses))
    self.target = min(self.plan.keep_prompts, len(self.plan.prompts) - len(self.rejected))
    return self._to_abort(before)

  def _to_abort(self, before: set[Key]) -> list[Key]:
    """The requests outstanding `before` that no longer are; all of them once the round is full."""
    if len(self.kept) >= self.target:
      self.done = True
      self.outstanding.clear()
    return sorted(before - self.outstanding, key=repr)

  @property
  def deferred(self) -> list:
    """Launched prompts that did not make the cut (only after `done`)."""
    return [p for p in self.plan.prompts if p not in self.kept and p not in self.rejected]


class TailBatcher:
  """Prompt queue, long-prompt queue, carried responses and per-epoch bookkeeping.

  `plan_round` does not change the state; `commit` applies a finished round.
  A checkpoint taken between the two therefore replays the interrupted round
  instead of losing its prompts.

  Args:
    prompts_per_round: P, the prompts a round keeps (the GRPO batch).
    responses_per_prompt: R, the responses of a kept prompt.
    eta: the speculation factor (>= 1; 1 disables it).
    recycle: partial-rollout recycling (see the module docstring).
    continue_in: "long_round" or "next_round": where deferred prompts go on
      (see the module docstring); without recycling always the long round.
  """

  def __init__(
    self,
    prompts_per_round: int,
    responses_per_prompt: int,
    eta: float = 1.25,
    recycle: bool = True,
    continue_in: str = "long_round",
  ):
    if prompts_per_round < 1 or responses_per_prompt < 1:
      raise ValueError("prompts_per_round and responses_per_prompt must be >= 1")
    if eta < 1.0:
      raise ValueError(f"tail_batching.eta must be >= 1.0 (1.0 disables it), got {eta}")
    self.P = prompts_per_round
    self.R = responses_per_prompt
    self.eta = float(eta)
    self.recycle = bool(recycle)
    if continue_in not in ("long_round", "next_round"):
      raise ValueError(
        f"tail_batching.continue_in must be long_round or next_round, got {continue_in!r}"
      )
    self.continue_in = continue_in if self.recycle else "long_round"
    self.epoch = -1
    self.round_index = 0
    self.fresh: list = []  # not yet tried this epoch, in dataset order
    self.long: list = []  # lost a short round; waits for a long round
    self.trained: list = []  # kept this epoch, in training order
    self.carried: dict[Any, dict[int, Carried]] = {}  # prompt -> response index -> response

  # The launch widths; the small epsilon keeps eta*P = 10.000000001 at 10.
  @property
  def launch_prompts(self) -> int:
    return max(self.P, math.ceil(self.eta * self.P - 1e-9))

  @property
  def launch_responses(self) -> int:
    if self.recycle:
      return self.R
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
    self.carried = {}

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

    def mk(kind: str, prompts: Sequence, r: int, kp: int) -> RoundPlan:
      finished = frozenset(
        (p, j) for p in prompts for j, c in self.carried.get(p, {}).items() if c.finished and j < r
      )
      return RoundPlan(kind, tuple(prompts), r, kp, self.R, self.epoch, self.round_index, finished)

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

  def commit(
    self, rnd: Round, *, partial: bool = False, carry: Mapping[Key, Carried] | None = None
  ) -> list:
    """Applies a round. Returns the prompt ids trained, in finish order.

    Args:
      rnd: the round, done (or failed part way, with `partial`).
      partial: applies a round that failed part way (a backend error): its
        kept prompts count as trained (the caller has them), the others go
        back to the front of the queue they came from, not to the long queue,
        since they did not lose a race.
      carry: with recycling, the responses of launched prompts that were not
        kept, as they stood at the round's end; a later round continues them.
        Ignored without recycling (that work is discarded).
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
      self.carried.pop(p, None)
    if self.recycle:
      for (p, j), c in (carry or {}).items():
        if p not in launched or p in rnd.kept:
          raise RuntimeError(f"carried response {(p, j)!r} is not of a deferred prompt")
        self.carried.setdefault(p, {})[j] = c
    for p in rnd.rejected:
      self.carried.pop(p, None)
    self.round_index += 1
    self.trained.extend(kept)
    if partial and not rnd.done:
      kept_set = set(kept) | set(rnd.rejected)
      self.fresh = [p for p in self.fresh if p not in kept_set]
      self.long = [p for p in self.long if p not in kept_set]
      return kept
    self.fresh = [p for p in self.fresh if p not in launched]
    if self.continue_in == "next_round":
      # Deferred prompts race again first, continued from where they stopped.
      self.fresh = rnd.deferred + self.fresh
      self.long = [p for p in self.long if p not in launched]
      return kept
    # Deferred prompts join the back of the long queue; ones already there
    # (never deferred twice: long rounds keep everything) keep their place.
    self.long = [p for p in self.long if p not in launched] + rnd.deferred
    return kept

  def get_state(self) -> dict:
    return {
      "P": self.P,
      "R": self.R,
      "eta": self.eta,
      "recycle": self.recycle,
      "epoch": self.epoch,
      "round_index": self.round_index,
      "fresh": list(self.fresh),
      "long": list(self.long),
      "trained": list(self.trained),
      # A list, not a dict: prompt ids stay ints through JSON.
      "carried": [
        [p, j, c.finished, c.completion]
        for p, responses in self.carried.items()
        for j, c in sorted(responses.items())
      ],
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
    self.carried = {}
    rows = state.get("carried", [])
    if rows and not self.recycle:
      log.warning(
        "recycling is off: %d carried responses of the checkpoint are generated again", len(rows)
      )
      return
    for p, j, finished, completion in rows:
      self.carried.setdefault(p, {})[int(j)] = Carried(bool(finished), dict(completion))


# --- the asyncio driver -------------------------------------------------------------


@dataclasses.dataclass
class RoundResult:
  """A committed round.

  Attributes:
    plan: what was launched.
    groups: prompt id -> its R kept completions (index order), in the order
      the prompts completed.
    deferred: launched prompts not kept (to the long-prompt queue, or with
      continue_in="next_round" to the front of the fresh queue).
    rejected: launched prompts a backend refused (RequestRejected on a fresh
      request: it cannot succeed on any server); dropped from the epoch, for
      the caller to count and release.
    stats: kind, wall_s, prompts, requests, aborted, retried, deferred,
      resumed (requests that continued a response), tokens_kept (every token
      of the kept responses), tokens_generated (decoded in this round),
      tokens_resumed (carried into the round by the responses it continued),
      tokens_carried (carried out of it), tokens_discarded (decoded, in this
      round or, for a restarted response, before it, and neither kept nor
      carried), restarted (continuations the backend refused, generated again
      from scratch), max_kept_len, and with a
      slot-reporting backend decode_steps and slot_idle_fraction.
  """

  plan: RoundPlan
  groups: dict
  deferred: list
  stats: dict
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
  make_body: Callable[[PromptId, int], dict],
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
    make_body: (prompt id, response index) -> SGLang /generate body (with
      input_ids when recycling); `rid` is set here, and a continued response
      gets `protocol.continue_body` of it.
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
  recycle = batcher.recycle
  if recycle and decode is None:
    raise ValueError("recycling continues responses: run_round needs `decode`")
  rnd = Round(plan)
  order = {k: i for i, k in enumerate(plan.keys())}
  slots0 = rollout.slot_stats()
  t0 = time.perf_counter()
  tasks: dict[asyncio.Task, tuple[Key, str, dict]] = {}
  tries: dict[Key, int] = {}
  finished: dict[Key, Completion] = {}
  # Unfinished responses so far (recycling): carried in, or aborted here.
  so_far: dict[Key, Completion] = {}
  for p in plan.prompts:
    for j, c in batcher.carried.get(p, {}).items():
      (finished if c.finished else so_far)[(p, j)] = Completion.from_dict(c.completion)
  tokens_resumed = sum(len(c.output_ids) for k, c in so_far.items() if k in rnd.outstanding)
  # Tokens decoded in this round by each response's current attempt.
  new_tokens: dict[Key, int] = {}
  segments: list[Completion] = []  # every request's output, aborted ones included
  aborted_rids: set[str] = set()
  # resumed: requests that continued a response; restarted: continuations
  # the backend refused, run again from scratch; lost_tokens: what those
  # had decoded before this round.
  events: collections.Counter = collections.Counter()
  stalls: dict[Key, int] = {}  # backend aborts of a response that gained no tokens
  progress: dict[Key, int] = {}  # its new tokens at its last backend abort

  def launch(key: Key) -> None:
    n = tries.get(key, 0)
    tries[key] = n + 1
    rid = f"{rid_prefix}-{plan.epoch}-{plan.index}-{key[0]}-{key[1]}-{n}"
    body = {**make_body(*key), "rid": rid}
    prefix = so_far.get(key)
    if prefix is not None and prefix.output_ids:
      body = protocol.continue_body(body, prefix.output_ids)
      events["resumed"] += 1
    tasks[asyncio.ensure_future(rollout.generate(body, str(key[0])))] = (key, rid, body)

  def record(key: Key, out: Completion, body: dict) -> Completion:
    """The whole response so far, from this request's output."""
    segments.append(out)
    out = out.pinned(version)
    prefix = so_far.get(key)  # only ever set when recycling
    if prefix is None or not prefix.output_ids:
      new_tokens[key] = len(out.output_ids)
      return out
    assert decode is not None, "checked at the start"
    new_tokens[key] = new_tokens.get(key, 0) + len(out.output_ids)
    sampling = protocol.SamplingParams.from_dict(body.get("sampling_params"))
    ids = prefix.output_ids + out.output_ids
    return prefix.continued_by(out, protocol.output_text(ids, out.finish_reason, sampling, decode))

  def is_refused_continuation(t: asyncio.Task, key: Key) -> bool:
    prefix = so_far.get(key)
    return (
      isinstance(t.exception(), RequestRejected) and prefix is not None and bool(prefix.output_ids)
    )

  def restart(key: Key, why: BaseException | None) -> None:
    """A continuation the backend refused: the response starts again from scratch.

    It happens when the partial tokens cannot be a prompt (a vision pad id
    without its media: requests stop at vision ids, Tokenizer.response_stop_ids,
    so only a backend that ignores stop_token_ids gets there); those tokens
    are discarded.
    """
    prefix = so_far.pop(key)
    earlier = len(prefix.output_ids) - new_tokens.pop(key, 0)
    events["lost_tokens"] += earlier
    events["restarted"] += 1
    log.warning("continuation of %s refused (%s); generating it again from scratch", key, why)
    launch(key)

  async def abort(keys: list[Key]) -> None:
    live = {k: rid for k, rid, _ in tasks.values()}
    rids = [live[k] for k in keys if k in live and live[k] not in aborted_rids]
    aborted_rids.update(rids)
    await asyncio.gather(*(rollout.abort(r) for r in rids), return_exceptions=True)

  def keep_news(before: int) -> None:
    if on_kept is None:
      return
    for p in list(rnd.kept)[before:]:
      on_kept(p, [finished[(p, j)] for j in rnd.kept[p]])

  keep_news(0)  # prompts whose responses all finished in earlier rounds
  for key in sorted(rnd.outstanding, key=order.__getitem__):
    launch(key)
  try:
    while not rnd.done:
      done, _ = await asyncio.wait(list(tasks), return_when=asyncio.FIRST_COMPLETED)
      for t in sorted(done, key=lambda t: order[tasks[t][0]]):
        key, rid, body = tasks.pop(t)
        if is_refused_continuation(t, key):
          if key in rnd.outstanding:
            restart(key, t.exception())
          continue
        if isinstance(t.exception(), RequestRejected):
          # A fresh request no server can serve (over its context, too
          # large): the prompt is dropped, not retried round after round.
          if key[0] not in rnd.rejected:
            log.warning("prompt %s refused by the backend, dropped: %s", key[0], t.exception())
          kept_before = len(rnd.kept)
          await abort(rnd.reject(key[0]))
          keep_news(kept_before)
          continue
        whole = record(key, t.result(), body)  # RequestRejected etc. fail the round
        if whole.finish_type == "abort":
          if recycle:
            so_far[key] = whole
          if rid not in aborted_rids and key in rnd.outstanding:
            # The backend's own abort (a weight-update pause, an engine
            # error): continued (recycling) or rerun. One that made progress
            # is not a failure when it is continued.
            if not (recycle and new_tokens.get(key, 0) > progress.get(key, 0)):
              stalls[key] = stalls.get(key, 0) + 1
            progress[key] = new_tokens.get(key, 0)
            if stalls.get(key, 0) > max_retries:
              raise RuntimeError(
                f"request {rid} aborted by the backend {stalls[key]} times without "
                f"progress: {whole.finish_reason}"
              )
            launch(key)
          continue
        so_far.pop(key, None)
        if key not in rnd.outstanding:
          if recycle:  # finished as its abort went out: carried whole
            finished[key] = whole
          continue
        finished[key] = whole
        if on_finished is not None:
          on_finished(key[0], whole)
        kept_before = len(rnd.kept)
        await abort(rnd.finish(*key))
        keep_news(kept_before)
  except Exception as e:
    failure: Exception | None = e
  else:
    failure = None
  finally:
    # Whatever is still running is speculation to stop (or a failed round's
    # leftovers): abort it and wait, so the next round starts on free slots,
    # no stray request outlives its round, and (recycling) what it decoded
    # is carried.
    if tasks:
      await abort([k for k, _, _ in tasks.values()])
      _, pending = await asyncio.wait(list(tasks), timeout=abort_grace_s)
      for t in pending:
        t.cancel()
      for t, (key, _, body) in sorted(tasks.items(), key=lambda kv: order[kv[1][0]]):
        if t.done() and not t.cancelled() and t.exception() is None:
          whole = record(key, t.result(), body)
          if recycle:
            if whole.finish_type == "abort":
              so_far[key] = whole
            else:
              so_far.pop(key, None)
              finished[key] = whole
  wall = time.perf_counter() - t0
  carry: dict[Key, Carried] = {}
  if recycle:
    for p in plan.prompts:
      if p in rnd.kept or p in rnd.rejected:
        continue
      for j in range(plan.responses):
        if (p, j) in finished:
          carry[(p, j)] = Carried(True, finished[(p, j)].to_dict())
        elif (p, j) in so_far and so_far[(p, j)].output_ids:
          carry[(p, j)] = Carried(False, so_far[(p, j)].to_dict())
  if failure is not None:
    kept = batcher.commit(rnd, partial=True, carry=carry)
    raise RoundFailed(
      f"round {plan.epoch}/{plan.index} failed after keeping {len(kept)} of "
      f"{plan.keep_prompts} prompts: {failure!r}",
      kept,
      rnd.rejected,
    ) from failure

  kept = batcher.commit(rnd, carry=carry)
  groups = {p: [finished[(p, j)] for j in rnd.kept[p]] for p in kept}
  saved = [k for p in kept for k in ((p, j) for j in rnd.kept[p])] + list(carry)
  generated = sum(len(c.output_ids) for c in segments)
  discarded = generated - sum(new_tokens.get(k, 0) for k in saved) + events["lost_tokens"]
  stats = {
    "kind": plan.kind,
    "wall_s": wall,
    "prompts": len(plan.prompts),
    "requests": sum(tries.values()),
    "aborted": len(aborted_rids),
    "retried": sum(tries.values()) - len(tries),
    "deferred": len(rnd.deferred),
    "resumed": events["resumed"],
    "restarted": events["restarted"],
    "rejected": len(rnd.rejected),
    "tokens_kept": sum(len(c.output_ids) for g in groups.values() for c in g),
    "tokens_generated": generated,
    "tokens_resumed": tokens_resumed,
    "tokens_carried": sum(len(c.completion["output_ids"]) for c in carry.values()),
    "tokens_discarded": discarded,
    "max_kept_len": max((len(c.output_ids) for g in groups.values() for c in g), default=0),
  }
  slots1 = rollout.slot_stats()
  if slots0 is not None and slots1 is not None:
    stats.update(_slot_usage(slots0, slots1, segments))
  return RoundResult(plan, groups, rnd.deferred, stats, list(rnd.rejected))


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
