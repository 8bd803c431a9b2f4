"""fluxjax.train, watched at four points and SIGKILLed at one: a launcher child.

  KILL_RECORD=/tmp/kills.jsonl KILL_POINT=queue KILL_VICTIM=1 \
    python -m fluxjax.launch --processes=2 --module=kill_points -- <fluxjax.train arguments>

Each process wraps library functions at the points (no hook in the
library), then runs fluxjax.train's main. The leader (process 0) holds the
run's decisions, so it watches; a point's moment comes only once a
checkpoint newer than the one the launch started from is committed (each
launch moves the run on):

  generation  a training request runs at a server (its /get_load says so)
              while the tail batcher carries a partial response (when
              rounds speculate: tail batching's eta above 1).
  queue       a kept group was just queued while the trainer is busy (not
              waiting for the queue): it waits for the trainer.
  publish     half of a new weight version's tensors are broadcast: the
              servers hold part of it.
  checkpoint  the victim has written one array of checkpoint N (its
              temporary folder exists, N is not committed), N at least two
              past the launch's first: every process decides from N alone.

At KILL_POINT's moment (after KILL_SKIP moments let pass: the bench's
random moments) the leader appends a line to KILL_RECORD with what it holds,
then SIGKILLs KILL_VICTIM: itself, or the follower by the pid file the
follower wrote beside the record; a checkpoint victim adds a line of its own
(`killed_mid_write`) and kills itself. At the first moment of each other
point in each RL step the leader appends the same line marked `shadow`
(nothing dies): what a kill there would have put at stake, the reference
for the kills' (bench/kill_resume.py). Without KILL_RECORD nothing is
wrapped; without KILL_POINT nothing dies.

A line: point, victim (a kill's), process, shadow, the step and version,
the latest committed checkpoint and the launch's first, and what the leader
holds: `in_flight` ([sample id, response index] of each training request
running), `partial` ([sample id, response index, tokens] of each
unfinished response the tail batcher carries), `finished` (its finished
ones), `queued` ([sample id, [response lengths]] of each kept group in the
producer's queue), `trained_since_checkpoint` (sample ids of the steps
after the latest committed checkpoint), `at_stake` (the sample ids of all
four: what a kill now throws work of away), `open` (every sample drawn and
not yet trained), plus what the point adds (`servers_running`, `publish`,
`checkpoint`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading

POINTS = ("generation", "queue", "publish", "checkpoint")
TRAINING_RID = "tb-"  # the producer's round requests (rl/round_driver.py), not evaluation's
POLL_S = 0.02  # between generation's looks at the servers


class Plan:
  """What this process watches, kills and records (from the environment)."""

  def __init__(self, argv: list[str], environ=os.environ):
    self.point = environ.get("KILL_POINT", "")
    if self.point and self.point not in POINTS:
      sys.exit(f"kill_points: unknown KILL_POINT {self.point!r}; one of {POINTS}")
    self.victim = int(environ.get("KILL_VICTIM", "0"))
    self.skip = int(environ.get("KILL_SKIP", "0"))
    self.record = environ.get("KILL_RECORD", "")
    flag = "--config.distributed.process_id="
    self.process = next((int(a[len(flag) :]) for a in argv if a.startswith(flag)), 0)
    workdir = next(a.split("=", 1)[1] for a in argv if a.startswith("--workdir="))
    self.checkpoints = os.path.join(workdir, "checkpoints")
    self.start = self.latest()  # the checkpoint this launch resumes from (0: none)
    self.fired = False
    self.shadowed: set[tuple[str, int]] = set()  # (point, step) recorded
    self.lock = threading.Lock()
    self.coordinator = None  # the leader's, once made
    self.trained: list[tuple[int, list[str]]] = []  # (step, sample ids) this launch
    self.in_flight: dict[str, tuple[int, int]] = {}  # rid -> (uid, response index)
    self.trainer_waiting = False
    self.watcher: asyncio.Future | None = None  # generation's, while requests run
    self.publishing: dict | None = None  # {"version", "tensors", "sent"}
    self.saving: int | None = None  # the checkpoint whose write the victim dies in

  def latest(self) -> int:
    if not os.path.isdir(self.checkpoints):
      return 0
    return max((int(e) for e in os.listdir(self.checkpoints) if e.isdigit()), default=0)

  def progressed(self) -> bool:
    return self.latest() > self.start

  def moment(self, point: str) -> bool:
    """Whether this moment of `point` (its condition holds) is the kill's."""
    with self.lock:
      if point != self.point or self.fired:
        return False
      if self.skip > 0:
        self.skip -= 1
        return False
      self.fired = True
      return True

  def shadow(self, point: str, step: int) -> bool:
    """Whether to record this moment of `point` as a shadow: the first of its step."""
    with self.lock:
      if (point, step) in self.shadowed:
        return False
      self.shadowed.add((point, step))
      return True

  def write(self, line: dict) -> None:
    data = (json.dumps(line) + "\n").encode()
    fd = os.open(self.record, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
      os.write(fd, data)
      os.fsync(fd)
    finally:
      os.close(fd)

  def line(self, point: str, shadow: bool) -> dict:
    return {"point": point, "victim": self.victim, "process": self.process, "shadow": shadow}

  def kill_victim(self) -> None:
    if self.victim == self.process:
      os.kill(os.getpid(), signal.SIGKILL)
    with open(f"{self.record}.pid{self.victim}") as f:
      os.kill(int(f.read()), signal.SIGKILL)


PLAN: Plan | None = None


def _plan() -> Plan:
  assert PLAN is not None, "main() sets it"
  return PLAN


def holdings() -> dict:
  """What the leader's coordinator holds now (call on the rollout loop)."""
  from fluxjax.rl import producer as producer_lib

  plan = _plan()
  coord = plan.coordinator
  producer = coord._producer
  samples = producer.samples

  def sample_id(uid) -> str:
    return samples[uid].id if uid in samples else f"uid{uid}"

  carried = [
    (uid, j, c) for uid, rs in producer.batcher.carried.items() for j, c in sorted(rs.items())
  ]
  with producer.out.mutex:
    queued = [i for i in producer.out.queue if isinstance(i, producer_lib.KeptGroup)]
  latest = plan.latest()
  held = {
    "step": coord.steps,
    "version": coord.version,
    "latest_checkpoint": latest,
    "start_checkpoint": plan.start,
    "in_flight": sorted([sample_id(u), j] for u, j in plan.in_flight.values()),
    "partial": [
      [sample_id(u), j, len(c.completion["output_ids"])] for u, j, c in carried if not c.finished
    ],
    "finished": [
      [sample_id(u), j, len(c.completion["output_ids"])] for u, j, c in carried if c.finished
    ],
    "queued": [[k.sample.id, [len(c.output_ids) for c in k.group.completions]] for k in queued],
    "trained_since_checkpoint": [i for step, ids in plan.trained if step > latest for i in ids],
    "open": sorted(sample_id(u) for u in samples),
  }
  stake = {i for i, _ in held["in_flight"]} | {i for i, _, _ in held["partial"]}
  stake |= {i for i, _ in held["queued"]} | set(held["trained_since_checkpoint"])
  return {**held, "at_stake": sorted(stake)}


def holdings_from_any_thread() -> dict:
  """`holdings`, taken on the rollout loop, where they change."""

  async def take() -> dict:
    return holdings()

  return _plan().coordinator._producer.call(take(), timeout=60)


def reached(point: str, extra: dict, held: dict | None = None) -> None:
  """`point`'s condition holds on the leader: a kill or a shadow, or nothing."""
  plan = _plan()
  kill = plan.moment(point)
  step = held["step"] if held is not None else plan.coordinator.steps
  if not kill and (plan.fired or not plan.shadow(point, step)):
    return  # after a kill the leader may run on a moment: it records nothing more
  if held is None:
    held = holdings_from_any_thread()
  plan.write({**plan.line(point, shadow=not kill), **held, **extra})
  if kill:
    plan.kill_victim()


# -- the wrappers ---------------------------------------------------------------------


def _wrap_coordinator() -> None:
  from fluxjax.rl import coordinator as coordinator_lib

  cls = coordinator_lib.Coordinator
  init, next_item, step = cls.__init__, cls._next_item, cls.step

  def remembered(self, *args, **kwargs):
    init(self, *args, **kwargs)
    _plan().coordinator = self

  def waiting(self):
    plan = _plan()
    plan.trainer_waiting = True
    try:
      return next_item(self)
    finally:
      plan.trainer_waiting = False

  def stepped(self):
    result = step(self)
    _plan().trained.append((self.steps, list(result.trained)))
    return result

  cls.__init__, cls._next_item, cls.step = remembered, waiting, stepped


def _wrap_generation() -> None:
  """Tracks training requests in flight; a watcher asks the servers meanwhile."""
  from fluxjax.rollout import fleet as fleet_lib
  from fluxjax.rollout import router

  def wrap(cls) -> None:
    generate = cls.generate

    async def tracked(self, request, group=None):
      plan = _plan()
      rid = request.rid or ""
      if rid.startswith(TRAINING_RID):
        uid, index = rid.split("-")[3:5]
        plan.in_flight[rid] = (int(uid), int(index))
        if plan.watcher is None or plan.watcher.done():
          plan.watcher = asyncio.ensure_future(_watch_generation(self))
      try:
        return await generate(self, request, group)
      finally:
        plan.in_flight.pop(rid, None)

    cls.generate = tracked

  wrap(fleet_lib.Fleet)
  wrap(router.RoutedFleet)


async def _watch_generation(fleet) -> None:
  """While training requests are in flight: asks the servers what runs."""
  plan = _plan()
  while plan.in_flight and not plan.fired:
    if plan.coordinator is not None and plan.progressed():
      loads = await asyncio.gather(
        *(s.client.request("GET", "/get_load") for s in fleet.servers), return_exceptions=True
      )
      running = sum(r[1].get("num_reqs", 0) for r in loads if not isinstance(r, BaseException))
      held = holdings()
      if running and held["in_flight"] and (held["partial"] or not _speculates()):
        reached("generation", {"servers_running": running}, held)
    await asyncio.sleep(POLL_S)


def _speculates() -> bool:
  """Whether rounds launch more prompts than they keep: only then is a
  response cut and carried partial (tail batching's eta above 1)."""
  batcher = _plan().coordinator._producer.batcher
  return batcher.launch_prompts > batcher.P


def _wrap_queue() -> None:
  from fluxjax.rl import producer as producer_lib

  emit = producer_lib.Producer._emit

  def emitted(self, item):
    emit(self, item)
    plan = _plan()
    if not isinstance(item, producer_lib.KeptGroup) or plan.coordinator is None:
      return
    if plan.trainer_waiting or not plan.progressed():
      return
    held = holdings()
    if held["queued"]:
      reached("queue", {"trainer_busy": True}, held)

  producer_lib.Producer._emit = emitted


def _wrap_publish() -> None:
  from fluxjax.models import hf_load
  from fluxjax.rollout import publish, weight_group

  publish_distributed, as_torch = publish.publish_distributed, weight_group._as_torch

  async def counted(fleet, model, version, **kwargs):
    plan = _plan()
    plan.publishing = None
    if plan.coordinator is not None and plan.progressed():
      tensors = len(hf_load.hf_layout(model.cfg))
      plan.publishing = {"version": str(version), "tensors": tensors, "sent": 0}
    return await publish_distributed(fleet, model, version, **kwargs)

  def converted(x):  # in the broadcast's thread, before each tensor goes out
    p = _plan().publishing
    if p is not None:
      if p["sent"] == p["tensors"] // 2:
        reached("publish", {"publish": dict(p)})
      p["sent"] += 1
    return as_torch(x)

  publish.publish_distributed = counted
  weight_group._as_torch = converted


def _wrap_checkpoint() -> None:
  from orbax.checkpoint._src.serialization import serialization

  from fluxjax.rl import checkpoint as checkpoint_lib

  save, write = checkpoint_lib.Checkpointer.save, serialization.async_serialize_from_host

  def saving(self, step, *args, **kwargs):
    plan = _plan()
    # Every process sees the same saves, so every process decides alike.
    if (kwargs.get("force") or self.should_save(step)) and step >= plan.start + 2:
      kill = plan.moment("checkpoint")
      if kill:
        plan.saving = step
      if plan.process == 0 and plan.coordinator is not None:
        if kill and plan.victim != 0:
          held = holdings_from_any_thread()
          plan.write({**plan.line("checkpoint", False), **held, "checkpoint": {"step": step}})
        elif not kill and not plan.fired and plan.shadow("checkpoint", step):
          held = holdings_from_any_thread()
          plan.write({**plan.line("checkpoint", True), **held, "checkpoint": {"step": step}})
    return save(self, step, *args, **kwargs)

  async def written(*args, **kwargs):
    await write(*args, **kwargs)
    plan = _plan()
    if plan.saving is None or plan.victim != plan.process:
      return
    step, plan.saving = plan.saving, None
    entries = sorted(os.listdir(plan.checkpoints))
    tmp = [e for e in entries if e.startswith(f"{step}.orbax-checkpoint-tmp")]
    line = plan.line("checkpoint", False)
    if plan.process == 0:
      line |= holdings_from_any_thread()
    detail = {"step": step, "tmp": tmp, "committed": str(step) in entries}
    plan.write({**line, "checkpoint": detail, "killed_mid_write": True})
    os.kill(os.getpid(), signal.SIGKILL)

  checkpoint_lib.Checkpointer.save = saving
  serialization.async_serialize_from_host = written


def main() -> None:
  global PLAN
  PLAN = Plan(sys.argv[1:])
  if PLAN.record:
    with open(f"{PLAN.record}.pid{PLAN.process}", "w") as f:
      f.write(str(os.getpid()))
    _wrap_coordinator()
    for wrap in (_wrap_generation, _wrap_queue, _wrap_publish, _wrap_checkpoint):
      wrap()
  from absl import app

  from fluxjax import train

  app.run(train.main, flags_parser=train.parse_flags)


if __name__ == "__main__":
  main()
