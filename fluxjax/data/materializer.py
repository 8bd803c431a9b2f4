"""The Materializer: device vision buffers from the worker store, one step ahead.

`Materializer` is the `patch_source` of `fluxjax.parallel.batch.materialize`, reading an
item's patches when asked, or, with `prepare` and `wait`, reading the next step's items in
a thread while the current step runs. Each process materializes only its own devices'
items, so pixels never travel through the controller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fluxjax.data import store as store_lib


class Materializer:
  """Reads patches of MediaRefs from a MetaStore, synchronously or ahead.

  Multi-host: every process computes the same plan from metadata (or receives it
  broadcast) and materializes only its own devices' items; with a worker pool attached,
  an item its store lacks is sent to its local preprocessors first.

  Args:
    store: the host store the workers fill.
    pool: optional WorkerPool; items missing from the store are submitted to
      it (the multi-host path, where each process decodes its own items).
    timeout: seconds to wait for one item before failing.
  """

  def __init__(self, store: store_lib.MetaStore, pool=None, timeout: float | None = 600.0):
    self.store = store
    self.pool = pool
    self.timeout = timeout
    self._ready: dict[str, np.ndarray] = {}
    self._next: dict[str, np.ndarray] = {}
    self._thread: threading.Thread | None = None
    self._error: BaseException | None = None
    self.wait_s = 0.0  # total time steps waited on materialization
    self.last_wait_s = 0.0
    self.bytes_read = 0
    self.steps = 0

  # Synchronous -----------------------------------------------------------
  def fetch(self, item) -> np.ndarray:
    """The patches of one MediaRef (slice-aware), waiting if still decoding."""
    if self.pool is not None and item.media_id not in self.store:
      self.pool.submit(item)
    entry = self.store.wait(item.media_id, self.timeout)
    if entry.status == store_lib.FAILED:
      raise ValueError(f"{item.id} could not be preprocessed: {entry.reason}")
    out = self.store.read(item.media_id, item.patch_rows)
    self.bytes_read += out.nbytes
    return out

  def __call__(self, item) -> np.ndarray:
    """`patch_source` for batch.materialize: prepared patches, else fetch.

    Item -> float32 [num_patches, patch_dim], the rows of its (possibly sliced) MediaRef,
    identical to the processor's output for that file.
    """
    out = self._ready.get(item.id)
    if out is not None:
      return out
    return self.fetch(item)

  # One step ahead --------------------------------------------------------
  @staticmethod
  def local_items(
    placement: Mapping[tuple[int, int], Sequence], devices: Iterable[int] | None = None
  ) -> list:
    """Items of a `media_placement` on the given plan devices (None: all)."""
    keep = None if devices is None else set(devices)
    out, seen = [], set()
    for (_, d), items in sorted(placement.items(), key=lambda kv: kv[0]):
      if keep is not None and d not in keep:
        continue
      for item in items:
        if item.id not in seen:
          seen.add(item.id)
          out.append(item)
    return out

  def prepare(
    self, placement: Mapping[tuple[int, int], Sequence], devices: Iterable[int] | None = None
  ) -> None:
    """Starts reading the next step's local items in a background thread.

    Keeps only the items placed on this process's devices and reads their patches (only
    the rows each slice needs) while the current step runs.

    Args:
      placement: `batch.media_placement(plan, seqs, cfg)` of the next step.
      devices: this process's plan devices (`sharding.mesh.local_device_indices`);
        None means all (one host).
    """
    if self._thread is not None:
      raise RuntimeError("prepare() called twice without wait()")
    items = self.local_items(placement, devices)
    if self.pool is not None:
      # Send every missing item first so the workers run in parallel.
      for item in items:
        if item.media_id not in self.store:
          self.pool.submit(item)
    self._next, self._error = {}, None

    def run():
      try:
        for item in items:
          self._next[item.id] = self.fetch(item)
      except BaseException as e:  # pylint: disable=broad-except
        self._error = e

    self._thread = threading.Thread(target=run, daemon=True, name="fluxjax-materializer")
    self._thread.start()

  def wait(self) -> float:
    """Blocks until the prepared step is ready; returns (and records) the wait.

    It blocks only if the reading is not finished. After this, `__call__` serves the
    prepared items without blocking.
    """
    if self._thread is None:
      raise RuntimeError("wait() without prepare()")
    start = time.perf_counter()
    self._thread.join()
    waited = time.perf_counter() - start
    self._thread = None
    if self._error is not None:
      raise self._error
    self._ready, self._next = self._next, {}
    self.last_wait_s = waited
    self.wait_s += waited
    self.steps += 1
    return waited

  def release(self, items: Iterable | None = None) -> None:
    """Drops the current step's buffers and evicts consumed items.

    Args:
      items: the MediaRefs consumed (their whole media are evicted from the
        store); None evicts every item that was served from this step.
    """
    ids = (
      {item.media_id for item in items}
      if items is not None
      else {key.split("[")[0] for key in self._ready}
    )
    self._ready = {}
    for media_id in ids:
      self.store.release(media_id)
