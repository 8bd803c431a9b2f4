"""Starts one node's processes of a multi-process (jax.distributed) run.

  python -m fluxjax.launch --processes N [options] -- <fluxjax.train arguments>

starts N local processes of `python -m fluxjax.train <arguments>`, each with its
--config.distributed.* flags (the launcher owns them and refuses them after `--`);
`--help` lists the options. Entry points: `main`, `child_env`, `child_args`,
`supervise`, `stop`. Several nodes, Slurm, and what a signal does are told in
docs/fleet.md, "More than one process", and docs/reliability.md, "Preemption".
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence

DISTRIBUTED_FLAG = "--config.distributed."
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


# XLA:CPU sizes its thread pool to max(CPUs, devices); with several processes of
# fake devices on a few cores a collective can wait forever for a thread. tsl
# reads NPROC as the CPU count (docs/testing.md).
CPU_THREADS = 24
POLL_S = 0.2


def with_cpu_devices(xla_flags: str, devices: int | None) -> str:
  """`xla_flags` with `devices` fake CPU devices (None: the device count flag removed)."""
  flags = [f for f in xla_flags.split() if not f.startswith(DEVICE_COUNT_FLAG)]
  return " ".join(flags + ([f"{DEVICE_COUNT_FLAG}={devices}"] if devices else []))


def _say(message: str) -> None:
  print(f"fluxjax.launch: {message}", file=sys.stderr, flush=True)


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def child_env(
  environ: Mapping[str, str], process_id: int, cpu_devices: int, gpus_per_process: int
) -> dict[str, str]:
  """The environment of process `process_id`: `environ` plus the platform settings.

  Args:
    environ: the launcher's environment.
    process_id: the process's index on this node, 0-based (its GPUs follow it).
    cpu_devices: fake CPU devices per process; 0 leaves the platform alone.
    gpus_per_process: local GPUs per process; 0 leaves the devices alone.
      CUDA_VISIBLE_DEVICES is kept, so the ids index the GPUs it shows.

  With cpu_devices K > 0 the process runs on K fake CPU devices (JAX_PLATFORMS=cpu,
  gloo collectives, --xla_force_host_platform_device_count=K in XLA_FLAGS, replacing
  any count already there; NPROC=24 unless set, so XLA:CPU's thread pool has room for
  every process's devices on a small machine, see docs/testing.md). With
  gpus_per_process G > 0 process i uses local GPUs i*G .. (i+1)*G-1
  (JAX_LOCAL_DEVICE_IDS).
  """
  env = dict(environ)
  if cpu_devices > 0:
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    env["XLA_FLAGS"] = with_cpu_devices(env.get("XLA_FLAGS", ""), cpu_devices)
    env.pop("JAX_NUM_CPU_DEVICES", None)  # it would override the XLA flag
    env.setdefault("NPROC", str(max(CPU_THREADS, 2 * cpu_devices)))
  if gpus_per_process > 0:
    first = process_id * gpus_per_process
    env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(i) for i in range(first, first + gpus_per_process))
  return env


def child_args(
  module: str,
  train_args: Sequence[str],
  coordinator_address: str,
  num_processes: int,
  process_id: int,
) -> list[str]:
  """The command line of process `process_id`.

  Args:
    module: the module to run with `python -m`.
    train_args: the module's arguments, passed unchanged before the launcher's.
    coordinator_address: host:port of process 0's coordinator service.
    num_processes: how many processes the run has.
    process_id: this process's index, 0-based.
  """
  return [
    sys.executable,
    "-m",
    module,
    *train_args,
    f"{DISTRIBUTED_FLAG}coordinator_address={coordinator_address}",
    f"{DISTRIBUTED_FLAG}num_processes={num_processes}",
    f"{DISTRIBUTED_FLAG}process_id={process_id}",
  ]


def exit_status(returncode: int) -> int:
  """A shell-style exit status: a process killed by signal S (returncode -S) gives 128 + S."""
  return 128 - returncode if returncode < 0 else returncode


def _describe(returncode: int) -> str:
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = "an unknown signal"
    return f"was killed by {name} ({-returncode})"
  return f"exited with code {returncode}"


def _signal_group(pgid: int, signum: int) -> None:
  try:
    os.killpg(pgid, signum)
  except ProcessLookupError:  # nothing left in the group
    pass


def stop(
  children: Sequence[subprocess.Popen], signum: int, grace_s: float, *, workers_too: bool = True
) -> None:
  """Stops every child and the workers in its process group.

  Sends `signum` to every child's group (exited children's groups too: their
  workers may outlive them), or with `workers_too` False to every child still
  running alone (a preempted trainer finishes its step with the rollout
  servers it launched, then stops them), waits up to `grace_s` for the
  children to exit, then SIGKILLs whatever is left in the groups and reaps
  the children.

  Args:
    children: processes started with start_new_session=True (pgid = pid).
    signum: the first signal to send, e.g. SIGTERM.
    grace_s: seconds before SIGKILL.
    workers_too: the first signal also goes to the children's workers.
  """
  for child in children:
    if workers_too:
      _signal_group(child.pid, signum)
    elif child.poll() is None:
      child.send_signal(signum)
  deadline = time.monotonic() + grace_s
  while time.monotonic() < deadline and any(child.poll() is None for child in children):
    time.sleep(0.05)
  for child in children:
    _signal_group(child.pid, signal.SIGKILL)
  for child in children:
    child.wait()


def supervise(
  children: Sequence[subprocess.Popen],
  grace_s: float,
  interrupted: Callable[[], int | None] = lambda: None,
  poll_s: float = POLL_S,
) -> int:
  """Waits for the children; stops them all when one fails or the launcher is interrupted.

  Args:
    children: the started processes, in process-id order.
    grace_s: seconds between the stop signal and SIGKILL.
    interrupted: returns the signal the launcher received, or None.
    poll_s: seconds between checks.

  Each process starts in its own session, so stopping it also stops the worker
  processes it started. When one process fails (nonzero exit or a signal), the
  others are stopped: SIGTERM to every process group, SIGKILL after grace_s.
  SIGINT and SIGTERM sent to the launcher (a preemption) go to the processes
  alone, their groups getting SIGKILL after grace_s: a preempted run finishes
  its step with the rollout servers it launched still up, checkpoints, and
  stops them itself.

  Returns:
    The launcher's exit code: 0 when every process exits 0; otherwise the first
    failing process's exit code, or 128 + the signal number when a signal ended it
    (SIGKILL: 137); 128 + the signal number when the launcher itself was
    interrupted. A usage error exits 2 (argparse).
  """
  while True:
    signum = interrupted()
    if signum is not None:
      _say(f"received {signal.Signals(signum).name}; stopping all {len(children)} processes")
      stop(children, signum, grace_s, workers_too=False)
      return 128 + signum
    returncodes = [child.poll() for child in children]
    failed = next((i for i, code in enumerate(returncodes) if code), None)
    if failed is not None:
      code = children[failed].returncode
      others = len(children) - 1
      _say(
        f"process {failed} (pid {children[failed].pid}) {_describe(code)}; "
        f"stopping the other {others} process{'' if others == 1 else 'es'}"
      )
      stop(children, signal.SIGTERM, grace_s)
      return exit_status(code)
    if all(code == 0 for code in returncodes):
      return 0
    time.sleep(poll_s)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
  """The launcher's options; `train_args` holds everything after `--`.

  Raises SystemExit(2) with a usage message on a bad option, or when the
  arguments after `--` set --config.distributed.* (the launcher sets those).
  """
  argv = list(argv)
  split = argv.index("--") if "--" in argv else len(argv)
  own, train_args = argv[:split], argv[split + 1 :]
  parser = argparse.ArgumentParser(
    prog="python -m fluxjax.launch",
    usage="%(prog)s --processes N [options] -- <fluxjax.train arguments>",
    description="Starts one node's processes of a multi-process (jax.distributed) run.",
  )
  parser.add_argument("--processes", type=int, required=True, help="how many processes (>= 1)")
  parser.add_argument(
    "--cpu_devices", type=int, default=0, help="fake CPU devices per process; 0 = platform as is"
  )
  parser.add_argument(
    "--gpus_per_process", type=int, default=0, help="local GPUs per process; 0 = devices as is"
  )
  parser.add_argument("--port", type=int, default=0, help="coordinator port; 0 = a free one")
  parser.add_argument("--num_nodes", type=int, default=1, help="nodes, each running a launcher")
  parser.add_argument("--node_rank", type=int, default=0, help="this node's index, 0-based")
  parser.add_argument(
    "--coordinator_address", default="", help="HOST:PORT of process 0 (node 0); M > 1 needs it"
  )
  parser.add_argument(
    "--grace_s", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL"
  )
  parser.add_argument("--module", default="fluxjax.train", help="module each process runs")
  args = parser.parse_args(own)
  if args.processes < 1:
    parser.error(f"--processes={args.processes}: need at least 1")
  for name in ("cpu_devices", "gpus_per_process", "grace_s"):
    if getattr(args, name) < 0:
      parser.error(f"--{name}={getattr(args, name)}: must not be negative")
  if not 0 <= args.port < 65536:
    parser.error(f"--port={args.port}: not a port number (0 = pick a free one)")
  if args.num_nodes < 1 or not 0 <= args.node_rank < args.num_nodes:
    parser.error(
      f"--num_nodes={args.num_nodes} --node_rank={args.node_rank}: need num_nodes >= 1 and "
      "0 <= node_rank < num_nodes"
    )
  if args.num_nodes > 1 and not args.coordinator_address:
    parser.error("--num_nodes > 1 needs --coordinator_address=HOST:PORT (node 0's host)")
  if args.coordinator_address and args.port:
    parser.error("give --coordinator_address=HOST:PORT or --port, not both")
  if args.coordinator_address and not args.coordinator_address.rpartition(":")[2].isdigit():
    parser.error(f"--coordinator_address={args.coordinator_address!r}: expected HOST:PORT")
  owned = [a for a in train_args if a.startswith(DISTRIBUTED_FLAG)]
  if owned:
    parser.error(
      f"{' '.join(owned)}: the launcher sets {DISTRIBUTED_FLAG}* for each process; "
      "drop these from the arguments after --"
    )
  args.train_args = train_args
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the launcher on `argv` (sys.argv[1:] when None) and returns its exit code."""
  args = parse_args(sys.argv[1:] if argv is None else argv)
  address = args.coordinator_address or f"127.0.0.1:{args.port or free_port()}"
  total = args.num_nodes * args.processes
  received: list[int] = []
  previous = {
    signum: signal.signal(signum, lambda s, _frame: received.append(s))
    for signum in (signal.SIGINT, signal.SIGTERM)
  }
  children: list[subprocess.Popen] = []
  try:
    for i in range(args.processes):
      process_id = args.node_rank * args.processes + i
      children.append(
        subprocess.Popen(
          child_args(args.module, args.train_args, address, total, process_id),
          env=child_env(os.environ, i, args.cpu_devices, args.gpus_per_process),
          start_new_session=True,
        )
      )
      _say(f"process {process_id} pid {children[-1].pid}")
    return supervise(children, args.grace_s, lambda: received[0] if received else None)
  except BaseException:
    stop(children, signal.SIGTERM, args.grace_s)
    raise
  finally:
    for signum, handler in previous.items():
      signal.signal(signum, handler)


if __name__ == "__main__":
  sys.exit(main())
