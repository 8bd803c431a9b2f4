"""The rollout backend seam: what the RL side calls, whichever engine serves it.

Two backends implement `RolloutBackend`: `EmbeddedRollout` (rollout/embedded.py), the
engine in a thread of this process, and `Fleet` (rollout/fleet.py), SGLang-compatible
servers over HTTP. Every backend call is a coroutine, and all of a backend's coroutines
run on one event loop (a fleet's HTTP session belongs to the loop it was opened on):
`LoopThread` is that loop in a background thread (docs/design.md, section 2).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from fluxjax.rollout.protocol import Completion, GenerateRequest

if TYPE_CHECKING:  # the model code is JAX: the fleet client does not load it to type this
  from fluxjax.models import vlm
  from fluxjax.rollout.publish import PublishReport

log = logging.getLogger(__name__)

T = TypeVar("T")
B = TypeVar("B", bound="RolloutBackend")


@dataclasses.dataclass(frozen=True)
class SlotStats:
  """A slot engine's counters; a round reads them before and after it runs.

  Attributes:
    decode_steps: decode steps run so far (each step computes every slot).
    num_slots: sequences decoded together in one step.
  """

  decode_steps: int
  num_slots: int


@runtime_checkable
class Sampler(Protocol):
  """What a tail-batched round needs from a backend."""

  async def generate(self, request: GenerateRequest, group: str | None = None) -> Completion:
    """Runs one request to its end (or its abort).

    `group` keys prompt affinity (a GRPO group shares a server's prefix
    cache); None lets the backend derive it from the prompt.
    """
    ...

  async def abort(self, rid: str) -> None:
    """Aborts request `rid`; its `generate` returns with finish type abort."""
    ...

  def slot_stats(self) -> SlotStats | None:
    """The engine's slot counters, or None for a backend that has none."""
    ...


@runtime_checkable
class RolloutBackend(Sampler, Protocol):
  """A rollout backend as the coordinator drives it.

  `EmbeddedRollout` hands weights over as arrays and reports slot statistics (decode
  steps, slots) for tail batching's idle fraction; `Fleet` sends weights through a
  versioned HF folder (pause -> update_weights_from_disk -> continue) and counts retries
  and servers down. Its lifetime is `start` ... `close` on the loop every call runs on (also
  `async with backend:`); weight versions arrive through `publish`.
  """

  async def start(self) -> None:
    """Opens what the backend needs on the running loop (sessions, probes)."""
    ...

  async def close(self) -> None:
    """Releases everything `start` and the constructor acquired (threads, sessions)."""
    ...

  async def __aenter__(self: B) -> B: ...

  async def __aexit__(self, *exc: object) -> None: ...

  async def publish(self, model: vlm.Qwen25VL, version: int) -> PublishReport:
    """Makes `model`'s weights the policy every later request samples from.

    Args:
      model: the trainer's model; the backend may keep its arrays (the
        caller hands over its own copy).
      version: the policy version; completions report it as their
        `weight_version`.

    Returns:
      The report; `failed` names servers that did not take the update.
    """
    ...

  def metrics(self) -> dict[str, float]:
    """Counters for the metrics writer (retries, servers down); may be empty."""
    ...


class LoopThread:
  """An asyncio event loop in a daemon thread, for synchronous callers.

  Callable from synchronous code (the trainer); `running(backend)` holds a backend open
  (`start` ... `close`) on it for the duration of a `with` block.

  A context manager: the loop runs inside the `with` block and stops at its
  end.

  Args:
    name: the thread's name.
  """

  def __init__(self, name: str = "rollout"):
    self.loop = asyncio.new_event_loop()
    self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

  def start(self) -> None:
    """Starts the loop's thread (once; later calls do nothing)."""
    if self._thread.ident is None:
      self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Runs `coro` on the loop and waits for its result (or exception)."""
    return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

  def call_soon(self, fn: Callable[..., object], *args: object) -> None:
    """Schedules `fn(*args)` on the loop without waiting for it."""
    self.loop.call_soon_threadsafe(fn, *args)

  def stop(self, timeout: float = 30.0) -> None:
    """Stops the loop and joins its thread."""
    if self._thread.is_alive():
      self.loop.call_soon_threadsafe(self.loop.stop)
      self._thread.join(timeout=timeout)

  def __enter__(self) -> LoopThread:
    self.start()
    return self

  def __exit__(self, *exc: object) -> None:
    self.stop()

  @contextlib.contextmanager
  def running(self, backend: B, close_timeout: float = 60.0) -> Iterator[B]:
    """`backend` started on this loop for the block, and closed on it after.

    A failure to close is logged rather than raised: it must not hide the
    error that ended the block, and there is nothing left to do about it.
    """
    self.start()
    self.call(backend.start())
    try:
      yield backend
    finally:
      try:
        self.call(backend.close(), timeout=close_timeout)
      except Exception:
        log.exception("closing the rollout backend")
