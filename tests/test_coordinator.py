"""The Coordinator's API: read-only views, the methods that change its state, and
its per-step decisions.

A coordinator over the tiny preset on the fake 8-device mesh, with a
recording rollout backend and a loader and rewards of the test's own (or a
real reward worker): nothing here compiles a train step. The loop tests
(test_train_loop.py, test_multiprocess.py) run the coordinator with the real
parts.
"""

import asyncio
import contextlib
import dataclasses
import os
import time

import jax
import numpy as np
import pytest

from fluxjax import config_args
from fluxjax.data import materializer as materializer_lib
from fluxjax.data import meta as meta_lib
from fluxjax.data import store as store_lib
from fluxjax.models import inputs
from fluxjax.parallel import train_step
from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import loop, reward_pool, trajectories
from fluxjax.rl import producer as producer_lib
from fluxjax.rollout import backend as backend_lib
from fluxjax.rollout import tensor_feed
from fluxjax.rollout.publish import PublishReport
from fluxjax.settings import Settings
from helpers import Act, InstantRewards, ListLoader, ScriptedRollout, completion

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _evaluation_text(backend: ScriptedRollout, answers: dict[str, str]):
  """Evaluation answers: every greedy one right, and the first sampled one per
  prompt (the group is the sample id; `answers` maps it to the right answer)."""

  def text(request, group, ids):
    sampled = [r for g, r in backend.requests if g == group and not r.sampling.greedy]
    right = request.sampling.greedy or sampled[0] is request
    return f"<answer>{answers[group] if right else 'wrong'}</answer>"

  return text


def _backend(tokens: int = 2, text=None) -> ScriptedRollout:
  """Responses of `tokens` tokens; `text` as ScriptedRollout's."""
  return ScriptedRollout(lambda request, group: Act(tokens=tokens), tick=0.0, text=text)


def _rid_text(request, group, ids) -> str:
  """The request's rid as the answer, as every backend answers: rewards are
  matched by it."""
  return f"<answer>{request.rid}</answer>"


def _data(samples) -> ListLoader:
  """A loader over `samples` in order, four at a time."""
  return ListLoader(samples, batch_size=4)


class _RecordingPolicy:
  """The run's policy worker, except that updates are recorded, not applied."""

  def __init__(self, policy, nonfinite=()):
    self._policy = policy
    self.added: list[int] = []  # sequences handed to the pending update
    self.updates: list[int] = []  # sequences per applied update
    self.nonfinite = list(nonfinite)  # per update: whether the device refused it

  def __getattr__(self, name):
    return getattr(self._policy, name)

  def add(self, seqs):
    self.added.extend(range(len(seqs)))

  def apply(self):
    self.updates.append(len(self.added))
    self.added = []
    refused = self.nonfinite.pop(0) if self.nonfinite else False
    return {"loss": np.float32(np.nan if refused else 0.0), "nonfinite": np.float32(refused)}


@contextlib.contextmanager
def _running(config, policy, data, backend, reward_fn: str):
  """A coordinator of `config` over `backend` on its own loop thread, its
  rewards from a one-worker pool of `reward_fn`."""
  from fluxjax.models.tokenizer import Tokenizer

  with (
    backend_lib.LoopThread() as thread,
    thread.running(backend),
    reward_pool.RewardScheduler(1, reward_fn) as scheduler,
    coordinator_lib.Coordinator(
      Settings.of(config), Tokenizer.default(), policy, data, backend, scheduler, thread=thread
    ) as c,
  ):
    yield c


@pytest.fixture(scope="module")
def parts(devices, tmp_path_factory):
  del devices
  config = config_args.load_config(os.path.join(ROOT, "configs", "vlm.py"), "tiny")
  with contextlib.ExitStack() as stack:
    store = store_lib.MetaStore(1 << 20)
    stack.callback(store.close)
    policy = loop.build_policy(
      config,
      str(tmp_path_factory.mktemp("coordinator")),
      stack,
      materializer_lib.Materializer(store),
      owns_media=False,
    )
    yield config, policy


