"""Tail batching: no prompt lost or trained twice, whatever the finish order."""

import asyncio
import json
import random

import hypothesis
import pytest
from hypothesis import strategies as st

from fluxjax.rl import round_driver as rd
from fluxjax.rl import tail_batching as tb
from fluxjax.rollout.protocol import GenerateRequest
from helpers import OVER_CONTEXT, Act, ScriptedRollout, decode, rid_key


def request(prompt: list[int], max_new: int, **sampling) -> GenerateRequest:
  """A request of `max_new` tokens exactly (no EOS)."""
  return GenerateRequest.of(prompt, {"max_new_tokens": max_new, "ignore_eos": True, **sampling})


def simulate_round(rnd: tb.Round, finish_time) -> dict:
  """Feeds a round its completions in order of `finish_time(key)`; aborts stick.

  Returns the carry of a recycling round: the deferred prompts' responses
  that finished before the round ended, and a paused one for the others.
  """
  aborted = set()
  for key in sorted(rnd.plan.requests(), key=lambda k: (finish_time(k), repr(k))):
    if key in aborted:
      continue
    aborted.update(rnd.finish(*key))
  assert rnd.done
  assert not rnd.outstanding
  carry = {}
  for p in rnd.deferred:
    for j in range(rnd.plan.responses):
      done = j in rnd.got[p]
      carry[(p, j)] = tb.Carried(done, {"output_ids": [7] * (3 if done else 1)})
  return carry


def run_epoch(batcher: tb.TailBatcher, prompts, finish_time, limit=lambda: None):
  batcher.start_epoch(prompts)
  rounds = []
  while (plan := batcher.plan_round(limit=limit())) is not None:
    rnd = tb.Round(plan)
    carry = simulate_round(rnd, finish_time)
    # Checkpoint round trip between rounds: the state is plain JSON.
    state = json.loads(json.dumps(batcher.get_state()))
    batcher.set_state(state)
    kept = batcher.commit(rnd, carry=carry)
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
  recycle=st.booleans(),
  continue_in=st.sampled_from(["long_round", "next_round"]),
)
def test_each_prompt_trained_exactly_once_per_epoch(
  n, P, R, eta, epochs, seed, recycle, continue_in
):
  rng = random.Random(seed)
  batcher = tb.TailBatcher(P, R, eta, recycle=recycle, continue_in=continue_in)
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
      if recycle:  # a kept prompt is all of its responses; finished ones never rerun
        assert plan.responses == R
        assert all(rnd.kept[p] == list(range(R)) for p in kept)
        assert not set(plan.requests()) & plan.finished
    assert not batcher.carried  # every carried response was trained
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
  # Recycling widens the prompts only: a kept prompt is all R of its responses.
  assert b.plan_round().responses == 4
  b = tb.TailBatcher(4, 4, 1.25, recycle=False)
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


def test_a_requeued_prompt_runs_again_first_and_trains_once():
  b = tb.TailBatcher(2, 2, 1.0)
  b.start_epoch(range(6))
  rnd = tb.Round(b.plan_round())
  simulate_round(rnd, lambda k: k[1])
  assert b.commit(rnd) == [0, 1]
  b.requeue([1])  # its group went stale before training
  assert b.trained == [0] and b.fresh[:2] == [1, 2]
  rnd = tb.Round(b.plan_round())
  assert rnd.plan.prompts == (1, 2)
  simulate_round(rnd, lambda k: k[1])
  assert b.commit(rnd) == [1, 2] and b.trained == [0, 1, 2]
  with pytest.raises(ValueError, match="no round kept"):
    b.requeue([5])


def test_commit_rejects_stale_round():
  b = tb.TailBatcher(2, 1, 1.0)
  b.start_epoch([0, 1, 2, 3])
  rnd = tb.Round(b.plan_round())
  simulate_round(rnd, lambda k: 0)
  b.commit(rnd)
  with pytest.raises(RuntimeError):
    b.commit(rnd)


