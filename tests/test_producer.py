"""The rollout producer: rounds in a thread, each kept group scored and handed over."""

import asyncio
import concurrent.futures
import dataclasses
import time

from fluxjax.data.meta import SampleMeta
from fluxjax.rl import async_control, tail_batching
from fluxjax.rl import producer as producer_lib
from fluxjax.rollout.client import Completion


@dataclasses.dataclass
class _Scored:
  reward: float


class _InstantRewards:
  """A reward scheduler whose scores are ready at once (reward = response length)."""

  def __init__(self):
    self.submitted = []

  def submit(self, text, answer, key=None):
    self.submitted.append(key)
    future = concurrent.futures.Future()
    future.set_result(_Scored(float(len(text))))
    return future


class _LateSpeculation:
  """Prompt 0 answers at once, the others after `slow_s`; one of prompt 0's
  speculative responses finishes at `late_s` and ignores its abort.

  That is the backend race a real engine has: the request finished in the
  same instant the abort was sent, so it comes back as a completion, not an
  abort, after its prompt was already kept, while the round still runs.
  """

  def __init__(self, late: tuple[str, str], late_s: float, slow_s: float):
    self.late, self.late_s, self.slow_s = late, late_s, slow_s
    self.events: dict[str, asyncio.Event] = {}
    self.late_done = asyncio.Event()

  async def generate(self, body, group=None):
    rid = body["rid"]  # tb-{epoch}-{round}-{prompt}-{index}-{try}
    prompt, index = rid.split("-")[3:5]
    n = body["sampling_params"]["max_new_tokens"]
    finished = Completion(
      rid,
      "x" * (1 + int(index)),
      [7] * n,
      [0.0] * n,
      {"type": "length", "length": n},
      3,
      "0",
      "fake",
      {},
    )
    if (prompt, index) == self.late:
      await asyncio.sleep(self.late_s)
      self.late_done.set()
      return finished
    ev = self.events[rid] = asyncio.Event()
    try:
      await asyncio.wait_for(ev.wait(), 0.01 if prompt == "0" else self.slow_s)
    except TimeoutError:
      return finished
    return Completion(
      rid, "", [7], [0.0], {"type": "abort", "message": "Abort"}, 3, "0", "fake", {}
    )

  async def abort(self, rid):
    if rid in self.events:
      self.events[rid].set()

  def slot_stats(self):
    return None


def test_a_late_speculative_response_of_a_forgotten_prompt_does_not_fail_the_round():
  """Prompt 0 is kept with its first 2 responses; its third (speculative) one
  finishes only after the trainer has consumed prompt 0 and forgotten it. The
  round must go on: the late response is discarded, not scored, not a fault."""
  P, R = 2, 2
  samples = [SampleMeta(uid=i, id=f"s{i}", prompt="p", answer="a") for i in range(3)]
  batches = [samples]
  # 3 prompts x 3 responses launched, 2 x 2 kept: prompt 0 is kept at once,
  # its late third response lands while prompts 1 and 2 still decode.
  rollout = _LateSpeculation(("0", "2"), late_s=0.5, slow_s=1.5)
  rewards = _InstantRewards()
  producer = producer_lib.Producer(
    rollout,
    rewards,
    tail_batching.TailBatcher(P, R, eta=1.5),
    async_control.AdmissionController(P, "sync"),
    next_samples=lambda: batches.pop(0) if batches else [],
    make_body=lambda sample, prompt, j: {
      "input_ids": [1, 2, 3],
      "sampling_params": {"max_new_tokens": 4},
    },
    prompt_fn=lambda sample: [1, 2, 3],
    max_prompt_tokens=16,
  )
  producer.batcher.start_epoch([])
  producer.start()
  try:
    got = []
    while len(got) < P:
      item = producer.out.get(timeout=30)
      assert not isinstance(item, BaseException), item
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
    while not rollout.late_done.is_set() and time.monotonic() < deadline:
      time.sleep(0.05)
    assert rollout.late_done.is_set()
  finally:
    producer.stop()
  assert producer.counts["faults/round_failures"] == 0
  # The late response was not scored: its prompt had been forgotten.
  assert rewards.submitted.count("s0") == R
