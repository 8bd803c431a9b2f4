"""Rollout and trainer on disjoint cores, for the benches that compare lag modes.

`pin_and_launch(trainer_cores, rollout_cores, config)` pins this process (the
trainer) to `trainer_cores` with sched_setaffinity, which must happen before
JAX starts its thread pools, and starts one `fluxjax.rollout.server` process
(SGLang's protocol) under `taskset -c rollout_cores`, configured like the
run's embedded engine would be. A run then drives it as a fleet of one:
`use_server(config, urls)`. Weights reach it through disk every step (pause
-> update_weights_from_disk -> continue), as they reach an SGLang fleet.

On GPUs decoding is memory-bound and rollout takes most of a step (about
70% in the Flexes paper's Table 1); on these CPU cores training dominates,
so the mechanisms that shorten or hide rollout have little to act on. Two
stand-ins for a rollout device: `server_flags` passes the server
`--min-decode-step-ms`, a floor under each decode step (a memory-bound
step reads every weight whatever the batch, so a round's few long
responses cost as much a step as a full batch), and `Throttle(pids, duty)`
lets the server run `duty` of every 20 ms (SIGSTOP / SIGCONT, as cpulimit
does), a uniformly slower device.
"""

from __future__ import annotations

import os
import signal
import threading
import time


def _cores(spec: str) -> set[int]:
  return {int(x) for x in spec.split(",") if x}


def pin_and_launch(trainer_cores: str, rollout_cores: str, config, server_flags=()):
  """Pins this process and starts the rollout server with `server_flags`
  added to its command; returns (servers, command)."""
  from fluxjax.rl import loop
  from fluxjax.rollout import factory, launcher

  os.sched_setaffinity(0, _cores(trainer_cores))
  # The run's settings as it resolves them (the checkpoint's vision limits).
  settings = loop.validate(config).settings
  cmd = ["taskset", "-c", rollout_cores, *factory.server_command(settings), *server_flags]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return launcher.launch_servers(cmd, 1, env=env, timeout_s=600), " ".join(cmd)


def use_server(config, urls) -> None:
  """Points a run's rollout at the launched server (a fleet of one)."""
  if urls:
    config.rollout.backend, config.rollout.urls = "sglang", tuple(urls)


def cpu_seconds(pid: int) -> float:
  """CPU seconds a process has used, all its threads (0 once it is gone)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
  except (FileNotFoundError, ProcessLookupError):
    return 0.0
  return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Throttle:
  """Runs processes `duty` of every `period_s`; `stop()` resumes them for good."""

  def __init__(self, pids, duty: float, period_s: float = 0.02):
    if not 0 < duty < 1:
      raise ValueError(f"a throttle's duty must lie in (0, 1), not {duty}")
    self._pids = list(pids)
    self._duty = duty
    self._run_s, self._stop_s = duty * period_s, (1 - duty) * period_s
    self._stopped_total = 0.0
    self._cpu_start = {pid: cpu_seconds(pid) for pid in self._pids}
    self._started = time.monotonic()
    self._done = threading.Event()
    self._thread = threading.Thread(target=self._cycle, name="rollout-throttle", daemon=True)
    self._thread.start()

  def _signal(self, sig) -> None:
    for pid in self._pids:
      try:
        os.kill(pid, sig)
      except ProcessLookupError:  # a server that exited: the run reports it
        pass

  def _cycle(self) -> None:
    while not self._done.wait(self._run_s):
      self._signal(signal.SIGSTOP)
      t = time.monotonic()
      # A late wake-up (a loaded machine) lets the processes run past their
      # share, and so does a stop that lands late (a signal to a process on
      # another virtual CPU can take half a millisecond): the stop that
      # follows is lengthened until the share is back, by whichever of the
      # time not stopped and the CPU the busiest process used is larger.
      ran = max((t - self._started) - self._stopped_total, self._cpu_used())
      self._done.wait(max(self._stop_s, ran / self._duty - (t - self._started)))
      self._signal(signal.SIGCONT)
      self._stopped_total += time.monotonic() - t

  def _cpu_used(self) -> float:
    return max((cpu_seconds(pid) - start for pid, start in self._cpu_start.items()), default=0.0)

  def achieved(self) -> float:
    """The share of time since the start the processes were allowed to run."""
    return 1 - self._stopped_total / (time.monotonic() - self._started)

  def stop(self) -> float:
    self._done.set()
    self._thread.join()
    self._signal(signal.SIGCONT)
    return self.achieved()
