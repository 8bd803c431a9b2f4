"""FlexUlysses placement (FlexRL Algorithm 2): a sharding degree per sequence.

From lengths only:
  1. Baseline split-place. M* = total tokens / D, M_th = 1.1 M*. Longest first,
     each sequence takes the smallest power-of-two degree p whose h/p fits under
     M_th on some aligned group of p devices (the group with the most available
     memory wins); degrees double while no group fits, up to p_max.
  2. Merge passes, p = p_max ... 2: inside one p-group, a few of its degree-p
     sequences (smallest first) are split two ways and moved to the group's two
     halves at degree p/2, when memory stays under M_th and the largest
     per-device attention cost does not grow. The cheapest candidate (least
     max-cost, then least communication) is applied until none is left.
  3. Short-item reorder: sequences of degree <= 2 are re-placed whole on one
     device each, longest first, on the device with the least sum of h^2
     among those with room under M_th.
Objective (lexicographic): max over devices of sum h^2/p, then communication.

Groups are aligned blocks of p consecutive devices, so groups of different
degrees nest: a degree-2^j group is the last j binary mesh axes (sp_0, sp_1,
...). The paper's SplitCost(h, p) = h (p-1) / p^2 (x16 beyond p = 8) is the
per-device all-to-all volume; summed over the p devices that carry it, a merge
from p to p/2 always lowers it, which is what makes merges "cheaper".
Deviation, for the memory invariant: the reorder keeps a sequence at degree 2
when no single device has room for it under M_th (the paper's fallback would
overfill a device).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

ALPHA = 1.1
TAU, GAMMA = 8, 16
MERGE_CANDIDATES = 4  # the paper's DEFAULT_M_CANDIDATES: up to 4 items per merge


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
    m = [0.0] * self.num_devices
    for h, pl in zip(self.lengths, self.placements):
      for d in pl.devices:
        m[d] += h / pl.p
    return m

  def compute(self) -> list[float]:
    c = [0.0] * self.num_devices
    for h, pl in zip(self.lengths, self.placements):
      for d in pl.devices:
        c[d] += h * h / pl.p
    return c

  def communication(self) -> float:
    return sum(comm_cost(h, pl.p) for h, pl in zip(self.lengths, self.placements))


def _groups(num_devices: int, p: int) -> range:
  return range(0, num_devices - p + 1, p)


def _baseline(lens, num_devices, p_max, m_th):
  mem = [0.0] * num_devices
  avail = [m_th] * num_devices
  placements: list[Placement | None] = [None] * len(lens)
  feasible_all = True
  order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
  for i in order:
    h = lens[i]
    p = 1
    while p < p_max and h / p > m_th:
      p *= 2

    def feasible(p):
      return [g for g in _groups(num_devices, p)
              if all(mem[d] + h / p <= m_th for d in range(g, g + p))]

    while p < p_max and not feasible(p):
      p *= 2
    candidates = feasible(p)
    if not candidates:  # nothing fits even at p_max: the least-loaded group
      feasible_all = False
      candidates = list(_groups(num_devices, p))
    first = max(candidates, key=lambda g: (sum(avail[d] for d in range(g, g + p)), -g))
    for d in range(first, first + p):
      mem[d] += h / p
      avail[d] -= h / p
    placements[i] = Placement(p, first)
  return placements, feasible_all


def _two_way(items, lens):
  """Splits items into two parts balanced in h^2 (greedy, longest first)."""
  a, b, ca, cb = [], [], 0.0, 0.0
  for i in sorted(items, key=lambda i: (-lens[i], i)):
    if ca <= cb:
      a.append(i)
      ca += lens[i] ** 2
    else:
      b.append(i)
      cb += lens[i] ** 2
  return a, b


def _merge_pass(fp: FlexPlacement, p: int) -> bool:
  """Applies the best merge at level p; False when there is none."""
  lens, half = fp.lengths, p // 2
  mem, comp = fp.memory(), fp.compute()
  max_c = max(comp)
  best = None
  for g in _groups(fp.num_devices, p):
    members = sorted((i for i, pl in enumerate(fp.placements) if pl.p == p and pl.first == g),
                     key=lambda i: (lens[i], i))
    for m in range(2, min(MERGE_CANDIDATES, len(members)) + 1):
      s1, s2 = _two_way(members[:m], lens)
      if not s1 or not s2:
        continue
      new_mem, new_comp = list(mem), list(comp)
      for d in range(g, g + p):
        for i in s1 + s2:
          new_mem[d] -= lens[i] / p
          new_comp[d] -= lens[i] ** 2 / p
      for part, start in ((s1, g), (s2, g + half)):
        for d in range(start, start + half):
          for i in part:
            new_mem[d] += lens[i] / half
            new_comp[d] += lens[i] ** 2 / half
      if any(new_mem[d] > fp.m_th + 1e-9 for d in range(g, g + p)):
        continue
      d_max = max(new_comp) - max_c
      if d_max > 1e-9 * max(max_c, 1.0):
        continue
      d_comm = sum(comm_cost(lens[i], half) - comm_cost(lens[i], p) for i in s1 + s2)
      key = (d_max, d_comm, g, m)
      if best is None or key < best[0]:
        best = (key, s1, s2, g)
  if best is None:
    return False
  _, s1, s2, g = best
  for i in s1:
    fp.placements[i] = Placement(half, g)
  for i in s2:
    fp.placements[i] = Placement(half, g + half)
  return True


def _short_item_reorder(fp: FlexPlacement) -> None:
  lens = fp.lengths
  short = sorted((i for i, pl in enumerate(fp.placements) if pl.p <= 2),
                 key=lambda i: (-lens[i], i))
  previous = {i: fp.placements[i] for i in short}
  for i in short:
    fp.placements[i] = Placement(0, 0)  # out of every device's load
  for i in short:
    mem, comp = fp.memory(), fp.compute()
    room = [d for d in range(fp.num_devices) if mem[d] + lens[i] <= fp.m_th + 1e-9]
    if room:
      d = min(room, key=lambda d: (comp[d], d))
      fp.placements[i] = Placement(1, d)
    else:
      fp.placements[i] = previous[i]


def plan_flex(lengths: Sequence[int], num_devices: int, p_max: int) -> FlexPlacement:
  """Algorithm 2 for one microbatch (see module docstring)."""
  if num_devices < 1 or num_devices & (num_devices - 1):
    raise ValueError(f"flex_ulysses needs a power-of-two device count, got {num_devices}")
  if p_max < 1 or p_max & (p_max - 1) or p_max > num_devices:
    raise ValueError(f"p_max {p_max} must be a power of two <= {num_devices} devices")
  lens = tuple(int(h) for h in lengths)
  m_star = sum(lens) / num_devices
  fp = FlexPlacement(num_devices, lens, [], ALPHA * max(m_star, 1.0))
  fp.placements, fp.baseline_feasible = _baseline(lens, num_devices, p_max, fp.m_th)
  p = p_max
  while p >= 2:
    while _merge_pass(fp, p):
      pass
    p //= 2
  _short_item_reorder(fp)
  return fp
