"""Weight publishing to a fleet: the disk path against the distributed broadcast.

  python bench/publish.py [--servers 2] [--sizes tiny,400m] [--processes 1,2]
      [--repeats 3] [--json PATH]

For each model size and trainer process count, S fluxjax servers (real
processes on loopback, one CPU device each) start from an HF folder of
random weights, and the trainer publishes another random model to them
`--repeats` times through each transport of rollout/publish.py. With one
process the model is whole on this process's device; with P processes
(`python -m fluxjax.launch --processes=P --cpu_devices=1`, this file's
`--worker` mode) it is sharded over their devices, process 0 publishes and
the others take part (`publish.take_part`): one bf16 gather per layer
tensor, and with the disk transport each process writes its own files.

  gather0      the path the weight-sync layer replaced (the baseline): every
               fp32 parameter gathered whole onto every process
               (process_allgather), process 0 alone casts and writes the
               bf16 folder, then the servers load it as `disk` does;
  disk         write a bf16 HF folder, then pause -> flush ->
               update_weights_from_disk -> continue (deltas off);
  disk_delta   the same with `rollout.weight_deltas`: the folder also holds
               its changes from the previous version, which the servers
               (at that version) read instead of the folder;
  distributed  pause -> flush -> update_weights_from_distributed while this
               process broadcasts the bf16 layer tensors over gloo -> continue
               (the group is made at the first publish, timed as `join`).

Before each publish every fp32 weight moves by +-lr (`--lr`, 1e-6 as in RL
post-training of 7B models: the share of bf16 elements that change follows
from it), so the deltas are what one optimizer step leaves.

Per transport: seconds the trainer is blocked (the publish through to its
servers' last phase), and deferred as a run publishes (`rollout.defer_updates`:
the call returns at once; the trainer's main thread gathers each tensor as
the writer thread or the wire takes it, between the step's ops, and is
blocked for the gathers' own time, `TensorFeed.gather_s`, the rest
overlapping its wait for rollouts; a one-process broadcast reads from its
own thread and blocks nothing until the next update), seconds the servers
are paused (pause through update), bytes
written to disk (the delta among them), bytes the trainer broadcast, bytes
each trainer process received from the others in its gathers (the
baseline's: each all-gathered result less this process's own shards of it;
the others': `gather.COUNTS`), how
many updates each server read as a delta, and the largest peak RSS growth of
every trainer process and server over one publish (VmHWM after clearing it,
against the RSS before that publish; the first publish's import of torch
counts for the distributed one).
The baseline runs first; ratios are each transport's over the baseline's.
In-process swapping (the embedded engine) moves no bytes and is not run here.

  python bench/publish.py --memory [--run-mb 1] [--json PATH]

instead measures what each of 2 trainer processes (2 CPU devices each) holds
over one publish of a 32M-parameter model whose largest tensors pass the
run: its peak RSS growth in the disk write (with deltas), the broadcast's
gathers and the embedded engine's stage (`multihost.gather_to_leader`),
in this tree and, in the same run, at `--baseline` (the commit before the
gathers went to their consumer alone, its `fluxjax/` unpacked by `git
archive`), against the bound: one fp32 layer beyond the process's shard.

Then the cost model (bench/publish_cost.py): what each transport costs a
Qwen2.5-VL-7B or 32B trainer on N hosts publishing to S servers, from
assumed bandwidths (flags).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json
import subprocess

import jax
import jax.numpy as jnp
from flax import nnx

import publish_cost
import runinfo
from fluxjax import settings as settings_lib
from fluxjax.models import config, hf_delta, hf_export, hf_load, sharded, vlm
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.rollout import launcher, publish
from fluxjax.sharding import mesh as mesh_lib

TRANSPORTS = ("gather0", "disk", "disk_delta", "distributed")


def model_config(size: str) -> config.ModelConfig:
  """tiny, or a ~400M-parameter text stack on the tiny vocabulary and vision tower."""
  tiny = config.preset("tiny")
  if size == "tiny":
    return tiny
  if size != "400m":
    raise ValueError(f"unknown size {size!r}: tiny or 400m")
  return _resized(
    tiny, hidden_size=1024, intermediate_size=4096, num_layers=24, num_heads=16, num_kv_heads=4
  )


def _resized(tiny, **text):
  """The tiny preset with a larger decoder (`text`: its fields), the vision
  merger's output resized to match."""
  text_cfg = dataclasses.replace(tiny.text, mrope_section=(8, 12, 12), **text)
  vision = dataclasses.replace(tiny.vision, out_hidden_size=text_cfg.hidden_size)
  return dataclasses.replace(tiny, text=text_cfg, vision=vision)


