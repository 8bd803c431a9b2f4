"""FlexUlysses placement (FlexRL Algorithm 2): a sharding degree per sequence.

From lengths only, for one microbatch on D devices:
  1. Baseline split-place. M* = total tokens / D, M_th = 1.1 M*. Longest
     first, each sequence takes the smallest power-of-two degree p (GETSPSIZE,
     which the paper leaves open: h/p under M_th and h^2/p at most the mean
     per-device attention load) that has an aligned group of p devices with
     room under M_th; degrees double while no group has room, up to p_max. Of
     the groups with room, the least loaded in compute wins (the paper: most
     available memory; compute balances better on our mixtures).
  2. Balance (ours). The paper's objective is max over devices of sum h^2/p;
     its stages place by memory. While the most loaded device holds a sequence
     whose degree can double onto a group with room, and doubling lowers the
     maximum, it is doubled.
  3. Merge passes (the paper's), p = p_max ... 2: inside one p-group, two to
     four of its smallest degree-p sequences are split two ways and moved to
     the group's halves at degree p/2 when memory stays under M_th and the
     maximum load does not grow; the cheapest (least max load, then least
     communication) is applied. Groups are visited in order and each is merged
     until it has no candidate left (the paper takes the global best each
     time; per group is linear time and finds the same merges when groups do
     not interact, which they do only through the global maximum).
  4. Short-item reorder (the paper's): sequences of degree <= 2 are re-placed
     whole, longest first, each on the least-loaded device with room.
     Deviation: a sequence no single device has room for keeps degree 2 (the
     paper's fallback would overfill a device and break M_th).
  5. Refine (ours): whole degree-1 sequences move from the most loaded device
     to the least loaded one while that lowers the maximum; then step 2 again.

Groups are aligned blocks of p consecutive devices, so groups of different
degrees nest: a degree-2^j group is the last j binary mesh axes. The paper's
SplitCost(h, p) = h (p-1) / p^2 (x16 beyond p = 8) is a per-device all-to-all
volume; summed over the p devices that carry it, a merge p -> p/2 always lowers
it, which is what makes merges "cheaper".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

ALPHA = 1.1
TAU, GAMMA = 8, 16
MERGE_CANDIDATES = 4  # the paper's DEFAULT_M_CANDIDATES
_EPS = 1e-9


def split_cost(h: float, p: int) -> float:
  """Per-device all-to-all volume proxy of one sequence at degree p."""
  if p <= 1:
    return 0.0
  return (GAMMA if p > TAU else 1.0) * h * (p - 1) / (p * p)


def comm_cost(h: float, p: int) -> float:
  """SplitCost summed over the p devices that carry it."""
  return p * split_cost(h, p)


@dataclasses.dataclass
class Placement:
  """Where one sequence runs: degree p on the aligned group starting at `first`."""
  p: int
  first: int

  @property
  def devices(self) -> range:
    return range(self.first, self.first + self.p)


@dataclasses.dataclass
class FlexPlacement:
  """The planner's output for one microbatch."""
  num_devices: int
  lengths: tuple[int, ...]
  placements: list[Placement]
  m_th: float
  baseline_feasible: bool = True  # every sequence found a group under M_th

  def memory(self) -> list[float]:
    return list(_loads(self, 1))

  def compute(self) -> list[float]:
    return list(_loads(self, 2))

  def communication(self) -> float:
    return sum(comm_cost(h, pl.p) for h, pl in zip(self.lengths, self.placements))


def _loads(fp: FlexPlacement, power: int) -> np.ndarray:
  out = np.zeros(fp.num_devices)
  for h, pl in zip(fp.lengths, fp.placements):
    if pl.p:
      out[pl.first:pl.first + pl.p] += float(h) ** power / pl.p
  return out


class _State:
  """Placements plus incrementally kept per-device memory and compute loads."""

  def __init__(self, lens, num_devices, p_max, m_th):
    self.h = np.asarray(lens, np.float64)
    self.d, self.p_max, self.m_th = num_devices, p_max, m_th
    self.mem = np.zeros(num_devices)
    self.comp = np.zeros(num_devices)
    self.pl: list[Placement | None] = [None] * len(lens)

  def add(self, i, p, first, sign=1.0):
    h = self.h[i]
    self.mem[first:first + p] += sign * h / p
    self.comp[first:first + p] += sign * h * h / p
    if sign > 0:
      self.pl[i] = Placement(p, first)

  def remove(self, i):
    pl = self.pl[i]
    self.add(i, pl.p, pl.first, -1.0)
    self.pl[i] = None

  def room(self, p, extra):
    """First devices of aligned p-groups where every device has room for `extra`."""
    ok = (self.mem + extra <= self.m_th + _EPS).reshape(-1, p).all(axis=1)
    return np.flatnonzero(ok) * p





