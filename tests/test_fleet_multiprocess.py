"""The `fleet` job on 2 processes x 2 CPU devices: launched servers behind the
launched router, weights broadcast from the training mesh, flex_ulysses
across both processes, adaptive lag and recycling; SIGKILLed at each of four
points (tests/kill_points.py) and resumed after each, the last time under
ulysses. test_fleet_sync.py
runs it synchronously against 1 process; bench/kill_resume.py repeats the
kills at random moments over seeds, and checks a synchronous run's resume
bit for bit."""

import json
import os

import multiprocess_runs as runs
import pytest

from fluxjax import config_args
from fluxjax.rl import loop, metrics
from helpers import assert_every_drawn_prompt_accounted_for

# (point, the process that dies there): each process dies twice. The points
# whose moment comes a fixed number of steps into a launch (publish,
# checkpoint) go before the one that waits on timing (queue).
KILLS = (("generation", 0), ("publish", 0), ("checkpoint", 1), ("queue", 1))


@pytest.mark.slow
def test_two_processes_on_a_fleet_resume_exactly_from_a_kill_at_each_point(tmp_path, monkeypatch):
  """2 processes x 2 devices against 2 launched fluxjax servers behind a
  launched sglang-router, weights broadcast from the training mesh, adaptive
  lag and recycling: SIGKILLed during generation (with partial responses
  carried), with kept groups waiting for a busy trainer, mid-broadcast of a
  weight version, and mid-write of a checkpoint, the leader and the
  follower twice each. Each kill stops the run, its servers and router;
  each restart resumes from the latest complete checkpoint, the last under
  ulysses (the strategy swapped by config). In the end every
  step trains P prompts no step trained before; every prompt drawn across
  the restarts is trained once, held for training, or counted as dropped
  with its reason; every prompt a kill put at stake (running, partial,
  queued, or trained after the last checkpoint) is trained once after it,
  at lengths like those of the prompts at stake where no kill came."""
  # Each killed launch trains a step or two before its point's moment comes.
  steps, workdir, record = 10, tmp_path / "fleet", tmp_path / "kills.jsonl"
  command = runs.fleet_command(workdir, steps, module="kill_points", **runs.KILLED)
  runs.reuse_compiled_programs(monkeypatch, tmp_path / "xla_cache")
  kills = []
  for point, victim in KILLS:
    lines = runs.killed_at(command, tmp_path / f"{point}.log", record, point, victim)
    kill = runs.assert_the_kill_landed_where_it_claims(point, lines)
    committed = max(int(e) for e in os.listdir(workdir / "checkpoints") if e.isdigit())
    assert committed == kill["latest_checkpoint"]
    kills.append(kill)
  # Recycling was under way: partial responses were carried at the kill.
  assert kills[0]["partial"], kills[0]
  # The last launch swaps the strategy by config alone: ulysses, its sequence
  # axis across both processes, under the same adaptive lag.
  ulysses = [a.replace("strategy=flex_ulysses", "strategy=ulysses") for a in command]
  out = runs.run(ulysses, tmp_path / "resumed.log", extra_env={"KILL_RECORD": str(record)})
  logs = [(tmp_path / f"{p}.log").read_text() for p, _ in KILLS[1:]] + [out]
  for kill, log in zip(kills, logs):
    assert f"resumed from step {kill['latest_checkpoint']}" in log, (kill["point"], log[-3000:])
  records = loop.read_trained(str(workdir))
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  trained = [i for r in records for i in r["ids"]]
  assert all(len(r["ids"]) == runs.P for r in records) and len(set(trained)) == len(trained)
  accounted = assert_every_drawn_prompt_accounted_for(workdir, runs.P)
  assert not any(accounted["dropped"].values()), accounted["dropped"]
  # What the kills put at stake was trained after them, once (or is held).
  redone = {i for k in kills for i in k["at_stake"]}
  assert redone and redone <= set(trained) | set(accounted["held"])
  # The redone prompts are trained at the lengths of the prompts at stake
  # where no kill came, by a rank test at a lenient level (few prompts here;
  # bench/kill_resume.py pools seeds at 0.01).
  shadows = [x for x in map(json.loads, record.read_text().splitlines()) if x["shadow"]]
  lengths = runs.at_stake_lengths(records, kills, shadows)
  assert len(lengths["killed"]) >= 4 and len(lengths["reference"]) >= 4, lengths
  assert lengths["p"] >= 0.001, lengths
  recs = {r["step"]: r for r in metrics.read_metrics(str(workdir)) if r["step"] >= 1}
  last = recs[steps]
  assert last["fleet/routed"] == 1.0 and last["fleet/servers"] == 2.0
  assert last["fleet/servers_down"] == 0.0 and last["faults/unwritten_publishes_total"] == 0.0
  # The broadcasts were deferred: their gathers ran between the steps' ops,
  # at least the first of each while the step waited for its rollouts.
  shares = [r["publish/overlapped_share"] for r in recs.values() if "publish/overlapped_share" in r]
  assert shares and all(0.0 < s <= 1.0 for s in shares)
  # Recycling carried responses on, discarding no decode work and restarting none.
  assert last["rollout/tokens_carried_total"] > 0.0 and last["rollout/resumed_total"] > 0.0
  assert last["rollout/tokens_discarded_total"] == 0.0 and last["rollout/restarted_total"] == 0.0
  # A gradient, not the loss (about 0 at ratio 1 with signal): test_multiprocess.py.
  assert any(r["train/grad_norm"] > 1e-3 for r in recs.values()), "no step had a signal"
  lag = config_args.load_config(arg="tiny").coordinator.lag
  assert all(lag.min_lag <= r["async/allowed_lag"] <= lag.max_lag for r in recs.values())
  assert all(
    lag.min_async_ratio <= r["async/async_ratio"] <= lag.max_async_ratio for r in recs.values()
  )
  assert any(r["async/sync_barrier"] == 1.0 for r in recs.values())  # sync_interval 3
  assert last["async/interval_barriers_total"] >= 1.0
  # Admission bounds the gap it admits; recycled tokens may be older.
  assert all(r["async/version_gap_max"] <= lag.max_lag for r in recs.values())
  assert all(r["async/trained_gap_max"] >= r["async/version_gap_max"] for r in recs.values())
  assert all(0.0 <= r["async/staleness_ema"] <= 1.0 for r in recs.values())
  assert all(0.0 <= r["async/staleness"] <= 1.0 for r in recs.values())
  assert all(f"strategy flex_ulysses (sp={runs.SP})" in log for log in logs[:-1])
  assert f"strategy ulysses (sp={runs.SP})" in out
  assert "sharding.strategy: 'flex_ulysses' -> 'ulysses'" in out  # the change, named
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["end"]["step"] == steps
  assert summary["resumed_from"] == kills[-1]["latest_checkpoint"]
