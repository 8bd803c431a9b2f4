"""Where a run's log records go: fluxjax's progress to the console, all of it to a file.

Every fluxjax module logs through the standard library (`logging.getLogger(__name__)`),
so all of its records sit under the `fluxjax` logger. train.py routes them: `configure()`
at start, and `add_file(workdir)` once the config is valid (a refused run writes nothing).
Library code never configures logging; a notebook or test sees fluxjax's records through
the root logger as usual.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

from absl import logging as absl_logging

LOG_FILE = "train.log"
_FORMAT_FILE = "%(asctime)s %(levelname).1s %(name)s] %(message)s"
_FORMAT_CONSOLE = "%(asctime)s %(message)s"
_FORMAT_CONSOLE_WARNING = "%(asctime)s %(levelname)s %(name)s] %(message)s"


class _ConsoleFilter(logging.Filter):
  """The console's share of the records.

  fluxjax's own records at `fluxjax_level` and above (progress, evaluation, the strategy
  and mesh); WARNING and above from other libraries, except those that log through absl
  (Orbax, Grain: ERROR and above; Orbax warns on every checkpoint about its internal
  layout).
  """

  def __init__(self, fluxjax_level: int = logging.INFO):
    super().__init__()
    self.fluxjax_level = fluxjax_level

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name == "fluxjax" or record.name.startswith("fluxjax."):
      return record.levelno >= self.fluxjax_level
    if record.name == "absl":
      return record.levelno >= logging.ERROR
    return record.levelno >= logging.WARNING


class _ConsoleFormatter(logging.Formatter):
  """Plain lines for progress; level and logger name where something is wrong."""

  def __init__(self, prefix: str = ""):
    super().__init__(prefix + _FORMAT_CONSOLE, datefmt="%H:%M:%S")
    self._warning = logging.Formatter(prefix + _FORMAT_CONSOLE_WARNING, datefmt="%H:%M:%S")

  def format(self, record: logging.LogRecord) -> str:
    if record.levelno >= logging.WARNING:
      return self._warning.format(record)
    return super().format(record)


def configure(console: TextIO | None = None, process_index: int = 0) -> None:
  """Routes every record of the process to the console (`_ConsoleFilter`'s share).

  Replaces the root logger's handlers (absl's, under `absl.app.run`), so it
  is for entry points only; `add_file` adds the run's log file once the work
  directory is known.

  Args:
    console: the console stream (default stderr).
    process_index: this process in a multi-controller run; k > 0 shows
      fluxjax's WARNING and above only, prefixed [p<k>] (the leader reports
      progress).
  """
  root = logging.getLogger()
  for handler in list(root.handlers):
    root.removeHandler(handler)
  root.setLevel(logging.INFO)
  logging.getLogger("fluxjax").setLevel(logging.DEBUG)
  to_console = logging.StreamHandler(console or sys.stderr)
  to_console.addFilter(_ConsoleFilter(logging.INFO if process_index == 0 else logging.WARNING))
  to_console.setFormatter(_ConsoleFormatter(f"[p{process_index}] " if process_index else ""))
  root.addHandler(to_console)
  # absl's own threshold gates what reaches the Python logger (Orbax logs
  # through absl); let its INFO through to the file.
  absl_logging.set_verbosity(absl_logging.INFO)


def log_file_name(process_index: int = 0) -> str:
  """train.log for the leader (process 0); train.p<k>.log for process k of several."""
  return LOG_FILE if process_index == 0 else LOG_FILE.replace(".log", f".p{process_index}.log")


def add_file(workdir: str, process_index: int = 0) -> str:
  """Also writes every record to WORKDIR/train.log (per process); returns its path.

  The file takes fluxjax at DEBUG (e.g. the evaluated answers) and everything else at
  INFO and above (Orbax writes ~60 INFO lines per checkpoint), for when a run needs
  explaining. Process k > 0 of a multi-controller run writes train.p<k>.log.
  """
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, log_file_name(process_index))
  to_file = logging.FileHandler(path)
  to_file.setFormatter(logging.Formatter(_FORMAT_FILE))
  logging.getLogger().addHandler(to_file)
  return path
