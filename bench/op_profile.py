"""Time by XLA op from a jax.profiler trace: where a GPU bench's step goes.

  python bench/op_profile.py TRACE_DIR [--top 25] [--where device|host]

`mfu.py --profile DIR` and `rollout.py --profile DIR` record their timed runs
with `capture(DIR)`; this reads the newest trace under DIR (the trace viewer's
`*.trace.json.gz`) and sums the complete events by op: on a GPU the kernels of
each `/device:GPU:*` process, named by the HLO op that launched them (its
`hlo_op` argument, else the kernel's name); with --where host the host
threads' events (what a CPU run records, since XLA:CPU reports no per-op
device events; they nest, Python frames around runtime calls, so their
times overlap). Each row: op, total ms, share of the summed time, count.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
from typing import NamedTuple

import jax


class OpTime(NamedTuple):
  op: str
  total_ms: float
  count: int


# XLA:GPU wraps runs of kernels in command buffers (CUDA graphs), and a trace
# then names them all after their buffer (`command_buffer_272`), hiding which
# ops take the time. Off, the step took the same time within 0.5% on an H200.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def expose_ops() -> None:
  """Turns XLA:GPU's command buffers off for this process, so that a trace
  names each kernel's op; call it before JAX's first use of a device."""
  flags = os.environ.get("XLA_FLAGS", "")
  if NO_COMMAND_BUFFERS not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()


def capture(log_dir: str) -> contextlib.AbstractContextManager:
  """Records what runs inside into a trace under `log_dir`."""
  return jax.profiler.trace(log_dir, create_perfetto_trace=False)


def newest_trace(log_dir: str) -> str:
  """The newest `*.trace.json.gz` under `log_dir`; FileNotFoundError names the folder."""
  found = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
  if not found:
    raise FileNotFoundError(f"no *.trace.json.gz under {log_dir}: was it recorded with capture()?")
  return max(found, key=os.path.getmtime)


def _process_names(events: list[dict]) -> dict[int, str]:
  return {
    e["pid"]: e.get("args", {}).get("name", "")
    for e in events
    if e.get("ph") == "M" and e.get("name") == "process_name"
  }


def op_times(trace_path: str, where: str = "device") -> list[OpTime]:
  """Complete events summed by op, longest first.

  Args:
    trace_path: a trace viewer `*.trace.json.gz`.
    where: "device" (processes named /device:...) or "host" (the others).
  """
  if where not in ("device", "host"):
    raise ValueError(f"where must be device or host, got {where!r}")
  with gzip.open(trace_path, "rt") as f:
    data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = _process_names(events)
  total: dict[str, float] = collections.defaultdict(float)
  count: collections.Counter[str] = collections.Counter()
  for e in events:
    if e.get("ph") != "X" or "dur" not in e:
      continue
    on_device = names.get(e.get("pid"), "").startswith("/device:")
    if on_device != (where == "device"):
      continue
    op = e.get("args", {}).get("hlo_op") or e.get("name", "?")
    total[op] += float(e["dur"]) / 1e3
    count[op] += 1
  rows = [OpTime(op, ms, count[op]) for op, ms in total.items()]
  return sorted(rows, key=lambda r: -r.total_ms)


def table(rows: list[OpTime], top: int) -> str:
  """A markdown table of the `top` longest ops and the rest in one row."""
  summed = sum(r.total_ms for r in rows) or 1.0
  lines = ["| op | total ms | share | count |", "|---|---|---|---|"]
  for r in rows[:top]:
    lines.append(f"| {r.op[:80]} | {r.total_ms:.3f} | {r.total_ms / summed:.1%} | {r.count} |")
  rest = rows[top:]
  if rest:
    ms = sum(r.total_ms for r in rest)
    lines.append(f"| ({len(rest)} more ops) | {ms:.3f} | {ms / summed:.1%} | - |")
  return "\n".join(lines)


def report(log_dir: str, top: int = 25, where: str = "device") -> list[OpTime]:
  """Prints the table of the newest trace under `log_dir`; returns its rows."""
  path = newest_trace(log_dir)
  rows = op_times(path, where)
  if not rows:
    print(f"{path}: no {where} events (XLA:CPU records host activity only: --where host)")
    return rows
  print(f"{path}: {where} time by op")
  print(table(rows, top))
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("trace_dir")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--where", default="device", choices=("device", "host"))
  args = p.parse_args()
  report(args.trace_dir, args.top, args.where)


if __name__ == "__main__":
  main()