@contextlib.contextmanager
def _idle(config, policy, backend):
  """A coordinator of `config` with no training data, scoring in this process."""
  from fluxjax.models.tokenizer import Tokenizer

  with (
    backend_lib.LoopThread() as thread,
    thread.running(backend),
    coordinator_lib.Coordinator(
      Settings.of(config),
      Tokenizer.default(),
      policy,
      ListLoader(),
      backend,
      InstantRewards(),
      thread=thread,
    ) as c,
  ):
    yield c


@pytest.fixture
def coord(parts):
  config, policy = parts
  backend = _backend()
  assert isinstance(backend, backend_lib.RolloutBackend)
  with _idle(config, policy, backend) as c:
    yield c, backend


def test_views_are_read_only(coord):
  c, _ = coord
  for name in ("policy", "requests", "version", "steps"):
    with pytest.raises(AttributeError):
      setattr(c, name, None)
  assert (c.version, c.steps) == (0, 0)


def test_publish_hands_the_backend_a_copy_and_counts_versions(coord):
  c, backend = coord
  c.publish(new_version=False)
  c.publish()
  assert [v for _, v in backend.published] == [0, 1] and c.version == 1
  from flax import nnx

  handed = jax.tree.leaves(nnx.state(backend.published[-1][0], nnx.Param))
  own = jax.tree.leaves(c.policy.state.params)
  assert len(handed) == len(own)
  # Its own buffers: the next update donates the trainer's.
  pointer = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
  assert all(pointer(h) != pointer(o) for h, o in zip(handed, own) if h.size)
  assert c.fault_counts()["scripted/publishes"] == 2.0


def test_load_params_replaces_the_parameters_only(coord, parts):
  c, _ = coord
  policy = parts[1]
  before = c.policy.state
  params = jax.tree.map(lambda x: x + 1, before.params)
  policy.load_params(params)
  assert c.policy.state.params is params  # the coordinator's policy is the run's
  assert c.policy.state.opt_state is before.opt_state and c.policy.state.step is before.step
  policy.load_params(before.params)


def test_restore_before_start_only(coord):
  c, _ = coord
  c.restore({"version": 4, "steps": 3, "filtered": 2}, {"position": 7})
  assert (c.version, c.steps) == (4, 3)
  assert c.fault_counts()["rollout/filtered_groups_total"] == 2.0
  state, data = c.get_state()
  assert (state["version"], state["steps"], state["filtered"]) == (4, 3, 2)
  assert data == {"position": 7}
  c.start()
  with pytest.raises(RuntimeError, match="after rollout started"):
    c.restore({"version": 4}, {})


def test_sequences_honour_the_advantage_settings(parts):
  config, policy = parts
  settings = Settings.of(config)
  settings = dataclasses.replace(settings, rl=dataclasses.replace(settings.rl, adv_eps=1.0))
  with _idle(settings, policy, _backend()) as c:  # Settings.of takes settings as they are
    prompt = inputs.sequence_from_tokens([5, 6, 7, 8], [], c.policy.cfg)
    group = trajectories.Group(
      "s1", prompt, [completion([10, 11], [-0.5, -1.0]), completion([12], [-2.0])], [1.0, 0.0]
    )
    a, b = c.sequences([group])
  # rewards (1, 0): centred +-0.5 over the unbiased std 0.7071 plus eps 1.0
  np.testing.assert_allclose(a.advantages_T[4:], 0.5 / (0.5**0.5 + 1.0), rtol=1e-5)
  np.testing.assert_allclose(b.advantages_T[4:], -0.5 / (0.5**0.5 + 1.0), rtol=1e-5)