def test_run_round_against_fake_rollout():
  # Prompt 3 is slow for every response; response 2 of each prompt is slow too.
  def length(p, j):
    return 600 if p == 3 else 90 if j == 2 else 5 + p + j

  rollout = ScriptedRollout()
  make = lambda p, j: request([1, 2, 3], length(p, j))
  b = tb.TailBatcher(3, 2, 1.5, recycle=False)  # launches 5 prompts x 3 responses
  b.start_epoch(range(6))

  async def main():
    res = await rd.run_round(rollout, b, make)
    assert res.plan.kind == "short" and (len(res.plan.prompts), res.plan.responses) == (5, 3)
    assert sorted(res.groups) == [0, 1, 2] and b.long == [3, 4]
    assert all(
      len(g) == 2 and all(c.finish_type == "length" for c in g) for g in res.groups.values()
    )
    # The short round ends before prompt 3's 600 ms responses could finish
    # (about 0.1 s alone; a loaded 2-core machine has taken 0.48 s).
    assert res.stats.wall_s < 0.6 and res.stats.max_kept_len <= 10
    assert res.stats.aborted == len(rollout.aborts) > 0
    rest = []
    while (r := await rd.run_round(rollout, b, make)) is not None:
      rest.append(r)
    return rest

  rest = asyncio.run(main())
  assert [r.plan.kind for r in rest] == ["long"]
  assert sorted(rest[0].groups) == [3, 4, 5]
  assert sorted(b.trained) == list(range(6)) and b.epoch_done


def test_round_slot_statistics_come_from_the_backends_counters():
  make = lambda p, j: request([1], 3 + p)
  b = tb.TailBatcher(2, 2, 1.0)  # no speculation: every response is kept
  b.start_epoch(range(2))
  res = asyncio.run(rd.run_round(ScriptedRollout(num_slots=8), b, make, decode=decode))
  # 2 x 3 + 2 x 4 tokens = 14 decode steps; each response's first token is
  # the prefill's, so 2 x 2 + 2 x 3 = 10 busy slot-steps of 14 x 8.
  assert res.stats.decode_steps == 14
  assert res.stats.slot_idle_fraction == pytest.approx(1.0 - 10 / (14 * 8))
  b = tb.TailBatcher(2, 2, 1.0)
  b.start_epoch(range(2))
  res = asyncio.run(rd.run_round(ScriptedRollout(), b, make, decode=decode))
  assert res.stats.decode_steps is None and res.stats.slot_idle_fraction is None


def test_failed_round_keeps_what_it_finished_and_requeues_the_rest():
  """A round stopped by a backend error: kept prompts stay trained (they were
  handed out through on_kept), the others go back to the queue front, and a
  streamed epoch (extend) then trains every prompt exactly once."""
  b = tb.TailBatcher(3, 2, 1.0)
  b.start_epoch([])
  b.extend(range(4))
  with pytest.raises(ValueError, match="twice"):
    b.extend([2])
  make = lambda p, j: request([1], 2)
  dies_on_2 = lambda r, g: (
    Act(seconds=0.05, fail=ConnectionError("server went away"))
    if rid_key(r.rid)[0] == "2"
    else Act()
  )
  streamed = []

  async def main():
    with pytest.raises(rd.RoundFailed) as err:
      await rd.run_round(
        ScriptedRollout(dies_on_2),
        b,
        make,
        on_kept=lambda p, comps: streamed.append((p, len(comps))),
        decode=decode,
      )
    assert sorted(err.value.kept) == [0, 1]
    assert b.fresh == [2, 3] and sorted(b.trained) == [0, 1]
    b.extend([4, 5])
    while await rd.run_round(
      ScriptedRollout(),
      b,
      make,
      on_kept=lambda p, comps: streamed.append((p, len(comps))),
      decode=decode,
    ):
      pass

  asyncio.run(main())
  assert sorted(p for p, _ in streamed) == list(range(6))  # each handed out once
  assert all(n == 2 for _, n in streamed)
  assert sorted(b.trained) == list(range(6)) and b.epoch_done


