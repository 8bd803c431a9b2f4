"""The `fleet` job on 2 processes x 4 CPU devices: launched servers behind the
launched router, weights broadcast from the training mesh, flex_ulysses
across both processes, adaptive lag and recycling; its follower SIGKILLed
mid-step (tests/multiprocess_runs.py). test_fleet_sync.py runs it
synchronously against 1 process."""

import json

import multiprocess_runs as runs
import pytest

from fluxjax import config_args
from fluxjax.rl import loop, metrics
from helpers import assert_every_drawn_prompt_accounted_for

# The fleet job with everything on: launched servers behind the router,
# weights broadcast, flex_ulysses across the two processes (multiprocess_runs'
# OVERRIDES), adaptive lag and tail batching with recycling (configs/vlm.py
# `fleet` modifier).
FLEET = {
  "coordinator.lag.mode": "adaptive",
  "coordinator.lag.sync_interval": 3,
  "rollout.tail_batching.eta": 1.5,
  "rollout.embedded_devices": 0,
  "rl.kl_coef": 0.0,
  # The reward has signal from the first step; the warm-up's publishes are
  # the RL steps' kind.
  "sft.enabled": False,
}


@pytest.mark.slow
def test_two_processes_on_a_fleet_survive_a_follower_killed_mid_step(tmp_path):
  """2 processes x 4 devices against 2 launched fluxjax servers behind a
  launched sglang-router, weights broadcast from the training mesh: the
  follower SIGKILLed mid-step stops the run, its servers and router with
  it; the restart resumes from the checkpoint, and every step trains P
  prompts no step trained before; every prompt drawn is trained, held for
  training, or counted as filtered."""
  steps, workdir = 4, tmp_path / "fleet"
  command = [
    a.replace("configs/vlm.py", "configs/vlm.py:fleet")
    for a in runs.two(workdir, total_steps=steps, **FLEET)
  ]
  runs.kill_once_a_checkpoint_is_complete(command, tmp_path / "killed.log", victim=1, step=2)
  out = runs.run(command, tmp_path / "resumed.log")
  assert "resumed from step" in out
  records = loop.read_trained(str(workdir))
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  trained = [i for r in records for i in r["ids"]]
  assert all(len(r["ids"]) == runs.P for r in records) and len(set(trained)) == len(trained)
  assert_every_drawn_prompt_accounted_for(workdir, runs.P)
  recs = {r["step"]: r for r in metrics.read_metrics(str(workdir)) if r["step"] >= 1}
  last = recs[steps]
  assert last["fleet/routed"] == 1.0 and last["fleet/servers"] == 2.0
  assert last["fleet/servers_down"] == 0.0 and last["faults/unwritten_publishes_total"] == 0.0
  # The broadcasts were deferred: their gathers ran between the steps' ops,
  # at least the first of each while the step waited for its rollouts.
  shares = [r["publish/overlapped_share"] for r in recs.values() if "publish/overlapped_share" in r]
  assert shares and all(0.0 < s <= 1.0 for s in shares)
  # Recycling discards no decode work and restarts no response.
  assert last["rollout/tokens_discarded_total"] == 0.0 and last["rollout/restarted_total"] == 0.0
  # A gradient, not the loss (about 0 at ratio 1 with signal): test_multiprocess.py.
  assert any(r["train/grad_norm"] > 1e-3 for r in recs.values()), "no step had a signal"
  lag = config_args.load_config().coordinator.lag
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
  assert "strategy flex_ulysses (sp=8)" in out
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["end"]["step"] == steps and summary["resumed_from"] >= 2
