"""The host store of preprocessed patches and its MetaStore (id -> worker, slot).

Workers write each item's float32 patches into one POSIX shared-memory segment (the
"slot", `write_shared`) and report its name; the `MetaStore` records media id -> (worker,
slot, shape, grid). A reader maps the segment and copies only the rows it needs
(`read_shared`), so a video slice costs its own bytes, and the controller never maps a
segment at all. Shared memory rather than arrays pickled through a pipe: a pickled result
is copied into the receiving process whether it needs it or not, and costs a serialize,
pipe and deserialize per item (bench/loader.py measures both).
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from multiprocessing import shared_memory

import numpy as np

PENDING, READY, FAILED = "pending", "ready", "failed"


def segment_prefix() -> str:
  """A new prefix for one pool's segment names: `fluxjax_<8 hex>_`.

  A segment left in /dev/shm by a killed run then says whose it was.
  """
  return f"fluxjax_{secrets.token_hex(4)}_"


def write_shared(array: np.ndarray, prefix: str) -> str:
  """Copies an array into a new shared-memory segment named `prefix` + 12
  hex digits; returns its name."""
  shm = shared_memory.SharedMemory(
    name=prefix + secrets.token_hex(6), create=True, size=max(1, array.nbytes)
  )
  try:
    np.ndarray(array.shape, array.dtype, buffer=shm.buf)[...] = array
    return shm.name
  finally:
    shm.close()


def read_shared(
  name: str, shape: tuple[int, ...], rows: tuple[int, int], dtype=np.float32
) -> np.ndarray:
  """A copy of rows [start, stop) of a segment holding an array of `shape`."""
  shm = shared_memory.SharedMemory(name=name)
  try:
    view = np.ndarray(shape, dtype, buffer=shm.buf)
    out = np.array(view[rows[0] : rows[1]])
    # The view must go before close(), or the mapping is still exported.
    del view
    return out
  finally:
    shm.close()


def unlink_shared(name: str) -> None:
  try:
    shm = shared_memory.SharedMemory(name=name)
  except FileNotFoundError:
    return
  shm.close()
  shm.unlink()


@dataclasses.dataclass
class Entry:
  """Where one media item's patches are.

  Attributes:
    media_id: the item's store key.
    worker: index of the worker that owns it.
    nbytes: bytes reserved for it (its patches once ready).
    expected_grid: the grid its MediaRef promised.
    status: PENDING, READY or FAILED.
    slot: shared-memory segment name (READY, shm transport).
    array: the patches themselves (READY, pickle transport).
    shape: shape of the stored patches.
    reason: why it failed (FAILED).
    decode_s: the worker's decode + preprocess time.
  """

  media_id: str
  worker: int
  nbytes: int
  expected_grid: tuple[int, int, int]
  status: str = PENDING
  slot: str | None = None
  array: np.ndarray | None = None
  shape: tuple[int, ...] | None = None
  reason: str | None = None
  decode_s: float = 0.0


class MetaStore:
  """Thread-safe registry of stored items, bounded in bytes.

  The loader stops prefetching past the budget (`has_room`), and an item is evicted (its
  segment unlinked) once it has been consumed (`release`).

  Args:
    budget_bytes: bytes the loader may keep reserved (pending + ready).
  """

  def __init__(self, budget_bytes: int = 2 << 30):
    self.budget_bytes = int(budget_bytes)
    self._entries: dict[str, Entry] = {}
    self._orphans: set[str] = set()  # released while still pending
    self._cv = threading.Condition()
    self.bytes_in_use = 0
    self.peak_bytes = 0
    self.evicted = 0

  def __contains__(self, media_id: str) -> bool:
    with self._cv:
      return media_id in self._entries

  def __len__(self) -> int:
    with self._cv:
      return len(self._entries)

  def has_room(self) -> bool:
    """Whether prefetching may reserve more (an empty store always may)."""
    with self._cv:
      return self.bytes_in_use < self.budget_bytes or not self._entries

  def register(
    self, media_id: str, worker: int, nbytes: int, expected_grid: tuple[int, int, int]
  ) -> None:
    with self._cv:
      if media_id in self._entries:
        raise KeyError(f"{media_id} is already registered")
      t, h, w = expected_grid  # stored as a tuple: set_ready compares tuples
      self._entries[media_id] = Entry(media_id, worker, nbytes, (t, h, w))
      self.bytes_in_use += nbytes
      self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)

  def set_ready(
    self,
    media_id: str,
    *,
    slot: str | None,
    shape,
    grid,
    array: np.ndarray | None = None,
    decode_s: float = 0.0,
  ) -> None:
    """Records a worker's result (or drops it if it was released meanwhile)."""
    with self._cv:
      entry = self._entries.get(media_id)
      if entry is None or media_id in self._orphans:
        self._orphans.discard(media_id)
        self._entries.pop(media_id, None)
        if entry is not None:
          self.bytes_in_use -= entry.nbytes
        if slot is not None:
          unlink_shared(slot)
        return
      entry.decode_s = decode_s
      if tuple(grid) != entry.expected_grid:
        # The header promised another size than the decoder found.
        entry.status, entry.reason = (
          FAILED,
          (f"decoded grid {tuple(grid)} != probed {entry.expected_grid}"),
        )
        if slot is not None:
          unlink_shared(slot)
      else:
        entry.status, entry.slot, entry.array = READY, slot, array
        entry.shape = tuple(shape)
      self._cv.notify_all()

  def set_failed(self, media_id: str, reason: str) -> None:
    with self._cv:
      entry = self._entries.get(media_id)
      if entry is None:
        return
      if media_id in self._orphans:
        self._orphans.discard(media_id)
        self._drop(media_id)
        return
      entry.status, entry.reason = FAILED, reason
      self._cv.notify_all()

  def get(self, media_id: str) -> Entry | None:
    with self._cv:
      return self._entries.get(media_id)

  def wait(self, media_id: str, timeout: float | None = None) -> Entry:
    """Blocks until an item is READY or FAILED; returns its entry.

    Raises:
      KeyError: the item was never registered.
      TimeoutError: not done within timeout seconds.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    with self._cv:
      while True:
        entry = self._entries.get(media_id)
        if entry is None:
          raise KeyError(f"{media_id} is not in the store")
        if entry.status != PENDING:
          return entry
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
          raise TimeoutError(f"{media_id} not ready after {timeout} s")
        self._cv.wait(left)

  def read(
    self, media_id: str, rows: tuple[int, int] | None = None, timeout: float | None = None
  ) -> np.ndarray:
    """Patches rows [start, stop) of a READY item (waits while pending)."""
    entry = self.wait(media_id, timeout)
    if entry.status == FAILED:
      raise ValueError(f"{media_id} failed: {entry.reason}")
    # READY: set_ready gave it a shape, and a slot when no array.
    assert entry.shape is not None
    rows = rows or (0, entry.shape[0])
    if entry.array is not None:
      return entry.array[rows[0] : rows[1]]
    assert entry.slot is not None
    return read_shared(entry.slot, entry.shape, rows)

  def _drop(self, media_id: str) -> None:
    entry = self._entries.pop(media_id)
    self.bytes_in_use -= entry.nbytes
    if entry.slot is not None:
      unlink_shared(entry.slot)
    self.evicted += 1

  def release(self, media_id: str) -> None:
    """Evicts a consumed item; one still pending is dropped when it lands."""
    with self._cv:
      entry = self._entries.get(media_id)
      if entry is None:
        return
      if entry.status == PENDING:
        self._orphans.add(media_id)
        return
      self._drop(media_id)

  def fail_pending(self, worker: int, reason: str) -> list[str]:
    """Fails every pending item of a worker (it died); returns their ids."""
    with self._cv:
      ids = [k for k, e in self._entries.items() if e.worker == worker and e.status == PENDING]
    for media_id in ids:
      self.set_failed(media_id, reason)
    return ids

  def close(self) -> None:
    """Unlinks every segment (pending results are dropped as they land)."""
    with self._cv:
      for media_id in list(self._entries):
        if self._entries[media_id].status == PENDING:
          self._orphans.add(media_id)
        else:
          self._drop(media_id)
