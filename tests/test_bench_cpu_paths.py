"""The GPU benchmarks' CPU paths: each script runs end to end on a small case.

The figures that matter come from a GPU (bench/README.md); what the suite
keeps is that the scripts still run, check what they check, and write their
--json records, so a lent GPU's minutes go to measuring, not to mending.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import server_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# script, arguments, a figure of its --json record that must hold
CASES = {
  "rollout": (
    "--requests 4 --slots 4 --prompt-len 8 --new-tokens 8 --concurrency 1,4 "
    "--decode-steps 1,3 --repeats 1",
    lambda r: (
      r["tokens_agreeing_with_loop"] == 8
      and {row["decode_steps_per_call"] for row in r["rows"]} == {1, 3}
    ),
  ),
  "mfu": (
    "--preset tiny --layers 2 --rows 2 --row-tokens 512 --seq-tokens 256 --image-side 16 "
    "--remat full --reps 1",
    lambda r: all(row["loss_finite"] and row["tokens"] == 1024 for row in r["rows"]),
  ),
  "threads": (
    "--steps 3 --rounds 2 --requests 4 --new-tokens 8",
    lambda r: r["tokens_equal"] and r["params_max_rel_diff"] <= 1e-5,
  ),
  "attention": (
    "--backends xla,xla_blocked --tokens 256 --mixtures image_heavy --reps 1",
    lambda r: max(r["cases"][0]["xla_blocked"]["parity_bf16_rel_vs_xla"].values()) < 1e-2,
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_a_gpu_benchmark_runs_on_the_cpu(script, tmp_path):
  args, holds = CASES[script]
  record = tmp_path / f"{script}.json"
  out = subprocess.run(
    [sys.executable, f"bench/{script}.py", *args.split(), "--json", str(record)],
    cwd=ROOT,
    env=server_env(),
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
  result = json.loads(record.read_text())
  assert result["bench"] == f"{script}.py" and holds(result), json.dumps(result)[:4000]
