"""The GPU benchmarks' CPU paths: each script runs end to end on a small case.

The figures that matter come from a GPU (bench/README.md); what the suite
keeps is that the scripts still run, check what they check, and write their
--json records, so a lent GPU's minutes go to measuring, not to mending.
"""

import gzip
import json
import os
import subprocess
import sys

import pytest

from helpers import server_env

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import op_profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script: its arguments, a figure of its --json record that must hold, and
# the traces its --profile writes (folder, a host event the trace must hold)
CASES = {
  "rollout": (
    "--requests 4 --slots 4 --prompt-len 8 --new-tokens 8 --concurrency 1,4 "
    "--decode-steps 1,3 --repeats 1 --profile {tmp}/trace",
    lambda r: (
      r["tokens_agreeing_with_loop"] == 8
      and r["partial"] is False
      and {row["decode_steps_per_call"] for row in r["rows"]} == {1, 3}
    ),
    {"xla-steps1-c4": "$engine.py", "xla-steps3-c4": "$engine.py"},
  ),
  "mfu": (
    "--preset tiny --layers 2 --rows 2 --row-tokens 512 --seq-tokens 256 --image-side 16 "
    "--remat full --reps 1 --profile {tmp}/trace",
    lambda r: all(row["loss_finite"] and row["tokens"] == 1024 for row in r["rows"]),
    {"auto-full": "ThunkExecutor::Execute"},
  ),
  "threads": (
    "--steps 3 --rounds 2 --requests 4 --new-tokens 8",
    lambda r: r["tokens_equal"] and r["params_max_rel_diff"] <= 1e-5,
    {},
  ),
  "attention": (
    "--backends xla,xla_blocked --tokens 256 --mixtures image_heavy --reps 1",
    lambda r: max(r["cases"][0]["xla_blocked"]["parity_bf16_rel_vs_xla"].values()) < 1e-2,
    {},
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_a_gpu_benchmark_runs_on_the_cpu(script, tmp_path):
  args, holds, traces = CASES[script]
  record = tmp_path / f"{script}.json"
  out = subprocess.run(
    [sys.executable, f"bench/{script}.py", *args.format(tmp=tmp_path).split(), "--json", record],
    cwd=ROOT,
    env=server_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
  result = json.loads(record.read_text())
  assert result["bench"] == f"{script}.py" and holds(result), json.dumps(result)[:4000]
  for folder, event in traces.items():  # on a CPU a trace holds host events only
    host = op_profile.op_times(op_profile.newest_trace(f"{tmp_path}/trace/{folder}"), "host")
    assert any(r.op.startswith(event) and r.count > 0 for r in host), host[:20]
  assert ("time by op" in out.stdout) == bool(traces)


def test_device_time_is_summed_by_the_hlo_op_that_launched_each_kernel(tmp_path):
  # The trace viewer's format: process names in metadata events, complete
  # ("X") events with microsecond durations; a GPU's kernels carry hlo_op.
  def kernel(name, dur, op=None, pid=2):
    event = {"ph": "X", "pid": pid, "tid": 1, "ts": 0, "dur": dur, "name": name}
    return event | ({"args": {"hlo_op": op}} if op else {})

  events = [
    {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
    {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
    kernel("sm90_gemm_a", 300.0, "dot.1"),
    kernel("sm90_gemm_b", 200.0, "dot.1"),
    kernel("loop_fusion", 400.0, "fusion.7"),
    kernel("memcpy", 100.0),
    kernel("PjitFunction(step)", 5000.0, pid=1),
  ]
  run = tmp_path / "plugins" / "profile" / "run"
  run.mkdir(parents=True)
  with gzip.open(run / "h.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  path = op_profile.newest_trace(str(tmp_path))
  assert op_profile.op_times(path) == [
    op_profile.OpTime("dot.1", 0.5, 2),
    op_profile.OpTime("fusion.7", 0.4, 1),
    op_profile.OpTime("memcpy", 0.1, 1),
  ]
  assert op_profile.op_times(path, "host") == [op_profile.OpTime("PjitFunction(step)", 5.0, 1)]
  table = op_profile.table(op_profile.op_times(path), top=2)
  assert "| dot.1 | 0.500 | 50.0% | 2 |" in table
  assert "| (1 more ops) | 0.100 | 10.0% | - |" in table
  with pytest.raises(FileNotFoundError, match=r"no \*\.trace\.json\.gz under"):
    op_profile.newest_trace(str(tmp_path / "plugins" / "none"))


def test_a_profiled_op_is_named_by_the_jax_operation_and_line_it_came_from(tmp_path):
  # expose_ops has XLA dump each optimized module; dumped_sources reads the
  # dump back: an instruction's op_name and its stack frame's file and line.
  script = tmp_path / "matmul.py"
  script.write_text(
    "import sys\n"
    f"sys.path.insert(0, {os.path.join(ROOT, 'bench')!r})\n"
    "import op_profile\n"
    "op_profile.expose_ops(sys.argv[1])\n"
    "import jax, jax.numpy as jnp\n"
    "def f(a, b):\n"
    "  h = a @ b\n"
    "  return jnp.tanh(h).sum()\n"
    "jax.jit(f)(jnp.ones((64, 64)), jnp.ones((64, 64)))\n"
  )
  hlo = tmp_path / "hlo"
  subprocess.run([sys.executable, str(script), str(hlo)], check=True, cwd=tmp_path)
  found = op_profile.dumped_sources(str(hlo))
  assert "jit(f)/dot_general @ matmul.py:7" in found.values(), found
  assert "jit(f)/tanh @ matmul.py:8" in found.values(), found
  rows = [op_profile.OpTime("dot.1", 2.0, 1), op_profile.OpTime("fusion.9", 1.0, 1)]
  table = op_profile.table(rows, top=5, source={"dot.1": "jit(f)/dot_general @ matmul.py:7"})
  assert "| dot.1 | 2.000 | 66.7% | 1 | jit(f)/dot_general @ matmul.py:7 |" in table
  assert "| fusion.9 | 1.000 | 33.3% | 1 | ? |" in table
