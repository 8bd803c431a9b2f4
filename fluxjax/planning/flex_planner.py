"""FlexUlysses placement (FlexRL Algorithm 2): a sharding degree per sequence.

Entry points: `plan_flex` places one microbatch from lengths only (its docstring
gives the algorithm, the paper's stages and where this departs from them);
`plan_flex_step` places a training step's microbatches jointly.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np

ALPHA = 1.1
TAU, GAMMA = 8, 16
MERGE_CANDIDATES = 4  # the paper's DEFAULT_M_CANDIDATES
IMPROVE_CANDIDATES = 4  # sequences of the most loaded device tried per step
MAKE_ROOM = 4  # full groups tried per sequence when no plain move helps
TOLERANCE = 0.01  # the search stops this far above the lower bound
SWEEPS = 1  # passes over a step's microbatches after the first placement
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
      out[pl.first : pl.first + pl.p] += float(h) ** power / pl.p
  return out


class _State:
  """Placements plus incrementally kept per-device memory and compute loads.

  Placements live in two integer arrays (degree, first device; degree 0 means
  not placed) so that the searches below can select items with numpy.
  """

  def __init__(self, lens, num_devices, p_max, m_th):
    self.h = np.asarray(lens, np.float64)
    self.h2 = self.h * self.h
    self.d, self.p_max, self.m_th = num_devices, p_max, m_th
    # Memory and compute per device are the rows of one array, so that one
    # reduction serves both.
    self.loads = np.zeros((2, num_devices))
    self.mem, self.comp = self.loads
    self.deg = np.zeros(len(self.h), np.int64)
    self.first = np.zeros(len(self.h), np.int64)
    self.base = np.zeros(num_devices)  # compute carried from other microbatches

  @property
  def pl(self) -> list[Placement | None]:
    return [Placement(p, f) if p else None for p, f in zip(self.deg.tolist(), self.first.tolist())]

  def placements(self) -> list[Placement]:
    """`pl` once every sequence is placed."""
    assert self.deg.all(), "a sequence is not placed"
    return [Placement(p, f) for p, f in zip(self.deg.tolist(), self.first.tolist())]

  def add(self, i, p, first):
    if p == 1:
      self.mem[first] += self.h[i]
      self.comp[first] += self.h2[i]
    else:
      self.mem[first : first + p] += self.h[i] / p
      self.comp[first : first + p] += self.h2[i] / p
    self.deg[i], self.first[i] = p, first

  def remove(self, i):
    p, first = int(self.deg[i]), int(self.first[i])
    if p == 1:
      self.mem[first] -= self.h[i]
      self.comp[first] -= self.h2[i]
    else:
      self.mem[first : first + p] -= self.h[i] / p
      self.comp[first : first + p] -= self.h2[i] / p
    self.deg[i] = 0

  def on(self, t):
    """Items with a shard on device t: blocks are aligned, so t is in an
    item's block iff they agree on all bits above its degree's."""
    return ((self.first ^ t) < self.deg).nonzero()[0]

  def snapshot(self):
    return self.loads.copy(), self.deg.copy(), self.first.copy()

  def restore(self, snap):
    self.loads[:] = snap[0]
    self.deg, self.first = snap[1].copy(), snap[2].copy()


def _group_max(loads: np.ndarray, p: int) -> np.ndarray:
  """Max over aligned blocks of p along the last axis (pairwise maxima for
  small p: numpy reduces a short axis slowly)."""
  if p > 4:
    return loads.reshape(*loads.shape[:-1], -1, p).max(axis=-1)
  while p > 1:
    loads = np.maximum(loads[..., 0::2], loads[..., 1::2])
    p //= 2
  return loads


# One level of `_Groups`: (mem, comp, full, changed, keys, ids, listed).
_Table = tuple[list[float], list[float], float, set[int], list[float], list[int], dict[int, float]]


class _Groups:
  """A state's loads in plain Python lists, for the greedy placements.

  The greedy stages ask, once or more per sequence, for the least-loaded
  aligned group of some degree with room for the sequence's shard; numpy
  would rebuild every group's maxima for each question. Here, per level k
  (degree 2^k; level 0 is the devices), each group's peak memory and compute
  follow the placements and, from the first question about the level on,
  the groups with room for some sequence still to place are kept sorted by
  (peak compute, index): a scan from the front, past the groups too full
  for this shard, answers. A level is re-sorted, for the groups whose
  compute changed, only when next asked about (sequences come longest
  first, so most placements happen at other levels than the one asked
  about); the scan reads memory as it is.

  Placements only add load, after the items `lifted` are taken off (in that
  order, as `_State.remove` would): so a group too full for the shortest
  sequence to place leaves the order for good when next re-sorted, and the
  least peak memory found by a failed scan stays a lower bound, which
  answers the questions it rules out without a scan. Device loads take the
  same float operations, in the same order, as `_State.add`; `write_back`
  hands them to the state.
  """

  def __init__(self, s: _State, lifted: Sequence[int] = ()):
    self.s = s
    self.h, self.h2 = s.h.tolist(), s.h2.tolist()
    level = s.loads.copy()
    if lifted:
      lifted = list(lifted)  # a tuple would index the arrays below as axes
      mem, comp = level.tolist()
      for i, p, first in zip(lifted, s.deg[lifted].tolist(), s.first[lifted].tolist()):
        dm, dc = self.h[i] / p, self.h2[i] / p
        for d in range(first, first + p):
          mem[d] -= dm
          comp[d] -= dc
      level[0], level[1] = mem, comp
      s.deg[lifted] = 0
    shortest = float(s.h[s.deg == 0].min(initial=np.inf))
    self.room = s.m_th + _EPS  # memory a device may hold
    # Per level, (mem, comp, full, changed, keys, ids, listed): the groups'
    # peaks; above `full` memory a group has room for no sequence still to
    # place (a question's bound, room - h / p, is at most this); the groups
    # changed since the level was last asked about; the sorted groups' keys
    # (peak compute) and indices, in two lists as bisecting floats is
    # cheaper than bisecting pairs; each listed group's key.
    self.tables: list[_Table] = []
    self.mem, self.comp = [], []
    for k in range(s.p_max.bit_length()):
      if k:
        level = np.maximum(level[:, 0::2], level[:, 1::2])
      mem, comp = level.tolist()
      self.mem.append(mem)
      self.comp.append(comp)
      self.tables.append((mem, comp, self.room - shortest / (1 << k), set(), [], [], {}))
    self.levels = [
      (k, mem, comp, changed)  # what `add` updates
      for k, (mem, comp, _, changed, *_) in enumerate(self.tables)
    ]
    self.unsorted = [True for _ in self.mem]  # not asked about yet
    self.min_mem = [-math.inf for _ in self.mem]  # a lower bound: loads only grow

  def least_loaded(self, p: int, extra: float) -> int:
    """Index of the aligned p-group with the least peak compute among those
    with room for `extra` tokens per device (first on ties); -1 if none."""
    k = p.bit_length() - 1
    lim = self.room - extra
    if self.min_mem[k] > lim:
      return -1
    mem, comp, full, changed, keys, ids, listed = self.tables[k]
    if self.unsorted[k]:
      self.unsorted[k] = False
      # By compute, ties by index (the sort is stable).
      ids[:] = sorted(
        itertools.compress(range(len(mem)), map(full.__ge__, mem)), key=comp.__getitem__
      )
      keys[:] = map(comp.__getitem__, ids)
      listed.update(zip(ids, keys))
      changed.clear()
    for g in changed:  # re-sort the groups that changed since the last question
      old = listed.pop(g, None)
      if old is not None:
        at = bisect.bisect_left(keys, old)
        while ids[at] != g:  # past equal keys of lower index
          at += 1
        del keys[at], ids[at]
      if mem[g] <= full:
        c = listed[g] = comp[g]
        at = bisect.bisect_left(keys, c)
        while at < len(keys) and keys[at] == c and ids[at] < g:
          at += 1
        keys.insert(at, c)
        ids.insert(at, g)
    changed.clear()
    for g in ids:
      if mem[g] <= lim:
        return g
    self.min_mem[k] = min(mem)  # exact, until the next placement
    return -1

  def least_computed(self, p: int) -> int:
    """Index of the p-group with the least peak compute, room or not."""
    comp = self.comp[p.bit_length() - 1]
    return min(range(len(comp)), key=comp.__getitem__)

  def add(self, i: int, p: int, first: int) -> None:
    dm, dc = self.h[i] / p, self.h2[i] / p
    top = p.bit_length() - 1
    levels = iter(self.levels)
    # The placement's own groups, of its degree and below: every device of
    # one gains the same, so its peak gains that too (rounding is monotone).
    for k, mem, comp, changed in levels:
      for g in range(first >> k, (first + p) >> k):
        mem[g] += dm
        comp[g] += dc
        changed.add(g)
      if k == top:
        break
    m, c = mem[first >> top], comp[first >> top]
    # The groups around it, on from the next level: their old peaks or the
    # placement's. Once a group's peaks stay, so do those of the groups
    # around it.
    for k, mem, comp, changed in levels:
      g = first >> k
      if m <= mem[g] and c <= comp[g]:
        break
      if m > mem[g]:
        mem[g] = m
      if c > comp[g]:
        comp[g] = c
        changed.add(g)
    self.s.deg[i], self.s.first[i] = p, first

  def write_back(self) -> None:
    self.s.mem[:] = self.mem[0]
    self.s.comp[:] = self.comp[0]


def _sp_sizes(s: _State, c_star: float) -> list[int]:
  """GETSPSIZE per sequence: the smallest degree whose shard fits the memory
  threshold and whose attention share h^2/p is at most the mean per-device
  load (at most p_max)."""
  p = np.ones(len(s.h), np.int64)
  while True:
    grow = (p < s.p_max) & ((s.h / p > s.m_th) | (s.h2 / p > c_star))
    if not grow.any():
      return p.tolist()
    p[grow] *= 2


def _baseline(s: _State) -> bool:
  feasible_all = True
  c_star = float(s.h2.sum()) / s.d
  groups = _Groups(s)
  sp_size = _sp_sizes(s, c_star)
  for i in np.lexsort((np.arange(len(s.h)), -s.h)).tolist():
    h, p = groups.h[i], sp_size[i]
    g = groups.least_loaded(p, h / p)
    while g < 0 and p < s.p_max:
      p *= 2
      g = groups.least_loaded(p, h / p)
    if g < 0:  # nothing fits even at p_max: the least-loaded group
      feasible_all = False
      g = groups.least_computed(p)
    groups.add(i, p, g * p)
  groups.write_back()
  return feasible_all


def _merge_level(s: _State, p: int) -> None:
  half = p // 2
  at_p = (s.deg == p).nonzero()[0]
  if len(at_p) < 2:
    return
  lim = s.m_th + _EPS
  h, h2 = s.h.tolist(), s.h2.tolist()
  # Members of each p-group, shortest first; merges only take members out.
  by_group: dict[int, list[int]] = {}
  at_p = at_p[np.lexsort((at_p, s.h[at_p]))]
  for i, g in zip(at_p.tolist(), s.first[at_p].tolist()):
    by_group.setdefault(g, []).append(i)
  # Peak compute of each p-group, and the two highest; a merge changes only
  # its own group's.
  peaks = _group_max(s.comp, p).tolist()
  top = heapq.nlargest(2, range(len(peaks)), key=peaks.__getitem__)
  for g in sorted(by_group):
    members = by_group[g]
    while len(members) >= 2:
      peak = peaks[top[0]]
      peak_outside = max((peaks[x] for x in top if x != g // p), default=0.0)
      mem_g, comp_g = s.loads[:, g : g + p].tolist()
      best = None
      for m in range(2, min(MERGE_CANDIDATES, len(members)) + 1):
        (s1, s2), sums = _two_way(members[:m], h, h2)
        if not s1 or not s2:
          continue
        # Loads of the group's devices after the split (plain floats: the
        # group is a handful of devices).
        out_m = (sums[0][0] + sums[1][0]) / p
        out_c = (sums[0][1] + sums[1][1]) / p
        new_peak, fits = peak_outside, True
        for k in range(p):
          in_m, in_c = sums[k // half]
          if mem_g[k] - out_m + in_m / half > lim:
            fits = False
            break
          new_peak = max(new_peak, comp_g[k] - out_c + in_c / half)
        if not fits or new_peak > peak * (1 + 1e-9):
          continue
        both = s1 + s2
        d_comm = sum(comm_cost(s.h[i], half) - comm_cost(s.h[i], p) for i in both)
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
      peaks[g // p] = float(s.comp[g : g + p].max())
      top = heapq.nlargest(2, range(len(peaks)), key=peaks.__getitem__)
      members = [i for i in members if s.deg[i] == p]


def _two_way(items, h, h2):
  """Splits items into two parts balanced in h^2 (greedy, longest first);
  returns the parts and each one's (tokens, sum of h2), summed in part
  order (as numpy sums a few numbers)."""
  parts, sums, weights = ([], []), ([0.0, 0.0], [0.0, 0.0]), [0.0, 0.0]
  for i in sorted(items, key=lambda i: (-h[i], i)):
    k = 0 if weights[0] <= weights[1] else 1
    parts[k].append(i)
    weights[k] += h[i] ** 2
    sums[k][0] += h[i]
    sums[k][1] += h2[i]
  return parts, sums


def _short_item_reorder(s: _State) -> None:
  short = np.flatnonzero((s.deg <= 2) & (s.h <= s.m_th))
  short = short[np.lexsort((short, -s.h[short]))].tolist()
  previous = dict(zip(short, zip(s.deg[short].tolist(), s.first[short].tolist())))
  snap = s.snapshot()
  feasible_before = bool((s.mem <= s.m_th + _EPS).all())
  groups = _Groups(s, lifted=short)
  for i in short:
    h = groups.h[i]
    d = groups.least_loaded(1, h)
    if d >= 0:
      groups.add(i, 1, d)
      continue
    # No device has room for it whole: the smallest degree with a group that
    # has room (its old group may have filled up meanwhile).
    p = min(2, s.p_max)
    g = groups.least_loaded(p, h / p)
    while g < 0 and p < s.p_max:
      p *= 2
      g = groups.least_loaded(p, h / p)
    if g >= 0:
      groups.add(i, p, g * p)
    else:
      groups.add(i, *previous[i])
  groups.write_back()
  # All or nothing: greedy re-placement can paint itself into a corner; never
  # trade a plan that respected M_th for one that does not.
  if feasible_before and (s.mem > s.m_th + _EPS).any():
    s.restore(snap)


def _improve(s: _State, max_steps: int, target: float) -> None:
  """Local search on the most loaded device t (step 4 of `plan_flex`'s docstring).

  Each step tries the moves and swaps of t's IMPROVE_CANDIDATES items with the
  largest share on t. The one whose touched devices end with the smallest
  maximum wins (ties: less communication), applied only below t's load, so
  the sorted load vector decreases and the search ends. Stops early once the
  peak reaches `target`.
  """
  degrees = [1 << k for k in range(s.p_max.bit_length())]
  lim = s.m_th + _EPS
  h2_of = s.h2.tolist()
  for _ in range(max_steps):
    t = int(s.comp.argmax())
    peak = float(s.comp[t])
    if peak <= target:
      return
    bar = peak * (1 - 1e-9)  # what a move must end below
    # Per-group maxima of every degree, shared by all candidates of this step,
    # and the least of them.
    gcomp, gmem = {1: s.comp}, {1: s.mem}
    level = s.loads
    for q in degrees[1:]:
      level = np.maximum(level[:, 0::2], level[:, 1::2])
      gmem[q], gcomp[q] = level
    # (argmin and a lookup: numpy's min() costs several times more)
    least = {q: float(gcomp[q][gcomp[q].argmin()]) for q in degrees}
    # Largest share on t first, ties by index.
    on = sorted(s.on(t).tolist(), key=lambda i: (-h2_of[i] / int(s.deg[i]), i))
    on = on[:IMPROVE_CANDIDATES]
    best = None
    same_degree = {}  # per degree: its items, their h and h^2, their groups' maxima
    for i in on:
      p, f, h, h2 = int(s.deg[i]), int(s.first[i]), float(s.h[i]), h2_of[i]
      rest_t = peak - h2 / p
      # (a) moves. Groups of degree p other than i's own, and degree-2p groups
      # other than its parent, do not hold i: their maxima are exact.
      for q in (p, 2 * p):
        if q > s.p_max:
          break
        g = f // q
        parent = np.inf
        if q > p:  # the parent: i's half loses its share, then both halves gain h/q
          half, sib = f // p, f // p ^ 1
          c_in = max(float(gcomp[p][half]) - h2 / p, float(gcomp[p][sib])) + h2 / q
          m_in = max(float(gmem[p][half]) - h / p, float(gmem[p][sib])) + h / q
          if m_in <= lim:
            parent = max(c_in, rest_t)
        if least[q] + h2 / q < bar:  # else no other group can end below the bar
          key = np.maximum(gcomp[q] + h2 / q, rest_t)
          key[gmem[q] + h / q > lim] = np.inf
          key[g] = parent
          g = int(key.argmin())
          top = float(key[g])
        else:
          top = parent
        if top < bar:
          cand = (top, comm_cost(h, q) - comm_cost(h, p), i, q, g * q, -1)
          if best is None or cand[:2] < best[:2]:
            best = cand
      # (b) swaps with a shorter same-degree item in another group. All items
      # of degree p are scored: the others end at the peak or above (i's own
      # group holds t; a longer item adds to t), so the first of the best is
      # the same. Memory is checked on the best first, on all if it fails.
      if p not in same_degree:
        js = (s.deg == p).nonzero()[0]
        gj = s.first[js] // p
        same_degree[p] = js, s.h[js], s.h2[js], gcomp[p][gj], gmem[p][gj]
      js, hj, h2j, gcomp_j, gmem_j = same_degree[p]
      delta = (h2 - h2j) / p
      key = np.maximum(gcomp_j + delta, peak - delta)
      k = int(key.argmin())
      if gmem_j[k] + (h - hj[k]) / p > lim:
        key[gmem_j + (h - hj) / p > lim] = np.inf
        k = int(key.argmin())
      if key[k] < bar:
        j = int(js[k])
        cand = (float(key[k]), 0.0, i, p, int(s.first[j]), j)
        if best is None or cand[:2] < best[:2]:
          best = cand
    if best is None:
      if not _make_room(s, t, peak, on):
        return
      continue
    _, _, i, q, first, j = best
    if j < 0:
      s.remove(i)
      s.add(i, q, first)
    else:
      fi = int(s.first[i])
      s.remove(i)
      s.remove(j)
      s.add(i, q, first)
      s.add(j, q, fi)


def _make_room(s: _State, t: int, peak: float, items: list[int]) -> bool:
  """The search's last resort: move an item of t to a group whose compute
  has room but whose memory has not, after moving whole degree-1 sequences
  off that group's full devices onto devices with room (short sequences
  carry many tokens and little compute). Applied only when every touched
  device ends below t's load. Returns whether something moved."""
  lim = s.m_th + _EPS
  best = None
  for i in items:
    p, f, h, h2 = int(s.deg[i]), int(s.first[i]), float(s.h[i]), float(s.h2[i])
    s.remove(i)
    rest_t = float(s.comp[t])
    for q in (p, 2 * p):
      if q > s.p_max:
        break
      gmem, gcomp = _group_max(s.loads, q)
      key = np.maximum(gcomp + h2 / q, rest_t)
      if q == p:
        key[f // p] = np.inf
      full = gmem + h / q > lim
      for g in (full & (key < peak * (1 - 1e-9))).nonzero()[0][:MAKE_ROOM].tolist():
        plan = _evict(s, range(g * q, g * q + q), h / q, peak, exclude=i)
        if plan is None:
          continue
        moves, dest_top, group_top = plan
        new_max = max(dest_top, group_top + h2 / q, rest_t)
        if new_max >= peak * (1 - 1e-9):
          continue
        cand = (new_max, len(moves), i, q, g * q, moves)
        if best is None or cand[:2] < best[:2]:
          best = cand
    s.add(i, p, f)
  if best is None:
    return False
  _, _, i, q, first, moves = best
  for j, d in moves:
    s.remove(j)
    s.add(j, 1, d)
  s.remove(i)
  s.add(i, q, first)
  return True


def _evict(s: _State, group: range, extra: float, peak: float, exclude: int):
  """Degree-1 moves that free room for `extra` more tokens on every device
  of `group`, each to the least-loaded device outside it with room and
  ending below `peak`: (moves, peak of the receiving devices, peak of the
  group after them), or None if impossible."""
  lim = s.m_th + _EPS
  # (memory, compute, outside mask): copies of the loads, once something may move.
  copies: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
  moves, top = [], 0.0
  for e in group:
    # (the moves so far took load off other devices of the group only)
    need = s.mem[e] + extra - lim
    if need <= 0:
      continue
    mine = ((s.first == e) & (s.deg == 1)).nonzero()[0]
    if not len(mine):
      return None  # nothing to move off
    if copies is None:
      outside = np.ones(s.d, bool)
      outside[group.start : group.stop] = False
      copies = s.mem.copy(), s.comp.copy(), outside
    mem, comp, outside = copies
    for j in mine[np.lexsort((mine, -s.h[mine]))].tolist():
      if need <= 0:
        break
      if j == exclude:
        continue
      hj, h2j = float(s.h[j]), float(s.h2[j])
      key = np.where(outside & (mem + hj <= lim), comp + h2j, np.inf)
      d = int(key.argmin())
      if key[d] >= peak * (1 - 1e-9):
        continue
      mem[e] -= hj
      comp[e] -= h2j
      mem[d] += hj
      comp[d] += h2j
      top = max(top, float(comp[d]))
      moves.append((j, d))
      need -= hj
    if need > 0:
      return None
  after = s.comp if copies is None else copies[1]  # None: no device needed room
  return moves, top, float(after[group.start : group.stop].max())


def _check(num_devices: int, p_max: int) -> None:
  if num_devices < 1 or num_devices & (num_devices - 1):
    raise ValueError(f"flex_ulysses needs a power-of-two device count, got {num_devices}")
  if p_max < 1 or p_max & (p_max - 1) or p_max > num_devices:
    raise ValueError(f"p_max {p_max} must be a power of two <= {num_devices} devices")


def _place(
  lens: tuple[int, ...],
  num_devices: int,
  p_max: int,
  base: np.ndarray,
  capacity: float | None = None,
) -> tuple[_State, bool]:
  """Algorithm 2 with our refinements on top of `base` compute per device."""
  m_star = max(sum(lens) / num_devices, 1.0)
  m_th = ALPHA * m_star
  if capacity is not None and m_star <= capacity:
    m_th = min(m_th, float(capacity))  # never plan past the device buffer
  s = _State(lens, num_devices, p_max, m_th)
  s.comp += base
  s.base = base.copy()
  feasible = _baseline(s)
  if not feasible and base.any():
    # Steering by the carried load can paint the memory packing into a
    # corner; the plain baseline may not, and the search still sees the load.
    plain = _State(lens, num_devices, p_max, m_th)
    if _baseline(plain):
      plain.comp += base
      plain.base = base.copy()
      s, feasible = plain, True
  p = p_max
  while p >= 4:
    _merge_level(s, p)
    p //= 2
  _short_item_reorder(s)
  _improve(s, 4 * len(lens) + num_devices, _target(s))
  return s, feasible


def _target(s: _State) -> float:
  """Peak at which the search stops: no plan beats the mean load, nor the
  longest sequence at p_max on the least loaded group."""
  bound = max(
    float(s.comp.sum()) / s.d, float(s.h2.max(initial=0.0)) / s.p_max + float(s.base.min())
  )
  return bound * (1 + TOLERANCE)


def _score(s: _State) -> tuple[float, float]:
  """Memory over M_th (only an infeasible baseline leaves any), then peak compute."""
  return max(0.0, float(s.mem.max()) - s.m_th), float(s.comp.max())


def _placement(s: _State, lens: tuple[int, ...], feasible: bool) -> FlexPlacement:
  return FlexPlacement(s.d, lens, s.placements(), s.m_th, feasible)


def plan_flex(lengths: Sequence[int], num_devices: int, p_max: int) -> FlexPlacement:
  """Places one microbatch.

  From lengths only, for one microbatch on D devices:
    1. Baseline split-place. M* = total tokens / D, M_th = 1.1 M*. Longest
       first, each sequence takes the smallest power-of-two degree p (GETSPSIZE,
       which the paper leaves open: h/p under M_th and h^2/p at most the mean
       per-device attention load) that has an aligned group of p devices with
       room under M_th; degrees double while no group has room, up to p_max. Of
       the groups with room, the least loaded in compute wins (the paper: most
       available memory; compute balances better on our mixtures).
    2. Merge passes (the paper's), p = p_max ... 4: inside one p-group, two to
       four of its smallest degree-p sequences are split two ways and moved to
       the group's halves at degree p/2 when memory stays under M_th and the
       maximum load does not grow; the cheapest (least max load, then least
       communication) is applied. Groups are visited in order and each is merged
       until it has no candidate left (the paper takes the global best each
       time; per group is linear time and finds the same merges when groups do
       not interact, which they do only through the global maximum). The
       paper's p = 2 pass is left out: step 3 re-places every sequence it could
       produce, and on the bench mixtures the plans are the same without it.
    3. Short-item reorder (the paper's): sequences of degree <= 2 are re-placed
       whole, longest first, each on the least-loaded device with room.
       Deviations: sequences longer than M_th, which no device can hold whole,
       stay where they are; a sequence no single device has room for keeps
       degree 2 (the paper's fallback would overfill a device and break M_th).
    4. Local search (ours; the paper's objective, max over devices of
       sum h^2/p, which its stages approach by memory only): on the most loaded
       device, move one of its sequences to another group of the same or twice
       its degree, or swap it with a shorter same-degree sequence elsewhere;
       failing that, make room for such a move by moving whole degree-1
       sequences off the full devices of the target group. Every step lowers
       the touched devices below the old peak and keeps M_th. It stops at 1%
       above a lower bound (the mean load; the longest sequence at p_max).

  Groups are aligned blocks of p consecutive devices, so groups of different
  degrees nest: a degree-2^j group is the last j binary mesh axes. The paper's
  SplitCost(h, p) = h (p-1) / p^2 (x16 beyond p = 8) is a per-device all-to-all
  volume; summed over the p devices that carry it, a merge p -> p/2 always lowers
  it, which is what makes merges "cheaper".
  """
  _check(num_devices, p_max)
  lens = tuple(map(int, lengths))
  s, feasible = _place(lens, num_devices, p_max, np.zeros(num_devices))
  return _placement(s, lens, feasible)


def split_microbatches(lengths: Sequence[int], count: int) -> list[list[int]]:
  """Splits a step into `count` microbatches of near-equal tokens.

  Longest first onto the microbatch with the fewest tokens so far (LPT), so
  every microbatch gets its share of long and short sequences and about the
  same M* (hence M_th); then, while it narrows the spread, the best swap of
  two sequences (or move of one) between the fullest and the emptiest
  microbatch. Returns the non-empty parts, indices ascending.
  """
  lens = list(map(int, lengths))
  heap = [(0, k) for k in range(max(1, count))]
  parts: list[list[int]] = [[] for _ in heap]
  # Longest first, ties by index (the sort is stable, also reversed).
  for i in sorted(range(len(lens)), key=lens.__getitem__, reverse=True):
    total, k = heap[0]
    parts[k].append(i)
    heapq.heapreplace(heap, (total + lens[i], k))
  totals = [0] * len(parts)
  for total, k in heap:
    totals[k] = total
  h = np.asarray(lens, np.int64)
  for _ in range(len(parts)):
    hi = max(range(len(parts)), key=lambda k: (totals[k], -k))
    lo = min(range(len(parts)), key=lambda k: (totals[k], k))
    gap = totals[hi] - totals[lo]
    if gap <= 1:
      break
    a = np.asarray(parts[hi], np.int64)
    b = np.asarray(parts[lo] + [-1], np.int64)  # -1: a plain move
    # |gap - 2 delta| for delta = tokens moved hi -> lo, every pair at once.
    spread = (gap - 2 * h[a])[:, None] + np.where(b >= 0, 2 * h[b], 0)[None, :]
    np.abs(spread, out=spread)
    k = int(spread.argmin())
    if spread.flat[k] >= gap:
      break
    x, y = int(a[k // len(b)]), int(b[k % len(b)])
    parts[hi].remove(x)
    parts[lo].append(x)
    if y >= 0:
      parts[lo].remove(y)
      parts[hi].append(y)
    d = lens[x] - (lens[y] if y >= 0 else 0)
    totals[hi] -= d
    totals[lo] += d
  return [sorted(p) for p in parts if p]


def plan_flex_step(
  microbatches: Sequence[Sequence[int]], num_devices: int, p_max: int, capacity: int | None = None
) -> list[FlexPlacement]:
  """Places the microbatches of one step jointly (ours, beyond the paper).

  What a device waits for at the step's end is its total over microbatches,
  so each microbatch is placed on top of the compute the earlier ones left
  (sum h^2 / p per device), and then, in SWEEPS passes, each microbatch's
  local search runs again against the others' final totals; if it still
  ends above the target, the microbatch is placed afresh on those totals and
  the better of the two kept. Every microbatch keeps its own M_th and all of
  plan_flex's invariants; with a `capacity` (tokens per device), M_th is at
  most that.
  """
  _check(num_devices, p_max)
  carried = np.zeros(num_devices)
  states = []
  for lengths in microbatches:
    lens = tuple(map(int, lengths))
    s, feasible = _place(lens, num_devices, p_max, carried, capacity)
    carried = s.comp.copy()
    states.append((s, lens, feasible))
  for _ in range(SWEEPS if len(states) > 1 else 0):
    for k, (s, lens, feasible) in enumerate(states):
      others = carried - (s.comp - s.base)
      s.comp += others - s.base
      s.base = others
      _improve(s, 4 * len(lens) + num_devices, _target(s))
      if s.comp.max() > _target(s):  # stuck: place it afresh on the others' loads
        t, f2 = _place(lens, num_devices, p_max, others, capacity)
        if _score(t) < _score(s) and (f2 or not feasible):
          s, feasible = t, f2
          states[k] = (s, lens, feasible)
      carried = s.comp.copy()
  return [_placement(s, lens, feasible) for s, lens, feasible in states]
