r"""Exact resume under async: the 2-process fleet job SIGKILLed at random moments, over seeds.

  python bench/kill_resume.py --seeds 5 --json bench/results/kill_resume-<machine>-<commit>.json
  python bench/kill_resume.py --seeds 1 --sync-kills 1      # one seed, to try it
  python bench/kill_resume.py --first-seed 2 --seeds 1 --json bench/results/...-seed2.json
  python bench/kill_resume.py --pool bench/results/kill_resume-*-seed*.json  # seeds run apart

Each seed runs tests/test_fleet_multiprocess.py's job (the `fleet` modifier on
2 processes x --devices CPU devices, 4 by default where the suite's test has
2: two launched fluxjax servers behind a launched sglang-router, weights
broadcast from the training mesh, flex_ulysses with its sequence axis
across both processes; tests/multiprocess_runs.py KILLED) with
`--config.seed` set to the seed, twice:

  async  adaptive lag, tail batching with recycling (eta 2): killed once at
         each of the four points of tests/kill_points.py (generation with
         partial responses carried, kept groups queued for a busy trainer,
         mid-broadcast of a weight version, mid-write of a checkpoint), in a
         random order, each by a random victim (leader or follower) at a
         random moment (0 to --max-skip of the point's moments let pass, at
         most one per RL step), resumed after each, then run to --steps.
  sync   the same job synchronous without speculation (KILLED_SYNC), once
         uninterrupted and once killed at --sync-kills points (the points in
         turn over the seeds, random victims, each point's first moment),
         both to --sync-steps.

Asserted per seed (a failed check stops the bench with its figures so far):
  (a) each kill landed where its point claims (multiprocess_runs
      `assert_the_kill_landed_where_it_claims`; an async generation kill
      with partial responses carried);
  (b) every prompt the loader drew across the restarts is trained once, held
      for training in the last checkpoint, or counted as dropped with its
      reason, and none was dropped; every prompt a kill put at stake is
      trained once after it (or held);
  (d) the sync runs train the same prompts per step, and the killed one's
      final parameters equal the uninterrupted one's bit for bit.
Pooled over the seeds:
  (c) the prompts the kills put at stake (running, partial, queued, trained
      after the last checkpoint) are trained at the lengths of the prompts at
      stake at the moments no kill came (the shadows: the same points, the
      same selection), by a two-sided Mann-Whitney U test: p >= 0.01. The
      lengths against the run's other trained prompts are reported beside it
      (the prompts at stake at any moment are the slow ones more often).

The table: one row per seed (kills as point/victim@step, what the kills
found: requests in flight, partial responses, queued groups; prompts drawn,
trained, held, dropped, redone; the sync run's kills and whether its
parameters are equal; wall time), then the pooled length test.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
# The environment the suite gives its launched runs (tests/conftest.py):
# XLA:CPU at -O1 without the MLIR fusion emitters, fp32 matmuls, no
# compilation cache; the launcher sets each process's device count.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))
os.environ.setdefault("MALLOC_ARENA_MAX", "1")
sys.path.insert(0, ROOT)  # runs from a checkout without `pip install -e .`, as the others
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, TESTS)  # the job, its checks and kill_points live with the tests
import multiprocess_runs as runs  # noqa: E402
import numpy as np  # noqa: E402

import runinfo  # noqa: E402
from fluxjax.rl import loop  # noqa: E402
from helpers import assert_every_drawn_prompt_accounted_for  # noqa: E402

ALPHA = 0.01  # the pooled length test's level
LENGTHS_DIFFER = f"kill_resume.py: the lengths at stake differ from the shadows' (p < {ALPHA})"


def killed_run(
  workdir: str, steps: int, kills: list[tuple[str, int, int]], overrides, devices: int
) -> dict:
  """The job in `workdir` killed at each (point, victim, skip) in turn, then
  run to `steps`; returns the kills' leader lines, all shadows, the records."""
  os.makedirs(workdir, exist_ok=True)
  record = os.path.join(workdir, "kills.jsonl")
  run_dir = os.path.join(workdir, "run")
  command = runs.fleet_command(run_dir, steps, "kill_points", devices, **overrides)
  lines, found = [], []
  for k, (point, victim, skip) in enumerate(kills):
    log = os.path.join(workdir, f"kill{k}-{point}.log")
    launch = runs.killed_at(command, log, record, point, victim, skip)
    kill = runs.assert_the_kill_landed_where_it_claims(point, launch)
    found.append({**kill, "skip": skip})
    lines += launch
  out = runs.run(command, os.path.join(workdir, "end.log"), extra_env={"KILL_RECORD": record})
  logs = [
    open(os.path.join(workdir, f"kill{k}-{p}.log")).read() for k, (p, _, _) in enumerate(kills)
  ]
  for kill, log in zip(found, logs[1:] + [out]):
    assert f"resumed from step {kill['latest_checkpoint']}" in log, (kill["point"], log[-2000:])
  shadows = [json.loads(x) for x in open(record)]
  return {
    "dir": run_dir,
    "kills": found,
    "shadows": [x for x in shadows if x["shadow"]],
    "records": loop.read_trained(run_dir),
  }


