"""The rollout producer: rounds in a thread, each kept group scored and handed over."""

import dataclasses
import logging
import time
from collections.abc import Callable

import fault_rewards
from fluxjax import config_args
from fluxjax import faults as faults_lib
from fluxjax.data.meta import SampleMeta
from fluxjax.rl import async_control, reward_pool, tail_batching
from fluxjax.rl import producer as producer_lib
from fluxjax.rollout.protocol import GenerateRequest
from helpers import OVER_CONTEXT, Act, InstantRewards, ListLoader, ScriptedRollout, decode, rid_key

FAULTS = config_args.load_config(arg="tiny").faults


@dataclasses.dataclass
class _Requests:
  """The producer's `RequestSource` without a tokenizer: a prompt is a token list."""

  prompt_fn: Callable = lambda sample: [1, 2, 3]
  max_new_tokens: Callable = lambda sample: 4
  prompt_budget: int = 16

  def prompt(self, sample):
    return self.prompt_fn(sample)

  def request(self, sample, prompt, index=0, greedy=False):
    return GenerateRequest.of(list(prompt), {"max_new_tokens": self.max_new_tokens(sample)})

  def decode(self, ids, skip_special_tokens):
    return decode(ids, skip_special_tokens=skip_special_tokens)


def _faults(**limits) -> dict:
  """The Producer's fault arguments: the config's limits, some overridden."""
  return {
    "faults": faults_lib.Faults({**FAULTS, **limits}),
    "request_retries": FAULTS.request_retries,
  }


def length(response: str, answer: str) -> float:
  """The reward of the producer's tests: the response's length."""
  return float(len(response))


def late_speculation(late: tuple[str, str], late_s: float, slow_s: float) -> ScriptedRollout:
  """Prompt 0 answers at once, the others after `slow_s`; one of prompt 0's
  speculative responses finishes at `late_s` and ignores its abort.

  That is the backend race a real engine has: the request finished in the
  same instant the abort was sent, so it comes back as a completion, not an
  abort, after its prompt was already kept, while the round still runs.
  Response j's text is j + 1 characters long.
  """

  def script(request, group):
    key = rid_key(request.rid)
    if key == late:
      return Act(seconds=late_s, abortable=False)
    return Act(seconds=0.01 if key[0] == "0" else slow_s)

  return ScriptedRollout(
    script, text=lambda request, group, ids: "x" * (1 + int(rid_key(request.rid)[1]))
  )


def test_a_late_speculative_response_of_a_forgotten_prompt_does_not_fail_the_round():
  """Prompt 0 is kept with its first 2 responses; its third (speculative) one
  finishes only after the trainer has consumed prompt 0 and forgotten it. The
  round must go on: the late response is discarded, not scored, not a fault."""
  P, R = 2, 2
  samples = [SampleMeta(uid=i, id=f"s{i}", prompt="p", answer="a") for i in range(3)]
  # 3 prompts x 3 responses launched, 2 x 2 kept: prompt 0 is kept at once,
  # its late third response lands while prompts 1 and 2 still decode.
  rollout = late_speculation(("0", "2"), late_s=0.5, slow_s=1.5)
  rewards = InstantRewards(length)
  producer = producer_lib.Producer(
    rollout,
    rewards,
    # Flexes as published: speculative responses, the first R kept.
    tail_batching.TailBatcher(P, R, eta=1.5, recycle=False),
    async_control.AdmissionController(P, "sync"),
    ListLoader(samples),
    _Requests(),
    **_faults(),
  )
  producer.batcher.start_epoch([])
  producer.start()
  try:
    got = []
    while len(got) < P:
      item = producer.out.get(timeout=30)
      assert not isinstance(item, producer_lib.Stopped), item
      if isinstance(item, producer_lib.KeptGroup):
        got.append(item)
        producer.done_with([item.sample.uid])  # trained: the producer forgets it
    uids = [k.sample.uid for k in got]
    assert uids[0] == 0 and len(set(uids)) == P  # prompt 0 first, then 1 or 2
    assert all(len(k.group.completions) == R for k in got)
    # Each kept group carries the rewards of exactly its kept responses.
    for k in got:
      assert k.group.rewards == [float(len(c.text)) for c in k.group.completions]
    end = producer.out.get(timeout=30)
    assert isinstance(end, producer_lib.RoundEnd), end
    deadline = time.monotonic() + 10
    late_back = lambda: any(rid_key(rid) == ("0", "2") for rid in rollout.returned)
    while not late_back() and time.monotonic() < deadline:
      time.sleep(0.05)
    assert late_back()
  finally:
    producer.stop()
  assert producer.failed_rounds.total == 0
  # The late response was not scored: its prompt had been forgotten.
  assert rewards.submitted.count("s0") == R


