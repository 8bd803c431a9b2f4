"""The asynchronous reward scheduler (Flexes section 4.3).

`RewardScheduler` runs the run's reward (rl/reward_spec.py) in a pool of spawned worker
processes as responses arrive: `submit` returns a Future of a `RewardResult`, `poll`
drains the results finished since the last poll, and `gather` waits. A call past its
timeout, or one that fails, yields 0 and is counted; the pool keeps serving. Why t_max
first, and how calls are timed: docs/rewards.md.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import multiprocessing
import multiprocessing.connection
import threading
import time
import traceback
from collections.abc import Hashable, Iterable
from typing import Any

from fluxjax import faults
from fluxjax import settings as settings_lib
from fluxjax.rl import reward_spec
from fluxjax.rl.reward_spec import RewardContext, RewardFn, Term

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# Worker processes.


def _worker_main(conn) -> None:
  """Loop of a spawned worker: (id, terms, response, answer, context) ->
  (id, status, (reward, per-term values) or the error, secs)."""
  faults.leave_stop_signals_to_parent()
  conn.send(("ready",))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    task_id, terms, response, answer, context = msg
    start = time.perf_counter()
    value: tuple[float, dict[str, float]] | str  # the reward and its terms, or the error
    try:
      fns = [reward_spec.load(t.fn) for t in terms]
      status, value = "ok", reward_spec.score(terms, fns, response, answer, context)
    except BaseException:
      status, value = "error", traceback.format_exc(limit=3)
    conn.send((task_id, status, value, time.perf_counter() - start))


class _Worker:
  """One spawned process and the parent's end of its pipe."""

  def __init__(self, ctx):
    self.conn, child = ctx.Pipe(duplex=True)
    self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="fluxjax-reward")
    self.proc.start()
    child.close()
    self.ready = False
    self.task = None  # the _Task it runs
    self.deadline = math.inf

  def kill(self) -> None:
    if self.proc.is_alive():
      self.proc.kill()
    self.proc.join(timeout=5)
    self.conn.close()


@dataclasses.dataclass
class RewardResult:
  """The outcome of one reward call.

  Attributes:
    reward: the reward; 0 on timeout or error.
    status: "ok", "timeout", "error" or "cancelled" (scheduler shut down).
    elapsed: compute seconds in the worker (the timeout for "timeout").
    timeout: the timeout T the call ran under.
    key: the anchor key given to submit.
    tag: caller's metadata, returned untouched (e.g. a sample id).
    error: traceback or reason for "error".
    terms: each reward function's value (empty unless "ok").
  """

  reward: float
  status: str
  elapsed: float
  timeout: float
  key: Hashable = None
  tag: Any = None
  error: str = ""
  terms: dict[str, float] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Task:
  id: int
  terms: tuple[Term, ...]
  response: str
  answer: str
  context: RewardContext
  key: Hashable
  tag: Any
  future: concurrent.futures.Future
  timeout: float = math.nan


