"""The summary a run ends with: what it achieved, what went wrong, where its curves are.

`summarize` builds a `Summary` from a run's records (metrics.jsonl as
`metrics.read_metrics` returns it, and trained.jsonl); `report` writes it to
WORKDIR/summary.json and logs its lines at INFO (the console shows them, logs.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shlex
from collections.abc import Collection, Mapping, Sequence

from fluxjax.rl import metrics as metrics_lib

log = logging.getLogger(__name__)

JSON = "summary.json"
# Where a run's records are: (label, name in the work directory). trained.jsonl
# is loop.TRAINED, train.log logs.LOG_FILE (neither importable from here).
FILES = (
  ("metrics", metrics_lib.JSONL),
  ("trained samples", "trained.jsonl"),
  ("TensorBoard", "tb"),
  ("full log", "train.log"),
)

# Fault and skip counters, by how a run's records hold them. Cumulative: the
# latest value (reward/* and the loader's data/skipped/<kind> count from the
# latest start; the checkpoint keeps the others).
CUMULATIVE_PREFIXES = ("faults/", "data/skipped")
CUMULATIVE = (
  "rollout/filtered_groups_total",
  "rollout/restarted_total",
  "rollout/tokens_discarded_total",
  "reward/timeout",
  "reward/error",
  "reward/worker_restarts",
  "fleet/retries",
)
LEVELS = ("fleet/servers_down",)  # a level, not a count: the most at any step
PER_STEP = ("sft/nonfinite",)  # 1 in each step with the event: summed


def _number(value) -> float | None:
  """A finite metric value, or None (MetricWriter writes non-finite ones as strings)."""
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return None
  return float(value) if math.isfinite(value) else None


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """Held-out metrics of one evaluation (keys: rl/evaluation.py).

  Attributes:
    step: the step it was logged at.
    accuracy, ci95: eval/accuracy and its 95% half-interval.
    greedy: eval/accuracy_greedy, or None.
    pass_at: {"pass@k": value}.
    prompts, samples: how much was evaluated.
    by_task, by_difficulty, by_band: eval/task/<t>, eval/accuracy/<d> and
      eval/band/<b> (the reference response's length band).
    by_task_level, by_task_greedy: eval/task_level/<t>@<d> and
      eval/task_greedy/<t>.
    priors: eval/prior/<t>, each task's most common answer's share.
  """

  step: int
  accuracy: float
  ci95: float
  greedy: float | None
  pass_at: dict[str, float]
  prompts: int
  samples: int
  by_task: dict[str, float]
  by_difficulty: dict[str, float]
  by_band: dict[str, float]
  by_task_level: dict[str, float]
  by_task_greedy: dict[str, float]
  priors: dict[str, float]

  @classmethod
  def of(cls, record: Mapping) -> Evaluation | None:
    """The evaluation a record holds, or None."""
    accuracy = _number(record.get("eval/accuracy"))
    if accuracy is None:
      return None

    def starting(prefix: str) -> dict[str, float]:
      found = {k[len(prefix) :]: _number(v) for k, v in record.items() if k.startswith(prefix)}
      return {k: v for k, v in sorted(found.items()) if v is not None}

    return cls(
      step=int(record["step"]),
      accuracy=accuracy,
      ci95=_number(record.get("eval/accuracy_ci95")) or 0.0,
      greedy=_number(record.get("eval/accuracy_greedy")),
      pass_at={"pass@" + k: v for k, v in starting("eval/pass@").items()},
      prompts=int(_number(record.get("eval/prompts")) or 0),
      samples=int(_number(record.get("eval/samples")) or 0),
      by_task=starting("eval/task/"),
      by_difficulty=starting("eval/accuracy/"),
      by_band=starting("eval/band/"),
      by_task_level=starting("eval/task_level/"),
      by_task_greedy=starting("eval/task_greedy/"),
      priors=starting("eval/prior/"),
    )


@dataclasses.dataclass(frozen=True)
class Summary:
  """What a run achieved; `lines()` is its text.

  It holds held-out accuracy (rl/evaluation.py) at the RL start (step 0, after any SFT
  warm-up) and at the last evaluation: sampled with its 95% interval, greedy, pass@k, per
  task and per difficulty, start -> end with the change; the wall time of this
  invocation, and the step it resumed from; trained samples per second over this
  invocation's RL steps, timed by `perf/step_seconds` (evaluation and checkpoints left
  out); every non-zero fault and skip counter; the command that draws the curves, and
  where the records are.

  Attributes:
    workdir: the run's work directory.
    wall_s: seconds this invocation ran.
    resumed_from: the checkpoint step it resumed from (0: a fresh run).
    last_step: the last RL step in the records.
    total_steps: the steps the run was configured for, or None.
    preempted: whether SIGTERM stopped it before total_steps.
    warm_up: the first evaluation before step 0 (the SFT warm-up's start), or None.
    start: the evaluation at step 0 (the RL start), or None.
    end: the last evaluation after step 0, or None.
    rl_steps, samples, step_seconds: this invocation's RL steps, the samples
      they trained and the seconds they took.
    faults: every non-zero fault and skip counter.
    plot_command: the command that draws the curves.
    files: {label: path} of the run's records.
    held_out: whether the evaluation rows are out of training (else the
      accuracy lines say they are training rows).
  """

  workdir: str
  wall_s: float
  resumed_from: int
  last_step: int
  total_steps: int | None
  preempted: bool
  warm_up: Evaluation | None
  start: Evaluation | None
  end: Evaluation | None
  rl_steps: int
  samples: int
  step_seconds: float
  faults: dict[str, float]
  plot_command: str
  files: dict[str, str]
  held_out: bool = True

  @property
  def samples_per_s(self) -> float | None:
    return self.samples / self.step_seconds if self.step_seconds > 0 else None

  @property
  def accuracy_change(self) -> float | None:
    if self.start is None or self.end is None:
      return None
    return self.end.accuracy - self.start.accuracy

  def to_json(self) -> dict:
    """summary.json: the fields, the derived rates and the text."""
    out = dataclasses.asdict(self)
    out.update(
      samples_per_s=self.samples_per_s, accuracy_change=self.accuracy_change, text=self.lines()
    )
    return out

  def lines(self) -> list[str]:
    return [
      self._header(),
      *self._accuracy_lines(),
      self._throughput(),
      "faults and skips: " + (", ".join(f"{k} {v:g}" for k, v in self.faults.items()) or "none"),
      f"curves: {self.plot_command} (PNGs into {os.path.join(self.workdir, 'plots')})",
      f"HF folder of the last checkpoint: python -m fluxjax.export {shlex.quote(self.workdir)} OUT",
      "records: " + "; ".join(f"{k} {v}" for k, v in self.files.items()),
    ]

  def _header(self) -> str:
    done = f"run summary ({self.workdir}): {self.last_step} RL steps"
    if self.total_steps is not None and self.last_step < self.total_steps:
      why = "preempted; the same command resumes" if self.preempted else "the data ran out"
      done += f" of {self.total_steps} ({why})"
    resumed = f", resumed from step {self.resumed_from}" if self.resumed_from else ""
    return f"{done}; this invocation {_duration(self.wall_s)} wall time{resumed}"

  def _accuracy_lines(self) -> list[str]:
    start, end = self.start, self.end
    some = end or start
    what = "held-out accuracy" if self.held_out else "accuracy on training rows (none held out)"
    if some is None:
      return [f"{what}: not evaluated"]
    out = [
      f"{what}, {_at(start, 'no step-0 evaluation')} -> "
      f"{_at(end, 'no later evaluation')} "
      f"({some.prompts} prompts, {some.samples} samples; ± 95% interval):",
    ]
    (a, ci_a), (b, ci_b) = ((e.accuracy, e.ci95) if e else (None, None) for e in (start, end))
    out.append(_row("sampled", a, b, ci_a, ci_b))
    for label, part in (
      ("greedy", lambda e: {"": e.greedy} if e.greedy is not None else {}),
      ("", lambda e: e.pass_at),
      ("task ", lambda e: e.by_task),
      ("greedy ", lambda e: e.by_task_greedy),
      ("", lambda e: e.by_task_level),
      ("difficulty ", lambda e: e.by_difficulty),
      ("length band ", lambda e: e.by_band),
    ):
      was, now = (part(e) if e is not None else {} for e in (start, end))
      out.extend(_row(label + k, was.get(k), now.get(k)) for k in sorted(was.keys() | now.keys()))
    known = next((e.priors for e in (end, start) if e is not None and e.priors), {})
    if known:
      priors = ", ".join(f"{k} {v:.3f}" for k, v in known.items())
      out.append(f"  answer priors (each task's most common answer): {priors}")
    if self.warm_up is not None:
      w = self.warm_up
      out.append(f"  before the SFT warm-up (step {w.step}): {_value(w.accuracy, w.ci95)}")
    return out

  def _throughput(self) -> str:
    if not self.rl_steps:
      return "throughput: no RL steps in this invocation"
    rate = self.samples_per_s
    per_s = f"{rate:.3g} samples/s" if rate is not None else "samples/s unknown"
    return (
      f"throughput: {self.samples} samples trained in {self.rl_steps} RL steps: "
      f"{per_s} ({self.step_seconds:.1f} s of step time)"
    )


def _duration(seconds: float) -> str:
  if seconds < 120:
    return f"{seconds:.0f} s"
  if seconds < 7200:
    return f"{seconds / 60:.1f} min"
  return f"{seconds / 3600:.2f} h"


def _at(e: Evaluation | None, missing: str) -> str:
  return f"step {e.step}" if e is not None else missing


def _value(v: float | None, ci: float | None = None) -> str:
  if v is None:
    return "-"
  return f"{v:.3f} ± {ci:.3f}" if ci is not None else f"{v:.3f}"


def _row(
  label: str,
  a: float | None,
  b: float | None,
  ci_a: float | None = None,
  ci_b: float | None = None,
) -> str:
  """`  label  start -> end  (change)`, with the intervals given."""
  text = f"  {label:<18} {_value(a, ci_a)} -> {_value(b, ci_b)}"
  return text + (f"  ({b - a:+.3f})" if a is not None and b is not None else "")


def fault_counts(records: Sequence[Mapping]) -> dict[str, float]:
  """Every non-zero fault and skip counter of the records (see CUMULATIVE, LEVELS, PER_STEP)."""
  out: dict[str, float] = {}
  for rec in records:
    for key, value in rec.items():
      v = _number(value)
      if v is None:
        continue
      if key.startswith(CUMULATIVE_PREFIXES) or key in CUMULATIVE:
        out[key] = v
      elif key in LEVELS:
        out[key] = max(out.get(key, 0.0), v)
      elif key in PER_STEP:
        out[key] = out.get(key, 0.0) + v
  return {k: v for k, v in sorted(out.items()) if v}


def summarize(
  records: Sequence[Mapping],
  trained: Sequence[Mapping],
  *,
  wall_s: float,
  workdir: str,
  resumed_from: int = 0,
  total_steps: int | None = None,
  preempted: bool = False,
  files: Collection[str] | None = None,
  held_out: bool = True,
) -> Summary:
  """The summary of a run from its records.

  Args:
    records: metrics.jsonl's records ({"step": s, ...}), one per step in
      step order (`metrics.read_metrics`).
    trained: trained.jsonl's records ({"step": s, "ids": [...]}).
    wall_s: seconds this invocation ran.
    workdir: the run's work directory.
    resumed_from: the checkpoint step this invocation resumed from (0: fresh).
    total_steps: the configured RL steps (to say when a run stopped early).
    preempted: whether SIGTERM stopped the run (else an early stop means the
      data ran out).
    files: names (FILES) present in the work directory; None: all of them.
    held_out: whether the evaluation rows are out of training.
  """
  evals = [e for r in records if (e := Evaluation.of(r)) is not None]
  mine = [r for r in records if r["step"] > resumed_from and "perf/step_seconds" in r]
  return Summary(
    workdir=workdir,
    wall_s=float(wall_s),
    resumed_from=resumed_from,
    last_step=max((int(r["step"]) for r in records), default=0),
    total_steps=total_steps,
    preempted=preempted,
    warm_up=next((e for e in evals if e.step < 0), None),
    start=next((e for e in evals if e.step == 0), None),
    end=next((e for e in reversed(evals) if e.step > 0), None),
    rl_steps=sum(1 for t in trained if t["step"] > resumed_from),
    samples=sum(len(t["ids"]) for t in trained if t["step"] > resumed_from),
    step_seconds=sum(_number(r["perf/step_seconds"]) or 0.0 for r in mine),
    faults=fault_counts(records),
    plot_command=f"python -m fluxjax.plot {shlex.quote(workdir)}",
    files={
      label: os.path.join(workdir, name) for label, name in FILES if files is None or name in files
    },
    held_out=held_out,
  )


def report(
  workdir: str,
  records: Sequence[Mapping],
  trained: Sequence[Mapping],
  **kwargs,
) -> Summary:
  """`summarize`, written to WORKDIR/summary.json and logged line by line at INFO."""
  present = {name for _, name in FILES if os.path.exists(os.path.join(workdir, name))}
  summary = summarize(records, trained, workdir=workdir, files=present, **kwargs)
  path = os.path.join(workdir, JSON)
  with open(path + ".tmp", "w") as f:
    json.dump(summary.to_json(), f, indent=2)
  os.replace(path + ".tmp", path)
  for line in summary.lines():
    log.info("%s", line)
  return summary
