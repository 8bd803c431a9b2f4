"""The 2-process main job's runs for tests/test_multiprocess*.py: its settings,
`python -m fluxjax.launch` around it, and a kill mid-step."""

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

from fluxjax import config_args
from fluxjax.rl import metrics
from helpers import ROOT, process_alive, run_launcher, train_command

P = 2  # prompts per step

OVERRIDES = {
  "sharding.strategy": "flex_ulysses",
  "sharding.sp": 8,  # across both processes of a 2 x 4 run (auto stays in one)
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


def env():
  """The reward workers import tests/fault_rewards.py."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(
    [os.path.join(ROOT, "tests"), *filter(None, [env.get("PYTHONPATH")])]
  )
  return env


def two(workdir, **overrides):
  return launched(workdir, 2, 4, **overrides)


def launched(workdir, processes: int, devices: int, grace_s: float = 10.0, **overrides):
  """`python -m fluxjax.launch` of the main job with OVERRIDES and `overrides`;
  `grace_s`: the launcher's time between SIGTERM and SIGKILL."""
  launcher = [sys.executable, "-m", "fluxjax.launch", f"--processes={processes}"]
  launcher += [f"--cpu_devices={devices}", f"--grace_s={grace_s}", "--"]
  # The train args, without `python -m fluxjax.train`.
  return launcher + train_command(workdir, {**OVERRIDES, **overrides})[3:]


def config(arg: str | None = None, **overrides):
  """The main job's config (configs/vlm.py:`arg`) with OVERRIDES and
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


def run(command, log_path, timeout=900):
  with open(log_path, "w") as log:
    done = run_launcher(
      command, cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
    )
  out = open(log_path).read()
  assert done.returncode == 0, out[-4000:]
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
  assert not any(process_alive(pid) for pid in started.values())
  left = group_members(set(started.values()))
  assert not left, f"processes left running in the run's process groups: {left}"
  return started


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