class RewardScheduler:
  """Asynchronous reward computation with Flexes' adaptive timeout.

  Each call gets T = min(max(t_min, anchor_factor * T_anchor), t_max), T_anchor being the
  slowest correct call (reward >= correct_threshold) seen so far for its `key` (None
  shares one anchor), and t_max before any. A call past T (its worker killed and
  replaced), or one that raises, returns no finite number or loses its worker, yields 0
  with status "timeout" or "error", logged with its key and tag and counted.

  Use as a context manager (or call `shutdown`): worker processes are killed
  on exit.

    with RewardScheduler(num_workers=4) as rs:
      fut = rs.submit(response, answer, key=prompt_id, tag=i)
      ...
      for result in rs.poll(): ...

  Args:
    num_workers: worker processes.
    fn: the default reward: a spec (rl/reward_spec.py), a module-level
      callable, or terms.
    t_min, t_max, anchor_factor: the timeout T = min(max(t_min,
      anchor_factor * T_anchor), t_max) (Flexes: 2 s, 30 s, 1.5).
    correct_threshold: a call is "correct" (may move the anchor) when its
      reward >= this.
  """

  def __init__(
    self,
    num_workers: int = 4,
    fn: str | RewardFn | tuple[Term, ...] = "accuracy_with_format",
    t_min: float = 2.0,
    t_max: float = 30.0,
    anchor_factor: float = 1.5,
    correct_threshold: float = 1.0,
  ):
    if num_workers < 1 or not 0 < t_min <= t_max:
      raise ValueError(
        f"need num_workers >= 1 and 0 < t_min <= t_max, got {num_workers}, {t_min}, {t_max}"
      )
    self.terms = reward_spec.terms_of(fn)
    self.t_min, self.t_max = float(t_min), float(t_max)
    self.anchor_factor, self.correct_threshold = float(anchor_factor), correct_threshold
    self._ctx = multiprocessing.get_context("spawn")
    self._lock = threading.Lock()
    self._pending: collections.deque[_Task] = collections.deque()
    self._done: collections.deque[RewardResult] = collections.deque()
    self._anchors: dict[Hashable, float] = {}
    self._counts: collections.Counter[str] = collections.Counter()
    self._next_id = 0
    self._closed = False
    # Wakes the dispatcher when work is submitted or on shutdown.
    self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
    self._workers = [_Worker(self._ctx) for _ in range(num_workers)]
    self._thread = threading.Thread(target=self._run, name="reward-dispatcher", daemon=True)
    self._thread.start()

  @classmethod
  def from_config(cls, reward: settings_lib.Reward) -> RewardScheduler:
    """From the `rl.reward` section of the run config (configs/vlm.py)."""
    return cls(
      num_workers=reward.num_workers,
      fn=reward_spec.parse(reward.fn, reward.weights),
      t_min=reward.t_min,
      t_max=reward.t_max,
      anchor_factor=reward.anchor_factor,
      correct_threshold=reward.correct_threshold,
    )

  # --- public API ---------------------------------------------------------

  def timeout_for(self, key: Hashable = None) -> float:
    """The timeout a call with this anchor key would get now."""
    with self._lock:
      return self._timeout_locked(key)

  def submit(
    self,
    response: str,
    answer: str,
    fn: str | RewardFn | tuple[Term, ...] | None = None,
    key: Hashable = None,
    tag: Any = None,
    context: RewardContext | None = None,
  ) -> concurrent.futures.Future:
    """Queues one reward call (`fn`: another reward than the default); returns
    a Future of its RewardResult."""
    future: concurrent.futures.Future[RewardResult] = concurrent.futures.Future()
    with self._lock:
      if self._closed:
        raise RuntimeError("RewardScheduler is shut down")
      terms = self.terms if fn is None else reward_spec.terms_of(fn)
      task = _Task(
        self._next_id, terms, response, answer, context or RewardContext(), key, tag, future
      )
      self._next_id += 1
      self._pending.append(task)
      self._counts["submitted"] += 1
    self._wake()
    return future

  def poll(self) -> list[RewardResult]:
    """Results finished since the last poll, in completion order (non-blocking)."""
    out = []
    with self._lock:
      while self._done:
        out.append(self._done.popleft())
    return out

  def gather(
    self, futures: Iterable[concurrent.futures.Future], timeout: float | None = None
  ) -> list[RewardResult]:
    """Waits for the given futures; their results in the given order."""
    futures = list(futures)
    concurrent.futures.wait(futures, timeout=timeout)
    return [f.result(timeout=0) for f in futures]

  def metrics(self) -> dict[str, float]:
    """Counters and timeout state, slash-namespaced for the metrics writer."""
    with self._lock:
      c = self._counts
      out = {
        f"reward/{k}": float(c[k])
        for k in ("submitted", "completed", "ok", "correct", "timeout", "error", "worker_restarts")
      }
      out["reward/pending"] = float(len(self._pending))
      out["reward/running"] = float(sum(w.task is not None for w in self._workers))
      out["reward/timeout_s"] = self._timeout_locked(None)
      out["reward/anchor_s"] = self._anchors.get(None, math.nan)
      return out

  def shutdown(self) -> None:
    """Stops the dispatcher, kills workers, and cancels unfinished calls."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    self._wake()
    self._thread.join(timeout=10)
    for w in self._workers:
      try:
        w.conn.send(None)
      except (OSError, ValueError):
        pass
    for w in self._workers:
      w.proc.join(timeout=1)
      w.kill()
      if w.task is not None:
        self._finish(
          w.task,
          RewardResult(0.0, "cancelled", 0.0, w.task.timeout, w.task.key, w.task.tag, "shut down"),
        )
        w.task = None
    while self._pending:
      t = self._pending.popleft()
      self._finish(t, RewardResult(0.0, "cancelled", 0.0, math.nan, t.key, t.tag, "shut down"))
    self._wake_r.close()
    self._wake_w.close()

  def __enter__(self) -> RewardScheduler:
    return self

  def __exit__(self, *exc) -> None:
    self.shutdown()

  # --- internals ----------------------------------------------------------

  def _timeout_locked(self, key: Hashable) -> float:
    anchor = self._anchors.get(key)
    if anchor is None:
      return self.t_max
    return min(max(self.t_min, self.anchor_factor * anchor), self.t_max)

  def _wake(self) -> None:
    try:
      self._wake_w.send_bytes(b"x")
    except (OSError, ValueError):
      pass

  def _finish(self, task: _Task, result: RewardResult) -> None:
    if result.status in ("error", "timeout"):
      # The last line of a traceback names the exception; the rest is in it.
      lines = result.error.strip().splitlines() or [""]
      log.warning(
        "reward call %s (key %r, tag %r), scored 0: %s",
        result.status,
        result.key,
        result.tag,
        lines[-1],
      )
    with self._lock:
      self._counts["completed"] += 1
      self._counts[result.status] += 1
      if result.status == "ok" and result.reward >= self.correct_threshold:
        self._counts["correct"] += 1
        self._anchors[task.key] = max(self._anchors.get(task.key, 0.0), result.elapsed)
      self._done.append(result)
    if not task.future.done():
      task.future.set_result(result)

  def _replace(self, i: int) -> None:
    self._workers[i].kill()
    self._workers[i] = _Worker(self._ctx)
    with self._lock:
      self._counts["worker_restarts"] += 1

  def _dispatch(self) -> None:
    for w in self._workers:
      if not (w.ready and w.task is None):
        continue
      with self._lock:
        if not self._pending:
          return
        task = self._pending.popleft()
        task.timeout = self._timeout_locked(task.key)
      try:
        w.conn.send((task.id, task.terms, task.response, task.answer, task.context))
      except Exception as e:
        self._finish(
          task,
          RewardResult(
            0.0, "error", 0.0, task.timeout, task.key, task.tag, f"dispatch failed: {e!r}"
          ),
        )
        continue
      w.task, w.deadline = task, time.monotonic() + task.timeout

  def _on_message(self, i: int) -> None:
    w = self._workers[i]
    try:
      msg = w.conn.recv()
    except (EOFError, OSError):
      # The worker died (os._exit, segfault, OOM kill): its call is an error.
      task = w.task
      w.task = None
      w.proc.join(timeout=1)
      reason = f"worker died (exit code {w.proc.exitcode})"
      # Replace first, so that metrics read when the future resolves count it.
      self._replace(i)
      if task is not None:
        self._finish(
          task, RewardResult(0.0, "error", 0.0, task.timeout, task.key, task.tag, reason)
        )
      return
    if msg[0] == "ready":
      w.ready = True
      return
    _, status, value, elapsed = msg
    task, w.task, w.deadline = w.task, None, math.inf
    if task is None:
      return
    if status == "ok":
      reward, terms = value
      result = RewardResult(reward, "ok", elapsed, task.timeout, task.key, task.tag, terms=terms)
    else:
      result = RewardResult(0.0, "error", elapsed, task.timeout, task.key, task.tag, str(value))
    self._finish(task, result)

  def _run(self) -> None:
    while True:
      with self._lock:
        if self._closed:
          return
      self._dispatch()
      now = time.monotonic()
      for i, w in enumerate(self._workers):
        if w.task is not None and now >= w.deadline:
          task, w.task = w.task, None
          self._replace(i)
          self._finish(
            task,
            RewardResult(
              0.0, "timeout", task.timeout, task.timeout, task.key, task.tag, "timed out"
            ),
          )
      next_deadline = min((w.deadline for w in self._workers), default=math.inf)
      wait_s = min(max(next_deadline - time.monotonic(), 0.0), 0.5)
      conns = {w.conn: i for i, w in enumerate(self._workers)}
      ready = multiprocessing.connection.wait([*conns, self._wake_r], timeout=wait_s)
      for c in ready:
        if c is self._wake_r:
          while self._wake_r.poll():
            self._wake_r.recv_bytes()
        else:
          self._on_message(conns[c])
