"""The 2-process main job's runs for tests/test_multiprocess.py and the fleet
tests (and bench/kill_resume.py): its settings, `python -m fluxjax.launch`
around it, kills mid-step or at a named point (tests/kill_points.py), and
what a killed run is checked for."""

import json
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
from scipy import stats

from fluxjax import config_args
from fluxjax.rl import metrics
from helpers import ROOT, process_alive, run_launcher, train_command

P = 2  # prompts per step
# CPU devices of each process of a 2-process run: more than one, so that a
# process holds several shards of the sequence axis as a GPU host does, and
# no more, since every device of a launch is a gloo rank and its collectives
# cost CPU (docs/testing.md, launched jobs).
DEVICES = 2
SP = 2 * DEVICES  # the sequence axis across both processes

OVERRIDES = {
  "sharding.strategy": "flex_ulysses",
  "sharding.sp": SP,  # auto would stay inside one process
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
  "rollout.embedded_devices": DEVICES,  # all of process 0's
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


# The fleet job with everything on: launched servers behind the router,
# weights broadcast, flex_ulysses across the two processes (OVERRIDES),
# adaptive lag and tail batching with recycling (configs/vlm.py `fleet`
# modifier).
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
# The fleet job killed at points (tests/kill_points.py). The generation
# point needs a partial response carried while a round runs. Random weights
# stop a response on one of 7 stop ids of 512 (1.4% a token), so at 192 new
# tokens 7% of responses reach the cap. Eta 2 launches 4 prompts a step and
# four slots a server start all 8 requests together: the round keeps the 2
# prompts that finish first and cuts 2 whose longest responses are still
# running, so each short round carries partial responses (unless 3 of its 4
# prompts run to the cap together: about 1%), and the long round after it
# continues them for hundreds of milliseconds or more.
KILLED = {
  **FLEET,
  "rl.max_new_tokens": 192,  # rollout.context_length 256 leaves 64 for a prompt
  "rollout.num_slots": 4,
  "rollout.tail_batching.eta": 2.0,
  "data.synth_train": 64,  # one epoch: no prompt drawn twice in a short run
  "coordinator.response_records": True,  # each trained response's length
}
# The same, synchronous and without speculation: its samples and updates
# follow from the seed alone (a resumed run must train what an uninterrupted
# one trains).
KILLED_SYNC = {**KILLED, "coordinator.lag.mode": "sync", "rollout.tail_batching.eta": 1.0}
KILL_POINTS = ("generation", "queue", "publish", "checkpoint")


def fleet_command(
  workdir, steps: int, module: str = "", devices: int = DEVICES, **overrides
) -> list[str]:
  """The `fleet` job (configs/vlm.py:fleet) on 2 processes x `devices`, the
  sequence axis across both. When one process dies the launcher gives the
  other 3 s to stop (SIGTERM) before SIGKILL: it waits in a collective that
  never completes."""
  overrides = {"sharding.sp": 2 * devices, **overrides}
  return launched(
    workdir,
    2,
    devices,
    grace_s=3.0,
    module=module,
    variant="tiny,fleet",
    total_steps=steps,
    **overrides,
  )


def env():
  """The reward workers import tests/fault_rewards.py."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [os.path.join(ROOT, "tests"), *filter(None, [env.get("PYTHONPATH")])]
  )
  return env


def reuse_compiled_programs(monkeypatch, directory) -> None:
  """The launches that follow in this test (their processes and the servers
  those start) keep the programs XLA compiles in `directory` (JAX's
  persistent compilation cache), so a relaunch of a job (a resume) loads
  what the first launch compiled. Only for jobs whose processes run no
  rollout engine of their own: docs/testing.md, executable reuse."""
  monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "true")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(directory))
  # Every program: a publish's 150 small ones take seconds too.
  monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def two(workdir, **overrides):
  return launched(workdir, 2, DEVICES, **overrides)


def one(workdir, **overrides):
  """The run `two` makes, as 1 process holding all of its devices."""
  return launched(workdir, 1, SP, **overrides)


def launched(
  workdir,
  processes: int,
  devices: int,
  grace_s: float = 10.0,
  module: str = "",
  variant: str = "tiny",
  **overrides,
):
  """`python -m fluxjax.launch` of configs/vlm.py:`variant` with OVERRIDES and
  `overrides`; `grace_s`: the launcher's time between SIGTERM and SIGKILL;
  `module`: the module each process runs instead of fluxjax.train
  (tests/kill_points.py)."""
  launcher = [sys.executable, "-m", "fluxjax.launch", f"--processes={processes}"]
  launcher += [f"--cpu_devices={devices}", f"--grace_s={grace_s}"]
  launcher += [f"--module={module}"] if module else []
  launcher += ["--"]
  # The train args, without `python -m fluxjax.train`.
  return launcher + train_command(workdir, {**OVERRIDES, **overrides}, variant)[3:]


def config(arg: str = "tiny", **overrides):
  """The tiny job's config (configs/vlm.py:`arg`) with OVERRIDES and
  `overrides`, as `launched` passes them on the command line."""
  c = config_args.load_config(arg=arg)
  for key, value in {**OVERRIDES, **overrides}.items():
    *sections, field = key.split(".")
    section = c
    for name in sections:
      section = section[name]
    section[field] = value
  return c


def params(workdir, step) -> dict:
  """Checkpoint `step`'s train state as host arrays, restored onto one device
  of this process, by key path."""
  path = os.path.join(workdir, "checkpoints", str(step), "state")
  checkpointer = ocp.StandardCheckpointer()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(
    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
    checkpointer.metadata(path).item_metadata,
  )
  state = checkpointer.restore(path, target)
  return {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree.leaves_with_path(state)}


def launch(command, log_path, timeout=900, extra_env: dict | None = None) -> tuple[int, str]:
  """Runs the launcher of `command` to its end; (its exit status, its log)."""
  with open(log_path, "w") as log:
    done = run_launcher(
      command,
      cwd=ROOT,
      env={**env(), **(extra_env or {})},
      stdout=log,
      stderr=subprocess.STDOUT,
      timeout=timeout,
    )
  return done.returncode, open(log_path).read()


def run(command, log_path, timeout=900, extra_env: dict | None = None) -> str:
  returncode, out = launch(command, log_path, timeout, extra_env)
  assert returncode == 0, out[-4000:]
  return out


def pids(log_path) -> dict[int, int]:
  text = open(log_path).read() if os.path.exists(log_path) else ""
  return {int(i): int(p) for i, p in re.findall(r"fluxjax\.launch: process (\d) pid (\d+)", text)}


def _signal_when(command, log_path, ready, signal_it) -> subprocess.Popen:
  """Starts the launcher, calls `signal_it(launcher)` once `ready()` holds,
  and waits for the launcher to exit (it stops the processes it started)."""
  with open(log_path, "w") as log:
    launcher = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 600
    try:
      while time.time() < deadline and launcher.poll() is None and not ready():
        time.sleep(0.2)
      assert launcher.poll() is None, open(log_path).read()[-4000:]
      signal_it(launcher)
      launcher.wait(timeout=300)
    finally:
      if launcher.poll() is None:
        launcher.terminate()  # it stops its processes
        launcher.wait(timeout=60)
  return launcher


def _workdir(command) -> pathlib.Path:
  return pathlib.Path(next(a for a in command if a.startswith("--workdir=")).split("=", 1)[1])


def kill_once_a_checkpoint_is_complete(command, log_path, victim: int, step: int = 1) -> dict:
  """Starts the launcher, SIGKILLs its process `victim` once checkpoint
  `step` is complete (step + 1 under way), checks that it stopped the rest
  and the servers they started (each process's group); returns the pids."""
  checkpoint = _workdir(command) / "checkpoints" / str(step)  # renamed into place when complete
  started = {}

  def kill(_):
    started.update(pids(log_path))
    assert sorted(started) == [0, 1]
    os.kill(started[victim], signal.SIGKILL)

  launcher = _signal_when(command, log_path, checkpoint.exists, kill)
  # The launcher stopped the other process (waiting in a collective or for
  # the next op) and exited with the killed one's fate.
  assert launcher.returncode == 128 + signal.SIGKILL, open(log_path).read()[-4000:]
  _assert_all_stopped(started)
  return started


def _assert_all_stopped(started: dict[int, int]) -> None:
  """The launcher's processes and every member of their groups (the servers
  and the router they started) are gone."""
  assert not any(process_alive(pid) for pid in started.values())
  left = members_after_sigkill(set(started.values()))
  assert not left, f"processes left running in the run's process groups: {left}"


def killed_at(command, log_path, record, point: str, victim: int, skip: int = 0) -> list[dict]:
  """Runs the launcher of `command` (module kill_points) until process
  `victim` is SIGKILLed at `point` (tests/kill_points.py; `skip` moments let
  pass first); checks that the launcher stopped the rest, the servers and
  the router with them, and exited with the killed one's fate. Returns the
  lines the launch appended to `record` (the kill's, and its shadows)."""
  assert "--module=kill_points" in command
  record = pathlib.Path(record)
  before = len(record.read_text().splitlines()) if record.exists() else 0
  plan = {"KILL_POINT": point, "KILL_VICTIM": str(victim), "KILL_SKIP": str(skip)}
  returncode, out = launch(command, log_path, extra_env={**plan, "KILL_RECORD": str(record)})
  if returncode == 0:
    raise AssertionError(f"the run ended before the {point} point's moment came: {out[-2000:]}")
  assert returncode == 128 + signal.SIGKILL, out[-4000:]
  started = pids(log_path)
  assert sorted(started) == [0, 1] and f"process {victim} (pid {started[victim]}) was killed" in out
  _assert_all_stopped(started)
  lines = [json.loads(x) for x in record.read_text().splitlines()[before:]]
  kills = [x for x in lines if not x["shadow"]]
  assert kills and all(x["point"] == point and x["victim"] == victim for x in kills), lines
  return lines


def preempt_once_rl_started(command, log_path) -> str:
  """Starts the launcher and sends it SIGTERM (a scheduler's preemption)
  once the run's RL start is evaluated, while step 1 is under way; returns
  the log. The launcher passes the signal on and exits 128 + SIGTERM."""
  workdir = _workdir(command)

  def rl_started() -> bool:
    path = workdir / metrics.JSONL
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    return any(json.loads(x)["step"] == 0 for x in lines if x.endswith("\n") and x.strip())

  launcher = _signal_when(command, log_path, rl_started, lambda p: p.send_signal(signal.SIGTERM))
  out = open(log_path).read()
  assert launcher.returncode == 128 + signal.SIGTERM, out[-4000:]
  return out


def members_after_sigkill(groups: set[int], within_s: float = 30.0) -> list[int]:
  """Live members of process groups the launcher SIGKILLed: none once the
  kernel has ended them (a loaded machine takes a moment), else who is left."""
  deadline = time.monotonic() + within_s
  while (left := group_members(groups)) and time.monotonic() < deadline:
    time.sleep(0.1)
  return left


def group_members(groups: set[int]) -> list[int]:
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


def assert_the_kill_landed_where_it_claims(point: str, lines: list[dict]) -> dict:
  """The leader's line of a kill (tests/kill_points.py) shows the point's work
  under way: requests running at the servers (with partial responses carried
  when rounds speculate), kept groups waiting for a busy trainer, part of a
  new version broadcast, or the victim's part of checkpoint N half written
  with N uncommitted. Returns the leader's line."""
  leader = next(x for x in lines if x["process"] == 0 and not x["shadow"] and "open" in x)
  assert leader["latest_checkpoint"] > leader["start_checkpoint"], leader  # the launch moved on
  if point == "generation":
    assert leader["servers_running"] >= 1 and leader["in_flight"], leader
    assert all(n > 0 for _, _, n in leader["partial"]), leader
  if point == "queue":
    assert leader["queued"] and leader["trainer_busy"], leader
  if point == "publish":
    p = leader["publish"]
    assert 0 < p["sent"] < p["tensors"] and int(p["version"]) == leader["version"], leader
  if point == "checkpoint":
    victim = next(x for x in lines if x.get("killed_mid_write"))
    assert victim["checkpoint"]["tmp"] and not victim["checkpoint"]["committed"], victim
    assert leader["checkpoint"]["step"] == victim["checkpoint"]["step"]
  return leader


def prompt_lengths(records: list[dict]) -> dict[str, float]:
  """Each trained prompt's mean response length (trained.jsonl's response records)."""
  lengths: dict[str, list[int]] = {}
  for r in records:
    for x in r["responses"]:
      lengths.setdefault(x["sample_id"], []).append(x["length"])
  return {i: sum(v) / len(v) for i, v in lengths.items()}


def at_stake_lengths(records: list[dict], kills: list[dict], shadows: list[dict]) -> dict:
  """The trained lengths of the prompts the kills put at stake, against those
  of the prompts at stake at the moments no kill came (kill_points' shadows,
  taken at the same points: the same selection, no kill), each prompt once.

  A resume that lost or cut short the long responses it redoes would train
  the killed prompts shorter than the reference; both are selected alike
  (at stake at a point's moment), so the run's other prompts are not the
  reference: the prompts at stake at any moment are the slow ones more often.
  Returns {"killed", "reference"}: lists of per-prompt mean lengths, and
  `compare`'s figures.
  """
  length = prompt_lengths(records)
  killed = {i for k in kills for i in k["at_stake"]}
  reference = {i for x in shadows for i in x["at_stake"]} - killed
  a = [length[i] for i in sorted(killed) if i in length]
  b = [length[i] for i in sorted(reference) if i in length]
  return {"killed": a, "reference": b, **compare(a, b)}


def compare(a: list[float], b: list[float]) -> dict:
  """Two-sided Mann-Whitney U of `a` against `b`: its p-value and the
  probability that a value of `a` exceeds one of `b` (ties count half)."""
  if not a or not b:
    return {"p": float("nan"), "auc": float("nan")}
  u = stats.mannwhitneyu(a, b, alternative="two-sided")
  return {"p": float(u.pvalue), "auc": float(u.statistic) / (len(a) * len(b))}
