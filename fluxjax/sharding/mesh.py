"""The device mesh: built from config, entered with `jax.set_mesh`.

Axes, outermost first:
  data   replicas of the model (parameters replicated across them; HSDP);
  fsdp   parameters, gradients and optimizer state sharded across it;
  sp...  the sequence-parallel factorization the strategy needs: one `sp` axis
         for fixed-degree Ulysses, binary `sp_0, sp_1, ...` for FlexUlysses.
         Parameters are sharded across these too: every device of a replica
         holds a 1/N slice (ZeRO-3 over fsdp x sp).
Every axis always exists (size 1 allowed), so specs never depend on the strategy.

Axis types are Auto: parameters, optimizer state and batches are placed with
explicit NamedShardings (jit in/out shardings), and the partitioner inserts
FSDP's per-layer all-gathers and gradient reduce-scatters. Explicit axes would
make every weight use a hand-written reshard; where we need exact control of
communication (Ulysses all-to-alls, minibatch-level sync) we use shard_map.
The flattened device index used by plans is the row-major position in
`mesh.devices`; batch arrays shard their leading axis over all axes in order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import ml_collections
from absl import logging

DATA = "data"
FSDP = "fsdp"
SP = "sp"


def maybe_initialize_distributed(cfg: ml_collections.ConfigDict | None) -> None:
  """Multi-controller start-up when a coordinator address is configured."""
  if cfg is None or not cfg.get("coordinator_address"):
    return
  jax.distributed.initialize(coordinator_address=cfg.coordinator_address,
                             num_processes=cfg.num_processes, process_id=cfg.process_id)
  logging.info("jax.distributed: process %d of %d", jax.process_index(), jax.process_count())


def mesh_shape(num_devices: int, data: int, fsdp: int,
               sp_axes: Sequence[tuple[str, int]]) -> dict[str, int]:
  """Resolves the one -1 among data/fsdp and checks the product."""
  sp = math.prod(size for _, size in sp_axes)
  sizes = {DATA: data, FSDP: fsdp}
  unknown = [k for k, v in sizes.items() if v == -1]
  if len(unknown) > 1:
    raise ValueError("at most one of mesh.data / mesh.fsdp may be -1")
  if unknown:
    known = math.prod(v for v in sizes.values() if v != -1) * sp
    if num_devices % known:
      raise ValueError(f"{num_devices} devices do not divide into data x fsdp x sp with "
                       f"known factors {known}")
    sizes[unknown[0]] = num_devices // known
  total = sizes[DATA] * sizes[FSDP] * sp
  if total != num_devices:
    raise ValueError(f"mesh data={sizes[DATA]} x fsdp={sizes[FSDP]} x sp={sp} = {total} "
                     f"!= {num_devices} devices")
  return {DATA: sizes[DATA], FSDP: sizes[FSDP], **dict(sp_axes)}


def make_mesh(data: int = 1, fsdp: int = -1, sp_axes: Sequence[tuple[str, int]] = ((SP, 1),),
              devices: Sequence[jax.Device] | None = None) -> jax.sharding.Mesh:
  """A mesh with Auto axes (see module docstring); place inputs with NamedSharding."""
  devices = list(devices) if devices is not None else jax.devices()
  shape = mesh_shape(len(devices), data, fsdp, sp_axes)
  names = tuple(shape)
  return jax.make_mesh(tuple(shape.values()), names,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(names),
                       devices=devices)


def batch_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """All axes, outermost first: the leading axis of every batch array."""
  return tuple(mesh.axis_names)


def param_axes(mesh: jax.sharding.Mesh) -> tuple[str, ...]:
  """The axes parameters are sharded over: everything but `data`."""
  return tuple(a for a in mesh.axis_names if a != DATA)

