"""Held-out evaluation statistics: accuracy with its interval, pass@k, per difficulty.

The coordinator samples `samples_per_prompt` responses per held-out prompt at
the training temperature (what the policy does when it trains) and, when
asked, one greedy response; `summarize` turns their scores into metrics:

  eval/accuracy          mean over prompts of the prompt's mean score
  eval/accuracy_ci95     1.96 x its standard error over prompts: samples of
                         one prompt are correlated, so the prompt is the unit
  eval/accuracy_greedy   mean greedy score
  eval/pass@k            unbiased pass@k (Chen et al. 2021) with k = samples
  eval/accuracy/<d>      eval/accuracy of the prompts of difficulty d
  eval/task/<t>          eval/accuracy of the prompts of task t
  eval/band/<b>          eval/accuracy of the prompts whose reference response
                         (reasoning and answer) is in length band b (tokens,
                         `length_band`)
  eval/reasoning_share   share of sampled responses that reason first
                         (reward_fns.reasons), also per difficulty
                         (eval/reasoning_share/<d>) and of the greedy ones
                         (eval/reasoning_share_greedy)
  eval/prompts, eval/samples

A score is 1 for a correct response, else 0: the coordinator scores with the
evaluation's reward (`eval.reward`, else the run's `rl.reward`) and counts a
response correct when its reward reaches rl.reward.correct_threshold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959964  # two-sided 95% normal quantile
# Upper ends (tokens) of the reference-response length bands; longer is the last band.
LENGTH_BANDS = (16, 32, 48)


def length_band(tokens: int) -> str:
  """The band label of a reference response of `tokens` tokens: "00-16" ... "49+"."""
  lo = 0
  for hi in LENGTH_BANDS:
    if tokens <= hi:
      return f"{lo:02d}-{hi}"
    lo = hi + 1
  return f"{lo}+"


def pass_at_k(n: int, c: int, k: int) -> float:
  """P(at least one of k draws without replacement is correct), c of n correct."""
  if not 0 < k <= n:
    raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
  """(mean, 95% half-interval) of independent values; 0 half-width for fewer than two."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    raise ValueError("no values")
  if x.size < 2:
    return float(x.mean()), 0.0
  return float(x.mean()), float(Z95 * x.std(ddof=1) / math.sqrt(x.size))


def summarize(
  scores: Sequence[Sequence[float]],
  difficulties: Sequence[str] | None = None,
  greedy: Sequence[float] | None = None,
  tasks: Sequence[str] | None = None,
  bands: Sequence[str] | None = None,
  reasoning: Sequence[Sequence[bool]] | None = None,
  greedy_reasoning: Sequence[bool] | None = None,
) -> dict[str, float]:
  """Metrics of one evaluation (see the module docstring).

  Args:
    scores: per prompt, the scores of its sampled responses (same count each).
    difficulties: per prompt, its difficulty label ("" = none); prompts
      without one are left out of the breakdown.
    greedy: per prompt, the score of its greedy response, or None.
    tasks: per prompt, its task name ("" = none), for a per-task breakdown.
    bands: per prompt, its reference length band ("" = none).
    reasoning: per prompt, whether each sampled response reasons first.
    greedy_reasoning: per prompt, whether its greedy response does.
  """
  if not scores:
    raise ValueError("nothing was evaluated")
  n = len(scores[0])
  if n == 0 or any(len(s) != n for s in scores):
    raise ValueError("every prompt needs the same, non-zero number of samples")
  per_prompt = [float(np.mean(s)) for s in scores]
  accuracy, ci = mean_ci95(per_prompt)
  correct = [sum(1 for x in s if x >= 1.0) for s in scores]
  out = {
    "eval/accuracy": accuracy,
    "eval/accuracy_ci95": ci,
    f"eval/pass@{n}": float(np.mean([pass_at_k(n, c, n) for c in correct])),
    "eval/prompts": float(len(scores)),
    "eval/samples": float(len(scores) * n),
  }
  if greedy is not None:
    if len(greedy) != len(scores):
      raise ValueError(f"{len(greedy)} greedy scores for {len(scores)} prompts")
    out["eval/accuracy_greedy"] = float(np.mean(greedy))
  for prefix, labels in (
    ("eval/accuracy/", difficulties),
    ("eval/task/", tasks),
    ("eval/band/", bands),
  ):
    if labels is None:
      continue
    if len(labels) != len(scores):
      raise ValueError(f"{len(labels)} labels for {len(scores)} prompts")
    for label in sorted({x for x in labels if x}):
      out[prefix + label] = float(np.mean([p for p, x in zip(per_prompt, labels) if x == label]))
  if reasoning is not None:
    out.update(_reasoning_shares(reasoning, difficulties))
  if greedy_reasoning is not None:
    out["eval/reasoning_share_greedy"] = float(np.mean(greedy_reasoning))
  return out


def _reasoning_shares(
  reasoning: Sequence[Sequence[bool]], difficulties: Sequence[str] | None
) -> dict[str, float]:
  share = [float(np.mean(r)) for r in reasoning]
  out = {"eval/reasoning_share": float(np.mean(share))}
  for label in sorted({x for x in difficulties or () if x}):
    picked = [s for s, x in zip(share, difficulties or (), strict=True) if x == label]
    out[f"eval/reasoning_share/{label}"] = float(np.mean(picked))
  return out
