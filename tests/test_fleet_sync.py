"""The `fleet` job synchronous under ulysses: 2 processes x 2 CPU devices train
what 1 process x 4 trains, the sequence axis across both processes, though
the 2-process run is preempted on the way (tests/multiprocess_runs.py)."""

import json

import multiprocess_runs as runs
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fluxjax.rl import metrics
from fluxjax.rollout import factory, launcher
from fluxjax.settings import Settings
from helpers import assert_each_prompt_trained_once, server_env

STEPS = 2
SYNC = {
  "sharding.strategy": "ulysses",
  "rollout.embedded_devices": 0,
  "rl.kl_coef": 0.0,
  "sft.enabled": False,
  "checkpoint.every": STEPS,  # the parameters compared, at the end
}


def _servers(log_dir):
  """A server as the fleet job launches them, shared by both runs (each run
  publishes its starting weights to it first)."""
  cmd = factory.server_command(Settings.of(runs.config("tiny,fleet", **SYNC)))
  return launcher.launch_servers(cmd, 1, env=server_env(), timeout_s=300, log_dir=str(log_dir))


@pytest.mark.slow
def test_a_synchronous_fleet_job_on_two_processes_matches_one_under_ulysses(tmp_path, monkeypatch):
  """The fleet job in sync mode without tail batching, ulysses at sp=4, as
  1 process x 4 and as 2 x 2, against the same server behind a launched
  router: it is seeded and sent the same bf16 weights, so both runs train the
  same prompts to the same losses and parameters, within the tolerance of
  test_multiprocess.py (the summation order of collectives). The 2-process
  run gets SIGTERM (a preemption) during step 1: every process checkpoints
  that step and stops, and the same command resumes it."""
  steps, one, two = STEPS, tmp_path / "one", tmp_path / "two"
  servers = _servers(tmp_path / "logs")
  runs.reuse_compiled_programs(monkeypatch, tmp_path / "xla_cache")  # after the server's start
  try:
    urls = {"rollout.urls": "(" + ",".join(f'"{u}"' for u in servers.urls) + ",)"}

    def command(workdir, processes):
      return runs.launched(
        workdir,
        processes,
        runs.SP // processes,
        grace_s=300,
        variant="tiny,fleet",
        total_steps=steps,
        **SYNC,
        **urls,
      )

    runs.run(command(one, 1), tmp_path / "one.log")
    stopped = runs.preempt_once_rl_started(command(two, 2), tmp_path / "preempted.log")
    preempted = json.loads((two / "summary.json").read_text())
    saved = ocp.utils.checkpoint_steps(str(two / "checkpoints"))
    resumed = runs.run(command(two, 2), tmp_path / "two.log")
  finally:
    servers.stop()
  assert "SIGTERM: the run stops after the RL step in progress" in stopped
  assert "SIGTERM: the leader checkpoints and stops this process" in stopped
  assert f"strategy ulysses (sp={runs.SP})" in stopped
  assert preempted["preempted"] and preempted["last_step"] == 1
  assert saved == [1]
  assert "resumed from step 1" in resumed
  a = assert_each_prompt_trained_once(one, steps, runs.P)
  b = assert_each_prompt_trained_once(two, steps, runs.P)
  assert [sorted(r["ids"]) for r in a] == [sorted(r["ids"]) for r in b]
  ma = {r["step"]: r for r in metrics.read_metrics(str(one)) if "train/loss" in r}
  mb = {r["step"]: r for r in metrics.read_metrics(str(two)) if "train/loss" in r}
  assert sorted(ma) == sorted(mb) == list(range(1, steps + 1))
  for k in ma:
    assert mb[k]["fleet/routed"] == ma[k]["fleet/routed"] == 1.0
    for key in ("train/loss", "train/grad_norm", "rollout/reward_mean"):
      np.testing.assert_allclose(mb[k][key], ma[k][key], rtol=1e-5, atol=1e-5, err_msg=key)
  # A zero advantage gives an exactly zero update; the loss itself is small.
  assert any(m["train/grad_norm"] > 1e-3 for m in ma.values()), "no step had a signal"
  pa, pb = runs.params(one, steps), runs.params(two, steps)
  assert pa.keys() == pb.keys()
  for key in pa:
    np.testing.assert_allclose(pb[key], pa[key], rtol=1e-5, atol=1e-5, err_msg=key)
