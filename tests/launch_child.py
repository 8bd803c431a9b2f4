"""A process for tests/test_launch.py to start through fluxjax.launch.

  python -m launch_child ACTION_0 ACTION_1 ... --config.distributed.*=...

Process i does ACTION_i:
  ok        exit 0.
  exit:N    exit with code N.
  sleep     sleep (until stopped; at most 60 s).
  sigkill   SIGKILL itself.
  orphan:N  start a `sleep` worker in its process group, print the worker's pid,
            exit with code N (the worker is left behind).
  preempt   start a `sleep` worker (a launched rollout server) in its process
            group and print its pid; on SIGTERM finish "the step" (0.5 s),
            print whether the worker was up through it, stop the worker
            itself and exit 128 + SIGTERM, as a preempted trainer does.
  jax       jax.distributed through fluxjax's set-up from the launcher's flags,
            then a jitted sum over a global array on a 4-device mesh; process 0
            prints `sum=<value>`. Then the leader's op channel: process 0 sends
            a small op and one of several chunks, the other prints what it
            received as `ops=<name>:<count>,...`; and the global array gathered
            onto process 0's devices, which prints `gathered=<values>` and
            `received=<bytes the other process sent it>` (also of a 2-D
            array placed by rows on its 2 devices, checked there).
  publish:ROOT  jax.distributed as for `jax`, the tiny model (seed 0) sharded
            over the 4 devices, then a fleet publish's parts: process 0
            writes ROOT/v3 as `publish.write_checkpoint` and the other takes
            part (`publish.take_part`); then both with the other's files
            refused by a full disk (ROOT/v4, process 0 prints
            `refused=<message>`); then ROOT/v5, one element of each
            parameter changed, with its delta from v3; then the distributed
            transport's gathers, process 0 printing `digest=<sha256 of every
            bf16 tensor>`. Process k prints what its gathers brought it for
            v3 and for the broadcast: `written<k>=` and `broadcast<k>=`
            `<bytes>,<the largest gather's bytes>`.

Each record is printed on a line of its own (`report`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import traceback

DISTRIBUTED_FLAG = "--config.distributed."
SUM_SIZE = 16
CHANNEL_BIG = 10240


def report(record: str) -> None:
  """Prints `record` to stdout on a line of its own: gloo (in jaxlib) prints
  from C to the same pipe, and a line it has not finished would otherwise
  take the record in."""
  sys.stdout.write(f"\n{record}\n")
  sys.stdout.flush()


def start_distributed(flags: dict[str, str]) -> None:
  import jax
  import ml_collections

  from fluxjax.sharding import mesh as mesh_lib

  cfg = ml_collections.ConfigDict(
    {
      "coordinator_address": flags["coordinator_address"],
      "num_processes": int(flags["num_processes"]),
      "process_id": int(flags["process_id"]),
      "local_device_ids": "",
      "auto": False,
    }
  )
  mesh_lib.maybe_initialize_distributed(cfg)
  assert jax.process_count() == 2, jax.process_count()
  assert jax.device_count() == 4, jax.devices()


def distributed_sum(flags: dict[str, str]) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  start_distributed(flags)
  mesh = jax.make_mesh((4,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))  # as fluxjax's
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
  values = np.arange(SUM_SIZE, dtype=np.float32)
  array = jax.make_array_from_callback((SUM_SIZE,), sharding, lambda index: values[index])
  total = jax.jit(jnp.sum)(array)
  if jax.process_index() == 0:
    report(f"sum={float(total)}")
    # A hybrid mesh: each data replica is one process's devices.
    from fluxjax.sharding import mesh as mesh_lib

    hybrid = mesh_lib.make_mesh(2, -1)
    owners = [sorted({d.process_index for d in row.flat}) for row in hybrid.devices]
    report("hybrid=" + ";".join(",".join(map(str, o)) for o in owners))
  leader_channel(array)


def leader_channel(array) -> None:
  import jax
  import numpy as np

  from fluxjax.parallel import multihost
  from fluxjax.sharding import gather

  channel = multihost.Channel(prefix="test/ops", timeout_s=60, chunk_bytes=1024)
  big = np.arange(CHANNEL_BIG, dtype=np.int32)  # 40 KiB: 40 chunks
  if multihost.is_leader():
    channel.send("small", 1, "two")
    last = channel.send("big", big)
  else:
    received = [channel.recv(), channel.recv()]
    assert received[0] == ("small", (1, "two")), received[0]
    np.testing.assert_array_equal(received[1][1][0], big)
    report("ops=" + ",".join(f"{name}:{len(args)}" for name, args in received))
  # The gather is a collective: once it is done on the leader, the follower
  # has read both ops (as a run's leader forgets after an update).
  local = jax.sharding.SingleDeviceSharding(multihost.leader_devices()[0])
  # x in runs of 6 float32 rows (24 bytes): 6, 6 and 4 of the 16. w [4, 8],
  # its columns over the 4 devices, to the leader's 2 devices by rows: each
  # 32-byte row in runs of 6 and 2 of its elements.
  P = jax.sharding.PartitionSpec
  w_values = np.arange(32, dtype=np.float32).reshape(4, 8)
  w = jax.make_array_from_callback(
    (4, 8), jax.sharding.NamedSharding(array.sharding.mesh, P(None, "x")), lambda i: w_values[i]
  )
  by_rows = jax.sharding.NamedSharding(
    jax.sharding.Mesh(multihost.leader_devices(), ("y",)), P("y")
  )
  shardings = {"x": local, "w": by_rows}
  gathered = multihost.gather_to_leader({"x": array, "w": w}, shardings, chunk_bytes=24)
  if not multihost.is_leader():
    assert gathered is None
    assert gather.COUNTS.host_bytes == 0, gather.COUNTS  # nothing came here
    return
  assert gathered["x"].sharding == local and gathered["w"].sharding == by_rows
  np.testing.assert_array_equal(np.asarray(gathered["w"]), w_values)
  report("gathered=" + ",".join(str(int(v)) for v in np.asarray(gathered["x"])))
  report(f"received={gather.COUNTS.received_bytes}")
  channel.forget_through(last)
  from jax._src.distributed import global_state

  try:
    global_state.client.key_value_try_get("test/ops/1")
  except jax.errors.JaxRuntimeError:  # not found: deleted
    pass
  else:
    raise AssertionError("forget_through left op 1 in the store")


def bf16_digest(model) -> str:
  """sha256 over every published tensor's name and bf16 bytes, in order, as
  a broadcast sends them (from a model that spans processes: each gathered
  in runs of rows, put together on process 0)."""
  import hashlib

  from fluxjax.models import hf_load
  from fluxjax.rollout import publish

  digest = hashlib.sha256()
  names = [name for name, _ in hf_load.hf_layout(model.cfg)]
  for name, tensor in zip(names, publish.broadcast_tensors(model), strict=True):
    digest.update(name.encode() + tensor.tobytes())
  return digest.hexdigest()


def fleet_publish(flags: dict[str, str], root: str) -> None:
  import errno

  import jax
  from flax import nnx

  from fluxjax.models import config, hf_export, sharded
  from fluxjax.rollout import publish
  from fluxjax.sharding import gather
  from fluxjax.sharding import mesh as mesh_lib

  start_distributed(flags)
  # Runs of rows of at most 4 KiB: the embedding, the LM head and every
  # kernel past that go to disk a slice at a time, each gathered across both
  # processes.
  hf_export.ROW_RUN_BYTES = 4096
  mesh = mesh_lib.make_mesh(1, -1)
  model = sharded.create_sharded_model(config.preset("tiny"), mesh, seed=0, log_table=False)
  assert hf_export.spans_processes(model)
  leader = jax.process_index() == 0
  gather.COUNTS.reset()
  if leader:
    publish.write_checkpoint(model, root, 3)
  else:
    publish.take_part(model, "disk", root, 3)
  print_counts("written")
  writer = hf_export.ShardWriter

  class DiskFull(hf_export.ShardWriter):
    def write(self, name, tensor, start=0):
      raise OSError(errno.ENOSPC, "No space left on device", self.path)

  if not leader:
    hf_export.ShardWriter = DiskFull
  if leader:
    try:
      publish.write_checkpoint(model, root, 4)
    except OSError as e:
      report(f"refused={e}")
  else:
    publish.take_part(model, "disk", root, 4)
  hf_export.ShardWriter = writer
  # Deferred: v5, one element of every parameter changed, carries its delta
  # from v3; v6 fails on process 1's full disk, as v4 did.
  changed = nnx.merge(
    nnx.graphdef(model), jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1.0), nnx.state(model))
  )
  deferred_publish(changed, root, 5)
  if not leader:
    hf_export.ShardWriter = DiskFull
  deferred_publish(changed, root, 6)
  hf_export.ShardWriter = writer
  gather.COUNTS.reset()
  if leader:
    report(f"digest={bf16_digest(model)}")
  else:
    publish.take_part(model, "distributed", root, 7)
  print_counts("broadcast")


def print_counts(what: str) -> None:
  """Prints `<what><process>=<bytes gathered here>,<the largest gather>`."""
  import jax

  from fluxjax.sharding import gather

  c = gather.COUNTS
  report(f"{what}{jax.process_index()}={c.host_bytes},{c.largest}")


def deferred_publish(model, root: str, version: int) -> None:
  """A deferred disk publish: process 0's feed gathered to its end (as its
  main thread does before an update), the other's part taken at once."""
  import jax

  from fluxjax.rollout import publish

  if jax.process_index() == 0:
    feed, written = publish.deferred_write(model, root, version, deltas=True)
    feed.finish(lambda n: None)  # the other process runs every gather in order
    try:
      report(f"deferred={written.result(timeout=60)}")
    except OSError as e:
      report(f"refused={e}")
  else:
    part = publish.take_part(model, "disk", root, version, deltas=True, defer=True)
    part.take(part.remaining)


