"""The tensors of a deferred broadcast from a trainer that spans processes.

Each published tensor of such a trainer is a collective gather that every
process runs, and collectives must meet in one order on every process: the
training step's own are launched from each process's main thread, in the
order the leader's ops arrive. A broadcast that overlaps training therefore
cannot gather from the rollout loop's thread. A `TensorFeed` splits the
work: the trainer's main thread gathers (`pump` between the step's ops while
it waits for rollouts, `finish` before the update that donates the arrays),
first announcing each run of gathers so that the other processes run the
same ones at the same point of their op stream; the broadcast takes each
gathered tensor from another thread as it comes (iterating the feed). At
most `capacity` gathered tensors wait between the two, so a process holds
the tensor on the wire plus `capacity` more, as the undeferred broadcast
does.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

# The main thread's poll while it waits for rollouts with a feed open: how
# late a gather may start after the broadcast took the previous tensor.
POLL_S = 0.005

_ABANDONED = object()


class Abandoned(RuntimeError):
  """The trainer stopped feeding the broadcast (its run failed)."""


class TensorFeed:
  """A bounded hand-off of `count` tensors from the gathering thread to the
  broadcasting one (see the module docstring).

  Args:
    tensors: the gathers, run on the main thread; yields numpy tensors.
    count: how many `tensors` yields.
    capacity: gathered tensors that may wait for the broadcast.
  """

  def __init__(self, tensors: Iterator[np.ndarray], count: int, capacity: int = 1):
    if capacity < 1:
      raise ValueError(f"capacity must be at least 1, got {capacity}")
    self._tensors = tensors
    self._count = count
    self._capacity = capacity
    self._gathered = 0  # main thread only
    self.pumped = 0  # of them, gathered by `pump` (while the trainer waited anyway)
    self.gather_s = 0.0  # the main thread's time in the gathers themselves
    self._taken = 0  # broadcasting thread only
    self._queue: queue.Queue = queue.Queue()
    self._done_taking = threading.Event()

  @property
  def count(self) -> int:
    return self._count

  @property
  def remaining(self) -> int:
    """Tensors not yet gathered."""
    return self._count - self._gathered

  @property
  def waiting(self) -> int:
    """Gathered tensors the broadcast has not taken yet."""
    return self._queue.qsize()

  def pump(self, announce: Callable[[int], None]) -> int:
    """Gathers as many tensors as there is room for, without waiting for the
    broadcast; returns how many. `announce(n)` runs first (the other
    processes' same n gathers)."""
    room = self._capacity - self.waiting if not self._done_taking.is_set() else 0
    n = min(max(room, 0), self.remaining)
    if n:
      announce(n)
      for _ in range(n):
        self._put(self._gather())
      self.pumped += n
    return n

  def finish(self, announce: Callable[[int], None]) -> None:
    """Gathers every tensor left, each as the broadcast makes room for it
    (dropped once the broadcast takes no more): the arrays are then free to
    change."""
    n = self.remaining
    if not n:
      return
    announce(n)
    for _ in range(n):
      while not self._done_taking.is_set() and self.waiting >= self._capacity:
        self._done_taking.wait(POLL_S)
      self._put(self._gather())

  def abandon(self) -> None:
    """Ends the feed without gathering the rest (the other processes are
    gone): the broadcast's next take raises `Abandoned`."""
    self._gathered = self._count
    self._queue.put(_ABANDONED)

  def _gather(self) -> np.ndarray:
    t = time.perf_counter()
    x = next(self._tensors)
    self.gather_s += time.perf_counter() - t
    return x

  def _put(self, x: np.ndarray) -> None:
    self._gathered += 1
    if not self._done_taking.is_set():
      self._queue.put(x)

  # The broadcasting thread's side.

  def __iter__(self) -> TensorFeed:
    return self

  def __next__(self) -> np.ndarray:
    if self._taken == self._count:
      self._done_taking.set()
      raise StopIteration
    x = self._queue.get()
    if x is _ABANDONED:
      self._done_taking.set()
      raise Abandoned("the trainer abandoned the publish before every tensor was gathered")
    self._taken += 1
    return x

  def close(self) -> None:
    """The broadcast takes no more: whatever is still gathered is dropped."""
    self._done_taking.set()
    while not self._queue.empty():
      self._queue.get_nowait()
