"""Fixed-degree planners: packed data parallelism and Ulysses, from lengths only.

`plan_packed_dp` and `plan_ulysses` follow one recipe (`_plan_groups`), the veRL-like
baseline that fluxjax's flex_ulysses (`plan_flex_ulysses`) is measured against.
`plan_loads` evaluates a plan under FlexRL's cost model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fluxjax.planning import balance, flex_planner
from fluxjax.planning.plan import Plan, Row, capacity_bucket


def _check_lengths(lengths: Sequence[int]) -> tuple[int, ...]:
  lens = tuple(map(int, lengths))
  if lens and min(lens) < 0:
    bad = next(i for i, n in enumerate(lens) if n < 0)
    raise ValueError(f"sequence {bad} has negative length {lens[bad]}")
  return lens


def _too_long(lens: tuple[int, ...], limit: int, what: str, advice: str) -> None:
  """Raises for the first sequence longer than `limit`, counting the others."""
  if not lens or max(lens) <= limit:
    return
  over = [i for i, n in enumerate(lens) if n > limit]
  more = f" (and {len(over) - 1} more)" if len(over) > 1 else ""
  raise ValueError(
    f"sequence {over[0]} has {lens[over[0]]} tokens > {what} {limit}{more}; {advice}"
  )


def _plan_groups(
  strategy: str,
  lens: tuple[int, ...],
  groups: Sequence[tuple[int, ...]],
  num_devices: int,
  capacity: int,
  shape: balance.CostShape,
) -> Plan:
  """Balances sequences over `groups`, packs each, and pads to a common count.

  The recipe of both fixed-degree planners:
    1. Karmarkar-Karp balances the sequences' `sequence_cost` over the attention groups:
       single devices (packed_dp) or consecutive blocks of sp devices (ulysses).
    2. Each group packs its sequences first-fit decreasing into rows of at most
       degree * capacity tokens.
    3. Every group runs the same number of microbatches (per-layer FSDP collectives
       demand it, ODC's LB-Micro); groups with fewer rows get empty ones. Microbatch m of
       every group is its m-th heaviest row, so the steps that per-layer sync serializes
       pair heavy with heavy.
  """
  degree = len(groups[0])
  costs = balance.sequence_cost(np.asarray(lens, dtype=np.int64), shape)
  parts = balance.karmarkar_karp(costs, len(groups))
  rows_per_group = []
  for part in parts:
    bins = balance.first_fit_decreasing(lens, degree * capacity, part)
    # Heaviest first, ties by first sequence: microbatch m pairs like with like.
    bins.sort(key=lambda b: (-float(costs[b].sum()), b[0]))
    rows_per_group.append(bins)
  num_mb = max(len(b) for b in rows_per_group)
  microbatches = tuple(
    tuple(
      Row(devices=g, seqs=tuple(bins[m]) if m < len(bins) else ())
      for g, bins in zip(groups, rows_per_group)
    )
    for m in range(num_mb)
  )
  return Plan(
    strategy=strategy,
    num_devices=num_devices,
    capacity=capacity,
    microbatches=microbatches,
    lengths=lens,
  )


def plan_packed_dp(
  lengths: Sequence[int], num_devices: int, capacity: int, shape: balance.CostShape
) -> Plan:
  """veRL-like packing: each sequence on one device, cost-balanced by KK.

  Args:
    lengths: tokens of every sequence (prompt + response + vision tokens).
    num_devices: D, the data-parallel devices.
    capacity: tokens per device per microbatch.
    shape: the model's dimensions for the cost model.

  Returns:
    A Plan of degree-1 rows; every device runs the same number of
    microbatches (an empty batch gives zero microbatches).

  Raises:
    ValueError: a sequence is longer than `capacity` (packed_dp cannot split
      it), a negative length, or a non-positive size.
  """
  if num_devices < 1 or capacity < 1:
    raise ValueError(f"num_devices and capacity must be >= 1, got {num_devices}, {capacity}")
  lens = _check_lengths(lengths)
  _too_long(lens, capacity, "packed_dp capacity", "use ulysses or flex_ulysses")
  groups = [(d,) for d in range(num_devices)]
  return _plan_groups("packed_dp", lens, groups, num_devices, capacity, shape)


def plan_ulysses(
  lengths: Sequence[int], num_devices: int, sp: int, capacity: int, shape: balance.CostShape
) -> Plan:
  """Fixed-degree Ulysses: groups of sp consecutive devices share every row.

  Args:
    lengths: tokens of every sequence (prompt + response + vision tokens).
    num_devices: D, the data-parallel devices.
    sp: the Ulysses degree, a power of two dividing D.
    capacity: tokens per device per microbatch; a row holds up to sp * capacity.
    shape: the model's dimensions for the cost model.

  Returns:
    A Plan whose rows are the device blocks (g*sp, ..., g*sp + sp - 1).

  Raises:
    ValueError: sp is not a power of two dividing D, a sequence is longer
      than sp * capacity, a negative length, or a non-positive size.
  """
  if num_devices < 1 or capacity < 1:
    raise ValueError(f"num_devices and capacity must be >= 1, got {num_devices}, {capacity}")
  if sp < 1 or sp & (sp - 1):
    raise ValueError(f"ulysses degree sp={sp} must be a power of two (1, 2, 4, 8, ...)")
  if num_devices % sp:
    raise ValueError(f"ulysses degree sp={sp} does not divide {num_devices} devices")
  lens = _check_lengths(lengths)
  _too_long(
    lens,
    sp * capacity,
    f"ulysses sp={sp} x capacity {capacity} =",
    "raise sp or capacity, or use flex_ulysses",
  )
  groups = [tuple(range(g * sp, (g + 1) * sp)) for g in range(num_devices // sp)]
  return _plan_groups("ulysses", lens, groups, num_devices, capacity, shape)


@dataclasses.dataclass(frozen=True)
class PlanLoads:
  """Per-microbatch, per-device work of a plan under the cost model.

  Every array is [microbatches, devices].

  Attributes:
    tokens: tokens a device holds (its even share of its row).
    attention: attention forward FLOPs.
    linear: per-token matmul forward FLOPs.
    all_to_all_bytes: Ulysses all-to-all bytes the device sends, forward pass.
  """

  tokens: np.ndarray
  attention: np.ndarray
  linear: np.ndarray
  all_to_all_bytes: np.ndarray

  @property
  def cost(self) -> np.ndarray:
    return self.attention + self.linear


def plan_loads(plan: Plan, shape: balance.CostShape) -> PlanLoads:
  """Spreads each row's tokens, FLOPs and all-to-all traffic over its devices.

  FlexRL's cost model: a row's tokens and FLOPs are shared evenly by its devices (Ulysses
  splits heads, and heads cost the same).

  Args:
    plan: any plan (validated or not).
    shape: the model's dimensions for the cost model.

  Returns:
    The loads of every device in every microbatch.
  """
  lens = np.asarray(plan.lengths, dtype=np.int64)
  attn_seq = balance.attention_cost(lens, shape)
  size = (plan.num_microbatches, plan.num_devices)
  tokens, attention, linear, a2a = (np.zeros(size) for _ in range(4))
  for m, rows in enumerate(plan.microbatches):
    for r in rows:
      p = r.degree
      seqs = list(r.seqs)
      row_tokens = float(lens[seqs].sum()) if seqs else 0.0
      share = row_tokens / p
      devs = list(r.devices)
      # += : under flex_ulysses a device sits in one row per degree.
      tokens[m, devs] += share
      attention[m, devs] += float(attn_seq[seqs].sum()) / p if seqs else 0.0
      linear[m, devs] += balance.linear_cost(share, shape)
      a2a[m, devs] += balance.ulysses_all_to_all_bytes(share, p, shape)
  return PlanLoads(tokens=tokens, attention=attention, linear=linear, all_to_all_bytes=a2a)


def plan_flex_ulysses(
  lengths: Sequence[int], num_devices: int, p_max: int, capacity: int, buckets: Sequence[int]
) -> Plan:
  """FlexUlysses: a degree per sequence (flex_planner), as a plan with levels.

  The batch is first split into as few microbatches as keep each one's
  threshold 1.1 M* within `capacity` (longest first onto the microbatch with
  the fewest tokens; M_th capped at `capacity`, and one more microbatch when
  that would leave under 5% slack), then the microbatches are placed by Algorithm 2 jointly,
  so that each device's total over the step is balanced
  (`flex_planner.plan_flex_step`). Each degree present gets a buffer
  section whose capacity is the bucket holding its fullest group slice, the
  same for every microbatch (static shapes).
  """
  lens = _check_lengths(lengths)
  _too_long(
    lens,
    p_max * capacity,
    "flex_ulysses p_max x capacity",
    "raise sharding.sp or sharding.capacity",
  )
  total = sum(lens)
  count = max(1, -(-int(flex_planner.ALPHA * total) // (num_devices * capacity)))
  while True:
    parts = flex_planner.split_microbatches(lens, count)
    # A part above the mean may push its 1.1 M* past the capacity: M_th is
    # then capped at the capacity, and below 5% slack the step gets one more
    # microbatch (a single sequence is placed at p_max and fits anyway).
    if any(len(p) > 1 and 1.05 * sum(lens[i] for i in p) > num_devices * capacity for p in parts):
      count += 1
      continue
    placed = flex_planner.plan_flex_step(
      [[lens[i] for i in part] for part in parts], num_devices, p_max, capacity
    )
    microbatches, need = _flex_rows(lens, parts, placed)
    # Sequences that each need a degree > 1 may still not fit the groups one
    # microbatch has (five of 4097 tokens at capacity 4096 and p_max 2 need
    # ten devices of eight): then the step takes one more microbatch. One
    # sequence per microbatch always fits (checked above).
    if max(need.values(), default=0) <= capacity or count >= len(lens):
      break
    count += 1
  levels = tuple((p, capacity_bucket(need[p], buckets)) for p in sorted(need, reverse=True))
  plan = Plan(
    "flex_ulysses", num_devices, sum(c for _, c in levels), tuple(microbatches), lens, levels
  )
  plan.validate()
  return plan


def _flex_rows(
  lens: tuple[int, ...], parts: list[list[int]], placed: list[flex_planner.FlexPlacement]
) -> tuple[list[tuple[Row, ...]], dict[int, int]]:
  """Rows of each placed microbatch, and per degree its fullest group's per-device tokens."""
  microbatches = []
  need: dict[int, int] = {}
  for part, fp in zip(parts, placed):
    groups: dict[tuple[int, int], list[int]] = {}  # (-degree, first device): highest first
    for i, pl in zip(part, fp.placements):
      groups.setdefault((-pl.p, pl.first), []).append(i)
    rows = []
    for key in sorted(groups):
      seqs, p, first = groups[key], -key[0], key[1]
      # Long sequences first, short ones packed after; ties in index order
      # (seqs ascend, and the sort is stable, also reversed).
      seqs.sort(key=lens.__getitem__, reverse=True)
      rows.append(Row(tuple(range(first, first + p)), tuple(seqs)))
      need[p] = max(need.get(p, 0), -(-sum(map(lens.__getitem__, seqs)) // p))
    microbatches.append(tuple(rows))
  return microbatches, need


def plan_packed_dp_lb_mini(
  lengths: Sequence[int], num_devices: int, capacity: int, shape: balance.CostShape
) -> Plan:
  """packed_dp for minibatch-level sync: ODC's LB-Mini.

  Karmarkar-Karp balances the whole minibatch over devices with no count
  constraint; each device then packs its own sequences into as many
  microbatches as it needs under `capacity`. Devices may run different numbers
  of microbatches (their later rows are empty), which only minibatch sync can
  exploit: with per-layer sync every device would wait for the longest.
  """
  lens = _check_lengths(lengths)
  _too_long(lens, capacity, "packed_dp capacity", "use ulysses or flex_ulysses")
  costs = balance.sequence_cost(np.asarray(lens, dtype=np.int64), shape)
  (schedule,) = balance.lb_mini(costs, lens, num_devices, capacity)
  count = max([len(s) for s in schedule] + [1])
  microbatches = tuple(
    tuple(
      Row((d,), tuple(schedule[d][m]) if m < len(schedule[d]) else ()) for d in range(num_devices)
    )
    for m in range(count)
  )
  return Plan("packed_dp", num_devices, capacity, microbatches, lens)
