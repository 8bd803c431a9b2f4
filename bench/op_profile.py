"""Time by XLA op from a jax.profiler trace: where a GPU bench's step goes.

  python bench/op_profile.py TRACE_DIR [--top 25] [--where device|host]

`mfu.py --profile DIR` and `rollout.py --profile DIR` record their timed runs
with `capture(DIR)`; this reads the newest trace under DIR (the trace viewer's
`*.trace.json.gz`) and sums the complete events by op: on a GPU the kernels of
each `/device:GPU:*` process, named by the HLO op that launched them (its
`hlo_op` argument, else the kernel's name); with --where host the host
threads' events (what a CPU run records, since XLA:CPU reports no per-op
device events; they nest, Python frames around runtime calls, so their
times overlap). Each row: op, total ms, share of the summed time, count,
and, given the optimized HLO (--hlo DIR: what `expose_ops(DIR)` has XLA
dump), the JAX operation and source line the op came from, so that
`custom-call.13` reads as the dot_general of a line of models/.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import gzip
import json
import os
import re
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


def hlo_dir_of(profile_dir: str) -> str:
  """Where a bench's --profile DIR keeps the HLO that `expose_ops` dumps."""
  return os.path.join(profile_dir, "hlo")


def expose_ops(hlo_dir: str | None = None) -> None:
  """Turns XLA:GPU's command buffers off for this process, so that a trace
  names each kernel's op, and with `hlo_dir` has XLA write each module's
  optimized HLO there (`sources` reads it); call it before JAX's first use
  of a device."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  extra = [NO_COMMAND_BUFFERS]
  if hlo_dir:
    extra += [f"--xla_dump_to={hlo_dir}", "--xla_dump_hlo_as_text"]
  os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in extra if f not in flags])


# One instruction of an HLO module's text: its name, and the op_name and
# source of its metadata (a fusion carries its root's). The source is inline
# (source_file, source_line) or a stack frame of the module's tables.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*metadata=\{([^}]*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_SOURCE = re.compile(r'source_file="([^"]*)" source_line=(\d+)')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


def _frames(hlo_text: str) -> dict[str, str]:
  """Stack frame id -> "file:line" from the module's FileNames, FileLocations
  and StackFrames tables."""
  tables: dict[str, dict[str, str]] = {}
  section = None
  for line in hlo_text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      section = tables.setdefault(line, {})
    elif section is not None and (m := _TABLE_ROW.match(line)):
      section[m.group(1)] = m.group(2)
    elif not line.strip():
      section = None
  files = {k: os.path.basename(v.strip('"')) for k, v in tables.get("FileNames", {}).items()}
  places = {}
  for k, v in tables.get("FileLocations", {}).items():
    f = dict(_FIELD.findall(v))
    places[k] = f"{files.get(f.get('file_name_id', ''), '?')}:{f.get('line', '?')}"
  return {
    k: places.get(dict(_FIELD.findall(v)).get("file_location_id", ""), "?")
    for k, v in tables.get("StackFrames", {}).items()
  }


def sources(hlo_text: str) -> dict[str, str]:
  """Instruction name -> "jax op @ file:line" from a module's HLO text."""
  frames = _frames(hlo_text)
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op = _OP_NAME.search(m.group(2))
    # jit(step)/jit(main)/transpose(jvp(...))/dot_general: the last two parts say enough.
    what = "/".join(op.group(1).split("/")[-2:]) if op else "?"
    if src := _SOURCE.search(m.group(2)):
      what += f" @ {os.path.basename(src.group(1))}:{src.group(2)}"
    elif (frame := _FRAME.search(m.group(2))) and frame.group(1) in frames:
      what += f" @ {frames[frame.group(1)]}"
    out[m.group(1)] = what
  return out


def dumped_sources(hlo_dir: str) -> dict[str, str]:
  """`sources` of every optimized module XLA dumped under `hlo_dir`; a name
  that two modules give different sources maps to both."""
  out: dict[str, str] = {}
  for path in sorted(glob.glob(os.path.join(hlo_dir, "*after_optimizations.txt"))):
    with open(path) as f:
      for name, src in sources(f.read()).items():
        out[name] = src if out.get(name, src) == src else f"{out[name]} | {src}"
  return out


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


def table(rows: list[OpTime], top: int, source: dict[str, str] | None = None) -> str:
  """A markdown table of the `top` longest ops and the rest in one row; with
  `source` (op -> where it came from) a column of it."""
  summed = sum(r.total_ms for r in rows) or 1.0
  head, rule = "| op | total ms | share | count |", "|---|---|---|---|"
  if source is not None:
    head, rule = head + " source |", rule + "---|"
  lines = [head, rule]
  for r in rows[:top]:
    line = f"| {r.op[:80]} | {r.total_ms:.3f} | {r.total_ms / summed:.1%} | {r.count} |"
    lines.append(line + (f" {source.get(r.op, '?')[:120]} |" if source is not None else ""))
  rest = rows[top:]
  if rest:
    ms = sum(r.total_ms for r in rest)
    tail = " - |" if source is not None else ""
    lines.append(f"| ({len(rest)} more ops) | {ms:.3f} | {ms / summed:.1%} | - |{tail}")
  return "\n".join(lines)


def report(
  log_dir: str, top: int = 25, where: str = "device", hlo_dir: str | None = None
) -> list[OpTime]:
  """Prints the table of the newest trace under `log_dir` (with each op's
  source when `hlo_dir` holds the dumped HLO); returns its rows."""
  path = newest_trace(log_dir)
  rows = op_times(path, where)
  if not rows:
    print(f"{path}: no {where} events (XLA:CPU records host activity only: --where host)")
    return rows
  print(f"{path}: {where} time by op")
  print(table(rows, top, dumped_sources(hlo_dir) if hlo_dir else None))
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("trace_dir")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--where", default="device", choices=("device", "host"))
  p.add_argument("--hlo", metavar="DIR", help="the optimized HLO XLA dumped (expose_ops)")
  args = p.parse_args()
  report(args.trace_dir, args.top, args.where, args.hlo)


if __name__ == "__main__":
  main()
