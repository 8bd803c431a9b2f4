"""Multi-controller runs: 2 processes x 4 CPU devices against 1 process x 8.

The main job runs as `python -m fluxjax.launch --processes=2 --cpu_devices=4
-- <train args>` (subprocesses, gloo collectives between them) and as
`loop.run` in this process, on the 8 fake devices the test session has.
Both runs are seeded, in sync mode without tail batching, and place the
embedded engine on 4 devices of process 0 (rollout.embedded_devices=4), so
rollout runs the same programs in both; they must then sample the same
responses and train the same updates, up to the summation order of
collectives across processes. A resumed run repeats exactly what the
killed one would have done, so the 2-process run is killed (its leader, the
process holding the run's decisions, as a one-process run's only process
does) and restarted on the way, and must still match.
"""

import json
import logging
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fluxjax import config_args
from fluxjax.parallel import train_step
from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import loop, metrics
from helpers import (
  ROOT,
  assert_each_prompt_trained_once,
  process_alive,
  run_launcher,
  train_command,
)

P = 2  # prompts per step

OVERRIDES = {
  "eval.every": 0,
  "checkpoint.every": 1,
  "data.synth_train": 16,
  "data.synth_eval": 2,
  "eval.prompts": 2,
  "eval.samples_per_prompt": 2,
  "rl.prompts_per_step": P,
  "rl.responses_per_prompt": 2,
  "rl.max_new_tokens": 6,
  "rl.reward.num_workers": 1,
  # A reward with signal from the first step (the warm-up is two steps).
  "rl.reward.fn": "fault_rewards:signal_unless_numeric",
  "rollout.num_slots": 4,
  "rollout.embedded_devices": 4,
  "rollout.tail_batching.eta": 1.0,
  "coordinator.lag.mode": "sync",
  "sft.steps": 3,
  "sft.batch_size": 2,
  "sft.eval_every": 2,
  "rl.kl_coef": 0.1,
  # Adam divides each gradient by its own RMS, so an element whose gradient
  # is only the residue of terms that cancel (a few embedding rows here)
  # takes a step of up to lr in the direction of that residue, which the
  # summation order of a collective decides. eps = 1e-6 bounds such a step
  # to ~1e-4 lr; elements with a real gradient (>> 1e-6) update as with the
  # default 1e-8. With 1e-8, 7 of 1M parameters differ by up to 1.4e-5.
  "optim.eps": 1e-6,
}


def _env():
  """The reward workers import tests/fault_rewards.py."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [os.path.join(ROOT, "tests"), *filter(None, [env.get("PYTHONPATH")])]
  )
  return env


def _one(workdir, **overrides) -> None:
  """The run in this process, on its 8 devices."""
  config = config_args.load_config()
  for key, value in {**OVERRIDES, **overrides}.items():
    *sections, field = key.split(".")
    section = config
    for name in sections:
      section = section[name]
    section[field] = value
  loop.run(config, str(workdir))


def _two(workdir, **overrides):
  launcher = [sys.executable, "-m", "fluxjax.launch", "--processes=2", "--cpu_devices=4", "--"]
  # The train args, without `python -m fluxjax.train`.
  return launcher + train_command(workdir, {**OVERRIDES, **overrides})[3:]


def _run(command, log_path, timeout=900):
  with open(log_path, "w") as log:
    done = run_launcher(
      command, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
    )
  out = open(log_path).read()
  assert done.returncode == 0, out[-4000:]
  return out


def _train_metrics(workdir) -> dict[int, dict]:
  return {r["step"]: r for r in metrics.read_metrics(str(workdir)) if "train/loss" in r}


def _params(workdir, step):
  """The checkpoint's train state as host arrays, restored onto one device of this process."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  checkpointer = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
    checkpointer.metadata(path).item_metadata,
  )
  state = checkpointer.restore(path, target)
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(state)}


def _pids(log_path) -> dict[int, int]:
  text = open(log_path).read() if os.path.exists(log_path) else ""
  return {int(i): int(p) for i, p in re.findall(r"fluxjax\.launch: process (\d) pid (\d+)", text)}