def preempted(worker: subprocess.Popen) -> None:
  def on_sigterm(signum, frame):
    time.sleep(0.5)  # the step in progress, which needs the worker
    up = worker.poll() is None
    print(f"launch_child: worker up through the step: {up}", file=sys.stderr, flush=True)
    worker.terminate()
    worker.wait()
    os._exit(128 + signal.SIGTERM)

  signal.signal(signal.SIGTERM, on_sigterm)
  print(f"launch_child: worker pid {worker.pid}", file=sys.stderr, flush=True)
  time.sleep(60)


def main() -> None:
  flags = dict(
    a[len(DISTRIBUTED_FLAG) :].split("=", 1) for a in sys.argv[1:] if a.startswith(DISTRIBUTED_FLAG)
  )
  actions = [a for a in sys.argv[1:] if not a.startswith("--")]
  action, _, code = actions[int(flags["process_id"])].partition(":")
  if action == "ok":
    return
  if action == "exit":
    sys.exit(int(code))
  if action == "sleep":
    time.sleep(60)
    return
  if action == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
  if action == "orphan":
    worker = subprocess.Popen(["sleep", "60"])
    print(f"launch_child: worker pid {worker.pid}", file=sys.stderr, flush=True)
    os._exit(int(code))  # no clean-up: the worker outlives this process
  if action == "preempt":
    preempted(subprocess.Popen(["sleep", "60"]))
  if action in ("jax", "publish"):
    try:
      if action == "jax":
        distributed_sum(flags)
      else:
        fleet_publish(flags, code)
    except BaseException:
      # jax.distributed's exit barrier would wait for the other process,
      # which may wait in a collective for this one: fail now.
      traceback.print_exc()
      sys.stderr.flush()
      os._exit(1)
    return
  sys.exit(f"launch_child: unknown action {action!r}")


if __name__ == "__main__":
  main()
