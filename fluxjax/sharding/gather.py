"""Cross-process gathers to the one process that consumes them (`gather_to`).

A tensor sharded over processes goes to the process that uses it (the writer of its
file, process 0 for a broadcast or the embedded engine) and to no other: each part of
it the consumer lacks is cast where it lies and sent from one device that holds it to
one of the consumer's (`jax.lax.ppermute` in a shard_map over just those devices:
send/recv, NCCL on GPUs, gloo on CPUs), and the consumer copies the parts into one host
array. An all-gather would place every byte on every device of every process. `COUNTS`
tallies what this process gathered. Figures: bench/README.md, "Gathers to the owner".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

_AXIS = "pairs"

# A box of an array: (start, stop) per dimension.
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
  """What one device holds of the gathered box: `bounds` in the result, and
  `local`, the same elements' place in its own block."""

  bounds: Bounds
  local: Bounds


# One send: (source device, consumer device, the part's bounds in the result).
_Send = tuple[jax.Device, jax.Device, Bounds]


@dataclasses.dataclass(frozen=True)
class _Plan:
  """How `gather_to` brings a box of one array to its consumer.

  Attributes:
    parts: {device: its part} for each device that holds some of the box.
    block: the largest part's shape; smaller ones are padded to it to be sent.
    own: {bounds: a consumer device that holds that part}.
    rounds: the sends, in rounds that give each consumer device one part.
  """

  parts: dict[jax.Device, _Part]
  block: tuple[int, ...]
  own: dict[Bounds, jax.Device]
  rounds: tuple[tuple[_Send, ...], ...]


def gather_to(
  x: jax.Array, consumer: int, box: Bounds | None = None, dtype=None
) -> np.ndarray | None:
  """`x[box]` (per dimension (start, stop); None: all of `x`), cast to
  `dtype` where it lies, whole on process `consumer`'s host; None on every
  other process.

  Parts the consumer's devices hold are copied from them; each other part
  is sent from one device that holds it to one of the consumer's, by a
  program on just those devices, a round of sends at a time: every process
  that holds part of `x` calls this, in the same order (no program runs
  when the consumer holds every part, as for an array replicated on each
  process). No process but the consumer receives anything; a sending
  device holds its part cast and the program's output, one round at a time.

  Raises:
    ValueError: the consumer holds none of `x`'s devices but lacks parts.
  """
  box = tuple((0, n) for n in x.shape) if box is None else tuple(box)
  dtype = np.dtype(x.dtype if dtype is None else dtype)
  plan = _plan(x.sharding, tuple(x.shape), consumer, box)
  shards = {s.device: s.data for s in x.addressable_shards}
  mine = jax.process_index() == consumer
  out = np.empty(tuple(b - a for a, b in box), dtype) if mine else None
  got = 0
  for sends in plan.rounds:
    received = _send(shards, plan, sends, dtype)
    if received is None:  # this process holds none of the round's devices
      continue
    if out is None:  # its sends done: one round's buffers at a time, not a queue
      received.block_until_ready()
    else:
      got += _copy_received(out, received, sends)
  if out is None:
    return None
  for bounds, device in plan.own.items():
    out[_slices(bounds)] = np.asarray(_local(shards[device], plan.parts[device], dtype))
  COUNTS.host_bytes += out.nbytes
  COUNTS.received_bytes += got
  COUNTS.largest = max(COUNTS.largest, out.nbytes)
  return out


def _plan(sharding, shape: tuple[int, ...], consumer: int, box: Bounds) -> _Plan:
  """The parts of `box` of an array of `shape` placed with `sharding`, and
  which device sends which to the consumer (the same on every process)."""
  devices = sorted(sharding.device_set, key=lambda d: d.id)
  index = sharding.devices_indices_map(shape)
  parts = {d: p for d in devices if (p := _part(index[d], shape, box)) is not None}
  holders: dict[Bounds, list[jax.Device]] = {}
  for device, part in parts.items():
    holders.setdefault(part.bounds, []).append(device)
  own, missing = {}, []
  for bounds, where in holders.items():
    mine = [d for d in where if d.process_index == consumer]
    if mine:
      own[bounds] = mine[0]
    else:
      missing.append((where[0], bounds))
  block = tuple(
    max(b - a for a, b in (p.bounds[i] for p in parts.values())) for i in range(len(shape))
  )
  targets = [d for d in devices if d.process_index == consumer]
  return _Plan(parts, block, own, _rounds(missing, targets, consumer))