def _kill_once_a_checkpoint_is_complete(command, log_path, victim: int, step: int = 1) -> dict:
  """Starts the launcher, SIGKILLs its process `victim` once checkpoint
  `step` is complete (step + 1 under way), checks that it stopped the rest
  and the servers they started (each process's group); returns the pids."""
  workdir = pathlib.Path(next(a for a in command if a.startswith("--workdir=")).split("=", 1)[1])
  with open(log_path, "w") as log:
    launcher = subprocess.Popen(command, cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    try:
      while time.time() < deadline and launcher.poll() is None:
        if (workdir / "checkpoints" / str(step)).exists():
          break  # renamed into place when complete
        time.sleep(0.2)
      assert launcher.poll() is None, open(log_path).read()[-4000:]
      pids = _pids(log_path)
      assert sorted(pids) == [0, 1]
      os.kill(pids[victim], signal.SIGKILL)
      launcher.wait(timeout=90)
    finally:
      if launcher.poll() is None:
        launcher.terminate()  # it stops its processes
        launcher.wait(timeout=60)
  # The launcher stopped the other process (waiting in a collective or for
  # the next op) and exited with the killed one's fate.
  assert launcher.returncode == 128 + signal.SIGKILL, open(log_path).read()[-4000:]
  assert not any(process_alive(pid) for pid in pids.values())
  left = _group_members(set(pids.values()))
  assert not left, f"processes left running in the run's process groups: {left}"
  return pids


def _group_members(groups: set[int]) -> list[int]:
  """Live processes in the given process groups (a launched server, a router)."""
  members = []
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.getpgid(int(entry)) in groups and process_alive(int(entry)):
          members.append(int(entry))
      except ProcessLookupError:
        pass
  return members


@pytest.mark.slow
def test_two_processes_killed_and_resumed_match_one_and_resume_in_one(
  tmp_path, caplog, monkeypatch
):
  """The main job with the SFT warm-up and a KL reference, as 1 process x 8
  devices and as 2 x 4, the latter's leader killed mid-step and the job
  restarted: the same prompts, losses and parameters (within 1e-5); then the
  2-process checkpoint resumes in one process, until NaN updates stop it."""
  one, two = tmp_path / "one", tmp_path / "two"
  _one(one, total_steps=3)
  _kill_once_a_checkpoint_is_complete(_two(two, total_steps=3), tmp_path / "killed.log", victim=0)
  before = {r["step"]: r for r in metrics.read_metrics(str(two))}
  out = _run(_two(two, total_steps=3), tmp_path / "two.log")
  assert "resumed from step" in out
  assert len(re.findall(r"fluxjax\.launch: process \d pid \d+", out)) == 2

  # Each prompt trained once, the same ones in both runs.
  a = assert_each_prompt_trained_once(one, 3, P)
  b = assert_each_prompt_trained_once(two, 3, P)
  assert [sorted(r["ids"]) for r in a] == [sorted(r["ids"]) for r in b]
  # Metrics are the leader's: one record per step, not one per process; the
  # resumed run dropped the records of the steps it redid and kept the others.
  for workdir in (one, two):
    lines = [json.loads(x) for x in open(workdir / metrics.JSONL) if x.strip()]
    assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) for r in lines if "train/loss" in r)
  after = {r["step"]: r for r in metrics.read_metrics(str(two))}
  kept = [s for s in before if s in after and after[s]["time"] == before[s]["time"]]
  assert kept and max(kept) >= 1, "the resumed run kept none of the first run's steps"
  ma, mb = _train_metrics(one), _train_metrics(two)
  for k in (1, 2, 3):
    for key in ("train/loss", "train/grad_norm", "train/kl", "rollout/reward_mean"):
      np.testing.assert_allclose(mb[k][key], ma[k][key], rtol=1e-5, atol=1e-5, err_msg=key)
  assert any(abs(m["train/loss"]) > 1e-3 for m in ma.values()), "no step had a signal"
  # Every process logged to its own file.
  assert (two / "train.log").exists() and (two / "train.p1.log").exists()
  # The parameters after step 3, each checkpoint restored in this one process.
  pa, pb = _params(one, 3), _params(two, 3)
  assert pa.keys() == pb.keys()
  for key in pa:
    np.testing.assert_allclose(pb[key], pa[key], rtol=1e-5, atol=1e-5, err_msg=key)

  # The warm-up: held-out accuracy before it (step -3), every 2 of its steps
  # (a published snapshot) and after it (step 0, where GRPO starts); its loss
  # at steps -2..0. Its two publishes and the first RL update: version 3.
  for workdir in (one, two):
    recs = {r["step"]: r for r in metrics.read_metrics(str(workdir))}
    assert sorted(recs) == [-3, -2, -1, 0, 1, 2, 3]
    assert all("eval/accuracy" in recs[k] for k in (-3, -1, 0)) and "eval/accuracy" not in recs[-2]
    assert all(np.isfinite(recs[k]["sft/loss"]) for k in (-2, -1, 0))
    assert recs[1]["policy/version"] == 3.0
    # The KL reference is the policy as RL began (saved once, by the leader):
    # zero KL at the first step, up to two programs' rounding, then positive.
    assert os.path.exists(workdir / "reference" / "config.json")
    assert 0.0 <= recs[1]["train/kl"] < 1e-9 and recs[2]["train/kl"] > 1e-6
    # The engine's behaviour logprobs are the trainer's: importance weights 1.
    assert recs[2]["train/is_weight"] == pytest.approx(1.0, abs=1e-4)

  # The 2-process checkpoint resumes in one process (8 devices) and goes on:
  # no second warm-up, the reference read back from the work directory (KL to
  # the restored policy would be ~0 at this first step). From step 5 every
  # batch carries a NaN advantage: step 5 applies no update and publishes
  # nothing (counted, its prompts logged), step 6 is the second in a row and
  # stops the run; the checkpoints hold the last good policy.
  good = coordinator_lib.Coordinator.sequences

  def poisoned(self, groups):
    seqs = good(self, groups)
    if self.steps >= 4:
      seqs[0].advantages_T = np.full_like(seqs[0].advantages_T, np.nan)
    return seqs

  monkeypatch.setattr(coordinator_lib.Coordinator, "sequences", poisoned)
  with (
    caplog.at_level(logging.INFO, logger="fluxjax"),
    pytest.raises(train_step.NonFiniteError, match="2 updates in a row"),
  ):
    _one(two, total_steps=6, **{"faults.nonfinite_steps": 2})
  assert "resumed from step 3" in caplog.text
  assert_each_prompt_trained_once(two, 5, P)  # the refused step's prompts are consumed
  recs = {r["step"]: r for r in metrics.read_metrics(str(two))}
  assert sorted(recs) == [-3, -2, -1, 0, 1, 2, 3, 4, 5]
  assert recs[4]["train/kl"] > 1e-6 and recs[4]["policy/version"] == 6.0
  assert recs[4]["train/nonfinite"] == 0.0 and recs[5]["train/nonfinite"] == 1.0
  assert recs[5]["policy/version"] == 6.0 and recs[5]["faults/nonfinite_steps_total"] == 1.0
  step5 = loop.read_trained(str(two))[-1]
  assert step5["step"] == 5 and all(i in caplog.text for i in step5["ids"])
  assert re.search(r"update 5 skipped: loss nan", caplog.text)
  assert max(ocp.utils.checkpoint_steps(str(two / "checkpoints"))) == 5
  p4, p5 = _params(two, 4), _params(two, 5)
  assert all(np.array_equal(p5[k], p4[k]) for k in p4)


