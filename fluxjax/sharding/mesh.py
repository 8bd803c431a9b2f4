"""The device mesh: built from config, entered with `jax.set_mesh`.

Axes, outermost first: `data` (replicas; HSDP), `fsdp`, then the strategy's sequence
axes; parameters are sharded over all but `data` (ZeRO-3; docs/config.md, "Sharding").
`data` and `fsdp` always exist (size 1 allowed); the sequence axes are the strategy's,
so only code that knows it names them: specs go through `param_axes` / `batch_axes`.
Plans' device d is `mesh.devices.flat[d]`: batch arrays shard their leading axis over
all axes in order.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from fluxjax import settings as settings_lib

log = logging.getLogger(__name__)

DATA = "data"
FSDP = "fsdp"
SP = "sp"


# FLUXJAX_DISTRIBUTED=1 declares a multi-process job that no other variable
# gives away, e.g. a Kubernetes job (JAX finds the address and ids itself).
DISTRIBUTED_ENV = "FLUXJAX_DISTRIBUTED"


def _env_int(environ: Mapping[str, str], name: str) -> int:
  try:
    return int(environ.get(name, ""))
  except ValueError:
    return 0


def cluster_job(environ: Mapping[str, str]) -> str | None:
  """The launcher of a multi-process job this process is one of, or None.

  Only jobs with more than one process count: a single Slurm task or a bare
  Kubernetes pod is a single-process run, and initializing jax.distributed
  there would wait for peers that never come. Kubernetes is never detected on
  its own (every pod has KUBERNETES_SERVICE_HOST); such jobs set
  FLUXJAX_DISTRIBUTED=1.

  Args:
    environ: the process environment (os.environ, or a dict in tests).

  Returns:
    "slurm" (an srun step of several tasks), "openmpi", "tpu" (a multi-host
    TPU pod), DISTRIBUTED_ENV, or None.
  """
  if _env_int(environ, "SLURM_NTASKS") > 1 and environ.get("SLURM_STEP_NODELIST"):
    return "slurm"
  if _env_int(environ, "OMPI_COMM_WORLD_SIZE") > 1:
    return "openmpi"
  if "," in environ.get("TPU_WORKER_HOSTNAMES", ""):
    return "tpu"
  if environ.get(DISTRIBUTED_ENV) == "1":
    return DISTRIBUTED_ENV
  return None


def distributed_arguments(
  distributed: settings_lib.Distributed | None, environ: Mapping[str, str]
) -> dict[str, Any] | None:
  """The jax.distributed.initialize arguments for this run, or None for a
  single-process run.

  A run is multi-process when `distributed.coordinator_address` or the
  JAX_COORDINATOR_ADDRESS variable is set, or when `distributed.auto` is on and
  `cluster_job` detects a job. Unset fields (-1, "") become None, which JAX
  fills in from the launcher's environment (Slurm, Open MPI, TPU, Kubernetes;
  JAX_COORDINATOR_ADDRESS and JAX_LOCAL_DEVICE_IDS).

  Args:
    distributed: the config's `distributed` section (see configs/vlm.py), or None.
    environ: the process environment.
  """
  if distributed is None:
    return None
  address = distributed.coordinator_address or None
  if not (
    address or environ.get("JAX_COORDINATOR_ADDRESS") or (distributed.auto and cluster_job(environ))
  ):
    return None
  num_processes, process_id = distributed.num_processes, distributed.process_id
  device_ids = distributed.local_device_ids
  return {
    "coordinator_address": address,
    "num_processes": None if num_processes == -1 else num_processes,
    "process_id": None if process_id == -1 else process_id,
    "local_device_ids": [int(i) for i in device_ids.split(",")] if device_ids else None,
  }


def maybe_initialize_distributed(
  distributed: settings_lib.Distributed | None, environ: Mapping[str, str] | None = None
) -> None:
  """Starts jax.distributed when this process is one of a multi-process run
  (see `distributed_arguments`); a single-process run is left alone.

  Must run before any JAX computation. A second call, or one after the caller
  initialized jax.distributed itself, does nothing.

  Args:
    distributed: the config's `distributed` section, or None.
    environ: the process environment; os.environ when None.
  """
  if jax.distributed.is_initialized():
    return
  arguments = distributed_arguments(distributed, os.environ if environ is None else environ)
  if arguments is None:
    return
  jax.distributed.initialize(**arguments)
  log.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def sp_room(num_devices: int, data: int, fsdp: int) -> int:
  """Devices left for the sequence-parallel axes by the explicit mesh.data and
  mesh.fsdp sizes (a -1 axis takes what sp leaves, so it counts as 1 here).

  Raises ValueError naming the mesh flag to change when they do not divide.
  """
  if data == AUTO:
    raise ValueError("mesh.data=0 (auto) is resolved by loop.validate (mesh.data_axis) first")
  for name, size in (("data", data), ("fsdp", fsdp)):
    if size != -1 and size < 1:
      raise ValueError(
        f"mesh.{name}={size}: a size must be positive or -1 (all remaining "
        f"devices); set --config.mesh.{name}"
      )
  if data == -1 and fsdp == -1:
    raise ValueError(
      "at most one of mesh.data / mesh.fsdp may be -1; set --config.mesh.data "
      f"to one of {_divisors(num_devices)}"
    )
  if data != -1 and num_devices % data:
    raise ValueError(
      f"mesh.data={data} does not divide the {num_devices} devices; set "
      f"--config.mesh.data to one of {_divisors(num_devices)}"
    )
  replica = num_devices // data if data != -1 else num_devices
  if fsdp != -1 and replica % fsdp:
    raise ValueError(
      f"mesh.fsdp={fsdp} does not divide the {replica} devices left after "
      f"mesh.data={data}; set --config.mesh.fsdp to -1 (all remaining devices) "
      f"or one of {_divisors(replica)}"
    )
  return replica // (fsdp if fsdp != -1 else 1)


def mesh_shape(
  num_devices: int, data: int, fsdp: int, sp_axes: Sequence[tuple[str, int]]
) -> dict[str, int]:
  """Resolves the one -1 among data/fsdp and checks the product.

  Errors name the flag to change: mesh.data, mesh.fsdp, or sharding.sp (the
  product of `sp_axes`, the strategy's largest sequence-parallel degree).
  """
  sp = math.prod(size for _, size in sp_axes)
  room = sp_room(num_devices, data, fsdp)
  if room % sp:
    raise ValueError(
      f"the {room} devices left after mesh.data={data}, mesh.fsdp={fsdp} do "
      f"not divide by the sequence-parallel degree {sp}; set "
      "--config.sharding.sp to 0 (auto) or a power of two dividing "
      f"{room}, or change --config.mesh.data / --config.mesh.fsdp"
    )
  sizes = {DATA: data, FSDP: fsdp}
  for name, size in sizes.items():
    if size == -1:
      sizes[name] = room // sp
  total = sizes[DATA] * sizes[FSDP] * sp
  if total != num_devices:  # both sizes explicit: fsdp is what sp and data leave
    raise ValueError(
      f"mesh data={sizes[DATA]} x fsdp={sizes[FSDP]} x sp={sp} = {total} "
      f"!= {num_devices} devices; set --config.mesh.fsdp="
      f"{num_devices // (data * sp)} or -1 (all remaining devices)"
    )
  return {DATA: sizes[DATA], FSDP: sizes[FSDP], **dict(sp_axes)}


def make_mesh(
  data: int = 1,
  fsdp: int = -1,
  sp_axes: Sequence[tuple[str, int]] = ((SP, 1),),
  devices: Sequence[jax.Device] | None = None,
) -> jax.sharding.Mesh:
  """A mesh with Auto axes; place inputs with NamedSharding.

  Auto: explicit NamedShardings place arrays and the partitioner inserts FSDP's
  per-layer all-gathers and gradient reduce-scatters (Explicit axes would make every
  weight use a hand-written reshard); where communication needs exact control (Ulysses
  all-to-alls, minibatch-level sync) we use shard_map.

  With `data` equal to the number of processes the devices span (a hybrid
  mesh), each data replica is one process's devices, so only the gradient
  all-reduce crosses hosts.
  """
  devices = list(devices) if devices is not None else jax.devices()
  shape = mesh_shape(len(devices), data, fsdp, sp_axes)
  names = tuple(shape)
  types = (jax.sharding.AxisType.Auto,) * len(names)
  if data > 1 and data == len({d.process_index for d in devices}):
    from jax.experimental import mesh_utils

    within = (1, *list(shape.values())[1:])
    across = (data,) + (1,) * (len(shape) - 1)
    grid = mesh_utils.create_hybrid_device_mesh(within, across, devices, process_is_granule=True)
    return jax.sharding.Mesh(grid, names, axis_types=types)
  return jax.make_mesh(tuple(shape.values()), names, axis_types=types, devices=devices)


# mesh.data = AUTO: `data_axis` chooses 1 (FSDP over every device) or the
# number of hosts (a hybrid mesh: FSDP within each host, replicas across).
AUTO = 0
# What one parameter costs in train state: fp32 weight, gradient and the two
# Adam moments.
STATE_BYTES_PER_PARAM = 16


def inter_host_bytes(param_count: int, hosts: int, *, hybrid: bool, remat: bool) -> float:
  """Bytes each host moves over its network links per update (ring
  collectives). FSDP over every device gathers the fp32 parameters for the
  forward and again for the backward (a third time with remat) and
  reduce-scatters the gradients across hosts; a hybrid mesh only
  all-reduces the gradients across hosts (2 (H-1)/H of them)."""
  collectives = 2 if hybrid else 3 + int(remat)
  return collectives * 4 * param_count * (hosts - 1) / hosts


def _memory_limit(devices: Sequence[Any]) -> int | None:
  """One of this process's devices' memory limit (only those report one;
  every process of a run has the same kind), or None."""
  mine = [d for d in devices if d.process_index == jax.process_index()] or list(devices)
  try:
    stats = mine[0].memory_stats()
  except jax.errors.JaxRuntimeError:  # a backend without memory statistics
    return None
  return (stats or {}).get("bytes_limit")


def data_axis(
  data: int,
  param_count: int,
  *,
  remat: bool,
  devices: Sequence[Any] | None = None,
  headroom: float = 0.5,
) -> int:
  """mesh.data resolved: AUTO is the number of hosts when a hybrid mesh is
  cheaper, else 1; any other value is kept.

  A hybrid mesh always moves fewer bytes between hosts
  (`inter_host_bytes`), but holds the train state once per host: it is
  chosen when that state, split over one host's devices, takes at most
  `headroom` of a device's memory (the rest is activations). Devices that
  report no memory limit (CPUs) keep FSDP over every device.
  """
  if data != AUTO:
    return data
  devices = list(devices) if devices is not None else jax.devices()
  hosts = len({d.process_index for d in devices})
  if hosts == 1:
    return 1
  limit = _memory_limit(devices)
  per_device = STATE_BYTES_PER_PARAM * param_count / (len(devices) // hosts)
  fits = limit is not None and per_device <= headroom * limit
  fsdp_gb, hybrid_gb = (
    inter_host_bytes(param_count, hosts, hybrid=h, remat=remat) / 1e9 for h in (False, True)
  )
  log.info(
    "mesh.data auto: %s (between hosts per update: FSDP %.1f GB, hybrid %.1f GB; hybrid "
    "train state %.1f GB per device, device limit %s)",
    f"{hosts} (hybrid)" if fits else "1 (FSDP over every device)",
    fsdp_gb,
    hybrid_gb,
    per_device / 1e9,
    f"{limit / 1e9:.1f} GB" if limit else "unknown",
  )
  return hosts if fits else 1


def batch_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """All axes, outermost first: the leading axis of every batch array."""
  return tuple(mesh.axis_names)


def param_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """The axes parameters are sharded over: everything but `data`."""
  return tuple(a for a in mesh.axis_names if a != DATA)


def local_device_indices(mesh: jax.sharding.Mesh) -> set[int]:
  """Plan device indices (rows of the batch's device axis) on this process.

  The batch's device axis is sharded over every mesh axis in order, so plan
  device d is `mesh.devices.flat[d]`.
  """
  me = jax.process_index()
  return {d for d, dev in enumerate(mesh.devices.flat) if dev.process_index == me}
