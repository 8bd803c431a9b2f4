"""The publisher: the policy's weights handed to rollout as numbered versions.

It counts versions, refuses a policy whose logits are not finite (a probe
before rollout samples it), settles deferred publishes and counts publishes
that reached no server. How a deferred publish overlaps the next step, and
why its gathers run on the trainer's main thread: docs/design.md, section 3,
step 5.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Protocol

from flax import nnx

from fluxjax import faults as faults_lib
from fluxjax.parallel import train_step
from fluxjax.rl.policy import Policy
from fluxjax.rollout.backend import LoopThread, RolloutBackend
from fluxjax.rollout.publish import PublishReport
from fluxjax.rollout.tensor_feed import TensorFeed

log = logging.getLogger(__name__)


class Served(Protocol):
  """Told each version once rollout serves it (the producer: admission opens)."""

  def set_version(self, version: int, step: int | None = None) -> None: ...


class Publisher:
  """Publishes the policy's weights and settles what a publish left running.

  Args:
    policy: stages the weights (and, for a fed publish, announces gathers).
    rollout: the backend the weights go to.
    thread: the rollout thread's loop; every backend call runs on it.
    served: told each version, with the RL steps it had, once rollout serves it.
    faults: the run's fault streaks (`unwritten_publishes`).
    wake: set when a fed publish's consumer takes an item (room to gather);
      the trainer waits on it, and rollout sets it too on each finished item.
  """

  def __init__(
    self,
    policy: Policy,
    rollout: RolloutBackend,
    thread: LoopThread,
    served: Served,
    faults: faults_lib.Faults,
    wake: threading.Event,
  ):
    self._policy = policy
    self._rollout = rollout
    self._thread = thread
    self._served = served
    self._version = 0  # the weight version last published
    # RL steps applied when each version was published, to name the step
    # whose update made a policy non-finite.
    self._version_steps: dict[str, int] = {}
    self._unwritten = faults.streak("unwritten_publishes")  # reached no server
    self._deferred: PublishReport | None = None  # a publish whose servers' part is pending
    self._wake = wake

  @property
  def version(self) -> int:
    """The weight version last published."""
    return self._version

  def restore(self, version: int) -> None:
    """The version a checkpoint had published (before any publish)."""
    self._version = version

  def publish(self, steps: int, new_version: bool = True) -> float:
    """Hands the weights, after `steps` RL steps, to rollout; returns seconds taken.

    `new_version=False` re-publishes the current version (the policy a run
    starts or resumes with). An embedded engine gets its own buffers (the
    next update donates the trainer's); a deferred publish returns at once,
    its servers' part still running.
    """
    t = time.perf_counter()
    self.settle()
    version = self._version + int(new_version)
    params = self._policy.stage(version)
    if params is None:
      raise RuntimeError("the coordinator runs on the leader, which receives the staged weights")
    self._probe(params, version, steps, new_version)
    self._version = version
    self._version_steps[str(version)] = steps
    model = nnx.merge(self._policy.graphdef, params)
    report = self._thread.call(self._rollout.publish(model, version))
    if report.pending is None:
      self._published(report)
      self._served.set_version(version, steps)
    else:  # the servers load it while training goes on
      if report.feed is not None:
        report.feed.on_take = self._wake.set
      report.pending.add_done_callback(lambda _: self._served.set_version(version, steps))
      self._deferred = report
    return time.perf_counter() - t

  def unchanged(self, steps: int) -> None:
    """A step that left the policy as it was: nothing to publish, but
    admission counts the step."""
    self.settle()
    self._served.set_version(self._version, steps)

  # -- a deferred publish ------------------------------------------------------
  def pump(self) -> bool:
    """Gathers the items a fed publish's consumer has room for, without
    waiting; returns whether gathers are left (the next room sets `wake`)."""
    feed = self._feed()
    if feed is None or not feed.remaining:
      return False
    feed.pump(self._policy.announce_gathers)
    return feed.remaining > 0

  def settle_reads(self) -> dict[str, float]:
    """Waits for a deferred publish that still reads the trainer's arrays
    (`PublishReport.reads_params`), which the next update donates: gathers
    the rest of a feed here, or waits for the whole publish.

    Returns publish/update_wait_seconds (the wait, which also holds the
    step's own gradient programs still running: the first gather's copy to
    the host queues behind them) and, for a fed publish,
    publish/overlapped_share (the share of its gathers that ran while the
    step waited for rollouts anyway).
    """
    feed = self._feed()
    t = time.perf_counter()
    self._gather_rest()
    deferred = self._deferred
    if deferred is not None and deferred.feed is None and deferred.reads_params:
      self.settle()
    out = {"publish/update_wait_seconds": time.perf_counter() - t}
    if feed is not None:
      out["publish/overlapped_share"] = feed.pumped / max(feed.count, 1)
    return out

  def settle(self) -> None:
    """Waits for a deferred publish's servers to load it; counts what it reached."""
    self._gather_rest()
    deferred, self._deferred = self._deferred, None
    if deferred is not None and deferred.pending is not None:
      self._published(self._thread.call(_result(deferred.pending)))

  def abandon(self) -> None:
    """The run failed and the other processes were told to stop: a fed
    publish gathers nothing more (a gather would wait for them)."""
    feed = self._feed()
    if feed is not None:
      feed.abandon()
      self._deferred = None

  def _feed(self) -> TensorFeed | None:
    return self._deferred.feed if self._deferred is not None else None

  def _gather_rest(self) -> None:
    """Gathers the items a fed publish has not had yet; what is left to
    write or send then reads none of the trainer's arrays."""
    feed = self._feed()
    if feed is not None:
      feed.finish(self._policy.announce_gathers)

  # -- what a publish reached --------------------------------------------------
  def _published(self, report: PublishReport) -> None:
    """Failures logged; publishes that reached no server counted, too many in
    a row raise. The version still moves on: servers tag each token with the
    version they serve, so the staleness measures see the gap."""
    if report.failed:
      log.warning("weight update %s failed on %s", report.version, report.failed)
    if report.path is not None or not report.failed:
      self._unwritten.ok()
      return
    if self._unwritten.fail():
      raise RuntimeError(
        f"{self._unwritten.in_a_row} weight publishes in a row reached no server"
        f" (last, version {report.version}: {report.failed[0]}); the fleet still serves"
        " an older policy. Free the disk under the run's weights folder and resume."
      )

  # -- non-finite policies -------------------------------------------------------
  def _probe(self, params: nnx.State, version: int, steps: int, new_version: bool) -> None:
    """Refuses to publish a policy whose logits are non-finite.

    Every parameter is finite here (`apply_update` refuses the rest), but
    finite weights can still overflow the activations (weights of 1e8 after a
    huge step): one forward of a few tokens finds that before rollout samples
    from the policy and before the step is checkpointed.
    """
    graphdef, cfg = self._policy.graphdef, self._policy.cfg
    if train_step.logits_finite(graphdef, params, train_step.probe_row(cfg)):
      return
    unsaved = (
      f" The run stops before checkpointing step {steps}: any checkpoint is of an earlier step."
      if new_version and steps
      else ""
    )
    raise train_step.NonFiniteError(
      f"{_broken_by(steps, str(version))}: every parameter is finite but its"
      f" logits are not (NaN or infinite on a {train_step.PROBE_TOKENS}-token probe)."
      f" Weight version {version} was not published.{unsaved} Lower optim.lr or"
      " optim.max_grad_norm."
    )

  def nonfinite_error(self, version: str, symptom: str) -> train_step.NonFiniteError:
    """The error naming the step whose update gave weight `version` non-finite logits."""
    return train_step.NonFiniteError(
      f"{_broken_by(self._version_steps.get(str(version)), version)}: rollout under"
      f" weight version {version} met non-finite logits ({symptom}). Checkpoints of that"
      " step or later, if any, hold those weights: resume from an earlier one with a lower"
      " optim.lr or optim.max_grad_norm."
    )


def _broken_by(steps: int | None, version: str) -> str:
  """Who made the policy of weight `version` non-finite (`steps`: RL steps it had)."""
  if steps is None:
    return f"weight version {version} is non-finite"
  if steps:
    return f"RL step {steps} made the policy non-finite"
  return "the policy the RL steps start from (initial, restored or warmed-up) is non-finite"


async def _result(task: asyncio.Task):
  return await task
