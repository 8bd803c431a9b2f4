"""Reward functions for the loop tests, loaded by import path in reward workers."""

import hashlib
import os
import time

from fluxjax.rl import reward_fns


def hang_once(response: str, answer: str) -> float:
  """Hangs (an hour) on the first call of the run, then scores normally.

  The first caller creates $FLUXJAX_HANG_FLAG atomically; every later call,
  in any worker process, finds it and scores with `accuracy_with_format`.
  """
  try:
    fd = os.open(os.environ["FLUXJAX_HANG_FLAG"], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
  except FileExistsError:
    return reward_fns.get("accuracy_with_format")(response, answer)
  os.close(fd)
  time.sleep(3600)
  return 0.0


def signal_unless_numeric(response: str, answer: str) -> float:
  """0 for every response to a numeric-answer prompt (a group without signal);
  otherwise one of 256 levels from a hash of the response, so that a group of
  distinct responses has signal but for a 256^-(R-1) chance (a 0/1 hash left
  1 in 8 groups of 4 without it, and the test's refills could run out)."""
  if answer.strip().isdigit():
    return 0.0
  return hashlib.md5(response.encode()).digest()[0] / 255.0


def fail_on_marked_answers(response: str, answer: str) -> float:
  """Raises for the reference answer "raise", returns NaN for "nan" and inf
  for "inf"; 1 for any other."""
  if answer == "raise":
    raise RuntimeError(f"reward bug on {response!r}")
  if answer in ("nan", "inf"):
    return float(answer)
  return 1.0
