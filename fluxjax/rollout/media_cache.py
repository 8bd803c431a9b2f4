"""Decoded media kept by what a request names, so a prompt's files are decoded once.

A GRPO step sends each prompt once per response, and an evaluation once per sample and
once greedily: every one of those requests names the same image and video files. SGLang
keeps a multimodal cache for the same reason. `MediaCache` keeps the decoded media by
`key`, with the preprocessing settings that shaped them.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading
from collections.abc import Callable, Hashable
from concurrent import futures

from fluxjax.models import processor

# A few hundred GPU-sized images or dozens of videos; each decoded once per
# step instead of once per response.
DEFAULT_MAX_BYTES = 512 << 20


def key(item: str, kind: str, settings: Hashable, is_path: bool) -> Hashable | None:
  """What identifies `item`'s decoded form: a path's identity, or the hash of
  anything else (base64); None for a path that cannot be read (left to the
  decoder's own error).

  A path's identity is its path, size and modification time (a rewritten file is
  decoded again); both forms go with the preprocessing `settings`.
  """
  if is_path:
    try:
      st = os.stat(item)
    except OSError:
      return None
    return ("path", kind, os.path.realpath(item), st.st_size, st.st_mtime_ns, settings)
  return ("data", kind, hashlib.sha256(item.encode()).hexdigest(), settings)


class MediaCache:
  """Thread-safe LRU of decoded, preprocessed media.

  Entries past `max_bytes` of patches go least recently used first. A request for an
  item another thread is decoding waits for that decode (a group's requests arrive
  together); a failed decode is not kept, and each of its waiters gets its error.
  """

  def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
    self.max_bytes = max_bytes
    self._lock = threading.Lock()
    self._done: collections.OrderedDict[Hashable, processor.ProcessedVision] = (
      collections.OrderedDict()
    )
    self._pending: dict[Hashable, futures.Future] = {}
    self._bytes = 0
    self.hits = self.misses = 0

  def get(
    self, k: Hashable, load: Callable[[], processor.ProcessedVision]
  ) -> processor.ProcessedVision:
    """The decoded item for key `k`, from `load()` on a miss. Its patches are
    read-only: every request of the group shares them."""
    with self._lock:
      if k in self._done:
        self._done.move_to_end(k)
        self.hits += 1
        return self._done[k]
      pending = self._pending.get(k)
      if pending is None:
        pending = self._pending[k] = futures.Future()
        self.misses += 1
        owner = True
      else:
        self.hits += 1
        owner = False
    if not owner:
      return pending.result()
    try:
      value = load()
    except BaseException as e:
      with self._lock:
        del self._pending[k]
      pending.set_exception(e)
      raise
    value.patches.setflags(write=False)
    with self._lock:
      del self._pending[k]
      self._keep(k, value)
    pending.set_result(value)
    return value

  def _keep(self, k: Hashable, value: processor.ProcessedVision) -> None:
    size = value.patches.nbytes
    if size > self.max_bytes:
      return
    self._done[k] = value
    self._bytes += size
    while self._bytes > self.max_bytes:
      _, old = self._done.popitem(last=False)
      self._bytes -= old.patches.nbytes

  def __len__(self) -> int:
    with self._lock:
      return len(self._done)