def test_evaluate_samples_at_the_training_temperature_and_summarizes(coord, parts):
  c, backend = coord
  config = parts[0]
  samples = [
    meta_lib.SampleMeta(uid=i, id=f"q{i}", prompt=f"Question {i}?", answer=a, difficulty=d)
    for i, (a, d) in enumerate([("red", "easy"), ("blue", "easy"), ("3", "hard")])
  ]
  backend.text = _evaluation_text(backend, {s.id: s.answer for s in samples})
  out = c.evaluate(samples)
  k = config.eval.samples_per_prompt
  greedy = [r.sampling.greedy for _, r in backend.requests]
  temps = [r.sampling.temperature for _, r in backend.requests if not r.sampling.greedy]
  assert greedy.count(False) == 3 * k and greedy.count(True) == 3
  assert temps == [config.rl.temperature] * 3 * k
  # One right of k sampled per prompt; every greedy answer right.
  assert out["eval/accuracy"] == pytest.approx(1 / k)
  assert out["eval/accuracy_ci95"] == 0.0  # no spread over prompts
  assert out[f"eval/pass@{k}"] == 1.0 and out["eval/accuracy_greedy"] == 1.0
  assert out["eval/accuracy/easy"] == out["eval/accuracy/hard"] == pytest.approx(1 / k)
  assert out["eval/prompts"] == 3 and out["eval/samples"] == 3 * k
  assert 0 < out["eval/seconds"] < 60
  # Every request stops at EOS and at the vision markup ids.
  tok = c.requests.tokenizer
  for _, r in backend.requests:
    stops = set(r.sampling.stop_token_ids)
    assert stops == {*tok.eos_ids, tok.image_pad_id, tok.video_pad_id, tok.vision_start_id,
                     tok.vision_end_id, tok.vision_pad_id}  # fmt: skip


def test_evaluation_scores_with_its_own_reward_when_it_has_one(parts):
  """eval.reward replaces the run's reward in evaluation: `constant` (0) marks
  even the right answers wrong, where the run's reward marks them right."""
  config = parts[0].copy_and_resolve_references()
  config.eval.reward = "constant"
  backend = _backend()
  samples = [meta_lib.SampleMeta(uid=0, id="q0", prompt="Q?", answer="red", difficulty="easy")]
  backend.text = lambda request, group, ids: "<answer>red</answer>"
  with _idle(config, parts[1], backend) as c:
    out = c.evaluate(samples)
  assert out["eval/accuracy"] == 0.0 and out["eval/accuracy_greedy"] == 0.0


def test_a_group_that_waited_past_the_bound_is_generated_again(parts, caplog):
  """Staleness is enforced when a group is trained, queue time included: in
  sync mode (bound 0) a group handed over one version late, as if it had
  waited in the queue through an update, is not trained; its prompt runs
  again and trains once, and every step still trains P groups."""
  config = parts[0].copy_and_resolve_references()
  config.rl.prompts_per_step, config.rl.responses_per_prompt = 2, 2
  config.rollout.tail_batching.eta = 1.0
  samples = [
    meta_lib.SampleMeta(uid=i, id=f"q{i}", prompt=f"Q{i}?", answer="red") for i in range(16)
  ]
  backend = _backend(tokens=3, text=_rid_text)
  data, policy = _data(samples), _RecordingPolicy(parts[1])
  with _running(config, policy, data, backend, "fault_rewards:signal_unless_numeric") as c:
    out, aged = c._producer.out, []
    put = out.put

    def age_the_third(item, *args, **kw):  # the queue time, simulated
      if isinstance(item, producer_lib.KeptGroup) and item.sample.id == "q2" and not aged:
        aged.append(item.sample.id)
        item = dataclasses.replace(item, launch_version=item.launch_version - 1)
      return put(item, *args, **kw)

    out.put = age_the_third
    results = [c.step() for _ in range(3)]
  trained = [i for r in results for i in r.trained]
  assert aged == ["q2"] and [len(r.trained) for r in results] == [2, 2, 2]
  assert trained.count("q2") == 1 and len(set(trained)) == 6
  assert sum(r.metrics["async/stale_requeued"] for r in results) == 1
  assert "sample q2 waited 1 versions (more than 0)" in caplog.text