def test_recycled_responses_are_scored_whole_and_survive_a_snapshot():
  """Recycling: the slow prompt's responses are paused when the short round
  has its P prompts, carried in the snapshot (restored into a new producer),
  continued in the epoch's last round, and scored on their whole text."""
  P, R = 2, 2
  samples = [SampleMeta(uid=i, id=f"s{i}", prompt="p", answer="a") for i in range(3)]
  lengths = {0: 4, 1: 5, 2: 200}

  def make(samples, rollout, rewards):
    return producer_lib.Producer(
      rollout,
      rewards,
      tail_batching.TailBatcher(P, R, eta=1.5),
      async_control.AdmissionController(P, "sync"),
      ListLoader(samples),
      _Requests(max_new_tokens=lambda sample: lengths[sample.uid]),
      **_faults(),
    )

  def drain(producer):
    got = []
    while True:
      item = producer.out.get(timeout=30)
      assert not isinstance(item, producer_lib.Stopped), item
      if isinstance(item, producer_lib.RoundEnd):
        return got, item.stats
      got.append(item)

  first = make(samples, ScriptedRollout(tick=2e-3), InstantRewards(length))
  first.batcher.start_epoch([])
  first.start()
  try:
    got, stats = drain(first)
    assert sorted(k.sample.uid for k in got) == [0, 1]
    assert stats.tokens_discarded == 0 and stats.tokens_carried > 0
    snap = first.snapshot(consumed={0, 1})
  finally:
    first.stop()
  carried = {(p, j): n for p, j, _, c in snap["batcher"]["carried"] for n in [len(c["output_ids"])]}
  assert sorted(carried) == [(2, 0), (2, 1)] and all(0 < n < 200 for n in carried.values())
  assert snap["batcher"]["long"] == [2] and "2" in snap["samples"]

  rollout, rewards = ScriptedRollout(tick=1e-4), InstantRewards(length)
  second = make([], rollout, rewards)
  second.restore(snap, step=1)
  second.start()
  try:
    got, stats = drain(second)
  finally:
    second.stop()
  (kept,) = got
  assert kept.sample.uid == 2 and stats.resumed == 2 and stats.tokens_discarded == 0
  for j, c in enumerate(kept.group.completions):
    assert c.output_ids == [pos % 97 for pos in range(3, 203)]
    assert c.segments == 2
    # Scored on the whole response, not on the continuation's text alone.
    assert kept.group.rewards[j] == float(len(decode(c.output_ids)))
  assert all(
    len(r.input_ids) == 3 + carried[(2, int(rid_key(r.rid)[1]))] for _, r in rollout.requests
  )


def _producer(loader, rewards, P, R, *, prompt_fn, rollout=None, admission=None, **limits):
  """A producer over `loader`'s samples on the token backend."""
  return producer_lib.Producer(
    rollout or ScriptedRollout(tick=1e-4),
    rewards,
    tail_batching.TailBatcher(P, R, eta=1.0),
    admission or async_control.AdmissionController(P, "sync"),
    loader,
    _Requests(prompt_fn=prompt_fn),
    **_faults(**limits),
  )


def _kept_until_round_end(producer) -> list:
  kept = []
  while True:
    item = producer.out.get(timeout=30)
    assert not isinstance(item, producer_lib.Stopped), item
    if isinstance(item, producer_lib.RoundEnd):
      return kept
    kept.append(item)


def _rounds(producer, n: int = 1) -> list[list]:
  """Starts a streamed epoch and returns the groups kept in each of its first n rounds."""
  producer.batcher.start_epoch([])
  producer.start()
  try:
    return [_kept_until_round_end(producer) for _ in range(n)]
  finally:
    producer.stop()


def _tokenize(sample):
  if sample.prompt == "untokenizable":
    raise UnicodeEncodeError("utf-8", sample.prompt, 0, 1, "surrogates not allowed")
  return [1, 2, 3]


def test_a_prompt_that_fails_to_build_is_a_counted_logged_skip(caplog):
  caplog.set_level(logging.WARNING, logger="fluxjax.rl.producer")
  samples = [
    SampleMeta(uid=0, id="s0", prompt="p", answer="a"),
    SampleMeta(uid=1, id="s1", prompt="untokenizable", answer="a"),
    SampleMeta(uid=2, id="s2", prompt="p", answer="a"),
  ]
  loader = ListLoader(samples)
  producer = _producer(loader, InstantRewards(length), 2, 2, prompt_fn=_tokenize)
  (kept,) = _rounds(producer)
  assert sorted(k.sample.id for k in kept) == ["s0", "s2"]
  assert producer.prompt_errors.total == 1
  assert [s.id for s in loader.released] == ["s1"]
  assert 1 not in producer.samples and 1 not in producer.prompts
  assert any(
    "skipping sample s1" in r.getMessage() and "UnicodeEncodeError" in r.getMessage()
    for r in caplog.records
  )


