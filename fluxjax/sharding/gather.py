"""Cross-process gathers to the one process that consumes them (`gather_to`).

A tensor sharded over processes goes to the process that uses it (the writer of its
file, process 0 for a broadcast or the embedded engine) and to no other: each block of
it the consumer lacks is sent from one device that holds it to one of the consumer's
devices (`jax.lax.ppermute` in a shard_map: NCCL send/recv on GPUs, gloo on CPUs), and
the consumer copies its blocks into one host array. An all-gather would place every
byte on every device of every process. `COUNTS` tallies what this process gathered.
What each process holds at a publish: docs/fleet.md, "What each process holds".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_AXIS = "blocks"

# A part's place in the gathered array: (start, stop) per dimension.
Bounds = tuple[tuple[int, int], ...]


@dataclasses.dataclass
class Counts:
  """What `gather_to` brought this process's host since `reset`.

  Attributes:
    host_bytes: bytes of the arrays gathered here (this process consumed them).
    received_bytes: of them, bytes sent here by other processes' devices.
    largest: bytes of the largest array gathered here.
  """

  host_bytes: int = 0
  received_bytes: int = 0
  largest: int = 0

  def reset(self) -> None:
    self.host_bytes = self.received_bytes = self.largest = 0


COUNTS = Counts()


@dataclasses.dataclass(frozen=True)
class _Part:
  """What one device holds of the gathered rows: `bounds` in the result,
  `rows` of its own block (axis 0) that they are."""

  bounds: Bounds
  rows: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How `gather_to` brings one array's rows to its consumer.

  Attributes:
    devices: the array's devices in id order (the same on every process).
    parts: {device: its part} for each device that holds some of the rows.
    block: the largest part's shape; smaller ones are padded to it to be sent.
    own: {bounds: a consumer device that holds that part}.
    rounds: per round, (source, destination) positions in `devices`: each
      round moves at most one part to each consumer device.
    sent: per round, {destination position: the bounds it receives}.
  """

  devices: tuple[jax.Device, ...]
  parts: dict[jax.Device, _Part]
  block: tuple[int, ...]
  own: dict[Bounds, jax.Device]
  rounds: tuple[tuple[tuple[int, int], ...], ...]
  sent: tuple[dict[int, Bounds], ...]


def gather_to(
  x: jax.Array, consumer: int, rows: tuple[int, int] | None = None
) -> np.ndarray | None:
  """`x` (or its rows [start, stop) on axis 0) whole on process `consumer`'s
  host; None on every other process.

  Parts the consumer's devices hold are copied from them; each other part
  is sent from one device that holds it to one of the consumer's, by a
  program every process that holds part of `x` runs: call it on each, in
  the same order (no program runs when the consumer holds every part, as
  for an array replicated on each process). No process but the consumer
  receives anything; a device holds its own block and what is sent to it.

  Raises:
    ValueError: the consumer holds none of `x`'s devices but lacks parts.
  """
  window = rows if rows is not None else (0, x.shape[0] if x.ndim else 0)
  plan = _plan(x.sharding, tuple(x.shape), consumer, window)
  received = _send(x, plan) if plan.rounds else None
  if jax.process_index() != consumer:
    return None
  out = np.empty((window[1] - window[0], *x.shape[1:]) if x.ndim else (), x.dtype)
  shards = {s.device: s for s in x.addressable_shards}
  for bounds, device in plan.own.items():
    out[_slices(bounds)] = np.asarray(_rows_of(shards[device].data, plan.parts[device]))
  got = _copy_received(out, received, plan) if received is not None else 0
  COUNTS.host_bytes += out.nbytes
  COUNTS.received_bytes += got
  COUNTS.largest = max(COUNTS.largest, out.nbytes)
  return out


def _plan(sharding, shape: tuple[int, ...], consumer: int, window: tuple[int, int]) -> _Plan:
  """The parts of rows `window` of an array of `shape` placed with
  `sharding`, and which device sends which to the consumer."""
  devices = tuple(sorted(sharding.device_set, key=lambda d: d.id))
  index = sharding.devices_indices_map(shape)
  parts = {d: p for d in devices if (p := _part(index[d], shape, window)) is not None}
  holders: dict[Bounds, list[jax.Device]] = {}
  for device, part in parts.items():
    holders.setdefault(part.bounds, []).append(device)
  own, missing = {}, []
  for bounds, where in holders.items():
    mine = [d for d in where if d.process_index == consumer]
    if mine:
      own[bounds] = mine[0]
    else:
      missing.append((bounds, where[0]))
  block = tuple(
    max(b - a for a, b in (p.bounds[i] for p in parts.values())) for i in range(len(shape))
  )
  return _Plan(devices, parts, block, own, *_rounds(devices, missing, consumer))