def test_dynamic_sampling_trains_only_groups_with_signal(parts):
  """DAPO: groups whose rewards are all equal are dropped, counted and refilled.

  The reward (tests/fault_rewards.py, in a reward worker) scores every
  response to a numeric-answer prompt 0, so those groups have no signal, and
  others by a hash of the response (each response is distinct): no
  numeric-answer prompt may be trained, and each step is still full.
  """

  config = parts[0].copy_and_resolve_references()
  config.rl.prompts_per_step, config.rl.responses_per_prompt = 3, 4
  config.rl.dynamic_sampling, config.rl.max_refill_rounds = True, 8
  # Every other prompt has a numeric answer. Eight refill rounds (24 groups)
  # per step are more than the data can ask for in three steps.
  samples = [
    meta_lib.SampleMeta(
      uid=i, id=f"q{i}", prompt=f"Question {i}?", answer=str(i) if i % 2 else "red"
    )
    for i in range(64)
  ]
  backend = _backend(tokens=3, text=_rid_text)
  data, policy = _data(samples), _RecordingPolicy(parts[1])
  with _running(config, policy, data, backend, "fault_rewards:signal_unless_numeric") as c:
    results = [c.step() for _ in range(3)]
    counts = c.fault_counts()
  trained = [i for r in results for i in r.trained]
  assert [len(r.trained) for r in results] == [3, 3, 3]  # refills kept every step full
  assert policy.updates == [12, 12, 12]  # 3 groups x 4 responses per update
  assert len(set(trained)) == 9
  # No numeric-answer prompt trained.
  assert all(int(i[1:]) % 2 == 0 for i in trained), trained
  filtered = [r.metrics["rollout/filtered_groups"] for r in results]
  assert sum(filtered) >= 1 and counts["rollout/filtered_groups_total"] == sum(filtered)
  # A dropped group's late speculative responses are discarded, not a fault.
  assert counts["faults/failed_rounds_total"] == 0.0
  # Dropped and trained samples are handed back to the loader.
  assert {s.id for s in data.released} >= set(trained)


def test_a_step_records_the_percentiles_of_its_response_lengths(parts):
  """`rollout/response_len_{mean,p50,p99,max}` and `rollout/reasoning_share`
  are over every trained response: lengths 1..8 within each group, and one
  60-token response, whose tail moves p99 and the max but not the median."""

  config = parts[0].copy_and_resolve_references()
  config.rl.prompts_per_step, config.rl.responses_per_prompt = 2, 8
  config.rollout.tail_batching.eta = 1.0  # every launched response is trained
  config.rl.max_new_tokens = 60
  samples = [
    meta_lib.SampleMeta(uid=i, id=f"q{i}", prompt=f"Q{i}?", answer="red") for i in range(8)
  ]
  lengths = {}  # group (the sample's uid) -> response lengths

  def varied(request, group):
    n = 60 if not lengths else sum(map(len, lengths.values())) % 8 + 1
    lengths.setdefault(group, []).append(n)
    return Act(tokens=n)

  def text(request, group, ids):  # responses of 5 tokens or more reason first
    return ("<think> x</think>" if len(ids) >= 5 else "") + _rid_text(request, group, ids)

  backend = ScriptedRollout(varied, tick=0.0, text=text)
  policy, data = _RecordingPolicy(parts[1]), _data(samples)
  with _running(config, policy, data, backend, "fault_rewards:signal_unless_numeric") as c:
    result = c.step()
  m = result.metrics
  # The next step's rounds may have started; only this step's groups count.
  trained = [n for uid, ns in lengths.items() if f"q{uid}" in result.trained for n in ns]
  assert len(trained) == 16 and sorted(trained)[-2:] == [8, 60]
  assert m["rollout/response_len_mean"] == pytest.approx(np.mean(trained))
  assert m["rollout/response_len_p50"] == pytest.approx(np.median(trained))
  assert m["rollout/response_len_p99"] == pytest.approx(np.percentile(trained, 99))
  assert m["rollout/response_len_p50"] < 8 < m["rollout/response_len_p99"] < 60
  assert m["rollout/response_len_max"] == 60
  assert m["rollout/reasoning_share"] == pytest.approx(np.mean([n >= 5 for n in trained]))
  # One reward function of weight 1: its own statistics are the reward's.
  assert m["reward/signal_unless_numeric/mean"] == pytest.approx(m["rollout/reward_mean"])
  assert m["reward/signal_unless_numeric/max"] <= 1.0
  assert m["rollout/response_clip_ratio"] == pytest.approx(1 / 16)  # the one at max_new_tokens
  # The first step's update runs at the schedule's first learning rate.
  optim = Settings.of(config).optim
  assert m["optim/lr"] == pytest.approx(float(train_step.lr_schedule(optim)(0)))
  # The step's time: the wait for rollouts, then the update applied.
  assert 0 < m["perf/update_seconds"] < m["perf/step_seconds"]
  assert m["rollout/wait_seconds"] + m["perf/update_seconds"] <= m["perf/step_seconds"]


