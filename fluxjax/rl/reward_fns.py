"""Reward functions: the registry and the built-in rewards.

A built-in reward function is `fn(response: str, answer: str) -> float` in [0, 1],
registered by name (`register`, `get`, `REWARDS`); rl/reward_spec.py says how a run
names its rewards. A callable handed to the reward pool must be a module-level function
(or a functools.partial of one): it is pickled into spawned worker processes
(rl/reward_pool.py). The built-in rewards, the controls and the order `extract_answer`
reads an answer in are told in docs/rewards.md, "Built-in rewards".
"""

from __future__ import annotations

import logging
import math
import random
import re
from collections.abc import Callable

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}
# Control reward -> the task reward its runs are evaluated with.
CONTROLS: dict[str, str] = {}


def register(name: str, control_of: str = ""):
  """Decorator adding a reward function to REWARDS under `name`; a control
  names the task reward `control_of` its evaluation scores with."""

  def wrap(fn):
    if name in REWARDS:
      raise ValueError(f"reward {name!r} is already registered")
    REWARDS[name] = fn
    if control_of:
      CONTROLS[name] = control_of
    return fn

  return wrap


def get(name_or_fn: str | RewardFn) -> RewardFn:
  """A registered reward function by name (or a callable, returned as is).

  A user's own reward, from a module or a file, and weighted sums of several
  are rl/reward_spec.py's.
  """
  if callable(name_or_fn):
    return name_or_fn
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


def reasons(response: str) -> bool:
  """Whether the response opens with a <think> block (leading whitespace aside)."""
  return response.lstrip().startswith("<think>")


def extract_answer(response: str) -> str:
  """The answer part of a response.

  In order: the last <answer>...</answer>, the last "answer is x" / "Answer: x", else
  the last number (numeric reference) or the last word.
  """
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


@register("accuracy_reversed", control_of="accuracy")
def accuracy_reversed(response: str, answer: str) -> float:
  """1 - accuracy: a policy trained on it must get worse at the task."""
  return 1.0 - accuracy(response, answer)


@register("random", control_of="accuracy")
def random_reward(response: str, answer: str) -> float:
  """1 or 0 by a fair coin, independent of the response: GRPO then gets
  advantages of full size that carry no information about the task, so any
  gain it shows is not learning from the reward."""
  del response, answer
  return float(random.random() < 0.5)


@register("constant", control_of="accuracy")
def constant(response: str, answer: str) -> float:
  """0 for every response: GRPO advantages are all zero, the policy gets no signal."""
  del response, answer
  return 0.0