def _part(index: tuple, shape: tuple[int, ...], window: tuple[int, int]) -> _Part | None:
  """A device's block `index` within rows `window`; None if it holds none of them."""
  bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
  if not shape:
    return _Part((), (0, 0))
  (a, b), rest = bounds[0], bounds[1:]
  lo, hi = max(a, window[0]), min(b, window[1])
  if lo >= hi:
    return None
  return _Part(((lo - window[0], hi - window[0]), *rest), (lo - a, hi - a))


def _rounds(devices, missing: list[tuple[Bounds, jax.Device]], consumer: int):
  """(rounds, sent): each missing part from its source to a consumer device,
  the consumer's devices taking one part each per round."""
  position = {d: i for i, d in enumerate(devices)}
  targets = [position[d] for d in devices if d.process_index == consumer]
  if missing and not targets:
    raise ValueError(
      f"process {consumer} holds none of the array's {len(devices)} devices: "
      "it cannot be gathered there"
    )
  rounds, sent = [], []
  for first in range(0, len(missing), max(1, len(targets))):
    batch = missing[first : first + len(targets)]
    rounds.append(tuple((position[src], dst) for (_, src), dst in zip(batch, targets)))
    sent.append({dst: bounds for (bounds, _), dst in zip(batch, targets)})
  return tuple(rounds), tuple(sent)


def _slices(bounds: Bounds) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in bounds)


def _rows_of(block: jax.Array, part: _Part) -> jax.Array:
  """The rows of its own `block` a device's `part` is (sliced on that device)."""
  if not block.ndim or part.rows == (0, block.shape[0]):
    return block
  return block[part.rows[0] : part.rows[1]]


def _send(x: jax.Array, plan: _Plan) -> jax.Array:
  """Runs the plan's rounds: every device's part in (padded to the plan's
  block), on each consumer device the parts it received, round after round
  on axis 0."""
  mesh = jax.sharding.Mesh(np.array(plan.devices), (_AXIS,))
  sharding = NamedSharding(mesh, PartitionSpec(_AXIS))
  blocks = [_outgoing(s, plan) for s in x.addressable_shards]
  stacked_shape = (len(plan.devices) * plan.block[0], *plan.block[1:])
  stacked = jax.make_array_from_single_device_arrays(stacked_shape, sharding, blocks)
  return _permute(mesh, plan.rounds)(stacked)


def _outgoing(shard, plan: _Plan) -> jax.Array:
  """What a device puts in: its part padded to the plan's block (zeros
  when it holds none of the rows), on that device."""
  part = plan.parts.get(shard.device)
  if part is None:
    return jax.device_put(np.zeros(plan.block, shard.data.dtype), shard.device)
  data = _rows_of(shard.data, part)
  if tuple(data.shape) == plan.block:
    return data
  return jnp.pad(data, [(0, want - have) for have, want in zip(data.shape, plan.block)])


@functools.lru_cache(maxsize=64)
def _permute(mesh: jax.sharding.Mesh, rounds: tuple[tuple[tuple[int, int], ...], ...]):
  """The program of `_send`, one per mesh and rounds."""

  def body(block):
    return jnp.concatenate([jax.lax.ppermute(block, _AXIS, list(pairs)) for pairs in rounds])

  spec = PartitionSpec(_AXIS)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _copy_received(out: np.ndarray, received: jax.Array, plan: _Plan) -> int:
  """Copies the parts the consumer's devices received into `out`; their bytes."""
  rows, got = plan.block[0], 0
  for shard in received.addressable_shards:
    dst = plan.devices.index(shard.device)
    mine = [(r, sent[dst]) for r, sent in enumerate(plan.sent) if dst in sent]
    if not mine:
      continue
    data = np.asarray(shard.data)  # this device's rounds, one copy to the host
    for r, bounds in mine:
      part = data[r * rows : (r + 1) * rows][tuple(slice(0, b - a) for a, b in bounds)]
      out[_slices(bounds)] = part
      got += part.nbytes
  return got
