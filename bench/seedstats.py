"""Statistics over seeds for the learning benchmarks: intervals, equivalence, time to a gain.

  t_interval       half-width of the two-sided Student t interval of a mean,
                   with the t quantile of its degrees of freedom (scipy).
  tost             two one-sided t tests that a mean (of paired differences)
                   lies within +-margin: equivalent when the (1 - 2 alpha)
                   interval lies inside the margin, i.e. both one-sided
                   p-values are below alpha.
  time_to_gain     the wall time at which a run's evaluations first reach a
                   gain over its RL start.

A learning claim is a mean over seeds with its interval over seeds; these are
the one place the benchmarks compute them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence

from scipy import stats


def t_quantile(df: int, level: float = 0.95) -> float:
  """The two-sided `level` quantile of Student's t with `df` degrees of freedom."""
  return float(stats.t.ppf(0.5 + level / 2, df))


def t_interval(values: Sequence[float], level: float = 0.95) -> float:
  """Half-width of the `level` t interval of the mean of `values` (nan for fewer than two)."""
  n = len(values)
  if n < 2:
    return float("nan")
  return t_quantile(n - 1, level) * statistics.stdev(values) / math.sqrt(n)


@dataclasses.dataclass(frozen=True)
class Equivalence:
  """A TOST of mean(values) within +-margin.

  mean, low, high: the mean and its (1 - 2 alpha) t interval (90% at alpha 0.05).
  p: the larger of the two one-sided p-values; equivalent: p < alpha.
  """

  n: int
  mean: float
  low: float
  high: float
  margin: float
  p: float
  equivalent: bool


def tost(values: Sequence[float], margin: float, alpha: float = 0.05) -> Equivalence:
  """Two one-sided t tests: H0 mean <= -margin and H0 mean >= +margin.

  For paired seeds pass the per-seed differences (arm minus baseline).
  Fewer than two values, or no spread, give p = nan and not equivalent
  unless the values are identical and inside the margin.
  """
  n = len(values)
  mean = statistics.fmean(values) if values else float("nan")
  if n < 2:
    return Equivalence(n, mean, float("nan"), float("nan"), margin, float("nan"), False)
  se = statistics.stdev(values) / math.sqrt(n)
  if se == 0.0:
    inside = abs(mean) < margin
    return Equivalence(n, mean, mean, mean, margin, 0.0 if inside else 1.0, inside)
  df = n - 1
  p_low = float(stats.t.sf((mean + margin) / se, df))  # against mean <= -margin
  p_high = float(stats.t.cdf((mean - margin) / se, df))  # against mean >= +margin
  half = t_quantile(df, 1 - 2 * alpha) * se
  p = max(p_low, p_high)
  return Equivalence(n, mean, mean - half, mean + half, margin, p, p < alpha)


def time_to_gain(evals: Sequence[dict], gain: float, key: str, clock: str) -> float | None:
  """The `clock` time of the first evaluation whose `key` exceeds the RL start's by `gain`.

  evals: a run's evaluations in step order, the first at the RL start (step 0).
  None when no evaluation reaches it (or the figure is missing).
  """
  start = evals[0].get(key)
  if start is None:
    return None
  for e in evals:
    value = e.get(key)
    if value is not None and value - start >= gain:
      return e[clock]
  return None


def mean_recorded(values) -> float:
  """The mean of the values given (None: not recorded); NaN if there are none."""
  present = [v for v in values if v is not None]
  return statistics.fmean(present) if present else float("nan")
