r"""python -m fluxjax.plot RUN [RUN ...] [--out DIR]: PNG curves of runs' metrics.

`plot` writes one PNG per panel of `PANELS` and a combined summary.png from each
RUN/metrics.jsonl (docs/metrics.md, "Plots"). A run with an SFT warm-up (fluxjax/rl/sft.py)
logs it at steps -S..0; those steps are shaded in every panel, so the accuracy curve
shows where the warm-up starts and where GRPO takes over. docs/metrics.md says what each
metric means and what a healthy run shows.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from fluxjax.rl import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class Panel:
  """One figure: the first of `keys` present, and what is drawn beside it.

  Attributes:
    name: the PNG's file name (without .png).
    title: the figure's title.
    keys: candidate metrics for the main curve; the first present is drawn.
    band: a metric holding the main curve's 95% half-interval, drawn shaded.
    also: prefixes of further metrics drawn as their own curves (all matches).
  """

  name: str
  title: str
  keys: tuple[str, ...]
  band: str | None = None
  also: tuple[str, ...] = ()


PANELS = (
  Panel("reward", "mean reward", ("rollout/reward_mean",)),
  Panel(
    "accuracy",
    "held-out accuracy",
    ("eval/accuracy",),
    band="eval/accuracy_ci95",
    also=("eval/accuracy_greedy", "eval/pass@"),
  ),
  Panel("accuracy_by_difficulty", "held-out accuracy by difficulty", (), also=("eval/accuracy/",)),
  Panel("accuracy_by_task", "held-out accuracy by task", (), also=("eval/task/",)),
  Panel(
    "response_length",
    "response length (tokens)",
    ("rollout/response_len_p50",),
    also=("rollout/response_len_mean", "rollout/response_len_p99"),
  ),
  Panel(
    "reasoning_share",
    "share of responses that reason",
    ("rollout/reasoning_share",),
    also=("eval/reasoning_share",),
  ),
  Panel("staleness", "staleness", ("async/staleness", "async/version_gap_mean")),
  Panel("throughput", "tokens / s", ("perf/tokens_per_s",)),
  Panel("sft_loss", "SFT warm-up loss", ("sft/loss",)),
  # Health (docs/metrics.md).
  Panel("loss", "loss", ("train/loss",), also=("train/pg_loss",)),
  Panel("entropy", "token entropy", ("train/entropy",)),
  Panel("kl", "KL", ("train/kl",), also=("train/behaviour_kl",)),
  Panel("clipfrac", "PPO clip fraction", ("train/clipfrac",)),
  Panel("grad_norm", "gradient norm", ("train/grad_norm",)),
  Panel("lr", "learning rate", ("optim/lr",)),
  Panel("is_weight", "importance weights", ("train/is_weight",), also=("train/is_truncated",)),
)


def _mark_warm_up(ax, first_step):
  """Shades the warm-up steps [first_step, 0] (nothing for a run without one)."""
  if first_step < 0:
    ax.axvspan(first_step, 0, color="tab:orange", alpha=0.12, lw=0, label="SFT warm-up")
    ax.axvline(0, color="tab:orange", lw=1, ls="--")


def _series(records, key):
  xs, ys = [], []
  for r in records:
    v = r.get(key)
    if isinstance(v, (int, float)):
      xs.append(r["step"])
      ys.append(v)
  return xs, ys


def _curves(records, panel: Panel) -> list[tuple[str, list, list, list | None]]:
  """(key, xs, ys, half-interval or None) of everything the panel draws."""
  out = []
  for key in panel.keys:
    xs, ys = _series(records, key)
    if xs:
      band = None
      if panel.band is not None:
        bx, by = _series(records, panel.band)
        band = by if bx == xs else None
      out.append((key, xs, ys, band))
      break
  names = sorted({k for r in records for k in r if k.startswith(panel.also)}) if panel.also else []
  for key in names:
    if key not in panel.keys and key != panel.band:
      xs, ys = _series(records, key)
      out.append((key, xs, ys, None))
  return out


def _draw(ax, runs, first_step, markers: bool) -> None:
  """runs: (label prefix, curves) pairs, drawn on one axis."""
  count = 0
  for prefix, curves in runs:
    for key, xs, ys, band in curves:
      marker = "o" if markers and len(xs) < 40 else None
      (line,) = ax.plot(xs, ys, marker=marker, lw=1.5, label=prefix + key)
      count += 1
      if band is not None:
        lo = [y - h for y, h in zip(ys, band)]
        hi = [y + h for y, h in zip(ys, band)]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
  ax.set_xlabel("step")
  ax.grid(alpha=0.3)
  _mark_warm_up(ax, first_step)
  if (count > 1 or first_step < 0) and (markers or count <= 8):  # the summary's stay legible
    ax.legend(loc="best", fontsize=7, frameon=False)


def plot(workdirs: str | Sequence[str], out_dir: str | None = None) -> list[str]:
  """Writes the PNGs of one run (into RUN/plots) or of several overlaid
  (into out_dir, default ./plots); returns their paths (panels with no data
  in any run are skipped).

  Several runs' curves are overlaid and labelled by the run's folder name. Held-out
  accuracy is drawn with its 95% interval shaded, greedy accuracy and pass@k beside it.
  """
  import matplotlib

  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  runs = [workdirs] if isinstance(workdirs, str) else list(workdirs)
  records = {run: metrics_lib.read_metrics(run) for run in runs}
  out_dir = out_dir or (os.path.join(runs[0], "plots") if len(runs) == 1 else "plots")
  os.makedirs(out_dir, exist_ok=True)
  prefix = {
    run: "" if len(runs) == 1 else f"{os.path.basename(os.path.normpath(run))}: " for run in runs
  }
  first_step = min((r["step"] for recs in records.values() for r in recs), default=0)
  drawn = []
  for panel in PANELS:
    per_run = [(prefix[run], c) for run in runs if (c := _curves(records[run], panel))]
    if per_run:
      drawn.append((panel, per_run))
  written = []
  for panel, per_run in drawn:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    _draw(ax, per_run, first_step, markers=True)
    ax.set_title(panel.title)
    single = len(per_run) == 1 and len(per_run[0][1]) == 1
    ax.set_ylabel(per_run[0][1][0][0] if single else "")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{panel.name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  if drawn:
    cols = min(len(drawn), 4)
    rows = -(-len(drawn) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (panel, per_run) in zip(axes.flat, drawn):
      _draw(ax, per_run, first_step, markers=False)
      ax.set_title(panel.title)
    for ax in list(axes.flat)[len(drawn) :]:
      ax.set_visible(False)
    fig.tight_layout()
    path = os.path.join(out_dir, "summary.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("runs", nargs="+", metavar="RUN", help="a run's work directory")
  p.add_argument("--out", help="where the PNGs go (default: RUN/plots, or ./plots for several)")
  args = p.parse_args(sys.argv[1:] if argv is None else argv)
  for run in args.runs:
    if not os.path.exists(os.path.join(run, metrics_lib.JSONL)):
      sys.exit(f"no {metrics_lib.JSONL} in {run}")
  for path in plot(args.runs, args.out):
    print(path)


if __name__ == "__main__":
  main()
