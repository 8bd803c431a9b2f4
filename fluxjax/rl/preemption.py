"""SIGTERM as a preemption: finish the RL step in progress, checkpoint, exit 143.

On SIGTERM (`Preemption`) the leader's loop finishes the RL step in progress, saves a
checkpoint of it and stops the run (the other processes with it); `loop.run` then raises
`Preempted`, so a requeued job resumes from that checkpoint with the same command, each
prompt trained once. Schedulers and their settings: docs/reliability.md, "Preemption".
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

log = logging.getLogger(__name__)


class Preempted(SystemExit):
  """The run stopped on SIGTERM after `step`, whose checkpoint is written.

  A SystemExit with status 128 + SIGTERM, so the job reports a termination.
  """

  def __init__(self, step: int):
    super().__init__(128 + signal.SIGTERM)
    self.step = step


class Preemption:
  """A context that turns SIGTERM into `requested` (the leader) or a log line (the others).

  The other processes of a multi-controller run only log the signal: the leader stops
  them after its checkpoint. A signal during the SFT warm-up stops it after its step in
  progress with a warm-up checkpoint when it keeps them (`sft.checkpoint_every`, as
  pretraining does), else takes effect after the first RL step. Python runs signal
  handlers in the main thread only; elsewhere (a notebook's worker thread) SIGTERM keeps
  its default.
  """

  def __init__(self, leader: bool):
    self.leader = leader
    self.requested = False
    self.stopped_at: int | None = None  # the step the leader stopped after
    self._previous: Any = None  # the handler to restore

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    if self.requested:
      return
    self.requested = True
    if self.leader:
      log.warning("SIGTERM: the run stops after the RL step in progress, with a checkpoint")
    else:
      log.warning("SIGTERM: the leader checkpoints and stops this process")

  def __enter__(self) -> Preemption:
    if threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None