def check_accounting(run: dict, steps: int) -> dict:
  """(b): every drawn prompt trained once, held, or dropped with its reason
  (none dropped); what the kills put at stake trained after them."""
  records = run["records"]
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  trained = [i for r in records for i in r["ids"]]
  assert all(len(r["ids"]) == runs.P for r in records) and len(set(trained)) == len(trained)
  accounted = assert_every_drawn_prompt_accounted_for(run["dir"], runs.P)
  assert not any(accounted["dropped"].values()), accounted["dropped"]
  redone = {i for k in run["kills"] for i in k["at_stake"]}
  assert redone <= set(trained) | set(accounted["held"]), redone - set(trained)
  return {
    "drawn": accounted["drawn"].total(),
    "trained": len(trained),
    "held": accounted["held"].total(),
    "dropped": accounted["dropped"],
    "redone": len(redone),
  }


def one_seed(seed: int, args, root: str) -> dict:
  rng = np.random.default_rng(seed)
  t0 = time.time()
  overrides = {**runs.KILLED, "seed": seed}
  order = [runs.KILL_POINTS[i] for i in rng.permutation(len(runs.KILL_POINTS))]
  kills = [(p, int(rng.integers(2)), int(rng.integers(args.max_skip + 1))) for p in order]
  work = os.path.join(root, f"seed{seed}")
  run = killed_run(os.path.join(work, "async"), args.steps, kills, overrides, args.devices)
  generation = next(k for k in run["kills"] if k["point"] == "generation")
  assert generation["partial"], generation  # (a): recycling's partial responses at stake
  accounting = check_accounting(run, args.steps)
  async_s = time.time() - t0
  # (d): the synchronous job, killed and not, bit for bit.
  sync = {**runs.KILLED_SYNC, "seed": seed}
  points = [runs.KILL_POINTS[(seed * args.sync_kills + k) % 4] for k in range(args.sync_kills)]
  # Each at its point's first moment: the short run must reach every kill
  # (the random moments are the async run's).
  sync_kills = [(p, int(rng.integers(2)), 0) for p in points]
  plain = os.path.join(work, "sync-plain")
  command = runs.fleet_command(
    os.path.join(plain, "run"), args.sync_steps, devices=args.devices, **sync
  )
  os.makedirs(plain, exist_ok=True)
  runs.run(command, os.path.join(plain, "end.log"))
  killed = killed_run(
    os.path.join(work, "sync-killed"), args.sync_steps, sync_kills, sync, args.devices
  )
  a = loop.read_trained(os.path.join(plain, "run"))
  assert [sorted(r["ids"]) for r in a] == [sorted(r["ids"]) for r in killed["records"]]
  pa = runs.params(os.path.join(plain, "run"), args.sync_steps)
  pb = runs.params(killed["dir"], args.sync_steps)
  differ = [k for k in pa if not np.array_equal(pa[k], pb[k])]
  assert pa.keys() == pb.keys() and not differ, f"parameters differ: {differ[:5]}"
  return {
    "seed": seed,
    "kills": [_kill_row(k) for k in run["kills"]],
    "accounting": accounting,
    "lengths": runs.at_stake_lengths(run["records"], run["kills"], run["shadows"]),
    "run_lengths": _against_the_run(run),
    "sync_kills": [_kill_row(k) for k in killed["kills"]],
    "sync_parameters_equal": True,
    "sync_parameters": len(pa),
    "async_wall_s": async_s,
    "wall_s": time.time() - t0,
  }


def _kill_row(kill: dict) -> dict:
  return {
    "point": kill["point"],
    "victim": kill["victim"],
    "skip": kill["skip"],
    "step": kill["step"],
    "checkpoint": kill["latest_checkpoint"],
    "in_flight": len(kill["in_flight"]),
    "partial": len(kill["partial"]),
    "queued": len(kill["queued"]),
    "at_stake": kill["at_stake"],
    "detail": kill.get("publish") or kill.get("checkpoint") or kill.get("servers_running"),
  }


def _against_the_run(run: dict) -> dict:
  """The killed prompts' lengths against every other prompt the run trained."""
  length = runs.prompt_lengths(run["records"])
  killed = {i for k in run["kills"] for i in k["at_stake"]}
  a = [v for i, v in length.items() if i in killed]
  b = [v for i, v in length.items() if i not in killed]
  return {"killed": a, "others": b, **runs.compare(a, b)}


def pooled(rows: list[dict]) -> dict:
  a = [x for r in rows for x in r["lengths"]["killed"]]
  b = [x for r in rows for x in r["lengths"]["reference"]]
  c = [x for r in rows for x in r["run_lengths"]["others"]]
  return {
    "killed_n": len(a),
    "killed_mean": float(np.mean(a)) if a else float("nan"),
    "reference_n": len(b),
    "reference_mean": float(np.mean(b)) if b else float("nan"),
    "others_n": len(c),
    "others_mean": float(np.mean(c)) if c else float("nan"),
    "against_shadows": runs.compare(a, b),
    "against_the_run": runs.compare(a, c),
  }


