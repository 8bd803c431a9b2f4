"""A run's reward: which functions, with which weights, called with what.

Entry points: `parse` (`rl.reward.fn` and `rl.reward.weights` into `Term`s), `load`
(a registered name, "package.module:function" or "path/to/file.py:function"), `call`
and `score` (a function called with the arguments it names, from a `RewardContext`)
and `evaluation` (the reward held-out responses are scored with). What a spec may
name and what a function is called with are told in docs/rewards.md.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fluxjax.rl import reward_fns

RewardFn = Callable[..., float]

# Parameter name -> the context field it receives.
ARGUMENTS = {
  "response": "response",
  "solution_str": "response",
  "answer": "answer",
  "ground_truth": "answer",
  "prompt": "prompt",
  "task": "task",
  "data_source": "data_source",
  "extra": "extra",
  "extra_info": "extra",
}


@dataclasses.dataclass(frozen=True)
class RewardContext:
  """What a reward may know of the row besides the response and the answer."""

  prompt: str = ""
  task: str = ""
  data_source: str = ""
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, sample) -> RewardContext:
    """A data.meta.SampleMeta's context."""
    return cls(sample.prompt, sample.task, sample.source, dict(sample.extra))


@dataclasses.dataclass(frozen=True)
class Term:
  """One function of the run's reward.

  Attributes:
    name: its logged name.
    fn: a spec `load` takes (a string), or a module-level callable.
    weight: its weight in the sum.
  """

  name: str
  fn: str | RewardFn
  weight: float = 1.0


def load(spec: str | RewardFn) -> RewardFn:
  """The function a spec names: a registered name, "module:function" or "file.py:function".

  Raises:
    KeyError: the spec names nothing loadable, with the reason.
  """
  if callable(spec):
    return spec
  if ":" not in spec:
    return reward_fns.get(spec)
  where, _, attr = spec.rpartition(":")
  try:
    module = _load_file(where) if where.endswith(".py") else importlib.import_module(where)
    fn = getattr(module, attr)
  except (ImportError, AttributeError, OSError, SyntaxError) as e:
    raise KeyError(f"cannot load reward {spec!r}: {type(e).__name__}: {e}") from None
  if not callable(fn):
    raise KeyError(f"reward {spec!r} is not callable")
  return fn


@functools.cache
def _load_file(path: str):
  """The module of a Python file, loaded once per process under a name of its path."""
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no reward file {path}")
  name = "fluxjax_reward_" + hashlib.sha1(path.encode()).hexdigest()[:12]
  spec = importlib.util.spec_from_file_location(name, path)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module


def parse(fn: str, weights: Sequence[float] = ()) -> tuple[Term, ...]:
  """The terms of `rl.reward.fn` and `rl.reward.weights`; file paths made absolute.

  Raises:
    ValueError: no function, a weight count that differs from the function
      count, a non-finite weight, or two functions with one name.
  """
  specs = [s.strip() for s in fn.split(",") if s.strip()]
  if not specs:
    raise ValueError("rl.reward.fn names no reward function")
  weights = tuple(float(w) for w in weights) or (1.0,) * len(specs)
  if len(weights) != len(specs):
    raise ValueError(
      f"rl.reward.weights has {len(weights)} weights for {len(specs)} functions ({fn!r})"
    )
  if not all(math.isfinite(w) for w in weights):
    raise ValueError(f"rl.reward.weights must be finite numbers, got {weights}")
  terms = tuple(Term(_name(s), _absolute(s), w) for s, w in zip(specs, weights, strict=True))
  names = [t.name for t in terms]
  if len(set(names)) != len(names):
    raise ValueError(f"rl.reward.fn names two functions alike ({names}); their metrics would mix")
  return terms


def evaluation(fn: str, eval_fn: str) -> str:
  """The reward spec held-out responses are scored with: `eval_fn` when set,
  else the run's `fn`, except that a control reward (reward_fns.CONTROLS) is
  scored with the task reward it controls: a run trained on 1 - accuracy
  must show its accuracy fall, not its reward rise."""
  if eval_fn:
    return eval_fn
  return reward_fns.CONTROLS.get(fn.strip(), fn)


def terms_of(fn: str | RewardFn | Sequence[Term]) -> tuple[Term, ...]:
  """Terms from a spec string, a callable (weight 1) or terms."""
  if isinstance(fn, str):
    return parse(fn)
  if callable(fn):
    return (Term(getattr(fn, "__name__", "reward"), fn),)
  return tuple(fn)


def _name(spec: str) -> str:
  return spec.rpartition(":")[2] if ":" in spec else spec


def _absolute(spec: str) -> str:
  where, sep, attr = spec.rpartition(":")
  return f"{os.path.abspath(where)}:{attr}" if sep and where.endswith(".py") else spec


def call(fn: RewardFn, response: str, answer: str, context: RewardContext) -> float:
  """`fn` called with the arguments it names (docs/rewards.md, "What a function is called with")."""
  values = {
    "response": response,
    "answer": answer,
    "prompt": context.prompt,
    "task": context.task,
    "data_source": context.data_source,
    "extra": dict(context.extra),
  }
  named, var_keyword = _parameters(fn)
  if not named:
    rest = {k: v for k, v in values.items() if k not in ("response", "answer")}
    return fn(response, answer, **(rest if var_keyword else {}))
  kwargs = {p: values[ARGUMENTS[p]] for p in named}
  if var_keyword:
    given = {ARGUMENTS[p] for p in named}
    kwargs.update({k: v for k, v in values.items() if k not in given})
  return fn(**kwargs)


def _parameters(fn: RewardFn) -> tuple[tuple[str, ...], bool]:
  """(the parameters of `fn` that ARGUMENTS names, whether it takes **kwargs)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):  # a builtin or extension without a signature
    return (), False
  kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
  named = tuple(p.name for p in params if p.kind in kinds and p.name in ARGUMENTS)
  return named, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def score(
  terms: Sequence[Term],
  fns: Sequence[RewardFn],
  response: str,
  answer: str,
  context: RewardContext,
) -> tuple[float, dict[str, float]]:
  """(the weighted sum, each term's value) of one response.

  Raises:
    ValueError: a term returned something that is not a finite number.
  """
  values = {}
  for term, fn in zip(terms, fns, strict=True):
    value = float(call(fn, response, answer, context))
    if not math.isfinite(value):
      raise ValueError(f"reward {term.name} returned a non-finite value {value}")
    values[term.name] = value
  return sum(t.weight * values[t.name] for t in terms), values
