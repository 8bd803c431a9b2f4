"""Preprocessor worker processes with least-loaded dispatch.

`WorkerPool` runs spawned processes (not forked: the parent may have started JAX, whose
threads a fork would copy half-alive) that decode with `fluxjax.models.media` and
preprocess with `fluxjax.models.processor`, the functions the model's processor path
uses, so the patches are identical. Results go into the host store (`store.py`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from multiprocessing import queues
from multiprocessing.context import SpawnProcess

from fluxjax import faults
from fluxjax.data import store as store_lib
from fluxjax.models import media as media_lib
from fluxjax.models import processor

log = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0  # how often an idle worker checks that its parent lives


# A worker's unit of work: decode and preprocess one file (MediaError if bad).
preprocess_file = media_lib.preprocess_file


def _worker_main(
  worker: int,
  proc,
  tasks,
  results,
  transport: str,
  parent_pid: int | None = None,
  limits: media_lib.MediaLimits = media_lib.DEFAULT_LIMITS,
  *,
  segment_prefix: str,
) -> None:
  """Worker loop: (media_id, kind, path) in, ("ok"|"failed", ...) out.

  A bad file is a "failed" result with its reason (`media.bad_file` turns
  any decoder exception into MediaError), never a dead worker.

  Exits when its parent is gone (killed without `close`, e.g. SIGKILL): the
  task queue carries both ends of its pipe into this process, so a read never
  sees end-of-file and the worker would otherwise wait forever.
  """
  faults.leave_stop_signals_to_parent()
  while True:
    try:
      task = tasks.get(timeout=PARENT_CHECK_S)
    except queue.Empty:
      if parent_pid is not None and os.getppid() != parent_pid:
        return
      continue
    if task is None:
      return
    media_id, kind, path = task
    start = time.perf_counter()
    try:
      pv = preprocess_file(kind, path, proc, limits)
    except media_lib.MediaError as e:
      results.put(("failed", worker, media_id, e.reason))
      continue
    slot = array = None
    if transport == "shm":
      try:
        slot = store_lib.write_shared(pv.patches, segment_prefix)
      except OSError as e:
        # Not the file's fault: no shared-memory segment could be made (too
        # many open, or /dev/shm refused it). The item fails, counted like a
        # bad file, and the worker serves the next one.
        results.put(("failed", worker, media_id, f"worker could not store the patches: {e}"))
        continue
    else:
      array = pv.patches
    results.put(
      (
        "ok",
        worker,
        media_id,
        slot,
        array,
        pv.patches.shape,
        pv.grid_thw,
        time.perf_counter() - start,
      )
    )


class WorkerPool:
  """Preprocessor processes feeding a MetaStore.

  Results go into the store as a shared-memory segment per item, reported by name;
  `transport="pickle"` sends the array through the result queue instead (kept for the
  benchmark's comparison). Task queues are bounded, so a flood of submissions blocks
  instead of growing memory. A worker that dies, or that the loader abandons because its
  decode hung, has its pending items failed (counted skips upstream) and is restarted.

  Args:
    num_workers: processes to start.
    proc: the processor configuration.
    store: where results are registered.
    queue_size: bound of each worker's task queue.
    transport: "shm" (shared-memory slots) or "pickle" (arrays via queue).
    limits: size budgets every decode enforces from the file's header.

  Attributes:
    segment_prefix: the start of every shared-memory segment name the
      pool's workers make (`store.segment_prefix`).
  """

  def __init__(
    self,
    num_workers: int,
    proc: processor.VisionProcessorConfig,
    store: store_lib.MetaStore,
    queue_size: int = 64,
    transport: str = "shm",
    limits: media_lib.MediaLimits = media_lib.DEFAULT_LIMITS,
  ):
    if num_workers < 1:
      raise ValueError(f"need at least one worker, got {num_workers}")
    if transport not in ("shm", "pickle"):
      raise ValueError(f"transport must be 'shm' or 'pickle', got {transport}")
    self.proc, self.store, self.transport, self.limits = proc, store, transport, limits
    self.patch_dim = 3 * proc.temporal_patch_size * proc.patch_size**2
    self._ctx = mp.get_context("spawn")
    self.segment_prefix = store_lib.segment_prefix()
    self._queue_size = queue_size
    self._results = self._ctx.Queue()
    self._tasks: list[queues.Queue] = [self._ctx.Queue(queue_size) for _ in range(num_workers)]
    self._load = [0] * num_workers
    self._lock = threading.Lock()
    self._pending: dict[str, tuple[int, int]] = {}  # id -> (worker, patches)
    self._closed = threading.Event()
    self._stopping = threading.Event()  # close() began: exits are not deaths
    self.restarts = 0
    self.decode_s = 0.0
    self._procs: list[SpawnProcess] = [self._start(w) for w in range(num_workers)]
    self._collector = threading.Thread(
      target=self._collect, daemon=True, name="fluxjax-worker-results"
    )
    self._collector.start()

  @property
  def num_workers(self) -> int:
    return len(self._procs)

  def _start(self, w: int) -> SpawnProcess:
    """Starts worker `w` on its task queue; returns the process."""
    process = self._ctx.Process(
      target=_worker_main,
      name=f"fluxjax-preproc-{w}",
      daemon=True,
      args=(
        w,
        self.proc,
        self._tasks[w],
        self._results,
        self.transport,
        os.getpid(),
        self.limits,
      ),
      kwargs={"segment_prefix": self.segment_prefix},
    )
    process.start()
    return process

  def loads(self) -> list[int]:
    """Outstanding patches per worker."""
    with self._lock:
      return list(self._load)

  def submit(self, ref) -> int:
    """Sends a whole MediaRef's decode to the least-loaded worker.

    The least-loaded worker has the fewest outstanding patches (FlexRL's least-loaded
    routing, weighted by work rather than task count since one long video outweighs
    many images). An item already in the store is not sent again.

    Returns:
      The worker's index (-1 when it was already there).
    """
    if ref.media_id in self.store:
      return -1
    cost = processor.num_patches(ref.full_grid)
    with self._lock:
      # Pending and queued under the lock that a restart holds: a restart of
      # worker w either fails this item with the dead queue or comes before
      # it, and the item goes to the new queue.
      w = min(range(len(self._load)), key=lambda i: (self._load[i], i))
      self.store.register(ref.media_id, w, ref.nbytes(self.patch_dim), ref.full_grid)
      self._load[w] += cost
      self._pending[ref.media_id] = (w, cost)
      tasks = self._tasks[w]
    while True:
      try:
        tasks.put((ref.media_id, ref.kind, ref.path), timeout=PARENT_CHECK_S)
        return w
      except queue.Full:
        with self._lock:
          if self._tasks[w] is not tasks:
            return w  # the worker was restarted meanwhile: the item failed with it

  def abandon(self, media_id: str) -> None:
    """Kills the worker decoding `media_id` (a decoder hung past the loader's
    timeout): it is restarted, and the items queued behind it fail (counted
    skips) instead of each waiting out the timeout in turn."""
    with self._lock:
      # While the item is pending its worker has not been replaced, so this
      # is the process that holds it.
      pending = self._pending.get(media_id)
      if pending is None:
        return
      w = pending[0]
      log.error("preprocessor %d is stuck on %s; killing it", w, media_id)
      self._procs[w].kill()

  def _done(self, media_id: str) -> None:
    with self._lock:
      w, cost = self._pending.pop(media_id, (None, 0))
      if w is not None:
        self._load[w] -= cost

  def _collect(self) -> None:
    while not self._closed.is_set():
      try:
        msg = self._results.get(timeout=0.2)
      except queue.Empty:
        self._check_alive()
        continue
      except (EOFError, OSError):
        return
      if msg[0] == "ok":
        _, _, media_id, slot, array, shape, grid, dt = msg
        self._done(media_id)
        self.decode_s += dt
        self.store.set_ready(media_id, slot=slot, shape=shape, grid=grid, array=array, decode_s=dt)
      else:
        _, _, media_id, reason = msg
        self._done(media_id)
        self.store.set_failed(media_id, reason)

  def _check_alive(self) -> None:
    for w, process in enumerate(self._procs):
      if self._stopping.is_set() or process.is_alive():
        continue
      log.error("preprocessor %d died (exit %s); restarting", w, process.exitcode)
      with self._lock:
        # Atomic with submit: no item is left behind in the dead queue.
        lost = [k for k, (pw, _) in self._pending.items() if pw == w]
        for media_id in lost:
          self._load[w] -= self._pending.pop(media_id)[1]
        self._tasks[w] = self._ctx.Queue(self._queue_size)
        self._procs[w] = self._start(w)
        self.restarts += 1
      for media_id in lost:
        self.store.set_failed(media_id, f"worker {w} died")

  def close(self, timeout: float = 5.0) -> None:
    """Stops the workers (joins, then kills stragglers)."""
    if self._stopping.is_set():
      return
    self._stopping.set()
    for q in self._tasks:
      try:
        q.put(None, timeout=0.5)
      except queue.Full:
        pass
    deadline = time.monotonic() + timeout
    for process in self._procs:
      process.join(max(0.0, deadline - time.monotonic()))
    for process in self._procs:
      if process.is_alive():
        process.kill()  # it ignores SIGTERM (faults.leave_stop_signals_to_parent)
        process.join(1.0)
    # Drain results that landed after the last poll, so their slots unlink.
    self._closed.set()
    self._collector.join(2.0)
    while True:
      try:
        msg = self._results.get(timeout=0.05)
      except (queue.Empty, EOFError, OSError):
        break
      if msg[0] == "ok":
        self.store.set_ready(msg[2], slot=msg[3], shape=msg[5], grid=msg[6], array=msg[4])
    for q in self._tasks + [self._results]:
      q.close()
      q.cancel_join_thread()

  def __enter__(self) -> WorkerPool:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
