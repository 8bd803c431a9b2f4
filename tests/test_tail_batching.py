"""Tail batching: no prompt lost or trained twice, whatever the finish order."""

import asyncio
import json
import random

import hypothesis
import pytest
from hypothesis import strategies as st

from fluxjax.rl import tail_batching as tb
from fluxjax.rollout.backend import SlotStats
from fluxjax.rollout.client import Completion


def simulate_round(rnd: tb.Round, finish_time) -> None:
  """Feeds a round its completions in order of `finish_time(key)`; aborts stick."""
  aborted = set()
  for key in sorted(rnd.plan.requests(), key=lambda k: (finish_time(k), repr(k))):
    if key in aborted:
      continue
    aborted.update(rnd.finish(*key))
  assert rnd.done
  assert not rnd.outstanding


def run_epoch(batcher: tb.TailBatcher, prompts, finish_time, limit=lambda: None):
  batcher.start_epoch(prompts)
  rounds = []
  while (plan := batcher.plan_round(limit=limit())) is not None:
    rnd = tb.Round(plan)
    simulate_round(rnd, finish_time)
    # Checkpoint round trip between rounds: the state is plain JSON.
    state = json.loads(json.dumps(batcher.get_state()))
    batcher.set_state(state)
    kept = batcher.commit(rnd)
    rounds.append((plan, kept, rnd))
    assert len(rounds) <= 2 * len(prompts) + 2, "the epoch does not terminate"
  return rounds


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(
  n=st.integers(0, 40),
  P=st.integers(1, 6),
  R=st.integers(1, 4),
  eta=st.sampled_from([1.0, 1.1, 1.25, 1.5, 2.0]),
  epochs=st.integers(1, 2),
  seed=st.integers(0, 2**32 - 1),
)
def test_each_prompt_trained_exactly_once_per_epoch(n, P, R, eta, epochs, seed):
  rng = random.Random(seed)
  batcher = tb.TailBatcher(P, R, eta)
  for _ in range(epochs):
    prompts = list(range(n))
    rng.shuffle(prompts)
    # Random per-request finish times, with a per-prompt scale so that some
    # prompts are systematically long (as in real tails) and ties happen.
    scale = {p: rng.choice([1, 1, 2, 10]) for p in prompts}
    times = {}
    ft = lambda k: times.setdefault(k, scale[k[0]] * rng.randint(0, 5))
    rounds = run_epoch(batcher, prompts, ft)
    trained = [p for _, kept, _ in rounds for p in kept]
    assert sorted(trained) == sorted(prompts)  # none dropped, none twice
    assert batcher.trained == trained
    assert batcher.epoch_done and not batcher.long  # the long queue drained
    for plan, kept, rnd in rounds:
      assert len(kept) <= P
      assert all(len(rnd.kept[p]) == R and len(set(rnd.kept[p])) == R for p in kept)
      if plan.kind == "long":
        assert plan.responses == R and set(kept) == set(plan.prompts)
    # Every round but the epoch's last trains a full batch of P prompts.
    assert all(len(kept) == P for _, kept, _ in rounds[:-1])


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
  n=st.integers(0, 30),
  P=st.integers(1, 6),
  R=st.integers(1, 3),
  eta=st.sampled_from([1.0, 1.25, 1.5]),
  seed=st.integers(0, 2**32 - 1),
)
def test_smaller_rounds_under_an_admission_limit_keep_exactly_once(n, P, R, eta, seed):
  """Rounds capped below P (DAPO refills, partly failed rounds) lose nothing."""
  rng = random.Random(seed)
  prompts = list(range(n))
  limits = []

  def limit():
    limits.append(rng.choice([None, None] + list(range(1, P + 1))))
    return limits[-1]

  rounds = run_epoch(tb.TailBatcher(P, R, eta), prompts, lambda k: rng.randint(0, 9), limit)
  trained = [p for _, kept, _ in rounds for p in kept]
  assert sorted(trained) == prompts
  for (plan, kept, _), cap in zip(rounds, limits):
    assert len(kept) == plan.keep_prompts <= (cap or P)
    if plan.kind == "short":  # as wide as a full round, in proportion
      assert len(plan.prompts) <= max(plan.keep_prompts, -(-eta * plan.keep_prompts // 1))


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
  n=st.integers(0, 30), P=st.integers(1, 5), R=st.integers(1, 3), seed=st.integers(0, 2**32 - 1)
)
def test_eta_one_is_plain_batching(n, P, R, seed):
  rng = random.Random(seed)
  prompts = [f"q{i}" for i in range(n)]
  rng.shuffle(prompts)
  rounds = run_epoch(tb.TailBatcher(P, R, 1.0), prompts, lambda k: rng.random())
  chunks = [prompts[i : i + P] for i in range(0, n, P)]
  assert [list(plan.prompts) for plan, _, _ in rounds] == chunks
  assert [sorted(kept) for _, kept, _ in rounds] == [sorted(c) for c in chunks]
  assert all(plan.responses == R and not rnd.deferred for plan, _, rnd in rounds)


def test_short_round_shape_and_long_round():
  b = tb.TailBatcher(4, 4, 1.25)
  b.start_epoch(range(20))
  plan = b.plan_round()
  assert (plan.kind, len(plan.prompts), plan.responses) == ("short", 5, 5)
  # Prompt 0 is the slow one: it loses and waits in the long queue.
  rnd = tb.Round(plan)
  simulate_round(rnd, lambda k: 100 if k[0] == 0 else k[1])
  assert b.commit(rnd) == [1, 2, 3, 4] and b.long == [0]
  for _ in range(3):
    rnd = tb.Round(b.plan_round())
    simulate_round(rnd, lambda k: 100 if k[0] in (5, 10, 15) else k[1])
    b.commit(rnd)
  assert b.long == [0, 5, 10, 15]
  plan = b.plan_round()
  assert (plan.kind, plan.prompts, plan.responses) == ("long", (0, 5, 10, 15), 4)


def test_commit_rejects_stale_round():
  b = tb.TailBatcher(2, 1, 1.0)
  b.start_epoch([0, 1, 2, 3])
  rnd = tb.Round(b.plan_round())
  simulate_round(rnd, lambda k: 0)
  b.commit(rnd)
  with pytest.raises(RuntimeError):
    b.commit(rnd)


class FakeRollout:
  """Completion after `delay(body)` seconds of 'decoding'; abort returns early."""

  def __init__(self, delay):
    self.delay = delay
    self.events: dict[str, asyncio.Event] = {}
    self.aborts = []

  async def generate(self, body, group=None):
    rid = body["rid"]
    ev = self.events[rid] = asyncio.Event()
    n = body["sampling_params"]["max_new_tokens"]
    try:
      await asyncio.wait_for(ev.wait(), self.delay(body))
      reason, n = {"type": "abort", "message": "Abort"}, 1
    except TimeoutError:
      reason = {"type": "length", "length": n}
    return Completion(rid, "", [7] * n, [0.0] * n, reason, 3, "0", "fake", {})

  async def abort(self, rid):
    self.aborts.append(rid)
    if rid in self.events:
      self.events[rid].set()

  def slot_stats(self):
    return None  # like a fleet: no slot counters


def test_run_round_against_fake_rollout():
  # Prompt 3 is slow for every response; response 2 of each prompt is slow too.
  def length(p, j):
    return 600 if p == 3 else 90 if j == 2 else 5 + p + j

  rollout = FakeRollout(lambda b: b["sampling_params"]["max_new_tokens"] * 1e-3)
  body = lambda p, j: {
    "input_ids": [1, 2, 3],
    "sampling_params": {"max_new_tokens": length(p, j), "ignore_eos": True},
  }
  b = tb.TailBatcher(3, 2, 1.5)  # launches 5 prompts x 3 responses
  b.start_epoch(range(6))

  async def main():
    res = await tb.run_round(rollout, b, body)
    assert res.plan.kind == "short" and (len(res.plan.prompts), res.plan.responses) == (5, 3)
    assert sorted(res.groups) == [0, 1, 2] and b.long == [3, 4]
    assert all(
      len(g) == 2 and all(c.finish_type == "length" for c in g) for g in res.groups.values()
    )
    # The short round ends long before prompt 3's 600 ms.
    assert res.stats["wall_s"] < 0.4 and res.stats["max_kept_len"] <= 10
    assert res.stats["aborted"] == len(rollout.aborts) > 0
    rest = []
    while (r := await tb.run_round(rollout, b, body)) is not None:
      rest.append(r)
    return rest

  rest = asyncio.run(main())
  assert [r.plan.kind for r in rest] == ["long"]
  assert sorted(rest[0].groups) == [3, 4, 5]
  assert sorted(b.trained) == list(range(6)) and b.epoch_done


class SlotRollout(FakeRollout):
  """A FakeRollout with an engine's slot counters: one decode step per output token."""

  def __init__(self, delay, num_slots):
    super().__init__(delay)
    self.decode_steps, self.num_slots = 0, num_slots

  async def generate(self, body, group=None):
    out = await super().generate(body, group)
    self.decode_steps += len(out.output_ids)
    return out

  def slot_stats(self):
    return SlotStats(self.decode_steps, self.num_slots)


def test_round_slot_statistics_come_from_the_backends_counters():
  body = lambda p, j: {"input_ids": [1], "sampling_params": {"max_new_tokens": 3 + p}}
  fast = lambda b: 1e-3
  b = tb.TailBatcher(2, 2, 1.0)  # no speculation: every response is kept
  b.start_epoch(range(2))
  res = asyncio.run(tb.run_round(SlotRollout(fast, num_slots=8), b, body))
  # 2 x 3 + 2 x 4 tokens = 14 decode steps; each response's first token is
  # the prefill's, so 2 x 2 + 2 x 3 = 10 busy slot-steps of 14 x 8.
  assert res.stats["decode_steps"] == 14
  assert res.stats["slot_idle_fraction"] == pytest.approx(1.0 - 10 / (14 * 8))
  b = tb.TailBatcher(2, 2, 1.0)
  b.start_epoch(range(2))
  res = asyncio.run(tb.run_round(FakeRollout(fast), b, body))
  assert "decode_steps" not in res.stats and "slot_idle_fraction" not in res.stats


class FailingRollout(FakeRollout):
  """A FakeRollout whose backend dies (raises) on one prompt's first response."""

  def __init__(self, delay, dies_on):
    super().__init__(delay)
    self.dies_on = dies_on

  async def generate(self, body, group=None):
    if body["rid"].split("-")[3] == str(self.dies_on):
      await asyncio.sleep(0.05)
      raise ConnectionError("server went away")
    return await super().generate(body, group)


def test_failed_round_keeps_what_it_finished_and_requeues_the_rest():
  """A round stopped by a backend error: kept prompts stay trained (they were
  handed out through on_kept), the others go back to the queue front, and a
  streamed epoch (extend) then trains every prompt exactly once."""
  fast = lambda b: 1e-3
  b = tb.TailBatcher(3, 2, 1.0)
  b.start_epoch([])
  b.extend(range(4))
  with pytest.raises(ValueError, match="twice"):
    b.extend([2])
  body = lambda p, j: {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}
  streamed = []

  async def main():
    with pytest.raises(tb.RoundFailed) as err:
      await tb.run_round(
        FailingRollout(fast, dies_on=2),
        b,
        body,
        on_kept=lambda p, comps: streamed.append((p, len(comps))),
      )
    assert sorted(err.value.kept) == [0, 1]
    assert b.fresh == [2, 3] and sorted(b.trained) == [0, 1]
    b.extend([4, 5])
    while await tb.run_round(
      FakeRollout(fast), b, body, on_kept=lambda p, comps: streamed.append((p, len(comps)))
    ):
      pass

  asyncio.run(main())
  assert sorted(p for p, _ in streamed) == list(range(6))  # each handed out once
  assert all(n == 2 for _, n in streamed)
  assert sorted(b.trained) == list(range(6)) and b.epoch_done