def table(rows: list[dict], pool: dict) -> list[str]:
  out = [
    "seed | kills (point/victim@step)                       | at the kills: run/part/queued"
    " | drawn trained held dropped redone | sync kills | sync params | wall s",
  ]
  for r in rows:
    kills = " ".join(f"{k['point'][:4]}/{k['victim']}@{k['step']}" for k in r["kills"])
    found = " ".join(f"{k['in_flight']}/{k['partial']}/{k['queued']}" for k in r["kills"])
    a = r["accounting"]
    sync = " ".join(f"{k['point'][:4]}/{k['victim']}@{k['step']}" for k in r["sync_kills"])
    equal = f"{r['sync_parameters']} equal" if r["sync_parameters_equal"] else "DIFFER"
    out.append(
      f"{r['seed']:4d} | {kills:47s} | {found:29s} | {a['drawn']:5d} {a['trained']:7d}"
      f" {a['held']:4d} {sum(a['dropped'].values()):7d} {a['redone']:6d} | {sync:10s} |"
      f" {equal:11s} | {r['wall_s']:.0f}"
    )
  s, t = pool["against_shadows"], pool["against_the_run"]
  out.append(
    f"lengths (per-prompt mean tokens), pooled: at stake at the kills {pool['killed_mean']:.1f}"
    f" (n={pool['killed_n']}) against the shadows' {pool['reference_mean']:.1f}"
    f" (n={pool['reference_n']}): P(longer) {s['auc']:.2f}, Mann-Whitney p {s['p']:.3f};"
    f" against the run's other prompts {pool['others_mean']:.1f} (n={pool['others_n']}):"
    f" P(longer) {t['auc']:.2f}, p {t['p']:.3f}"
  )
  return out


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seeds", type=int, default=5, help="how many seeds (0, 1, ...)")
  p.add_argument("--first-seed", type=int, default=0)
  p.add_argument("--steps", type=int, default=16, help="RL steps of each async run")
  p.add_argument("--sync-steps", type=int, default=6, help="RL steps of each sync run")
  p.add_argument("--sync-kills", type=int, default=2, help="kills of each killed sync run")
  p.add_argument("--max-skip", type=int, default=2, help="a point's moments let pass, at most")
  p.add_argument(
    "--devices",
    type=int,
    default=4,
    help="CPU devices of each process, the sequence axis across both (the seeds recorded ran 4)",
  )
  p.add_argument(
    "--workdir",
    default=None,
    help="default: a new temporary folder; a seed whose row is there is not run again",
  )
  p.add_argument("--json", default=None)
  p.add_argument(
    "--pool",
    nargs="+",
    metavar="FILE",
    help="print the table and the pooled test of the seeds recorded in these --json files; "
    "run nothing",
  )
  args = p.parse_args()
  if args.pool:
    return print_pooled(args.pool)
  root = args.workdir or tempfile.mkdtemp(prefix="kill_resume-")
  print(f"work directory: {root}", flush=True)
  rows: list[dict] = []
  error = None
  for seed in range(args.first_seed, args.first_seed + args.seeds):
    done = os.path.join(root, f"seed{seed}", "row.json")
    if os.path.exists(done):  # a stopped bench goes on where it stopped
      with open(done) as f:
        rows.append(json.load(f))
      print(f"seed {seed}: its row from {done}", flush=True)
      continue
    try:
      rows.append(one_seed(seed, args, root))
    except AssertionError as e:
      error = f"seed {seed}: {e}"
      break
    with open(done, "w") as f:
      json.dump(rows[-1], f)
    print("\n".join(table(rows, pooled(rows))[-2:]), flush=True)
  pool = pooled(rows)
  print("\n".join(table(rows, pool)))
  passed = error is None and pool["against_shadows"]["p"] >= ALPHA
  if args.json:
    runinfo.write(
      args.json,
      "kill_resume.py",
      {"args": vars(args), "seeds": rows, "pooled": pool, "passed": passed, "error": error},
    )
  if error is not None:
    sys.exit(f"kill_resume.py: {error[:4000]}")
  if not passed:
    sys.exit(LENGTHS_DIFFER)


def print_pooled(paths: list[str]) -> None:
  """The table and pooled length test of seeds recorded by separate runs
  (each file's own seeds; a seed recorded twice is an error)."""
  rows: list[dict] = []
  for path in paths:
    with open(path) as f:
      record = json.load(f)
    if record.get("bench") != "kill_resume.py":
      sys.exit(f"{path} is not a kill_resume.py record (bench: {record.get('bench')!r})")
    if record.get("error"):
      sys.exit(f"{path} recorded a failed seed: {record['error'][:400]}")
    rows += record["seeds"]
  seeds = [r["seed"] for r in rows]
  if len(set(seeds)) != len(seeds):
    sys.exit(f"a seed is recorded twice: {sorted(seeds)}")
  pool = pooled(rows)
  print("\n".join(table(rows, pool)))
  if pool["against_shadows"]["p"] < ALPHA:
    sys.exit(LENGTHS_DIFFER)


if __name__ == "__main__":
  main()