def test_recycling_continues_aborted_responses_and_discards_nothing():
  prompt = [1, 2, 3]
  lengths = {3: 300, 4: 250}
  length = lambda p, j: lengths.get(p, 5 + p + j)
  make = lambda p, j: request(prompt, length(p, j))
  rollout = ScriptedRollout()
  b = tb.TailBatcher(3, 2, 1.5)  # recycling: 5 prompts x 2 responses
  b.start_epoch(range(6))

  short = asyncio.run(rd.run_round(rollout, b, make, version="1", decode=decode))
  assert (len(short.plan.prompts), short.plan.responses) == (5, 2)
  assert sorted(short.groups) == [0, 1, 2] and b.long == [3, 4]
  assert short.stats.tokens_discarded == 0 and short.stats.tokens_carried > 0
  paused = {(p, j): c for p, cs in b.carried.items() for j, c in cs.items()}
  assert sorted(paused) == [(3, 0), (3, 1), (4, 0), (4, 1)]
  assert all(not c.finished and c.completion["output_ids"] for c in paused.values())
  carried_tokens = sum(len(c.completion["output_ids"]) for c in paused.values())
  assert carried_tokens == short.stats.tokens_carried

  # A checkpoint between the rounds keeps the partial responses.
  resumed = tb.TailBatcher(3, 2, 1.5)
  resumed.set_state(json.loads(json.dumps(b.get_state())))
  assert resumed.carried == b.carried

  sent = len(rollout.requests)
  rest = asyncio.run(rd.run_round(rollout, resumed, make, version="2", decode=decode))
  assert rest.plan.kind == "long" and sorted(rest.groups) == [3, 4, 5]
  assert rest.stats.resumed == 4 and rest.stats.tokens_resumed == carried_tokens
  assert rest.stats.tokens_discarded == 0
  for p in (3, 4):
    for j, c in enumerate(rest.groups[p]):
      m = len(paused[(p, j)].completion["output_ids"])
      n = lengths[p]
      positions = range(len(prompt), len(prompt) + n)
      # Tokens, behaviour logprobs and text equal the uninterrupted response's.
      assert c.output_ids == [pos % 97 for pos in positions]
      assert c.logprobs == [-pos / 1000 for pos in positions]
      assert c.text == decode(c.output_ids) and c.prompt_tokens == len(prompt)
      # Each token keeps the version of the round that sampled it.
      assert c.versions() == ["1"] * m + ["2"] * (n - m)
      assert c.segments == 2
  continued = [x for _, x in rollout.requests[sent:] if len(x.input_ids) > len(prompt)]
  assert len(continued) == 4
  for x in continued:
    m = len(x.input_ids) - len(prompt)
    assert x.sampling.max_new_tokens == lengths[int(rid_key(x.rid)[0])] - m
  assert sorted(resumed.trained) == list(range(6)) and not resumed.carried


def test_discarded_work_without_recycling_and_deterministic_ties():
  make = lambda p, j: request([1], 300 if p == 3 else 5)
  b = tb.TailBatcher(3, 2, 1.5, recycle=False)
  b.start_epoch(range(6))
  res = asyncio.run(rd.run_round(ScriptedRollout(), b, make, decode=decode))
  assert res.stats.tokens_discarded > 0 and not b.carried
  # Equal-length responses finish in the same loop turns: the kept order is
  # the request order, run after run.
  orders = []
  for _ in range(3):
    b = tb.TailBatcher(3, 2, 1.5)
    b.start_epoch(range(6))
    res = asyncio.run(rd.run_round(ScriptedRollout(tick=0.0), b, make, decode=decode))
    orders.append(list(res.groups))
  assert orders == [[0, 1, 2]] * 3


