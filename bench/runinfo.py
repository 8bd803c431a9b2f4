"""Run metadata and the --json writer the benchmarks share (results go to bench/results/).

Every file a benchmark writes with `--json PATH` starts with the same header:

  bench     the script's name, e.g. "balance.py"
  command   the command line, as typed after `python`
  machine   platform, processor, CPU count, Python, numpy and (where importable)
            jax version, backend and devices
  commit    `git rev-parse --short HEAD` of the checkout when the benchmark
            started (the code it imported), or "unknown"; tree_dirty says
            whether tracked files differed from it then; commit_at_write is
            added if HEAD moved while it ran
  date      UTC, ISO 8601

followed by the script's own figures (its args and everything its tables print,
unrounded). Name a file that records a run `<bench>-<machine>-<short commit>.json`
under bench/results/.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys

from fluxjax.provenance import commit, tree_dirty

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict:
  """What ran the benchmark. Imports jax only to describe it (and only here)."""
  m = {
    "platform": platform.platform(),
    "machine": platform.machine(),
    "processor": cpu_model(),
    "cpu_count": os.cpu_count(),
    "python": platform.python_version(),
  }
  try:
    m["load_average_1min"] = os.getloadavg()[0]
  except OSError:
    pass
  try:
    import numpy

    m["numpy"] = numpy.__version__
  except ImportError:
    pass
  try:
    import jax

    m["jax"] = jax.__version__
    m["jax_backend"] = jax.default_backend()
    m["jax_devices"] = [
      {"id": d.id, "platform": d.platform, "device_kind": d.device_kind} for d in jax.devices()
    ]
  except Exception as e:
    m["jax_devices"] = f"unavailable: {type(e).__name__}: {e}"
  return m


# The checkout as the benchmark imported it: a long run's file, written at its
# end, names the code that ran, not a commit made while it ran.
_STARTED = {"commit": commit(), "tree_dirty": tree_dirty()}


def header(bench: str) -> dict:
  now = commit()
  return {
    "bench": bench,
    "command": "python " + shlex.join(sys.argv),
    "machine": machine(),
    **_STARTED,
    **({"commit_at_write": now} if now != _STARTED["commit"] else {}),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }


def _plain(o):
  """JSON fallback for numpy scalars and arrays, tuples of them, and anything else (str)."""
  if hasattr(o, "tolist"):
    return o.tolist()
  if hasattr(o, "item"):
    return o.item()
  return str(o)


def write(path: str, bench: str, figures: dict) -> None:
  """Writes header(bench) followed by figures to path (indented JSON)."""
  record = {**header(bench), **figures}
  with open(path, "w") as f:
    json.dump(record, f, indent=1, default=_plain)
    f.write("\n")