def test_prompts_failing_in_a_row_stop_the_run():
  """A tokenizer that fails on everything is a bug, not a dataset of bad samples."""
  samples = [SampleMeta(uid=i, id=f"s{i}", prompt="untokenizable", answer="a") for i in range(4)]
  producer = _producer(
    ListLoader(samples), InstantRewards(length), 2, 2, prompt_fn=_tokenize, prompt_errors=3
  )
  producer.batcher.start_epoch([])
  producer.start()
  try:
    stopped = producer.out.get(timeout=30)
  finally:
    producer.stop()
  assert isinstance(stopped, producer_lib.Stopped), stopped
  error = stopped.error
  assert isinstance(error, RuntimeError), error
  assert "3 prompts in a row failed to build" in str(error) and "s2" in str(error)
  assert producer.prompt_errors.total == 3


def test_rewards_that_raise_or_are_not_finite_score_zero_and_the_producer_goes_on(caplog):
  caplog.set_level(logging.WARNING, logger="fluxjax.rl.reward_pool")
  answers = {"s0": "raise", "s1": "nan", "s2": "inf", "s3": "1"}
  samples = [SampleMeta(uid=i, id=f"s{i}", prompt="p", answer=answers[f"s{i}"]) for i in range(4)]
  with reward_pool.RewardScheduler(num_workers=1, fn=fault_rewards.fail_on_marked_answers) as rs:
    producer = _producer(ListLoader(samples), rs, 4, 2, prompt_fn=lambda sample: [1, 2, 3])
    (kept,) = _rounds(producer)
    metrics = rs.metrics()
  rewards = {k.sample.id: k.group.rewards for k in kept}
  assert rewards == {"s0": [0.0, 0.0], "s1": [0.0, 0.0], "s2": [0.0, 0.0], "s3": [1.0, 1.0]}
  assert metrics["reward/error"] == 6 and metrics["reward/ok"] == 2
  logged = [r.getMessage() for r in caplog.records if r.name == "fluxjax.rl.reward_pool"]
  for sample_id, why in [("s0", "reward bug"), ("s1", "non-finite"), ("s2", "non-finite")]:
    assert sum(f"'{sample_id}'" in m and why in m for m in logged) == 2, (sample_id, logged)


def test_a_prompt_the_backend_refuses_is_a_counted_skip_and_its_place_refilled(caplog):
  """One request no server can serve must not fail rounds until the run stops:
  the sample is skipped (counted, logged, released) and admission lets
  another prompt take its place."""
  caplog.set_level(logging.WARNING, logger="fluxjax.rl.producer")
  samples = [SampleMeta(uid=i, id=f"s{i}", prompt="p", answer="a") for i in range(3)]
  loader = ListLoader(samples)
  producer = _producer(
    loader,
    InstantRewards(length),
    2,
    2,
    prompt_fn=lambda sample: [1, 9] if sample.id == "s1" else [1, 2],
    # Refuses every request whose prompt holds token 9 (over the server's context).
    rollout=ScriptedRollout(
      lambda r, g: Act(refuse=OVER_CONTEXT) if 9 in r.input_ids else Act(), tick=1e-4
    ),
  )
  first, second = _rounds(producer, 2)
  assert [k.sample.id for k in first] == ["s0"] and [k.sample.id for k in second] == ["s2"]
  assert producer.counts["data/skipped/rejected"] == 1
  assert producer.failed_rounds.total == 0
  assert [s.id for s in loader.released] == ["s1"] and 1 not in producer.samples
  assert "skipping sample s1: the rollout backend refused its request" in caplog.text


def test_a_loader_that_raises_stop_iteration_ends_the_stream():
  """The real loader ends its last epoch with StopIteration (not []), raised
  in an executor thread: the producer must see the end of the data, not hang."""
  samples = [SampleMeta(uid=i, id=f"s{i}", prompt="p", answer="a") for i in range(2)]
  producer = _producer(
    ListLoader(samples, stop_at_end=True),
    InstantRewards(length),
    2,
    2,
    prompt_fn=_tokenize,
    admission=async_control.AdmissionController(2, "fixed", fixed_lag=1),
  )
  producer.batcher.start_epoch([])
  producer.start()
  try:
    assert sorted(k.sample.id for k in _kept_until_round_end(producer)) == ["s0", "s1"]
    assert isinstance(producer.out.get(timeout=30), producer_lib.DataEnd)
  finally:
    producer.stop()