def test_a_refused_continuation_is_generated_again_and_counted():
  """A server refuses a continuation whose partial tokens hold a vision
  placeholder no media backs: the response is generated again from scratch."""
  make = lambda p, j: request([1, 2, 3], 200 if p == 3 else 5)
  b = tb.TailBatcher(3, 1, 1.5)
  b.start_epoch(range(4))
  rollout = ScriptedRollout(
    lambda r, g: (
      Act(refuse="the prompt has 1 image placeholder(s) but the request sent 0")
      if len(r.input_ids) > 3
      else Act()
    )
  )
  short = asyncio.run(rd.run_round(rollout, b, make, decode=decode))
  carried = short.stats.tokens_carried
  assert b.long == [3] and carried > 0
  rest = asyncio.run(rd.run_round(rollout, b, make, decode=decode))
  (c,) = rest.groups[3]
  assert c.output_ids == [pos % 97 for pos in range(3, 203)]  # whole, from scratch
  assert rest.stats.restarted == 1 and rest.stats.tokens_discarded == carried


def pauses_every(tokens: int):
  """A script that aborts each request on its own after `tokens` tokens, like
  a fleet whose weight update pauses (mode abort) the requests in flight."""
  return lambda r, g: (
    Act(tokens=tokens, finish="abort") if r.sampling.max_new_tokens > tokens else Act()
  )


@pytest.mark.parametrize("recycle", [True, False])
def test_backend_pauses_are_continued_not_counted_as_failures(recycle):
  make = lambda p, j: request([1, 2, 3], 20)
  b = tb.TailBatcher(2, 1, 1.0, recycle=recycle)
  b.start_epoch(range(2))
  rollout = ScriptedRollout(pauses_every(6), tick=1e-4)
  run = rd.run_round(rollout, b, make, decode=decode, max_retries=2)
  if not recycle:  # every attempt restarts from scratch and is paused again
    with pytest.raises(rd.RoundFailed, match="without progress"):
      asyncio.run(run)
    return
  res = asyncio.run(run)
  for (c,) in res.groups.values():  # 4 pieces of 6, 6, 6 and 2 tokens
    assert c.output_ids == [pos % 97 for pos in range(3, 23)] and c.segments == 4
  assert res.stats.tokens_discarded == 0 and res.stats.resumed == 6


def test_next_round_continuation_races_deferred_prompts_first():
  """APRIL's order: a deferred prompt goes to the front of the fresh queue and
  is continued in the very next short round, not after P others gathered."""
  b = tb.TailBatcher(4, 2, 1.25, continue_in="next_round")
  b.start_epoch(range(20))
  rnd = tb.Round(b.plan_round())
  carry = simulate_round(rnd, lambda k: 100 if k[0] == 0 else k[1])
  assert b.commit(rnd, carry=carry) == [1, 2, 3, 4] and not b.long
  plan = b.plan_round()
  assert plan.kind == "short" and plan.prompts == (0, 5, 6, 7, 8)
  with pytest.raises(ValueError, match="continue_in"):
    tb.TailBatcher(4, 2, 1.25, continue_in="later")


@pytest.mark.parametrize("eta", [1.0, 1.5])
def test_a_prompt_the_backend_refuses_is_dropped_and_the_round_goes_on(eta):
  """Not a failed round (re-queued and refused again until the run stops):
  the prompt leaves the epoch, reported as rejected; the round keeps the
  others (a short round fills P from its spare prompts, one without spares
  ends with P - 1) and the next round trains the rest."""
  make = lambda p, j: request([1], 2 + p)
  b = tb.TailBatcher(3, 2, eta, recycle=False)
  b.start_epoch(range(6))
  rollout = ScriptedRollout(
    lambda r, g: Act(refuse=OVER_CONTEXT) if rid_key(r.rid)[0] == "1" else Act()
  )

  async def main():
    rounds = []
    while (r := await rd.run_round(rollout, b, make)) is not None:
      rounds.append(r)
    return rounds

  rounds = asyncio.run(main())
  assert rounds[0].rejected == [1] and rounds[0].stats.rejected == 1
  assert 1 not in rounds[0].deferred and 1 not in rounds[0].groups
  assert len(rounds[0].groups) == (3 if eta > 1.0 else 2)
  assert all(r.rejected == [] for r in rounds[1:])
  assert sorted(b.trained) == [0, 2, 3, 4, 5] and b.epoch_done