def _sp_size(h: float, s: "_State", c_star: float) -> int:
  """GETSPSIZE: the smallest degree whose shard fits the memory threshold and
  whose attention share h^2/p does not exceed the mean per-device load."""
  p = 1
  while p < s.p_max and (h / p > s.m_th or h * h / p > c_star):
    p *= 2
  return p


def _baseline(s: _State) -> bool:
  feasible_all = True
  c_star = float((s.h ** 2).sum()) / s.d
  for i in sorted(range(len(s.h)), key=lambda i: (-s.h[i], i)):
    h = s.h[i]
    p = _sp_size(h, s, c_star)
    while p < s.p_max and not len(s.room(p, h / p)):
      p *= 2
    firsts = s.room(p, h / p)
    if not len(firsts):  # nothing fits even at p_max: the least-loaded group
      feasible_all = False
      firsts = np.arange(0, s.d, p)
    # Among groups with room, the least loaded in compute (the paper takes the
    # most available memory; on the bench mixtures this balances better).
    key = s.comp.reshape(-1, p).max(axis=1)[firsts // p]
    first = int(firsts[np.argmin(key)])
    s.add(i, p, first)
  return feasible_all


def _raise_degrees(s: _State, max_steps: int) -> None:
  """Doubles degrees of sequences on the most loaded device while it helps."""
  for _ in range(max_steps):
    top = int(np.argmax(s.comp))
    peak = s.comp[top]
    best = None
    on_top = [i for i, pl in enumerate(s.pl) if pl.first <= top < pl.first + pl.p and pl.p < s.p_max]
    for i in sorted(on_top, key=lambda i: (-s.h[i] ** 2 / s.pl[i].p, i))[:4]:
      pl, h = s.pl[i], s.h[i]
      q = 2 * pl.p
      s.remove(i)
      firsts = s.room(q, h / q)
      if len(firsts):
        # Peak after placing on each candidate group, all groups at once:
        # max(load outside the group, the group's own max + h^2/q).
        prefix = np.concatenate([[0.0], np.maximum.accumulate(s.comp)])
        suffix = np.concatenate([np.maximum.accumulate(s.comp[::-1])[::-1], [0.0]])
        outside = np.maximum(prefix[firsts], suffix[firsts + q])
        inside = s.comp.reshape(-1, q).max(axis=1)[firsts // q] + h * h / q
        peaks = np.maximum(outside, inside)
        k = int(np.argmin(peaks))
        if peaks[k] < peak * (1 - 1e-6) and (best is None or peaks[k] < best[0]):
          best = (float(peaks[k]), i, q, int(firsts[k]))
      s.add(i, pl.p, pl.first)
    if best is None:
      return
    _, i, q, first = best
    s.remove(i)
    s.add(i, q, first)


def _merge_level(s: _State, p: int) -> None:
  half = p // 2
  for g in range(0, s.d, p):
    while True:
      members = sorted((i for i, pl in enumerate(s.pl) if pl.p == p and pl.first == g),
                       key=lambda i: (s.h[i], i))
      if len(members) < 2:
        break
      outside = np.concatenate([s.comp[:g], s.comp[g + p:]])
      peak_outside = float(outside.max()) if len(outside) else 0.0
      peak = float(s.comp.max())
      best = None
      for m in range(2, min(MERGE_CANDIDATES, len(members)) + 1):
        s1, s2 = _two_way(members[:m], s.h)
        if not s1 or not s2:
          continue
        mem, comp = s.mem[g:g + p].copy(), s.comp[g:g + p].copy()
        for i in s1 + s2:
          mem -= s.h[i] / p
          comp -= s.h[i] ** 2 / p
        for part, lo in ((s1, 0), (s2, half)):
          for i in part:
            mem[lo:lo + half] += s.h[i] / half
            comp[lo:lo + half] += s.h[i] ** 2 / half
        if (mem > s.m_th + _EPS).any():
          continue
        new_peak = max(peak_outside, float(comp.max()))
        if new_peak > peak * (1 + 1e-9):
          continue
        d_comm = sum(comm_cost(s.h[i], half) - comm_cost(s.h[i], p) for i in s1 + s2)
        key = (new_peak, d_comm, m)
        if best is None or key < best[0]:
          best = (key, s1, s2)
      if best is None:
        break
      _, s1, s2 = best
      for i in s1 + s2:
        s.remove(i)
      for i in s1:
        s.add(i, half, g)
      for i in s2:
        s.add(i, half, g + half)


def _two_way(items, h):
  """Splits items into two parts balanced in h^2 (greedy, longest first)."""
  a, b, ca, cb = [], [], 0.0, 0.0
  for i in sorted(items, key=lambda i: (-h[i], i)):
    if ca <= cb:
      a.append(i)
      ca += h[i] ** 2
    else:
      b.append(i)
      cb += h[i] ** 2
  return a, b


def _short_item_reorder(s: _State) -> None:
  short = sorted((i for i, pl in enumerate(s.pl) if pl.p <= 2), key=lambda i: (-s.h[i], i))
  previous = {i: s.pl[i] for i in short}
  snapshot = (s.mem.copy(), s.comp.copy(), list(s.pl))
  feasible_before = bool((s.mem <= s.m_th + _EPS).all())
  for i in short:
    s.remove(i)
  for i in short:
    ok = np.flatnonzero(s.mem + s.h[i] <= s.m_th + _EPS)
    if len(ok):
      s.add(i, 1, int(ok[np.argmin(s.comp[ok])]))
      continue
    # No device has room for it whole: the smallest degree with a group that
    # has room (its old group may have filled up meanwhile).
    p = min(2, s.p_max)
    while p < s.p_max and not len(s.room(p, s.h[i] / p)):
      p *= 2
    firsts = s.room(p, s.h[i] / p)
    if len(firsts):
      s.add(i, p, int(firsts[np.argmin(s.comp.reshape(-1, p).max(axis=1)[firsts // p])]))
    else:
      s.add(i, previous[i].p, previous[i].first)
  # All or nothing: greedy re-placement can paint itself into a corner; never
  # trade a plan that respected M_th for one that does not.
  if feasible_before and (s.mem > s.m_th + _EPS).any():
    s.mem, s.comp, s.pl = snapshot[0], snapshot[1], snapshot[2]


def _refine_moves(s: _State, max_steps: int) -> None:
  """Moves whole degree-1 sequences off the most loaded device while it helps."""
  for _ in range(max_steps):
    top = int(np.argmax(s.comp))
    peak = s.comp[top]
    moved = False
    for i in sorted((i for i, pl in enumerate(s.pl) if pl.p == 1 and pl.first == top),
                    key=lambda i: (-s.h[i], i)):
      h = s.h[i]
      ok = np.flatnonzero(s.mem + h <= s.m_th + _EPS)
      ok = ok[ok != top]
      if not len(ok):
        continue
      d = int(ok[np.argmin(s.comp[ok])])
      if s.comp[d] + h * h < peak * (1 - 1e-6):
        s.remove(i)
        s.add(i, 1, d)
        moved = True
        break
    if not moved:
      return


def plan_flex(lengths: Sequence[int], num_devices: int, p_max: int) -> FlexPlacement:
  """Places one microbatch (see module docstring)."""
  if num_devices < 1 or num_devices & (num_devices - 1):
    raise ValueError(f"flex_ulysses needs a power-of-two device count, got {num_devices}")
  if p_max < 1 or p_max & (p_max - 1) or p_max > num_devices:
    raise ValueError(f"p_max {p_max} must be a power of two <= {num_devices} devices")
  lens = tuple(int(h) for h in lengths)
  m_th = ALPHA * max(sum(lens) / num_devices, 1.0)
  s = _State(lens, num_devices, p_max, m_th)
  feasible = _baseline(s)
  steps = 4 * len(lens) + num_devices
  _raise_degrees(s, steps)
  p = p_max
  while p >= 2:
    _merge_level(s, p)
    p //= 2
  _short_item_reorder(s)
  _refine_moves(s, steps)
  _raise_degrees(s, steps)
  return FlexPlacement(num_devices, lens, list(s.pl), m_th, feasible)