# The fleet job with everything on: launched servers behind the router,
# weights broadcast, flex_ulysses across the two processes, adaptive lag and
# tail batching with recycling (configs/vlm.py `fleet` modifier).
FLEET = {
  "sharding.strategy": "flex_ulysses",
  "coordinator.lag.mode": "adaptive",
  "coordinator.lag.sync_interval": 3,
  "rollout.tail_batching.eta": 1.5,
  "rollout.embedded_devices": 0,
  "rl.kl_coef": 0.0,
}


@pytest.mark.slow
def test_two_processes_on_a_fleet_survive_a_follower_killed_mid_step(tmp_path):
  """2 processes x 4 devices against 2 launched fluxjax servers behind a
  launched sglang-router, weights broadcast from the training mesh: the
  follower SIGKILLed mid-step stops the run, its servers and router with
  it; the restart resumes from the checkpoint, and every step trains P
  prompts no step trained before."""
  steps, workdir = 5, tmp_path / "fleet"
  command = [
    a.replace("configs/vlm.py", "configs/vlm.py:fleet")
    for a in _two(workdir, total_steps=steps, **FLEET)
  ]
  _kill_once_a_checkpoint_is_complete(command, tmp_path / "killed.log", victim=1, step=2)
  out = _run(command, tmp_path / "resumed.log")
  assert "resumed from step" in out
  records = loop.read_trained(str(workdir))
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  trained = [i for r in records for i in r["ids"]]
  assert all(len(r["ids"]) == P for r in records) and len(set(trained)) == len(trained)
  recs = {r["step"]: r for r in metrics.read_metrics(str(workdir)) if r["step"] >= 1}
  last = recs[steps]
  assert last["fleet/routed"] == 1.0 and last["fleet/servers"] == 2.0
  assert last["fleet/servers_down"] == 0.0 and last["faults/unwritten_publishes_total"] == 0.0
  # Recycling discards no decode work and restarts no response.
  assert last["rollout/tokens_discarded_total"] == 0.0 and last["rollout/restarted_total"] == 0.0
  assert any(abs(r["train/loss"]) > 1e-3 for r in recs.values()), "no step had a signal"
  lag = config_args.load_config().coordinator.lag
  assert all(lag.min_lag <= r["async/allowed_lag"] <= lag.max_lag for r in recs.values())
  assert all(
    lag.min_async_ratio <= r["async/async_ratio"] <= lag.max_async_ratio for r in recs.values()
  )
  assert any(r["async/sync_barrier"] == 1.0 for r in recs.values())  # sync_interval 3
  assert all(r["async/version_gap_max"] <= lag.max_lag for r in recs.values())
  assert all(0.0 <= r["async/staleness"] <= 1.0 for r in recs.values())
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["end"]["step"] == steps and summary["resumed_from"] >= 2