def random_model(cfg: config.ModelConfig, seed: int) -> vlm.Qwen25VL:
  """Random weights held as device arrays, as a trainer's are."""
  graphdef, state = nnx.split(vlm.abstract_model(cfg))
  rng = np.random.default_rng(seed)
  state = jax.tree.map(
    lambda x: jax.device_put((0.02 * rng.standard_normal(x.shape, np.float32)).astype(x.dtype)),
    state,
  )
  return nnx.merge(graphdef, state)


def _clear_peak(pid: int | str = "self") -> None:
  with open(f"/proc/{pid}/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS


def _peak_and_now(pid: int | str = "self") -> tuple[int, int]:
  fields = {}
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key in ("VmHWM", "VmRSS"):
        fields[key] = int(value.split()[0]) * 1024
  return fields["VmHWM"], fields["VmRSS"]


def _folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


@functools.partial(jax.jit, static_argnums=2)
def _adam_like_step(state, key, lr: float):
  """Every parameter moved by +-lr, as Adam's first steps move it."""
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(key, len(leaves))
  moved = [x + lr * jnp.sign(jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(leaves, keys)]
  return jax.tree.unflatten(treedef, moved)


def _warm_up_step(model, lr: float) -> None:
  """Compiles the step outside the measured publishes (every process)."""
  jax.block_until_ready(_adam_like_step(nnx.state(model), jax.random.key(0), lr))


def _versions(model, transport: str, repeats: int, lr: float):
  """(version, model) of each publish of a transport: an untimed first one,
  then `repeats` timed ones, each after one more step of size lr (the same
  sequence on every process)."""
  graphdef, state = nnx.split(model)
  first = 100 * (1 + TRANSPORTS.index(transport))
  for i in range(repeats + 1):
    # Finished before the publish starts, so neither its time nor its memory counts.
    state = jax.block_until_ready(_adam_like_step(state, jax.random.key(first + i), lr))
    yield first + i, nnx.merge(graphdef, state)


def _configure(fleet, transport: str) -> None:
  fleet.weight_sync = "distributed" if transport == "distributed" else "disk"
  fleet.weight_deltas = transport == "disk_delta"


def _gather_counts():
  """gather.COUNTS where this tree has it (not at BEFORE_OWNER_GATHERS)."""
  try:
    from fluxjax.sharding import gather
  except ImportError:
    return None
  return gather.COUNTS


class GatherCount:
  """Bytes this process received in cross-process all-gathers: each gathered
  array's bytes less its own shards' (the baseline's, and hf_load.to_host's
  at a commit before `gather.gather_to`); `total()` adds gather_to's."""

  received = 0

  @classmethod
  def reset(cls) -> None:
    cls.received = 0
    counts = _gather_counts()
    if counts is not None:
      counts.reset()

  @classmethod
  def total(cls) -> int:
    counts = _gather_counts()
    return cls.received + (counts.received_bytes if counts is not None else 0)

  @classmethod
  def gather(cls, x: jax.Array) -> np.ndarray:
    from jax.experimental import multihost_utils

    out = np.asarray(multihost_utils.process_allgather(x, tiled=True))
    own = sum(int(np.prod(s.data.shape)) for s in x.addressable_shards if s.replica_id == 0)
    cls.received += out.nbytes - own * out.dtype.itemsize
    return out


def _count_to_host(x):
  """hf_load.to_host, counting what its gathers bring this process."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return GatherCount.gather(x)
  return np.asarray(jax.device_get(x))


hf_load.to_host = _count_to_host


def gather0_write(model, root: str, version: int) -> str | None:
  """The baseline's part on this process: every parameter gathered whole in
  fp32 onto every process, then process 0 alone writes the bf16 folder."""
  graphdef, state = nnx.split(model)
  whole = jax.tree.map(
    lambda x: GatherCount.gather(x) if not x.is_fully_addressable else np.asarray(x), state
  )
  if jax.process_index() != 0:
    return None
  path = publish.version_path(root, version)
  return hf_export.save_hf_checkpoint(nnx.merge(graphdef, whole), path, dtype="bfloat16")


async def _publish_gather0(fleet, model, version: int) -> publish.PublishReport:
  t = time.perf_counter()
  loop = asyncio.get_running_loop()
  path = await loop.run_in_executor(None, gather0_write, model, fleet.weights_root, version)
  write_s = time.perf_counter() - t
  seconds, failed = await fleet.update_weights(path, str(version))
  return publish.PublishReport(str(version), path, {"write": write_s, **seconds}, failed)


async def _publishes(fleet, model, transport: str, args, pids: list[int]) -> dict:
  """The untimed first publish (it makes the distributed group and imports
  torch, and gives the deltas a base), then `repeats` timed ones; the peak
  RSS growth covers all of them (over the RSS before the first: what was
  allocated once and kept counts)."""
  _configure(fleet, transport)
  applied0 = [(await s.client.server_info()).get("weight_deltas_applied") for s in fleet.servers]
  growth = {p: 0 for p in ["self", *pids]}
  rows, join_s = [], 0.0
  for i, (version, stepped) in enumerate(_versions(model, transport, args.repeats, args.lr)):
    before = _reset_peaks(growth)
    GatherCount.reset()
    t = time.perf_counter()
    if transport == "gather0":
      report = await _publish_gather0(fleet, stepped, version)
    else:
      report = await fleet.publish(stepped, version)  # deferred where it can be
    returned = time.perf_counter() - t
    if report.feed is not None:  # the main thread's gathers, as the writer or the wire takes them
      await asyncio.get_running_loop().run_in_executor(None, report.feed.finish, _told_already)
      returned += report.feed.gather_s
    if report.pending is not None:
      report = await report.pending
    blocked = time.perf_counter() - t
    _record_peaks(growth, before)
    if report.failed:
      raise RuntimeError(f"{transport} publish failed: {report.failed}")
    if i == 0:  # untimed
      join_s = report.seconds.get("join", 0.0)
      continue
    s = report.seconds
    delta = os.path.join(report.path, hf_delta.DELTA_DIR) if report.path else ""
    rows.append(
      {
        "blocked_s": blocked,
        "deferred_blocked_s": returned,
        "paused_s": s["pause"] + s["flush"] + s["update"],
        "seconds": s,
        "written_bytes": _folder_bytes(report.path) if report.path else 0,
        "delta_bytes": _folder_bytes(delta) if os.path.isdir(delta) else 0,
        "sent_bytes": report.sent_bytes,
        "gathered_bytes": GatherCount.total(),
      }
    )
  growth = {str(p): g for p, g in growth.items()}
  applied = [
    (await s.client.server_info()).get("weight_deltas_applied") - before
    for s, before in zip(fleet.servers, applied0)
  ]
  return {
    "join_s": join_s,
    "rows": rows,
    "peak_rss_growth_bytes": growth,
    "deltas_applied": applied,
  }


def _told_already(n: int) -> None:
  """A feed's announcement: the other processes here run every gather of a
  publish in order (`_take_parts`), each meeting process 0's in turn."""


def _take_parts(model, transport: str, args, root: str) -> dict:
  """A follower's side of `_publishes`: its part in each publish, its peak RSS growth."""
  growth = {"self": 0}
  sync = "distributed" if transport == "distributed" else "disk"
  gathered = 0
  for version, stepped in _versions(model, transport, args.repeats, args.lr):
    before = _reset_peaks(growth)
    GatherCount.reset()
    if transport == "gather0":
      gather0_write(stepped, root, version)
    else:
      publish.take_part(stepped, sync, root, version, deltas=transport == "disk_delta")
    _record_peaks(growth, before)
    gathered = max(gathered, GatherCount.total())
  me = f"p{jax.process_index()}"
  return {"peak_rss_growth_bytes": {me: growth["self"]}, "gathered_bytes": {me: gathered}}


def _reset_peaks(growth: dict) -> dict:
  """Each process's RSS now, its peak reset to it (before a publish)."""
  before = {p: _peak_and_now(p)[1] for p in growth}
  for p in growth:
    _clear_peak(p)
  return before


def _record_peaks(growth: dict, before: dict) -> None:
  """The largest peak growth over one publish so far, per process."""
  for p in growth:
    growth[p] = max(growth[p], _peak_and_now(p)[0] - before[p])


def _start_folder(cfg: config.ModelConfig, size: str, workdir: str) -> str:
  start = os.path.join(workdir, f"{size}-start")
  if not os.path.exists(start):
    hf_export.save_hf_checkpoint(random_model(cfg, 0), start, dtype="bfloat16")
  return start


def _publish_all(model, size: str, args) -> dict:
  """This process publishes `model` through each transport to S launched servers."""
  workdir = args.workdir
  start = _start_folder(model.cfg, size, workdir)
  cmd = ["python", "-m", "fluxjax.rollout.server", "--model-path", start, "--num-slots", "2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  launched = launcher.launch_servers(cmd, args.servers, env=env, timeout_s=900)
  try:

    async def go():
      root = os.path.join(workdir, f"{size}-weights")
      async with fleet_lib.Fleet(launched.urls, weights_root=root, defer_updates=True) as fleet:
        pids = [p.pid for p in launched.procs]
        return {t: await _publishes(fleet, model, t, args, pids) for t in TRANSPORTS}

    return asyncio.run(go())
  finally:
    launched.stop()


def measure(size: str, args) -> dict:
  cfg = model_config(size)
  _start_folder(cfg, size, args.workdir)
  model = random_model(cfg, 1)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  _warm_up_step(model, args.lr)
  result = _publish_all(model, size, args)
  return {"size": size, "processes": 1, "parameters": n_params, "servers": args.servers, **result}


def measure_processes(size: str, processes: int, args) -> dict:
  """The same publishes from a model sharded over `processes` processes (`worker`)."""
  workdir = args.workdir
  _start_folder(model_config(size), size, workdir)  # written once, by this process
  command = [sys.executable, "-m", "fluxjax.launch", f"--processes={processes}"]
  command += ["--cpu_devices=1", "--module=publish", "--", "--worker", "--sizes", size]
  command += ["--servers", str(args.servers), "--repeats", str(args.repeats)]
  command += ["--lr", str(args.lr), "--workdir", workdir]
  bench = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([bench, os.environ.get("PYTHONPATH", "")]))
  done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
  if done.returncode != 0:
    raise RuntimeError(f"{processes}-process publish bench failed:\n{done.stderr[-4000:]}")
  parts = [json.load(open(os.path.join(workdir, f"{size}-p{k}.json"))) for k in range(processes)]
  result = parts[0]
  for t in TRANSPORTS:
    result[t]["gathered_bytes"] = {"p0": max(r["gathered_bytes"] for r in result[t]["rows"])}
    for part in parts[1:]:
      result[t]["peak_rss_growth_bytes"].update(part[t]["peak_rss_growth_bytes"])
      result[t]["gathered_bytes"].update(part[t]["gathered_bytes"])
  return result


def _init_distributed() -> None:
  """jax.distributed from the launcher's --config.distributed.* flags."""
  flags = dict(
    a[len("--config.distributed.") :].split("=", 1)
    for a in sys.argv
    if a.startswith("--config.distributed.")
  )
  mesh_lib.maybe_initialize_distributed(
    settings_lib.Distributed(
      auto=False,
      coordinator_address=flags["coordinator_address"],
      num_processes=int(flags["num_processes"]),
      process_id=int(flags["process_id"]),
      local_device_ids="",
    )
  )


def worker(args) -> None:
  """One process of `measure_processes`: the model sharded over every process's device."""
  _init_distributed()
  size, me = args.sizes, jax.process_index()
  cfg = model_config(size)
  mesh = mesh_lib.make_mesh(1, -1)
  model = sharded.create_sharded_model(cfg, mesh, seed=1, max_replicated_bytes=1 << 30)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  _warm_up_step(model, args.lr)
  if me == 0:
    result = _publish_all(model, size, args)
    for t in TRANSPORTS:
      growth = result[t]["peak_rss_growth_bytes"]
      growth["p0"] = growth.pop("self")
    result = {"size": size, "processes": jax.process_count(), "parameters": n_params, **result}
    result["servers"] = args.servers
  else:
    root = os.path.join(args.workdir, f"{size}-weights")
    result = {t: _take_parts(model, t, args, root) for t in TRANSPORTS}
  with open(os.path.join(args.workdir, f"{size}-p{me}.json"), "w") as f:
    json.dump(result, f)


# --- gathers to the owner: peak RSS per process on 2 processes ----------------------

# The last commit whose publishes all-gathered every tensor onto every process
# and whose delta builder held a folder file's entries until the file was
# written: the baseline `--memory` runs in the same script (`git archive`).
BEFORE_OWNER_GATHERS = "9c17cf9dc19196c24881562f54b33eda1725e649"
MEMORY_PHASES = ("disk", "broadcast", "stage")


def memory_config() -> config.ModelConfig:
  """A 4-layer text stack of width 512 on a 16384-token vocabulary (32M
  parameters): its embedding and LM head, 16 MiB each in bf16, are past the
  run; its fp32 decoder layer (15.2 MB) is to a 1 MiB run (the default)
  about what a 7B layer (932 MB) is to hf_export.ROW_RUN_BYTES (64 MiB)."""
  tiny = config.preset("tiny")
  return _resized(
    tiny,
    vocab_size=16384,
    hidden_size=512,
    intermediate_size=2048,
    num_layers=4,
    num_heads=8,
    num_kv_heads=2,
  )


@functools.partial(jax.jit, static_argnums=2)
def _nudge(state, key, share: float):
  """About `share` of every parameter's elements moved by 1e-2 (the rest kept)."""
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(key, len(leaves))
  moved = [
    x + jnp.where(jax.random.uniform(k, x.shape) < share, 1e-2, 0.0).astype(x.dtype)
    for x, k in zip(leaves, keys)
  ]
  return jax.tree.unflatten(treedef, moved)


def _memory_phase(phase: str, model, root: str, version: int, run_bytes: int) -> None:
  """This process's part in one publish: `disk` (its files and their deltas
  from version 1), `broadcast` (process 0 takes every tensor whole) or
  `stage` (the embedded engine's fp32 copy on process 0's devices, dropped)."""
  from fluxjax.parallel import multihost

  leader = jax.process_index() == 0
  if phase == "disk" and leader:
    publish.write_checkpoint(model, root, version, deltas=version > 1)
  elif phase == "disk":
    publish.take_part(model, "disk", root, version, deltas=version > 1)
  elif phase == "broadcast" and leader:
    for _ in publish.broadcast_tensors(model):
      pass
  elif phase == "broadcast":
    publish.take_part(model, "distributed", root, version)
  else:
    params = nnx.state(model, nnx.Param)
    local = mesh_lib.make_mesh(1, -1, devices=multihost.leader_devices())
    where = sharded.model_shardings(model.cfg, local, max_replicated_bytes=1 << 30, log_table=False)
    shardings = nnx.from_flat_state([(p, where[p]) for p, _ in nnx.to_flat_state(params)])
    jax.block_until_ready(multihost.gather_to_leader(params, shardings, chunk_bytes=run_bytes))


class GatherPrograms:
  """Send programs (`gather._send`) this process ran, where the tree has them."""

  ran = 0

  @classmethod
  def install(cls) -> None:
    try:
      from fluxjax.sharding import gather
    except ImportError:
      return
    send = gather._send

    def counted(*args, **kwargs):
      out = send(*args, **kwargs)
      cls.ran += out is not None
      return out

    gather._send = counted


def _measured(fn) -> dict:
  """Runs `fn` on every process at once; this process's peak RSS growth over
  it, the bytes its gathers received from other processes, the gathers'
  send programs it ran, and its wall time."""
  from jax.experimental import multihost_utils

  multihost_utils.sync_global_devices("before")
  before = _reset_peaks({"self": 0})["self"]
  GatherCount.reset()
  GatherPrograms.ran = 0
  t0 = time.perf_counter()
  fn()
  seconds = time.perf_counter() - t0
  peak = _peak_and_now()[0]
  multihost_utils.sync_global_devices("after")
  return {
    "peak_growth_bytes": peak - before,
    "received_bytes": GatherCount.total(),
    "send_programs": GatherPrograms.ran,
    "seconds": seconds,
  }


def memory_worker(args) -> None:
  """One process of `measure_memory`: each phase once untimed (compiling,
  and version 1 for the deltas' base), then measured on a nudged model."""
  _init_distributed()
  run_bytes = int(args.run_mb * 2**20)
  hf_export.ROW_RUN_BYTES = run_bytes
  mesh = mesh_lib.make_mesh(1, -1)
  model = sharded.create_sharded_model(
    memory_config(), mesh, seed=1, max_replicated_bytes=1 << 30, log_table=False
  )
  root = os.path.join(args.workdir, f"memory-{args.label}")
  GatherPrograms.install()
  first = {}  # each phase's first run: its programs compiled
  for phase in MEMORY_PHASES:
    t0 = time.perf_counter()
    _memory_phase(phase, model, root, 1, run_bytes)
    first[phase] = time.perf_counter() - t0
  graphdef, state = nnx.split(model)
  state = jax.block_until_ready(_nudge(state, jax.random.key(2), args.memory_share))
  nudged = nnx.merge(graphdef, state)
  phases = {
    p: _measured(functools.partial(_memory_phase, p, nudged, root, 2, run_bytes))
    for p in MEMORY_PHASES
  }
  for phase, seconds in first.items():
    phases[phase]["first_seconds"] = seconds
  if _gather_counts() is None:  # the baseline's stage gathers outside hf_load.to_host
    phases["stage"]["received_bytes"] = None
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  own = sum(s.data.nbytes for x in params for s in x.addressable_shards)
  result = {"phases": phases, "own_shard_bytes": own, "fp32_bytes": sum(x.nbytes for x in params)}
  with open(
    os.path.join(args.workdir, f"memory-{args.label}-p{jax.process_index()}.json"), "w"
  ) as f:
    json.dump(result, f)


def _baseline_tree(rev: str, workdir: str) -> str:
  """`fluxjax/` at commit `rev`, unpacked under `workdir` (what PYTHONPATH puts first)."""
  import io
  import tarfile

  tree = os.path.join(workdir, "baseline")
  data = subprocess.run(
    ["git", "-C", runinfo.ROOT, "archive", rev, "fluxjax"], capture_output=True, check=True
  ).stdout
  with tarfile.open(fileobj=io.BytesIO(data)) as archive:
    archive.extractall(tree, filter="data")
  return tree


def _memory_run(label: str, tree: str, args) -> list[dict]:
  """`memory_worker` on 2 processes x 2 CPU devices with `tree`'s fluxjax;
  each process's result."""
  command = [sys.executable, "-m", "fluxjax.launch", "--processes=2", "--cpu_devices=2"]
  command += ["--module=publish", "--", "--memory-worker", "--label", label]
  command += ["--run-mb", str(args.run_mb), "--memory-share", str(args.memory_share)]
  command += ["--workdir", args.workdir]
  bench = os.path.dirname(os.path.abspath(__file__))
  # Large blocks are mapped and unmapped, not kept in the heap once freed:
  # each phase's peak growth is then its own, not what an earlier one left.
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree, bench]), MALLOC_MMAP_THRESHOLD_="131072")
  # Run from the work directory: `python -m` puts the current one first on the path.
  done = subprocess.run(
    command, env=env, cwd=args.workdir, capture_output=True, text=True, timeout=3600
  )
  if done.returncode != 0:
    raise RuntimeError(f"memory bench ({label}) failed:\n{done.stderr[-4000:]}")
  return [json.load(open(os.path.join(args.workdir, f"memory-{label}-p{k}.json"))) for k in (0, 1)]