def test_refused_updates_publish_nothing_and_too_many_in_a_row_stop(parts, caplog):
  """Updates the device refused (non-finite) keep the policy version and are
  counted with their prompts logged; `faults.nonfinite_steps` in a
  row raise."""
  from fluxjax.parallel import train_step

  config = parts[0].copy_and_resolve_references()
  config.rl.prompts_per_step, config.rl.responses_per_prompt = 2, 2
  config.rl.reward.fn = "constant"
  config.faults.nonfinite_steps = 2
  samples = [
    meta_lib.SampleMeta(uid=i, id=f"q{i}", prompt=f"Question {i}?", answer="red") for i in range(16)
  ]
  backend = _backend()
  backend.text = _evaluation_text(backend, {s.id: s.answer for s in samples})
  policy = _RecordingPolicy(parts[1], nonfinite=[False, True, False, True, True])
  with _running(config, policy, _data(samples), backend, "constant") as c:
    c.publish(new_version=False)
    versions = []
    for _ in range(4):
      result = c.step()
      versions.append(result.metrics["policy/version"])
    assert versions == [1.0, 1.0, 2.0, 2.0]  # steps 2 and 4 were refused
    assert [v for _, v in backend.published] == [0, 1, 2]
    assert result.metrics["faults/nonfinite_steps_total"] == 2.0
    assert all(i in caplog.text for i in result.trained)  # step 4's prompts
    with pytest.raises(train_step.NonFiniteError, match="2 updates in a row"):
      c.step()
    assert c.get_state()[0]["faults"]["nonfinite_steps"] == 3


def test_a_deferred_publish_opens_admission_when_its_servers_are_done(coord):
  """A backend that defers its servers' part: `publish` returns at once with
  the version moved on, admission stays on the previous version until the
  servers are done, and the next publish (or `settle_publish`) waits for them
  and counts a final report that reached no server."""
  c, backend = coord
  written = backend.publish
  gates: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
  finals = iter([True, False])  # whether each deferred publish reaches a server

  async def publish(model, version):
    gate = asyncio.Event()
    gates.append((asyncio.get_running_loop(), gate))
    reaches = next(finals)

    async def load():
      await gate.wait()
      if reaches:
        return await written(model, version)
      return PublishReport(str(version), None, {"write": 0.0}, ["server: refused"])

    pending = asyncio.create_task(load())
    return PublishReport(str(version), "folder", {"write": 0.0}, [], pending=pending)

  backend.publish = publish
  c.publish()
  assert c.version == 1 and c._producer.version == 0 and backend.published == []
  loop, gate = gates[0]
  loop.call_soon_threadsafe(gate.set)
  c.settle_publish()
  assert c._producer.version == 1 and [v for _, v in backend.published] == [1]
  c.publish()
  loop.call_soon_threadsafe(gates[1][1].set)
  c.settle_publish()
  assert c._producer.version == 2 and [v for _, v in backend.published] == [1]
  assert c.fault_counts()["faults/unwritten_publishes_total"] == 1.0


