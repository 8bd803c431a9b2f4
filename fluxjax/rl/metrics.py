"""Metrics: JSON lines and TensorBoard under the work directory, from process 0.

Keys are slash-namespaced (`train/loss`, `rollout/len_mean`, `data/skipped`).
Values must already be host floats: the loop fetches device metrics one step
late (train_step.DelayedMetrics, or after the update in the coordinator), so
writing never blocks a dispatch queue.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Mapping

import jax

log = logging.getLogger(__name__)

JSONL = "metrics.jsonl"


class MetricWriter:
  """Appends `{"step": s, "time": t, **metrics}` lines; mirrors to TensorBoard.

  Only process 0 writes; other processes get a writer that does nothing, so
  callers need no `if process_index() == 0`.
  """

  def __init__(self, workdir: str, tensorboard: bool = True):
    self.active = jax.process_index() == 0
    self.path = os.path.join(workdir, JSONL)
    self._tb = None
    if not self.active:
      return
    os.makedirs(workdir, exist_ok=True)
    self._file = open(self.path, "a", buffering=1)
    if tensorboard:
      try:
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
      except ImportError:  # an optional extra: JSONL stays the record
        log.warning("tensorboardX not installed; metrics go to %s only", self.path)

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    if not self.active:
      return
    clean = {}
    for k, v in metrics.items():
      v = float(v)
      clean[k] = v if math.isfinite(v) else str(v)  # JSON has no NaN/inf
    self._file.write(json.dumps({"step": int(step), "time": time.time(), **clean}) + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        if math.isfinite(float(v)):  # NaN = "no value yet" (e.g. no reward anchor)
          self._tb.add_scalar(k, float(v), int(step))

  def drop_after(self, step: int) -> int:
    """Drops the records of steps after `step` (a resumed run redoes them);
    returns how many. TensorBoard's events stay as written."""
    if not self.active:
      return 0
    self._file.close()
    dropped = truncate_after(self.path, step)
    self._file = open(self.path, "a", buffering=1)
    return dropped

  def close(self) -> None:
    if not self.active:
      return
    self._file.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def truncate_after(path: str, step: int) -> int:
  """Drops records of steps > `step` from a JSONL log (a resumed run redoes them).

  Returns how many records were dropped. The file is rewritten atomically.
  """
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = [ln for ln in f if ln.strip()]
  keep = [ln for ln in lines if json.loads(ln)["step"] <= step]
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(keep)
  os.replace(tmp, path)
  return len(lines) - len(keep)


def read_records(workdir: str) -> list[dict]:
  """Every line of a run's metrics file as written, redone steps included."""
  with open(os.path.join(workdir, JSONL)) as f:
    return [json.loads(line) for line in f if line.strip()]


def read_metrics(workdir: str) -> list[dict]:
  """All records of a run, in order (a resumed run appends to the same file).

  When a run resumed from an earlier checkpoint, steps after it were redone;
  the last record of each step wins, so curves continue without duplicates.
  """
  by_step: dict[int, dict] = {}
  for rec in read_records(workdir):
    by_step[rec["step"]] = {**by_step.get(rec["step"], {}), **rec}
  return [by_step[s] for s in sorted(by_step)]


class Progress:
  """A one-line progress display: step, reward, tokens/s, staleness, ETA."""

  def __init__(self, total_steps: int, first_step: int = 0):
    self.total = total_steps
    self.first = first_step
    self.start = time.time()

  def line(self, step: int, metrics: Mapping[str, float]) -> str:
    done = max(step - self.first, 1)
    per_step = (time.time() - self.start) / done
    eta = per_step * max(self.total - step, 0)
    parts = [f"step {step}/{self.total}"]
    for key, label in (
      ("rollout/reward_mean", "reward"),
      ("eval/accuracy", "acc"),
      ("perf/tokens_per_s", "tok/s"),
      ("async/staleness", "stale"),
      ("train/loss", "loss"),
    ):
      if key in metrics:
        parts.append(f"{label} {float(metrics[key]):.4g}")
    parts.append(f"ETA {eta / 60:.1f} min")
    return " | ".join(parts)
