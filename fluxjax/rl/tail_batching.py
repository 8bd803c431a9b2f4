"""Flexes tail batching: speculative short rounds, deferred long prompts.

A short round launches ceil(eta*P) prompts, keeps the first P prompts to finish and
defers the rest to a long-prompt queue; `recycle` keeps a loser's partial responses
(APRIL, the Flux design) and `continue_in` says where they go on. The modes are told
in docs/training-loop.md, "One step" (Producer). The scheduling here (`TailBatcher`,
`Round`) is pure and synchronous so that it can be property-tested;
rl/round_driver.py `run_round` is the asyncio driver that runs a round on a rollout
backend.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

PromptId = Hashable  # int or str: it goes into JSON checkpoints
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
    recycle: partial-rollout recycling (docs/training-loop.md, "One step").
    continue_in: "long_round" or "next_round": where deferred prompts go on
      (docs/training-loop.md, "One step"); without recycling always the long round.
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

  def requeue(self, prompt_ids: Sequence[PromptId]) -> None:
    """Kept prompts that will not train after all (their group went stale
    waiting to be trained) go back to the front of the fresh queue, to be
    launched again from scratch."""
    kept = set(self.trained)
    missing = [p for p in prompt_ids if p not in kept]
    if missing:
      raise ValueError(f"requeue of prompts no round kept this epoch: {missing!r}")
    back = set(prompt_ids)
    self.trained = [p for p in self.trained if p not in back]
    self.fresh = list(prompt_ids) + self.fresh

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