def test_publishes_whose_write_failed_are_counted_and_too_many_stop(coord, parts):
  """A publish that reached no server (its write failed) moves the version on,
  is counted, and `faults.unwritten_publishes` in a row raise."""
  c, backend = coord
  written = backend.publish
  outcomes = iter([False, True, False, False, False])  # whether each write succeeds

  async def publish(model, version):
    if next(outcomes):
      return await written(model, version)
    return PublishReport(str(version), None, {"write": 0.0}, ["write: [Errno 28] disk full"])

  backend.publish = publish
  limit = parts[0].faults.unwritten_publishes
  assert limit == 3
  c.publish()  # failed
  c.publish()  # written: the count in a row starts again
  c.publish()
  c.publish()
  assert c.version == 4 and [v for _, v in backend.published] == [2]
  assert c.fault_counts()["faults/unwritten_publishes_total"] == 3.0
  # Every fault total is in the checkpointed state, so a resumed run goes on counting.
  assert c.get_state()[0]["faults"]["unwritten_publishes"] == 3
  with pytest.raises(RuntimeError, match="3 weight publishes in a row reached no server"):
    c.publish()


@pytest.mark.parametrize("reads_params", [True, False])
def test_a_deferred_broadcast_holds_back_the_update_not_the_rollout(parts, reads_params):
  """A deferred publish that still reads the trainer's arrays (a broadcast,
  `reads_params`) is waited for before the next update donates them, and only
  then: the next step's rollout and gradient parts go on meanwhile (lag 1).
  One that has read them (a written folder) holds back neither."""
  import threading

  config = parts[0].copy_and_resolve_references()
  config.rl.prompts_per_step, config.rl.responses_per_prompt = 2, 2
  config.rl.reward.fn = "constant"
  config.coordinator.lag.mode, config.coordinator.lag.fixed_lag = "fixed", 1
  samples = [
    meta_lib.SampleMeta(uid=i, id=f"q{i}", prompt=f"Question {i}?", answer="red") for i in range(16)
  ]
  backend = _backend()
  gates: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
  events: list[str] = []

  async def publish(model, version):
    if version == 0:  # the start's: at once
      return PublishReport(str(version), None, {}, [])
    gate = asyncio.Event()
    gates.append((asyncio.get_running_loop(), gate))

    async def send():
      await gate.wait()
      events.append(f"sent {version}")
      return PublishReport(str(version), None, {"update": 0.0}, [])

    pending = asyncio.create_task(send())
    return PublishReport(str(version), None, {}, [], pending=pending, reads_params=reads_params)

  backend.publish = publish

  class Policy(_RecordingPolicy):
    def add(self, seqs):
      if len(gates) == 1 and "opening" not in events:  # step 2's first part
        events.append("opening")
        loop, gate = gates[0]
        loop.call_soon_threadsafe(loop.call_later, 0.3, gate.set)
      events.append("add")
      super().add(seqs)

    def apply(self):
      events.append("apply")
      return super().apply()

  with _running(config, Policy(parts[1]), _data(samples), backend, "constant") as c:
    c.publish(new_version=False)
    c.step()  # publishes version 1, its broadcast held at the gate
    assert len(gates) == 1 and "sent 1" not in events
    # Should rollout wait for version 1, nothing opens the gate: this does.
    loop, gate = gates[0]
    fallback = threading.Timer(10.0, loop.call_soon_threadsafe, (gate.set,))
    fallback.start()
    try:
      c.step()
    finally:
      fallback.cancel()
      for loop, gate in gates[1:]:  # step 2's publish, which close waits for
        loop.call_soon_threadsafe(gate.set)
  step2 = events[events.index("apply") + 1 :]
  assert step2[0] == "opening", events  # step 2's parts came before version 1 was sent
  if reads_params:
    assert step2.index("sent 1") < step2.index("apply"), events
  else:
    assert step2.index("apply") < step2.index("sent 1"), events


def _fed_broadcasts(events: list[str], count: int, take_s: float):
  """A backend `publish` whose versions after 0 are deferred broadcasts fed
  from the trainer's main thread (a trainer spanning processes): `count`
  tensors whose gathers are logged, each taken `take_s` after the last."""

  async def publish(model, version):
    if version == 0:
      return PublishReport(str(version), None, {}, [])

    def gathers():
      for i in range(count):
        events.append(f"gather {version}.{i}")
        yield np.zeros(4, np.float32)

    feed = tensor_feed.TensorFeed(gathers(), count)

    def send():
      try:
        for i, _ in enumerate(feed):
          time.sleep(take_s)
          events.append(f"sent {version}.{i}")
      except tensor_feed.Abandoned:
        events.append(f"abandoned {version}")

    async def broadcast():
      await asyncio.get_running_loop().run_in_executor(None, send)
      return PublishReport(str(version), None, {"update": 0.0}, [])

    pending = asyncio.create_task(broadcast())
    return PublishReport(str(version), None, {}, [], pending=pending, reads_params=True, feed=feed)

  return publish


