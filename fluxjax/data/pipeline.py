"""The controller side of the ShadowLoader: a Grain pipeline of metadata only.

`ShadowLoader` hands out batches of `SampleMeta`; the controller holds `SampleMeta` and
`MediaRef` only, and patches stay in the workers' store until a materializer reads them.
`meta_dataset` is its Grain MapDataset.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Sequence

import grain

from fluxjax import faults as faults_lib
from fluxjax.data import meta as meta_lib
from fluxjax.data import readers
from fluxjax.data import store as store_lib
from fluxjax.data import workers as workers_lib
from fluxjax.models import processor

log = logging.getLogger(__name__)


def meta_dataset(
  rows: Sequence[dict],
  proc: processor.VisionProcessorConfig,
  *,
  seed: int = 0,
  shuffle: bool = True,
  num_epochs: int | None = None,
  limits: meta_lib.MediaLimits = meta_lib.MediaLimits(),
) -> grain.MapDataset:
  """The metadata MapDataset: shuffled rows -> SampleMeta (uid = position).

  Args:
    rows: normalized rows (`readers.read_rows`).
    proc: the processor configuration (token counts follow its resize rule).
    seed: shuffle seed (per epoch, Grain's).
    shuffle: shuffle the rows.
    num_epochs: passes over the rows; None repeats forever.
    limits: media size limits.
  """
  ds = grain.MapDataset.source(readers.RowSource(rows)).seed(seed)
  if shuffle:
    ds = ds.shuffle()
  ds = ds.repeat(num_epochs)
  return ds.map_with_index(meta_lib.ToMeta(proc, limits))


# (needle, kind), first match wins. Reasons start with a phrase of our own
# (models/media.py, data/workers.py, data/store.py, this module); a decoder's
# message follows it, so the phrases that lead a reason come first.
_SKIP_KINDS = (
  ("not found", "missing"),
  ("not a regular file", "missing"),
  ("stream ended early", "truncated"),
  ("decompression-bomb", "size"),
  ("out of memory", "size"),
  ("cannot preprocess", "preprocess"),
  ("cannot open video", "unsupported"),
  ("no video stream", "unsupported"),
  ("cannot decode", "corrupt"),
  ("cannot read", "corrupt"),
  ("unknown frame rate", "corrupt"),
  ("has no frames", "corrupt"),
  ("bad frame size", "corrupt"),
  ("empty image", "corrupt"),
  ("the header said", "corrupt"),
  ("exceed", "size"),
  ("side below", "size"),
  ("size rejected", "size"),
  ("decoded grid", "size"),
  ("died", "worker"),
  ("worker could not", "worker"),
  ("timed out", "timeout"),
)


def skip_kind(reason: str) -> str:
  """A coarse class of a skip reason, for per-kind metrics."""
  for needle, kind in _SKIP_KINDS:
    if needle in reason:
      return kind
  return "other"


@dataclasses.dataclass
class _Slot:
  meta: meta_lib.SampleMeta
  state_after: dict  # Grain state once this sample was pulled


class ShadowLoader:
  """Batches of SampleMeta whose media are decoded and stored by workers.

    rows -> MapDataset.source().seed().shuffle().repeat().map_with_index(ToMeta)
         -> iterator (Grain threads probe headers ahead)
         -> lookahead window: each sample's media go to the least-loaded
            preprocessor as soon as it is pulled (prefetch)
         -> next_batch(): the first batch_size samples, in stream order, whose
            media decoded

  Args:
    rows: normalized rows, or a path to a .jsonl / .parquet dataset.
    batch_size: samples per batch (held even when samples are skipped).
    proc: the processor configuration.
    num_workers: preprocessor processes (0: no decoding, metadata only).
    seed: shuffle seed.
    shuffle: shuffle the rows.
    num_epochs: passes over the data; None repeats forever.
    lookahead: samples kept in flight (default: two batches, i.e. the next
      batch is decoded while the current one trains).
    store_bytes: budget of the host store; prefetching beyond the current
      batch stops while it is full.
    limits: media size budgets, checked from headers by the probe and by
      every worker decode.
    read_threads: Grain threads probing headers ahead.
    transport: worker result transport ("shm" or "pickle").
    decode_timeout_s: a decode that takes longer (a hung decoder) is a
      counted skip rather than a stalled run.
  """

  def __init__(
    self,
    rows: Sequence[dict] | str,
    batch_size: int,
    proc: processor.VisionProcessorConfig,
    *,
    num_workers: int = 2,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = None,
    lookahead: int | None = None,
    store_bytes: int = 2 << 30,
    limits: meta_lib.MediaLimits = meta_lib.MediaLimits(),
    read_threads: int = 2,
    transport: str = "shm",
    decode_timeout_s: float = 300.0,
  ):
    if isinstance(rows, str):
      rows = readers.read_rows(rows)
    self.batch_size = batch_size
    self.num_rows = len(rows)
    # Skips in a row: a whole pass over the rows without a usable sample stops.
    self._skips = faults_lib.Streak("skipped_samples", limit=self.num_rows)
    self.proc = proc
    self.decode_timeout_s = decode_timeout_s
    self.lookahead = max(lookahead or 2 * batch_size, batch_size)
    self._ds = meta_dataset(
      rows, proc, seed=seed, shuffle=shuffle, num_epochs=num_epochs, limits=limits
    )
    self._read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=self.lookahead)
    self._iter = iter(self._ds.to_iter_dataset(self._read))
    self._committed = self._iter.get_state()
    self._window: collections.deque[_Slot] = collections.deque()
    self._exhausted = False
    self.store = store_lib.MetaStore(store_bytes)
    self.pool = (
      workers_lib.WorkerPool(num_workers, proc, self.store, transport=transport, limits=limits)
      if num_workers
      else None
    )
    self.skipped = 0
    self.skip_reasons: collections.Counter = collections.Counter()
    self.emitted = 0
    self.wait_s = 0.0  # time next_batch spent waiting for workers
    self.last_wait_s = 0.0

  # Prefetch --------------------------------------------------------------
  def _good_in_window(self) -> int:
    return sum(1 for s in self._window if s.meta.error is None)

  def _pull(self) -> bool:
    try:
      sample = next(self._iter)
    except StopIteration:
      self._exhausted = True
      return False
    self._window.append(_Slot(sample, self._iter.get_state()))
    if sample.error is None and self.pool is not None:
      for ref in sample.media:
        self.pool.submit(ref)
    return True

  def _fill(self) -> None:
    """Tops the window up: the current batch always, the lookahead in budget."""
    while not self._exhausted:
      # Bounded: a dataset of nothing but bad rows must reach next_batch's
      # whole-pass check instead of being pulled forever.
      if (
        self._good_in_window() < self.batch_size
        and len(self._window) < self.lookahead + self.num_rows
      ) or (len(self._window) < self.lookahead and self.store.has_room()):
        self._pull()
      else:
        return

  # Batches ---------------------------------------------------------------
  def _skip(self, sample: meta_lib.SampleMeta, reason: str) -> None:
    self.skipped += 1
    self.skip_reasons[skip_kind(reason)] += 1
    log.warning("skipping sample %s (uid %d): %s", sample.id, sample.uid, reason)
    for ref in sample.media:
      self.store.release(ref.media_id)

  def _media_status(self, sample: meta_lib.SampleMeta) -> str | None:
    """Waits for a sample's media; returns the first failure reason or None."""
    for ref in sample.media:
      if self.pool is None:
        continue
      try:
        entry = self.store.wait(ref.media_id, self.decode_timeout_s)
      except TimeoutError:
        reason = f"decode timed out after {self.decode_timeout_s} s"
        self.store.set_failed(ref.media_id, reason)
        # The worker is stuck in it: restart it rather than let the items
        # queued behind it wait out the timeout one by one.
        self.pool.abandon(ref.media_id)
        return f"{ref.path}: {reason}"
      if entry.status == store_lib.FAILED:
        return f"{ref.path}: {entry.reason}"
    return None

  def next_batch(self) -> list[meta_lib.SampleMeta]:
    """The next batch_size usable samples (fewer only at the end of data).

    A sample whose file is missing, corrupt, truncated, unsupported or outside the size
    limits is skipped (id and reason logged, counted) and the next one takes its place.

    Raises:
      StopIteration: the data is exhausted (finite num_epochs).
    """
    batch: list[meta_lib.SampleMeta] = []
    waited = 0.0
    while len(batch) < self.batch_size:
      self._fill()
      if not self._window:
        break
      slot = self._window[0]
      sample = slot.meta
      reason = sample.error
      if reason is None:
        start = time.perf_counter()
        reason = self._media_status(sample)
        waited += time.perf_counter() - start
      self._window.popleft()
      self._committed = slot.state_after
      if reason is not None:
        self._skip(sample, reason)
        if self._skips.fail():  # with repeating epochs this would loop forever
          raise RuntimeError(
            f"no usable sample in a whole pass over the {self.num_rows} rows "
            f"(skips by kind: {dict(self.skip_reasons)}; last: {reason})"
          )
        continue
      self._skips.ok()
      batch.append(sample)
    self.last_wait_s = waited
    self.wait_s += waited
    if not batch:
      raise StopIteration
    self.emitted += len(batch)
    # Prefetch the next batch now, so its decode overlaps this step.
    self._fill()
    return batch

  def __iter__(self):
    return self

  def __next__(self) -> list[meta_lib.SampleMeta]:
    return self.next_batch()

  def release(self, batch: Sequence[meta_lib.SampleMeta]) -> None:
    """Evicts a consumed batch's patches from the store."""
    for sample in batch:
      for ref in sample.media:
        self.store.release(ref.media_id)

  # State -----------------------------------------------------------------
  def get_state(self) -> dict:
    """JSON-serializable state: resume after the last sample handed out.

    It is the Grain iterator state just after the last sample handed out or skipped, so
    a restored loader continues with the first sample no batch has seen (samples in the
    lookahead window are pulled again, never lost).
    """
    return {"grain": dict(self._committed), "skipped": self.skipped, "emitted": self.emitted}

  def set_state(self, state: dict) -> None:
    """Restores `get_state()`; in-flight prefetches are dropped."""
    for slot in self._window:
      for ref in slot.meta.media:
        self.store.release(ref.media_id)
    self._window.clear()
    self._exhausted = False
    self._iter.set_state(state["grain"])
    self._committed = self._iter.get_state()
    self.skipped = int(state.get("skipped", 0))
    self.emitted = int(state.get("emitted", 0))

  def metrics(self) -> dict:
    """Slash-namespaced counters for the metrics writer."""
    out = {
      "data/emitted": self.emitted,
      "data/skipped": self.skipped,
      "data/wait_s": self.wait_s,
      "data/store_bytes": self.store.bytes_in_use,
      "data/store_peak_bytes": self.store.peak_bytes,
    }
    for kind, n in self.skip_reasons.items():
      out[f"data/skipped/{kind}"] = n
    return out

  def close(self) -> None:
    """Stops the workers and frees every stored slot."""
    if self.pool is not None:
      self.pool.close()
    self.store.close()

  def __enter__(self) -> ShadowLoader:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
