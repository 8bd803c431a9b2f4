"""The documented size distributions of the datasets the synthetic mixes model.

One place for what both the synthetic generator (fluxjax/data/synth.py) and
the balance benchmark (bench/mixtures.py) draw from; the sources and the
assumptions behind each number are in bench/mixtures.py's docstring.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

_Z99 = 2.3263478740408408  # standard normal quantile of 0.99


@dataclasses.dataclass(frozen=True)
class LogNormal:
  """A log-normal given by its median and 99th percentile, clipped to [lo, hi]."""

  median: float
  p99: float
  lo: float
  hi: float

  @property
  def sigma(self) -> float:
    return math.log(self.p99 / self.median) / _Z99

  def sample(self, rng: np.random.Generator, n: int | None = None):
    """One float (n None) or an array of n, from `rng`'s standard normals."""
    if n is None:
      x = self.median * math.exp(self.sigma * rng.standard_normal())
      return float(min(max(x, self.lo), self.hi))
    xs = self.median * np.exp(self.sigma * rng.standard_normal(n))
    return np.clip(xs, self.lo, self.hi)


# Geo3K: one geometry diagram per problem (longer side, pixels). ASSUMED.
GEO3K_LONG_SIDE = LogNormal(median=420, p99=1100, lo=100, hi=2000)
# NExT-QA: mean duration 44 s; median 40 s and p99 115 s give that mean.
NEXTQA_SECONDS = LogNormal(median=40, p99=115, lo=5, hi=180)
NEXTQA_RESOLUTIONS = ((480, 640), (360, 640))
# LongVILA-Reason: minutes-long videos; resolutions and their shares ASSUMED.
LONGVILA_SECONDS = LogNormal(median=300, p99=1800, lo=30, hi=3600)
LONGVILA_RESOLUTIONS = ((360, 640), (480, 854), (720, 1280), (1080, 1920))
LONGVILA_RES_P = (0.2, 0.3, 0.4, 0.1)
