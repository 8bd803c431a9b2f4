"""Where a run's log records go: fluxjax's progress to the console, all of it to a file.

Every fluxjax module logs through the standard library,
`log = logging.getLogger(__name__)`, so all of its records sit under the
`fluxjax` logger. train.py routes them: `configure()` at start, and
`add_file(workdir)` once the config is valid (a refused run writes nothing):

  console  fluxjax's own INFO and above (progress, evaluation, the strategy
           and mesh); WARNING and above from other libraries, except those
           that log through absl (Orbax, Grain: ERROR and above; Orbax
           warns on every checkpoint about its internal layout);
  file     WORKDIR/train.log: fluxjax at DEBUG (e.g. the evaluated answers)
           and everything else at INFO and above (Orbax writes ~60 INFO
           lines per checkpoint), for when a run needs explaining.

Library code never configures logging; a notebook or test sees fluxjax's
records through the root logger as usual.
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
  """The console's share of the records (see the module docstring)."""

  def filter(self, record: logging.LogRecord) -> bool:
    if record.name == "fluxjax" or record.name.startswith("fluxjax."):
      return record.levelno >= logging.INFO
    if record.name == "absl":
      return record.levelno >= logging.ERROR
    return record.levelno >= logging.WARNING


class _ConsoleFormatter(logging.Formatter):
  """Plain lines for progress; level and logger name where something is wrong."""

  def __init__(self):
    super().__init__(_FORMAT_CONSOLE, datefmt="%H:%M:%S")
    self._warning = logging.Formatter(_FORMAT_CONSOLE_WARNING, datefmt="%H:%M:%S")

  def format(self, record: logging.LogRecord) -> str:
    if record.levelno >= logging.WARNING:
      return self._warning.format(record)
    return super().format(record)


def configure(console: TextIO | None = None) -> None:
  """Routes every record of the process to the console (see the module docstring).

  Replaces the root logger's handlers (absl's, under `absl.app.run`), so it
  is for entry points only; `add_file` adds the run's log file once the work
  directory is known.

  Args:
    console: the console stream (default stderr).
  """
  root = logging.getLogger()
  for handler in list(root.handlers):
    root.removeHandler(handler)
  root.setLevel(logging.INFO)
  logging.getLogger("fluxjax").setLevel(logging.DEBUG)
  to_console = logging.StreamHandler(console or sys.stderr)
  to_console.addFilter(_ConsoleFilter())
  to_console.setFormatter(_ConsoleFormatter())
  root.addHandler(to_console)
  # absl's own threshold gates what reaches the Python logger (Orbax logs
  # through absl); let its INFO through to the file.
  absl_logging.set_verbosity(absl_logging.INFO)


def add_file(workdir: str) -> str:
  """Also writes every record to WORKDIR/train.log; returns its path."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, LOG_FILE)
  to_file = logging.FileHandler(path)
  to_file.setFormatter(logging.Formatter(_FORMAT_FILE))
  logging.getLogger().addHandler(to_file)
  return path