class _GatherPolicy(_RecordingPolicy):
  """Logs the ops the followers would receive: each announced run of gathers, parts, updates."""

  def __init__(self, policy, events):
    super().__init__(policy)
    self.events = events

  def announce_gathers(self, n):
    self.events.append(f"announce {n}")

  def add(self, seqs):
    self.events.append("add")
    super().add(seqs)

  def apply(self):
    self.events.append("apply")
    return super().apply()


def _fed_config(parts):
  config = parts[0].copy_and_resolve_references()
  config.rl.prompts_per_step, config.rl.responses_per_prompt = 2, 2
  config.rl.reward.fn = "constant"
  config.coordinator.lag.mode, config.coordinator.lag.fixed_lag = "fixed", 1
  return config


_SAMPLES = [
  meta_lib.SampleMeta(uid=i, id=f"q{i}", prompt=f"Question {i}?", answer="red") for i in range(16)
]


def test_a_broadcast_from_several_processes_is_gathered_while_the_step_waits(parts):
  """A deferred broadcast whose tensors the main thread gathers (the trainer
  spans processes): the next step gathers what the broadcast can take while
  it waits for rollouts, each run of gathers announced to the followers
  first, and the rest before its update; the broadcast sends every tensor
  in order."""
  events: list[str] = []
  backend = _backend()
  backend.publish = _fed_broadcasts(events, count=6, take_s=0.02)
  policy = _GatherPolicy(parts[1], events)
  with _running(_fed_config(parts), policy, _data(_SAMPLES), backend, "constant") as c:
    c.publish(new_version=False)
    c.step()  # publishes version 1: nothing gathered yet
    assert not any(e.startswith("gather") for e in events), events
    step1 = len(events)
    metrics = c.step().metrics
  step2 = events[step1 : events.index("apply", step1) + 1]
  # The first wait for a group pumps: announced, then gathered, before any part.
  assert step2[:2] == ["announce 1", "gather 1.0"], step2
  gathered = [e for e in step2 if e.startswith("gather 1.")]
  assert gathered == [f"gather 1.{i}" for i in range(6)], step2  # all before the update
  announced = 0
  for e in step2:
    if e.startswith("announce"):
      announced += int(e.split()[1])
    elif e.startswith("gather 1."):
      assert int(e.split(".")[1]) < announced, step2
  assert announced == 6
  assert [e for e in events if e.startswith("sent 1.")] == [f"sent 1.{i}" for i in range(6)]
  assert metrics["publish/update_wait_seconds"] >= 0.0
  assert 1 / 6 <= metrics["publish/overlapped_share"] <= 1.0  # the first wait's gather at least


def test_a_failed_run_abandons_a_fed_broadcast_instead_of_gathering(parts):
  """The followers were told to stop: closing after a failure gathers
  nothing more, and the broadcast ends."""
  events: list[str] = []
  backend = _backend()
  backend.publish = _fed_broadcasts(events, count=6, take_s=0.0)
  policy = _GatherPolicy(parts[1], events)
  with (
    pytest.raises(KeyboardInterrupt),
    _running(_fed_config(parts), policy, _data(_SAMPLES), backend, "constant") as c,
  ):
    c.publish(new_version=False)
    c.step()
    raise KeyboardInterrupt
  deadline = time.monotonic() + 10
  while "abandoned 1" not in events and time.monotonic() < deadline:  # the sender's thread
    time.sleep(0.01)
  assert "abandoned 1" in events
  assert not any(e.startswith(("gather", "announce")) for e in events), events
