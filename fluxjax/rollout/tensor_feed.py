"""The items of a deferred publish, gathered on the trainer's main thread.

Across processes each published tensor is a collective gather, and collectives must meet
in one order, so a publish that overlaps training cannot gather from another thread
(docs/fleet.md, "Deferred publish"). A `TensorFeed` splits the work: the main thread
gathers, and a consumer thread iterates the feed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_ABANDONED = object()


class Abandoned(RuntimeError):
  """The trainer stopped feeding the publish (its run failed)."""


class TensorFeed:
  """A bounded hand-off of `count` items from the gathering thread to a
  consumer.

  The main thread gathers (the leader: `pump` while it waits for rollouts, `finish`
  before the update that donates the arrays, each run announced first; another process:
  `take`, as announced), and a consumer thread iterates the feed, with at most `capacity`
  gathered items between them. A one-process trainer needs no announcements: the feed
  keeps its main thread the only one launching programs.

  Args:
    items: the gathers, run on the gathering thread.
    count: how many `items` yields.
    capacity: gathered items that may wait for the consumer.
    consumed: False: nothing takes the items; each is dropped once gathered
      (another process's part in a broadcast).
    after_last: run on the gathering thread after the last gather.
  """

  def __init__(
    self,
    items: Iterator[Any],
    count: int,
    capacity: int = 1,
    *,
    consumed: bool = True,
    after_last: Callable[[], None] | None = None,
  ):
    if capacity < 1:
      raise ValueError(f"capacity must be at least 1, got {capacity}")
    self._items = items
    self._count = count
    self._consumed = consumed
    self._after_last = after_last
    self._room = threading.Semaphore(capacity)
    self._queue: queue.Queue = queue.Queue()
    self._done_taking = threading.Event()
    self._gathered = 0  # gathering thread only
    self._taken = 0  # consumer only
    self.pumped = 0  # gathered by `pump` (while the trainer waited anyway)
    self.gather_s = 0.0  # the gathering thread's time in the gathers themselves
    # Called by the consumer after each take: the trainer's main thread,
    # waiting for rollouts, wakes to gather the next.
    self.on_take: Callable[[], None] | None = None

  @property
  def count(self) -> int:
    return self._count

  @property
  def remaining(self) -> int:
    """Items not yet gathered."""
    return self._count - self._gathered

  @property
  def waiting(self) -> int:
    """Gathered items the consumer has not taken yet."""
    return self._queue.qsize()

  def pump(self, announce: Callable[[int], None]) -> int:
    """Gathers as many items as there is room for, without waiting for the
    consumer; returns how many. `announce(n)` runs first (the other
    processes' same n gathers)."""
    n = 0
    while n < self.remaining and self._room.acquire(blocking=False):
      n += 1
    if n:
      announce(n)
      for _ in range(n):
        self._put(self._gather())
      self.pumped += n
    return n

  def finish(self, announce: Callable[[int], None]) -> None:
    """Gathers every item left, each as the consumer makes room for it
    (dropped once it takes no more): the arrays are then free to change."""
    n = self.remaining
    if n:
      announce(n)
      self.take(n)

  def take(self, n: int) -> None:
    """Gathers the next `n` items, each as the consumer makes room for it."""
    if n > self.remaining:
      raise ValueError(f"{n} gathers asked for, {self.remaining} left")
    for _ in range(n):
      if self._consumed:
        self._room.acquire()  # `close` releases one that waits
      self._put(self._gather())

  def abandon(self) -> None:
    """Ends the feed without gathering the rest (the other processes are
    gone): the consumer's next take raises `Abandoned`."""
    self._gathered = self._count
    self._queue.put(_ABANDONED)

  def _gather(self) -> Any:
    t = time.perf_counter()
    x = next(self._items)
    self.gather_s += time.perf_counter() - t
    self._gathered += 1
    return x

  def _put(self, x: Any) -> None:
    """Hands a gathered item over (its room taken), or drops it when no one
    takes it; after the last, `after_last`."""
    if self._consumed and not self._done_taking.is_set():
      self._queue.put(x)
    if self._gathered == self._count and self._after_last is not None:
      self._after_last()

  # The consumer's side.

  def __iter__(self) -> TensorFeed:
    return self

  def __next__(self) -> Any:
    if self._taken == self._count:
      self._done_taking.set()
      raise StopIteration
    x = self._queue.get()
    if x is _ABANDONED:
      self._done_taking.set()
      raise Abandoned("the trainer abandoned the publish before every item was gathered")
    self._taken += 1
    self._room.release()
    if self.on_take is not None:
      self.on_take()
    return x

  def close(self) -> None:
    """The consumer takes no more: whatever is gathered from now is dropped."""
    self._done_taking.set()
    self._room.release(self._count + 1)  # a put waiting for room goes on
    while not self._queue.empty():
      self._queue.get_nowait()