def measure_memory(args) -> dict:
  """Peak RSS growth per process over one publish of each phase, at
  `args.baseline` and in this tree, with the bounds they are held to."""
  runs = {
    "before": _memory_run("before", _baseline_tree(args.baseline, args.workdir), args),
    "owner": _memory_run("owner", runinfo.ROOT, args),
  }
  cfg = memory_config()
  layers = [n for n, _ in hf_load.hf_layout(cfg) if n.startswith("model.layers.0.")]
  shapes = dict(hf_load.hf_layout(cfg))
  return {
    "config": dataclasses.asdict(cfg),
    "run_bytes": int(args.run_mb * 2**20),
    "largest_tensor_bf16_bytes": 2 * max(int(np.prod(s)) for s in shapes.values()),
    "fp32_layer_bytes": 4 * sum(int(np.prod(shapes[n])) for n in layers),
    "baseline": args.baseline,
    "runs": runs,
  }


def _megabytes(n: int | None) -> str:
  return "-" if n is None else f"{n / 1e6:.1f}"


def _print_memory(m: dict) -> None:
  run, layer = m["run_bytes"], m["fp32_layer_bytes"]
  before, owner = m["runs"]["before"], m["runs"]["owner"]
  copy = owner[0]["fp32_bytes"]
  print(
    f"\nGathers to the owner, 2 processes x 2 CPU devices: {copy / 4e6:.1f}M parameters, "
    f"own shard {owner[0]['own_shard_bytes'] / 1e6:.1f} MB per process, run "
    f"{run / 2**20:g} MiB, largest tensor {m['largest_tensor_bf16_bytes'] / 2**20:.0f} MiB in "
    f"bf16, one fp32 layer {layer / 1e6:.1f} MB; baseline {m['baseline'][:7]}"
  )
  print("| phase | process | peak +MB before | now | now / before | received MB before | now |")
  print("|---|---|---|---|---|---|---|")
  for phase in MEMORY_PHASES:
    for k in (0, 1):
      b, o = before[k]["phases"][phase], owner[k]["phases"][phase]
      grew = [b["peak_growth_bytes"], o["peak_growth_bytes"]]
      got = [_megabytes(r["received_bytes"]) for r in (b, o)]
      print(
        f"| {phase} | {k} | {grew[0] / 1e6:.1f} | {grew[1] / 1e6:.1f} "
        f"| {grew[1] / max(grew[0], 1):.2f} | {got[0]} | {got[1]} |"
      )
  print(
    "| phase | process | send programs before | now | seconds before | now "
    "| first run's seconds before | now |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for phase in MEMORY_PHASES:
    for k in (0, 1):
      b, o = before[k]["phases"][phase], owner[k]["phases"][phase]
      print(
        f"| {phase} | {k} | {b['send_programs']} | {o['send_programs']} "
        f"| {b['seconds']:.2f} | {o['seconds']:.2f} "
        f"| {b['first_seconds']:.2f} | {o['first_seconds']:.2f} |"
      )
  print(
    f"  bound: beyond its own shard a process holds one fp32 layer ({layer / 1e6:.1f} MB); "
    f"process 0's stage also holds the engine's copy it makes ({copy / 1e6:.1f} MB)"
  )


def _print_result(r: dict) -> None:
  print(
    f"\n{r['size']}: {r['parameters'] / 1e6:.1f}M parameters, {r['processes']} trainer "
    f"process(es), {r['servers']} servers"
  )
  print(
    "| transport | blocked s | deferred blocked s | paused s | written MB | delta MB | sent MB "
    "| gathered MB per process | trainer peak +MB per process | server peak +MB "
    "| deltas applied |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  med = {}
  for t in TRANSPORTS:
    rows = r[t]["rows"]
    keys = ("blocked_s", "deferred_blocked_s", "paused_s")
    med[t] = {k: float(np.median([x[k] for x in rows])) for k in keys}
    growth = dict(r[t]["peak_rss_growth_bytes"])
    trainers = {k: growth.pop(k) for k in list(growth) if k == "self" or k.startswith("p")}
    mine = " / ".join(f"{v / 1e6:.0f}" for _, v in sorted(trainers.items()))
    theirs = max(growth.values()) / 1e6
    written, sent = rows[0]["written_bytes"] / 1e6, rows[0]["sent_bytes"] / 1e6
    delta = rows[0]["delta_bytes"] / 1e6
    gathered = r[t].get("gathered_bytes", {"p0": max(x["gathered_bytes"] for x in rows)})
    gathered = " / ".join(f"{v / 1e6:.1f}" for _, v in sorted(gathered.items()))
    print(
      f"| {t} | {med[t]['blocked_s']:.3f} | {med[t]['deferred_blocked_s']:.3f} | "
      f"{med[t]['paused_s']:.3f} | {written:.1f} | {delta:.2f} | {sent:.1f} | {gathered} | "
      f"{mine} | {theirs:.0f} | {r[t]['deltas_applied']} |"
    )
  for k in ("blocked_s", "deferred_blocked_s", "paused_s"):
    print(
      f"  {k}: vs gather0: disk {med['disk'][k] / med['gather0'][k]:.2f}, disk_delta "
      f"{med['disk_delta'][k] / med['gather0'][k]:.2f}, distributed "
      f"{med['distributed'][k] / med['gather0'][k]:.2f}"
    )
  print(f"  group join at the first distributed publish: {r['distributed']['join_s']:.3f} s")


def memory_main(args) -> None:
  """`--memory`: the baseline's run and this tree's, printed, and --json."""
  t0 = time.time()
  with tempfile.TemporaryDirectory(prefix="bench-publish-memory-") as workdir:
    args.workdir = workdir
    m = measure_memory(args)
  _print_memory(m)
  print(f"bench wall time {time.time() - t0:.0f} s")
  if args.json:
    runinfo.write(args.json, "publish.py", {"args": vars(args), "memory": m})


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--servers", type=int, default=2)
  p.add_argument("--sizes", default="tiny,400m")
  p.add_argument("--processes", default="1,2", help="trainer process counts")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument(
    "--lr", type=float, default=1e-6, help="each publish follows a +-lr step of every weight"
  )
  p.add_argument("--net-gbps", type=float, default=25.0, help="GB/s per host link (NCCL)")
  p.add_argument("--disk-write-gbps", type=float, default=2.0, help="GB/s one writer gets")
  p.add_argument("--disk-read-gbps", type=float, default=2.0, help="GB/s one reader gets")
  p.add_argument("--fs-read-gbps", type=float, default=20.0, help="GB/s the shared FS serves")
  p.add_argument(
    "--changed-share", type=float, default=0.01, help="bf16 elements one step changes (model)"
  )
  p.add_argument("--json", default=None)
  p.add_argument(
    "--memory",
    action="store_true",
    help="only the peak RSS per process of 2 processes' publishes, against --baseline",
  )
  p.add_argument("--run-mb", type=float, default=1, help="--memory: the run (ROW_RUN_BYTES), MiB")
  p.add_argument(
    "--memory-share", type=float, default=0.2, help="--memory: elements each version changes"
  )
  p.add_argument("--baseline", default=BEFORE_OWNER_GATHERS, help="--memory: the commit to compare")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--memory-worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--label", default="", help=argparse.SUPPRESS)
  p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
  args, _ = p.parse_known_args()  # a worker is also given the launcher's flags
  if args.worker:
    worker(args)
    return
  if args.memory_worker:
    memory_worker(args)
    return
  if args.memory:
    memory_main(args)
    return
  t0 = time.time()
  results = []
  with tempfile.TemporaryDirectory(prefix="bench-publish-") as workdir:
    args.workdir = workdir
    for size in args.sizes.split(","):
      for processes in map(int, args.processes.split(",")):
        one = processes == 1
        r = measure(size, args) if one else measure_processes(size, processes, args)
        results.append(r)
        _print_result(r)
  proj = publish_cost.projection(args)
  publish_cost.print_projection(proj)
  print(f"bench wall time {time.time() - t0:.0f} s")
  if args.json:
    runinfo.write(
      args.json, "publish.py", {"args": vars(args), "results": results, "projection": proj}
    )


if __name__ == "__main__":
  main()
