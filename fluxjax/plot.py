r"""python -m fluxjax.plot WORKDIR: PNG curves of a run's metrics.

Writes WORKDIR/plots/{reward,accuracy,response_length,staleness,throughput,
sft_loss}.png and a combined WORKDIR/plots/summary.png from
WORKDIR/metrics.jsonl. A run with an SFT warm-up (fluxjax/rl/sft.py) logs it
at steps -S..0; those steps are shaded and labelled in every panel, so the
accuracy curve shows where the warm-up starts and where GRPO takes over.
"""

from __future__ import annotations

import os
import sys

from fluxjax.rl import metrics as metrics_lib

# One panel per curve: (file name, title, candidate metric keys).
PANELS = (
  ("reward", "mean reward", ("rollout/reward_mean",)),
  ("accuracy", "held-out accuracy", ("eval/accuracy",)),
  ("response_length", "response length (tokens)", ("rollout/response_len_mean",)),
  ("staleness", "staleness", ("async/staleness", "async/version_gap_mean")),
  ("throughput", "tokens / s", ("perf/tokens_per_s",)),
  ("sft_loss", "SFT warm-up loss", ("sft/loss",)),
)


def _mark_warm_up(ax, first_step):
  """Shades the warm-up steps [first_step, 0] (nothing for a run without one)."""
  if first_step < 0:
    ax.axvspan(first_step, 0, color="tab:orange", alpha=0.12, lw=0, label="SFT warm-up")
    ax.axvline(0, color="tab:orange", lw=1, ls="--")
    ax.legend(loc="best", fontsize=7, frameon=False)


def _series(records, key):
  xs, ys = [], []
  for r in records:
    v = r.get(key)
    if isinstance(v, (int, float)):
      xs.append(r["step"])
      ys.append(v)
  return xs, ys


def plot(workdir: str) -> list[str]:
  """Writes the PNGs; returns their paths (panels with no data are skipped)."""
  import matplotlib

  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  records = metrics_lib.read_metrics(workdir)
  out_dir = os.path.join(workdir, "plots")
  os.makedirs(out_dir, exist_ok=True)
  written, panels = [], []
  first_step = min((r["step"] for r in records), default=0)
  for name, title, keys in PANELS:
    for key in keys:
      xs, ys = _series(records, key)
      if xs:
        panels.append((name, title, key, xs, ys))
        break
  for name, title, key, xs, ys in panels:
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.plot(xs, ys, marker="o" if len(xs) < 40 else None, lw=1.5)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    _mark_warm_up(ax, first_step)
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  if panels:
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (_, title, _, xs, ys) in zip(axes[0], panels):
      ax.plot(xs, ys, lw=1.5)
      ax.set_title(title)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
      _mark_warm_up(ax, first_step)
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
