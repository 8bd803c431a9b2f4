r"""python -m fluxjax.plot WORKDIR: PNG curves of a run's metrics.

Writes WORKDIR/plots/{reward,accuracy,response_length,staleness,throughput}.png
and a combined WORKDIR/plots/summary.png from WORKDIR/metrics.jsonl.
"""

from __future__ import annotations

import os
import sys

from fluxjax import metrics as metrics_lib

# One panel per curve: (file name, title, candidate metric keys).
PANELS = (
    ("reward", "mean reward", ("rollout/reward_mean",)),
    ("accuracy", "held-out accuracy", ("eval/accuracy",)),
    ("response_length", "response length (tokens)", ("rollout/response_len_mean",)),
    ("staleness", "staleness", ("async/staleness", "async/version_gap_mean")),
    ("throughput", "tokens / s", ("perf/tokens_per_s",)),
)


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
    fig.tight_layout()
    path = os.path.join(out_dir, f"{name}.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
  if panels:
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.2), squeeze=False)
    for ax, (name, title, key, xs, ys) in zip(axes[0], panels):
      ax.plot(xs, ys, lw=1.5)
      ax.set_title(title)
      ax.set_xlabel("step")
      ax.grid(alpha=0.3)
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
