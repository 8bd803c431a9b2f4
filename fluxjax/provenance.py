"""Which code ran: the checkout's commit, and a run's record of its invocations.

A run that is killed or preempted and started again is one run made by
several invocations, possibly at different commits. Each start appends one
line to `WORKDIR/invocations.jsonl` (`record_invocation`), so what made a
result (a base model's card, a benchmark) can name the commit it started
at and the time it took over all its invocations. A run that refines a
model and exports over its folder keeps that model's card first
(`keep_parent_card`), so the new card can name its parent.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INVOCATIONS = "invocations.jsonl"
# The card of the model a run started from (model.hf_path), kept in its work directory.
PARENT_CARD = "parent_card.json"


def _git(*args: str) -> str | None:
  try:
    out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() if out.returncode == 0 else None


def commit() -> str:
  """`git rev-parse --short HEAD` of the checkout fluxjax runs from, or "unknown"."""
  return _git("rev-parse", "--short", "HEAD") or "unknown"


def tree_dirty() -> bool | None:
  """Whether tracked files differ from that commit (None: not a git checkout)."""
  status = _git("status", "--porcelain", "--untracked-files=no")
  return None if status is None else bool(status)


def record_invocation(workdir: str) -> dict:
  """Appends this invocation (start time, commit, tree state, host, command
  line) to the run's invocations.jsonl; returns the record."""
  record = {
    "time": time.time(),
    "commit": commit(),
    "tree_dirty": tree_dirty(),
    "host": socket.gethostname(),
    "argv": sys.argv,
  }
  with open(os.path.join(workdir, INVOCATIONS), "a") as f:
    f.write(json.dumps(record) + "\n")
  return record


def invocations(workdir: str) -> list[dict]:
  """The run's invocations, first first ([] for a run from before they were recorded)."""
  path = os.path.join(workdir, INVOCATIONS)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def busy_seconds(starts: list[float], record_times: list[float]) -> float:
  """Seconds a run worked over its invocations: for each start, up to the
  last record written before the next start (a killed invocation's time
  ends at its last record)."""
  total = 0.0
  for start, end in itertools.pairwise([*sorted(starts), float("inf")]):
    written = [t for t in record_times if start <= t < end]
    if written:
      total += max(written) - start
  return total


def keep_parent_card(hf_path: str, workdir: str) -> None:
  """Copies `hf_path`'s card.json, if any, into the work directory once: an
  export may replace that folder, card included, before the new card is written."""
  card, kept = os.path.join(hf_path, "card.json"), os.path.join(workdir, PARENT_CARD)
  if hf_path and os.path.exists(card) and not os.path.exists(kept):
    shutil.copyfile(card, kept)


def parent_card(workdir: str) -> dict | None:
  """The card `keep_parent_card` kept, or None."""
  path = os.path.join(workdir, PARENT_CARD)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)
