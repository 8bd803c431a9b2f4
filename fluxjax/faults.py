"""The fault policy: failures are counted, and too many in a row stop the run.

A `Streak` counts one kind of failure, and `Faults` holds a run's streaks by name; the
limits live in the config's `faults` section (configs/vlm.py), nowhere else. Which faults
are counted: docs/reliability.md, "Faults, counted in the metrics".
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Mapping


def metric(name: str) -> str:
  """The metric (and summary line) of a fault's total."""
  return f"faults/{name}_total"


def leave_stop_signals_to_parent() -> None:
  """Ignores SIGTERM and SIGINT in a helper process: its parent stops it
  (a stop message, else SIGKILL), and it exits when its parent is gone.

  A helper process (a preprocessor, a reward worker) calls it first: a scheduler's SIGTERM
  or a terminal's Ctrl-C reaches the whole process group, and a helper dying of it before
  its parent shuts it down would be counted as a crash and restarted.
  """
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)


@dataclasses.dataclass
class Streak:
  """Failures of one kind: the run's total and the current run of them.

  `fail()` adds one to the total and to the current streak, `ok()` ends the streak, and
  `fail()` returns True once `limit` failures have come in a row; the caller then raises
  an error that names the cause.
  """

  name: str
  limit: int = 0  # failures in a row that stop the run; 0 = never
  in_a_row: int = 0
  total: int = 0

  def ok(self) -> None:
    self.in_a_row = 0

  def fail(self) -> bool:
    """Counts one failure; True when it is the `limit`-th in a row."""
    self.in_a_row += 1
    self.total += 1
    return bool(self.limit) and self.in_a_row >= self.limit


class Faults:
  """A run's streaks, one per fault name, with the limits of the `faults` config.

  Every total is reported as `faults/<name>_total` (`metric`) and checkpointed together
  (`get_state`, `set_state`), so a resumed run goes on counting where it stopped.
  """

  def __init__(self, limits: Mapping[str, int]):
    self._limits = {k: int(v) for k, v in limits.items()}
    self._streaks: dict[str, Streak] = {}

  def streak(self, name: str) -> Streak:
    """The streak of `name` (created on first use, with its configured limit)."""
    if name not in self._streaks:
      if name not in self._limits:
        raise KeyError(f"no limit for fault {name!r}: add faults.{name} to the config")
      self._streaks[name] = Streak(name, self._limits[name])
    return self._streaks[name]

  def totals(self) -> dict[str, float]:
    """`faults/<name>_total` of every streak, failures or not."""
    return {metric(s.name): float(s.total) for s in self._streaks.values()}

  def get_state(self) -> dict[str, int]:
    return {name: s.total for name, s in self._streaks.items()}

  def set_state(self, state: Mapping[str, int]) -> None:
    for name, total in state.items():
      self.streak(name).total = int(total)
