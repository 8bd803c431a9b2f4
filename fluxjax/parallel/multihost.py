"""Several JAX processes, one run: process 0 decides, every process computes.

In a multi-controller run (jax.distributed) every jitted program on the one global mesh
must be launched by every process, in the same order. Decisions that depend on timing or
on I/O only one process does are made once, on process 0, the leader, which sends each
as an op on a `Channel` and then runs it; the others run the ops in order (rl/worker.py).
`gather_to_leader` gives the leader's rollout engine its own copy of the weights.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fluxjax.sharding import gather

log = logging.getLogger(__name__)

LEADER = 0


def is_leader() -> bool:
  """Whether this process decides (process 0; also a single-process run)."""
  return jax.process_index() == LEADER


def leader_devices() -> list[jax.Device]:
  """The leader's devices, in global order."""
  return [d for d in jax.devices() if d.process_index == LEADER]


def _client():
  from jax._src.distributed import global_state  # the one place touching it

  if global_state.client is None:
    raise RuntimeError("jax.distributed is not initialized: a channel needs several processes")
  return global_state.client


class Channel:
  """An ordered op stream from the leader to every other process.

  The stream runs over the coordination service's key-value store, not a device
  collective (why: docs/design.md, section 3, "Multi-controller runs"); payloads are
  pickled and split into chunks the gRPC service accepts.

  Op n is stored as chunks `{prefix}/{n}/{i}` and then a header `{prefix}/{n}`
  holding the chunk count: a reader that sees the header finds every chunk.
  The leader deletes ops once every follower has read them (`forget_through`,
  after a collective that every follower must have reached).

  Args:
    prefix: key prefix (one channel per prefix).
    timeout_s: how long a follower waits for the next op; the leader's
      rollout and evaluation between two ops may take long.
    chunk_bytes: payload bytes per key.
  """

  def __init__(
    self, prefix: str = "fluxjax/ops", timeout_s: float = 7 * 86400, chunk_bytes: int = 2 << 20
  ):
    self.prefix = prefix
    self.timeout_ms = int(timeout_s * 1000)
    self.chunk_bytes = int(chunk_bytes)
    self._next = 0  # the next op to send or receive
    self._forgotten = 0  # ops below this are deleted

  def send(self, name: str, *args: Any) -> int:
    """Leader: appends op `name(*args)`; returns its number."""
    client = _client()
    n = self._next
    payload = pickle.dumps((name, args), protocol=pickle.HIGHEST_PROTOCOL)
    chunks = max(1, -(-len(payload) // self.chunk_bytes))
    for i in range(chunks):
      part = payload[i * self.chunk_bytes : (i + 1) * self.chunk_bytes]
      client.key_value_set_bytes(f"{self.prefix}/{n}/{i}", part)
    client.key_value_set(f"{self.prefix}/{n}", str(chunks))
    self._next += 1
    return n

  def recv(self) -> tuple[str, tuple]:
    """Follower: the next op as (name, args), waiting for it."""
    client = _client()
    n = self._next
    chunks = int(client.blocking_key_value_get(f"{self.prefix}/{n}", self.timeout_ms))
    payload = b"".join(
      client.blocking_key_value_get_bytes(f"{self.prefix}/{n}/{i}", self.timeout_ms)
      for i in range(chunks)
    )
    self._next += 1
    name, args = pickle.loads(payload)
    return name, args

  def forget_through(self, n: int) -> None:
    """Leader: deletes ops up to `n`, which every follower has read."""
    client = _client()
    for k in range(self._forgotten, n + 1):
      client.key_value_delete(f"{self.prefix}/{k}")  # the header and the chunks under it
    self._forgotten = max(self._forgotten, n + 1)


@contextlib.contextmanager
def fail_fast() -> Iterator[None]:
  """Ends this process at once when the block raises in a multi-process run.

  jax.distributed shuts down at interpreter exit with a barrier across every
  process, and the others may be waiting in a collective (or for an op) for
  this one: a plain exit would hang them all. Exiting now lets the launcher
  (or the cluster scheduler) see the failure and stop the others. The error
  is logged first; one process re-raises as usual. A SystemExit is a
  deliberate exit (a preemption's 143, after the others were stopped) and
  leaves as usual.
  """
  try:
    yield
  except SystemExit:
    raise
  except BaseException:
    if jax.process_count() == 1:
      raise
    log.exception("process %d of %d failed", jax.process_index(), jax.process_count())
    for handler in logging.getLogger().handlers:
      handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


GATHER_CHUNK_BYTES = 64 << 20  # the most of a leaf `gather_to_leader` moves at once


def gather_to_leader(tree, shardings, chunk_bytes: int = GATHER_CHUNK_BYTES):
  """A copy of a sharded tree placed with `shardings` on the leader's devices.

  The leader's rollout engine gets its own copy of the weights this way, a run of rows at
  a time and to the leader alone.

  Collective: every process calls it, with the same tree structure, in the
  same order. Each leaf goes to the leader alone (`gather.gather_to`) in
  boxes of at most `chunk_bytes` (runs of rows; a row larger than that in
  runs of its own rows, and so on), and the leader writes each box into its
  devices' blocks of the copy as it comes: its host holds one box at a
  time, and no other process receives anything.

  Args:
    tree: jax.Arrays sharded over the global mesh.
    shardings: a tree like `tree` of shardings on leader devices only.
    chunk_bytes: the most one gather brings the leader.

  Returns:
    On the leader the placed copy; None on every other process.
  """
  flat_shardings = jax.tree.leaves(shardings)
  leaves, treedef = jax.tree.flatten(tree)
  if len(flat_shardings) != len(leaves):
    raise ValueError(f"{len(flat_shardings)} shardings for {len(leaves)} arrays")
  placed = [_gather_leaf(leaf, s, chunk_bytes) for leaf, s in zip(leaves, flat_shardings)]
  return jax.tree.unflatten(treedef, placed) if is_leader() else None


def _gather_leaf(leaf: jax.Array, sharding, chunk_bytes: int) -> jax.Array | None:
  """`leaf` placed with `sharding` on the leader (None elsewhere), a box at a time."""
  if leaf.ndim == 0:
    host = gather.gather_to(leaf, LEADER)
    return None if host is None else jax.device_put(host, sharding)
  blocks = _empty_blocks(leaf, sharding) if is_leader() else None
  index = {
    d: tuple(s.indices(n)[:2] for s, n in zip(i, leaf.shape))
    for d, i in sharding.devices_indices_map(leaf.shape).items()
  }
  for box in _boxes(leaf.shape, leaf.dtype.itemsize, chunk_bytes):
    host = gather.gather_to(leaf, LEADER, box)
    if blocks is not None:
      assert host is not None
      _write_box(blocks, index, host, box)
  if blocks is None:
    return None
  return jax.make_array_from_single_device_arrays(leaf.shape, sharding, list(blocks.values()))


def _boxes(shape: tuple[int, ...], itemsize: int, chunk_bytes: int) -> Iterator[gather.Bounds]:
  """Boxes that cover an array of `shape` in order, each of at most
  `chunk_bytes`: runs along the first axis whose entries fit (one entry
  each of the axes before it)."""
  k = next(
    (k for k in range(len(shape)) if math.prod(shape[k + 1 :]) * itemsize <= chunk_bytes),
    len(shape) - 1,
  )
  step = max(1, chunk_bytes // (math.prod(shape[k + 1 :]) * itemsize))
  rest = tuple((0, n) for n in shape[k + 1 :])
  for outer in itertools.product(*(range(n) for n in shape[:k])):
    for start in range(0, shape[k], step):
      yield (*((i, i + 1) for i in outer), (start, min(shape[k], start + step)), *rest)


def _empty_blocks(leaf: jax.Array, sharding) -> dict[jax.Device, jax.Array]:
  """Each of `sharding`'s devices' block of `leaf`, zeros, on that device."""
  shape = sharding.shard_shape(leaf.shape)
  return {d: jnp.zeros(shape, leaf.dtype, device=d) for d in sharding.addressable_devices}


def _write_box(blocks: dict, index: dict, host: np.ndarray, box: gather.Bounds) -> None:
  """Writes `host`, the leaf's `box`, into each device's block where they
  meet, in place (`index`: {device: its block's (start, stop) per axis})."""
  for device, block in blocks.items():
    meet = [(max(a, lo), min(b, hi)) for (a, b), (lo, hi) in zip(index[device], box)]
    if any(first >= last for first, last in meet):
      continue
    piece = host[tuple(slice(first - lo, last - lo) for (first, last), (lo, _) in zip(meet, box))]
    at = tuple(first - a for (first, _), (a, _) in zip(meet, index[device]))
    blocks[device] = _set_box(block, jax.device_put(piece, device), at)


@functools.partial(jax.jit, donate_argnums=0)
def _set_box(block: jax.Array, piece: jax.Array, at: tuple) -> jax.Array:
  """`block` with `piece` written from index `at` (in place: the block is donated)."""
  return jax.lax.dynamic_update_slice(block, piece, at)
