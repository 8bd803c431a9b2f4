r"""python -m fluxjax.plot WORKDIR: PNG curves of a run's metrics.

Writes WORKDIR/plots/{reward,accuracy,accuracy_by_difficulty,
accuracy_by_task,response_length,staleness,throughput,sft_loss}.png and a
combined WORKDIR/plots/summary.png from WORKDIR/metrics.jsonl. Held-out
accuracy is drawn with its 95% interval shaded, greedy accuracy and pass@k
beside it. A run with an SFT warm-up (fluxjax/rl/sft.py) logs it at steps
-S..0; those steps are shaded and labelled in every panel, so the accuracy
curve shows where the warm-up starts and where GRPO takes over.
"""

from __future__ import annotations

import dataclasses
import os
import sys

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
    ("rollout/response_len_p50", "rollout/response_len_mean", "rollout/response_len_p99"),
  ),
  Panel("staleness", "staleness", ("async/staleness", "async/version_gap_mean")),
  Panel("throughput", "tokens / s", ("perf/tokens_per_s",)),
  Panel("sft_loss", "SFT warm-up loss", ("sft/loss",)),
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


def _draw(ax, curves, first_step, markers: bool) -> None:
  for key, xs, ys, band in curves:
    (line,) = ax.plot(xs, ys, marker="o" if markers and len(xs) < 40 else None, lw=1.5, label=key)
    if band is not None:
      lo = [y - h for y, h in zip(ys, band)]
      hi = [y + h for y, h in zip(ys, band)]
      ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
  ax.set_xlabel("step")
  ax.grid(alpha=0.3)
  _mark_warm_up(ax, first_step)
  if len(curves) > 1 or first_step < 0:
    ax.legend(loc="best", fontsize=7, frameon=False)


def plot(workdir: str) -> list[str]:
  """Writes the PNGs; returns their paths (panels with no data are skipped)."""
  import matplotlib

  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  records = metrics_lib.read_metrics(workdir)
  out_dir = os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  written = []
  first_step = min((r["step"] for r in records), default=0)
  drawn = [(panel, curves) for panel in PANELS if (curves := _curves(records, panel))]
  for panel, curves in drawn:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    _draw(ax, curves, first_step, markers=True)
    ax.set_title(panel.title)
    ax.set_ylabel(curves[0][0] if len(curves) == 1 else "")
    fig.tight_layout()
    path = os.path.join(out_dir, f"{panel.name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  if drawn:
    fig, axes = plt.subplots(1, len(drawn), figsize=(4.2 * len(drawn), 3.2), squeeze=False)
    for ax, (panel, curves) in zip(axes[0], drawn):
      _draw(ax, curves, first_step, markers=False)
      ax.set_title(panel.title)
    fig.tight_layout()
    path = os.path.join(out_dir, "summary.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  return written


def main(argv=None) -> None:
  argv = sys.argv[1:] if argv is None else argv
  if len(argv) != 1:
    sys.exit("usage: python -m fluxjax.plot WORKDIR")
  if not os.path.exists(os.path.join(argv[0], metrics_lib.JSONL)):
    sys.exit(f"no {metrics_lib.JSONL} in {argv[0]}")
  for path in plot(argv[0]):
    print(path)


if __name__ == "__main__":
  main()
