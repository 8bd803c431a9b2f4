"""Starting rollout server processes and waiting for them to serve.

`launch_servers` runs a server command (`python -m sglang.launch_server ...` or
`python -m fluxjax.rollout.server`) on free ports, each process with its own
log file and environment, waits for every /health, and hands back the
processes to stop (`LaunchedServers.stop`). The client of the running
servers is fleet.py.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence


def free_port(host: str = "127.0.0.1") -> int:
  """A port on `host` that nothing listens on now (the system picks it)."""
  with socket.socket() as s:
    s.bind((host, 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class LaunchedServers:
  """Server processes started by `launch_servers`; `stop()` ends them."""

  urls: list[str]
  procs: list[subprocess.Popen]
  logs: list[str]
  # A router launched in front of these servers (rollout.router_launch).
  router: LaunchedServers | None = None

  def stop(self) -> None:
    if self.router is not None:
      self.router.stop()
    for p in self.procs:
      if p.poll() is None:
        p.terminate()
    for p in self.procs:
      try:
        p.wait(timeout=10)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


# glibc malloc on transparent huge pages (appended to GLIBC_TUNABLES unless it
# sets hugetlb; other C libraries ignore it). A decoding server allocates the
# same large temporaries every step and glibc hands them back to the kernel,
# so each step faults them in again 4 KiB at a time, a third of a CPU
# server's time in the kernel; huge pages spare most of it (docs/testing.md,
# allocator settings).
MALLOC_TUNABLES = "glibc.malloc.hugetlb=1"


def server_process_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """`env` (default: this process's) with `MALLOC_TUNABLES` added."""
  env = dict(os.environ if env is None else env)
  tunables = env.get("GLIBC_TUNABLES", "")
  if "glibc.malloc.hugetlb" not in tunables:
    env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, MALLOC_TUNABLES) if t)
  return env


def launch_servers(
  cmd: Sequence[str],
  num_servers: int,
  *,
  host: str = "127.0.0.1",
  env: dict | None = None,
  timeout_s: float = 300.0,
  log_dir: str | None = None,
  log_name: str = "server",
  gpu_groups: Sequence[str] | None = None,
) -> LaunchedServers:
  """Starts `cmd + --host H --port P` num_servers times and waits for /health.

  `cmd` is e.g. ["python", "-m", "sglang.launch_server", "--model-path", M]
  (or our `fluxjax.rollout.server`, which takes the same flags). The
  processes get `env` (default: this process's) with `MALLOC_TUNABLES`.
  Each writes its output to `log_dir`/<log_name><i>.log (a run's
  WORKDIR/logs; a new temporary folder when None). With `gpu_groups`,
  server i runs with CUDA_VISIBLE_DEVICES=gpu_groups[i].
  """
  log_dir = log_dir or tempfile.mkdtemp(prefix="fluxjax-servers-")
  os.makedirs(log_dir, exist_ok=True)
  urls, procs, logs = [], [], []
  cmd = [sys.executable if c == "python" else c for c in cmd]
  env = server_process_env(env)
  for i in range(num_servers):
    port = free_port(host)
    path = os.path.join(log_dir, f"{log_name}{i}.log")
    own_env = env if gpu_groups is None else {**env, "CUDA_VISIBLE_DEVICES": gpu_groups[i]}
    with open(path, "wb") as f:
      procs.append(
        subprocess.Popen(
          [*cmd, "--host", host, "--port", str(port)],
          stdout=f,
          stderr=subprocess.STDOUT,
          env=own_env,
        )
      )
    urls.append(f"http://{host}:{port}")
    logs.append(path)
  launched = LaunchedServers(urls, procs, logs)
  deadline = time.time() + timeout_s
  pending = set(range(num_servers))
  try:
    while pending:
      for i in list(pending):
        if procs[i].poll() is not None:
          raise RuntimeError(
            f"rollout server {i} exited with {procs[i].returncode}; "
            f"log: {open(logs[i]).read()[-2000:]}"
          )
        try:
          with urllib.request.urlopen(urls[i] + "/health", timeout=2) as r:
            if r.status == 200:
              pending.discard(i)
        except OSError:
          pass
      if pending and time.time() > deadline:
        raise TimeoutError(f"rollout servers {sorted(pending)} not healthy in {timeout_s}s")
      if pending:
        time.sleep(0.25)
  except BaseException:
    launched.stop()
    raise
  return launched