def _part(index: tuple, shape: tuple[int, ...], box: Bounds) -> _Part | None:
  """A device's block `index` within `box`; None if it holds none of it."""
  bounds, local = [], []
  for s, n, (lo, hi) in zip(index, shape, box):
    a, b = s.indices(n)[:2]
    first, last = max(a, lo), min(b, hi)
    if first >= last:
      return None
    bounds.append((first - lo, last - lo))
    local.append((first - a, last - a))
  return _Part(tuple(bounds), tuple(local))


def _rounds(missing: list[tuple[jax.Device, Bounds]], targets: list[jax.Device], consumer: int):
  """The sends of the `missing` parts, the consumer's devices (`targets`)
  taking one part each per round."""
  if missing and not targets:
    raise ValueError(
      f"process {consumer} holds none of the array's devices: it cannot be gathered there"
    )
  rounds = []
  for first in range(0, len(missing), max(1, len(targets))):
    batch = missing[first : first + len(targets)]
    rounds.append(tuple((src, dst, bounds) for (src, bounds), dst in zip(batch, targets)))
  return tuple(rounds)


def _slices(bounds: Bounds) -> tuple[slice, ...]:
  return tuple(slice(a, b) for a, b in bounds)


def _local(block: jax.Array, part: _Part, dtype: np.dtype) -> jax.Array:
  """The elements of its own `block` a device's `part` is, in `dtype` (on that device)."""
  if any(a != 0 or b != n for (a, b), n in zip(part.local, block.shape)):
    block = block[_slices(part.local)]
  return block if block.dtype == dtype else block.astype(dtype)


def _send(shards: dict, plan: _Plan, sends: tuple[_Send, ...], dtype: np.dtype):
  """One round: a program on the round's sources then consumer devices,
  each source's part (cast, padded to the plan's block) sent to its
  consumer device. Its output (the parts, on the consumer devices), or None
  where this process holds none of those devices."""
  devices = [src for src, _, _ in sends] + [dst for _, dst, _ in sends]
  if all(d.process_index != jax.process_index() for d in devices):
    return None
  mesh = jax.sharding.Mesh(np.array(devices), (_AXIS,))
  sources = {src for src, _, _ in sends}
  blocks = [
    _outgoing(shards[d], plan.parts[d], plan.block, dtype)
    if d in sources
    else jax.device_put(np.zeros(plan.block, dtype), d)
    for d in devices
    if d.process_index == jax.process_index()
  ]
  shape = (len(devices) * plan.block[0], *plan.block[1:])
  stacked = jax.make_array_from_single_device_arrays(
    shape, NamedSharding(mesh, PartitionSpec(_AXIS)), blocks
  )
  return _permute(mesh, len(sends))(stacked)


def _outgoing(block: jax.Array, part: _Part, shape: tuple[int, ...], dtype) -> jax.Array:
  """A source device's part, cast and padded to `shape`, on that device."""
  data = _local(block, part, dtype)
  if tuple(data.shape) == shape:
    return data
  return jnp.pad(data, [(0, want - have) for have, want in zip(data.shape, shape)])


@functools.lru_cache(maxsize=256)
def _permute(mesh: jax.sharding.Mesh, pairs: int):
  """The program of `_send` on `mesh` (its first `pairs` devices send to the
  next `pairs`, in order), one per mesh."""

  def body(block):
    return jax.lax.ppermute(block, _AXIS, [(j, pairs + j) for j in range(pairs)])

  spec = PartitionSpec(_AXIS)
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=spec))


def _copy_received(out: np.ndarray, received: jax.Array, sends: tuple[_Send, ...]) -> int:
  """Copies the parts the consumer's devices received in one round into
  `out`; their bytes."""
  got = 0
  data = {s.device: s.data for s in received.addressable_shards}
  for _, dst, bounds in sends:
    part = np.asarray(data[dst])[tuple(slice(0, b - a) for a, b in bounds)]
    out[_slices(bounds)] = part
    got += part.nbytes
  return got
