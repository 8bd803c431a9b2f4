"""Reward functions and the asynchronous reward scheduler (Flexes section 4.3).

Registry. A reward function is `fn(response: str, answer: str) -> float` in
[0, 1], registered by name (`register`, `get`, `REWARDS`). It must be a module-
level function (or a functools.partial of one): it is pickled into spawned
worker processes. Built in, matching the synthetic tasks (fluxjax/data/synth.py
answers are an integer or a colour/shape word; the system prompts of
models/tokenizer.py ask for "the final answer inside <answer></answer>" or "a
single number or word", and its corpus answers as "<answer>x</answer>",
"Answer: x", "The answer is x." or a bare "x"):

  exact                 extracted answer == reference, case- and
                        punctuation-insensitive.
  numeric               both parse as numbers and |x - y| <= abs_tol +
                        rel_tol * |y| (defaults 1e-6, 1e-6).
  accuracy              numeric when the reference is a number, else exact.
  format                1 iff the response is `[<think>...</think>] <answer>
                        x</answer>` and nothing else.
  accuracy_with_format  0.9 * accuracy + 0.1 * format (R1-style shaping).

Controls (bench/learning.py): accuracy_reversed (1 - accuracy), random (a
fair coin per call, independent of the response) and constant (0).

`extract_answer` takes, in order: the last <answer>...</answer>, the last
"answer is x" / "Answer: x", else the last number (numeric reference) or
the last word.

Scheduler. `RewardScheduler` runs reward calls in a pool of spawned worker
processes as responses arrive: `submit` returns a Future of a
`RewardResult`, `poll` drains the results finished since the last poll, and
`gather` waits. Each call gets the Flexes adaptive timeout

  T = min(max(t_min, anchor_factor * T_anchor), t_max)

where T_anchor is the slowest *correct* call (reward >= correct_threshold)
seen so far for the call's `key` (e.g. the prompt id: Flexes anchors per test
case; key None shares one anchor). Before any correct call T = t_max: there is
no evidence yet of how long a correct answer takes, so nothing is cut early.
A call that exceeds T has its worker killed (SIGKILL: a hung sandbox may ignore
SIGTERM) and replaced, and yields reward 0 with status "timeout"; a call that
raises, returns a value that is not a finite number, or whose worker dies,
yields 0 with status "error". Each such call is logged with its key and tag
(the producer's key is the sample id) and counted (`reward/timeout`,
`reward/error`). The pool keeps serving either way. Durations are measured
inside the worker (compute time, not queueing); the deadline is counted from
dispatch to a worker that has already finished starting up.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import importlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import random
import re
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Iterable
from typing import Any

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register(name: str):
  """Decorator adding a reward function to REWARDS under `name`."""

  def wrap(fn):
    if name in REWARDS:
      raise ValueError(f"reward {name!r} is already registered")
    REWARDS[name] = fn
    return fn

  return wrap


def get(name_or_fn: str | RewardFn) -> RewardFn:
  """A reward function: a registered name, "package.module:function", or a callable.

  The import path is how a user plugs in their own reward without editing
  fluxjax (veRL's custom_reward_function): `--config.rl.reward.fn=my.mod:score`.
  The module must be importable by the spawned reward workers.
  """
  if callable(name_or_fn):
    return name_or_fn
  if ":" in name_or_fn:
    module_name, _, attr = name_or_fn.partition(":")
    try:
      fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
      raise KeyError(f"cannot load reward {name_or_fn!r}: {e}") from None
    if not callable(fn):
      raise KeyError(f"reward {name_or_fn!r} is not callable")
    return fn
  try:
    return REWARDS[name_or_fn]
  except KeyError:
    raise KeyError(f"unknown reward {name_or_fn!r}; known: {sorted(REWARDS)}") from None


# ---------------------------------------------------------------------------
# Answer extraction and the registry.

_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_PHRASE_RE = re.compile(r"answer(?:\s+is|\s*:)\s*([^\n<]*)", re.I)
_NUMBER_RE = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|[-+]?\.\d+")
_WORD_RE = re.compile(r"[A-Za-z]+")
# One optional think block (no nested or repeated tags), then one answer.
_FORMAT_RE = re.compile(
  r"\s*(?:<think>(?:(?!</?think>).)*</think>\s*)?<answer>([^<]*)</answer>\s*", re.S
)


def extract_answer(response: str) -> str:
  """The answer part of a response (see the module docstring for the order)."""
  tags = _TAG_RE.findall(response)
  if tags:
    return tags[-1].strip()
  phrases = _PHRASE_RE.findall(response)
  if phrases and phrases[-1].strip():
    return phrases[-1].strip()
  return response.strip()


def normalize(text: str) -> str:
  """Lower case, outer whitespace, quotes and trailing punctuation removed."""
  text = text.strip().lower()
  text = re.sub(r"\s+", " ", text)
  return text.strip(" .,;:!?\"'`$()[]{}")


def parse_number(text: str) -> float | None:
  """The last number in text (thousands commas allowed), or None."""
  found = _NUMBER_RE.findall(text)
  if not found:
    return None
  try:
    return float(found[-1].replace(",", ""))
  except ValueError:
    return None


def _is_number(text: str) -> bool:
  return re.fullmatch(r"\s*" + _NUMBER_RE.pattern + r"\s*", text) is not None


@register("exact")
def exact_answer(response: str, answer: str) -> float:
  """1 if the extracted answer equals the reference (normalized), else 0."""
  got = normalize(extract_answer(response))
  want = normalize(answer)
  if got == want:
    return 1.0
  # A bare or phrased answer may carry words around it ("It is red."): accept
  # when its last word is the reference, for single-word references.
  words = _WORD_RE.findall(got)
  return float(bool(words) and " " not in want and words[-1] == want)


@register("numeric")
def numeric_answer(
  response: str, answer: str, *, abs_tol: float = 1e-6, rel_tol: float = 1e-6
) -> float:
  """1 if the last number of the extracted answer is within tolerance."""
  want = parse_number(answer)
  got = parse_number(extract_answer(response))
  if want is None or got is None or not math.isfinite(got):
    return 0.0
  return float(abs(got - want) <= abs_tol + rel_tol * abs(want))


@register("accuracy")
def accuracy(response: str, answer: str) -> float:
  """numeric for numeric references, exact otherwise."""
  if _is_number(answer):
    return numeric_answer(response, answer)
  return exact_answer(response, answer)


@register("format")
def format_reward(response: str, answer: str) -> float:
  """1 iff the response is `[<think>...</think>] <answer>x</answer>` only."""
  del answer  # the format does not depend on the reference
  m = _FORMAT_RE.fullmatch(response)
  return float(m is not None and m.group(1).strip() != "")


@register("accuracy_with_format")
def accuracy_with_format(response: str, answer: str) -> float:
  """0.9 * accuracy + 0.1 * format: correctness dominates, format is shaping."""
  return 0.9 * accuracy(response, answer) + 0.1 * format_reward(response, answer)


# Controls for showing that training follows the reward (bench/learning.py).


@register("accuracy_reversed")
def accuracy_reversed(response: str, answer: str) -> float:
  """1 - accuracy: a policy trained on it must get worse at the task."""
  return 1.0 - accuracy(response, answer)


@register("random")
def random_reward(response: str, answer: str) -> float:
  """1 or 0 by a fair coin, independent of the response: GRPO then gets
  advantages of full size that carry no information about the task, so any
  gain it shows is not learning from the reward."""
  del response, answer
  return float(random.random() < 0.5)


@register("constant")
def constant(response: str, answer: str) -> float:
  """0 for every response: GRPO advantages are all zero, the policy gets no signal."""
  del response, answer
  return 0.0


# ---------------------------------------------------------------------------
# Worker processes.


def _worker_main(conn) -> None:
  """Loop of a spawned worker: (id, fn, response, answer) -> (id, status, value, secs)."""
  conn.send(("ready",))
  while True:
    try:
      msg = conn.recv()
    except (EOFError, OSError):
      return
    if msg is None:
      return
    task_id, fn, response, answer = msg
    start = time.perf_counter()
    value: float | str  # the reward, or the error's description
    try:
      reward = float(get(fn)(response, answer))
      status, value = (
        ("ok", reward) if math.isfinite(reward) else ("error", f"non-finite reward {reward}")
      )
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
  """

  reward: float
  status: str
  elapsed: float
  timeout: float
  key: Hashable = None
  tag: Any = None
  error: str = ""


@dataclasses.dataclass
class _Task:
  id: int
  fn: str | RewardFn
  response: str
  answer: str
  key: Hashable
  tag: Any
  future: concurrent.futures.Future
  timeout: float = math.nan


class RewardScheduler:
  """Asynchronous reward computation with Flexes' adaptive timeout.

  Use as a context manager (or call `shutdown`): worker processes are killed
  on exit.

    with RewardScheduler(num_workers=4) as rs:
      fut = rs.submit(response, answer, fn="accuracy", key=prompt_id, tag=i)
      ...
      for result in rs.poll(): ...

  Args:
    num_workers: worker processes.
    fn: default reward function (registry name or module-level callable).
    t_min, t_max, anchor_factor: the timeout T = min(max(t_min,
      anchor_factor * T_anchor), t_max) (Flexes: 2 s, 30 s, 1.5).
    correct_threshold: a call is "correct" (may move the anchor) when its
      reward >= this.
  """

  def __init__(
    self,
    num_workers: int = 4,
    fn: str | RewardFn = "accuracy_with_format",
    t_min: float = 2.0,
    t_max: float = 30.0,
    anchor_factor: float = 1.5,
    correct_threshold: float = 1.0,
  ):
    if num_workers < 1 or not 0 < t_min <= t_max:
      raise ValueError(
        f"need num_workers >= 1 and 0 < t_min <= t_max, got {num_workers}, {t_min}, {t_max}"
      )
    self.fn, self.t_min, self.t_max = fn, float(t_min), float(t_max)
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
  def from_config(cls, cfg) -> RewardScheduler:
    """From the `rl.reward` section of the run config (configs/vlm.py)."""
    return cls(
      num_workers=cfg.num_workers,
      fn=cfg.fn,
      t_min=cfg.t_min,
      t_max=cfg.t_max,
      anchor_factor=cfg.anchor_factor,
      correct_threshold=cfg.correct_threshold,
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
    fn: str | RewardFn | None = None,
    key: Hashable = None,
    tag: Any = None,
  ) -> concurrent.futures.Future:
    """Queues one reward call; returns a Future of its RewardResult."""
    future: concurrent.futures.Future[RewardResult] = concurrent.futures.Future()
    with self._lock:
      if self._closed:
        raise RuntimeError("RewardScheduler is shut down")
      task = _Task(
        self._next_id, fn if fn is not None else self.fn, response, answer, key, tag, future
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
        w.conn.send((task.id, task.fn, task.response, task.answer))
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
      result = RewardResult(value, "ok", elapsed, task.timeout, task.key, task.tag)
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


__all__ = [
  "REWARDS",
  "RewardFn",
  "RewardResult",
  "RewardScheduler",
  "accuracy",
  "accuracy_with_format",
  "exact_answer",
  "extract_answer",
  "format_reward",
  "get",
  "normalize",
  "numeric_answer",
  "parse_number",
  "register",
]
