"""The `fleet` job on a hybrid mesh across 2 processes x 2 CPU devices: data
across the processes, FSDP inside each (mesh.data=2), publishing to a
launched server by broadcast, then, resumed, from disk
(tests/multiprocess_runs.py)."""

import multiprocess_runs as runs
import pytest

from fluxjax.rl import metrics
from fluxjax.rollout import factory, launcher
from fluxjax.settings import Settings
from helpers import assert_each_prompt_trained_once, server_env

HYBRID = {
  "mesh.data": 2,  # the number of processes: a hybrid mesh (sharding/mesh.py)
  "sharding.strategy": "packed_dp",
  "rollout.embedded_devices": 0,
  "rl.kl_coef": 0.0,
  "sft.enabled": False,
}


@pytest.mark.slow
def test_a_hybrid_mesh_across_processes_trains_and_publishes_by_broadcast_and_disk(
  tmp_path, monkeypatch
):
  """Two steps publishing by broadcast, then the run resumed with
  rollout.weight_sync=disk for two more, each process writing its own
  files. A synchronous run samples each step from the weights the trainer
  holds, so its behaviour KL is bf16 rounding (about 5e-7 here; one update
  stale would be about 1e-4): steps 2 and 4 show the broadcast and the disk
  publish delivered. Each prompt trains once."""
  workdir = tmp_path / "hybrid"
  cmd = factory.server_command(Settings.of(runs.config("tiny,fleet", **HYBRID)))
  logs = str(tmp_path / "logs")
  servers = launcher.launch_servers(cmd, 1, env=server_env(), timeout_s=300, log_dir=logs)
  runs.reuse_compiled_programs(monkeypatch, tmp_path / "xla_cache")  # after the server's start
  try:
    urls = {"rollout.urls": "(" + ",".join(f'"{u}"' for u in servers.urls) + ",)"}

    def command(steps, **overrides):
      return runs.launched(
        workdir,
        2,
        runs.DEVICES,
        variant="tiny,fleet",
        total_steps=steps,
        **HYBRID,
        **urls,
        **overrides,
      )

    broadcast = runs.run(command(2), tmp_path / "broadcast.log")
    disk = runs.run(command(4, **{"rollout.weight_sync": "disk"}), tmp_path / "disk.log")
  finally:
    servers.stop()
  for out in (broadcast, disk):
    mesh = f"{{'data': 2, 'fsdp': {runs.DEVICES}, 'sp': 1}}"
    assert f"strategy packed_dp (sp=1) on mesh {mesh}" in out
  assert "resumed from step 2" in disk
  assert_each_prompt_trained_once(workdir, 4, runs.P)
  recs = {r["step"]: r for r in metrics.read_metrics(str(workdir)) if "train/loss" in r}
  assert sorted(recs) == [1, 2, 3, 4]
  assert all(r["train/behaviour_kl"] < 1e-5 for r in recs.values())
  assert any(r["train/grad_norm"] > 1e-3 for r in recs.values()), "no step had a signal"
  assert recs[4]["policy/version"] == 4.0 and recs[4]["faults/unwritten_publishes_total"] == 0.0
  for version in (3, 4):  # one file per process
    files = sorted(p.name for p in (workdir / "weights" / f"v{version}").glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
