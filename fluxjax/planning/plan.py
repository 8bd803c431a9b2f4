"""The placement plan: which tokens go where, computed from lengths only.

A `Plan` is plain data (ints and tuples) made on the controller: printable, testable and
cheap to broadcast. Strategies make plans; `fluxjax/parallel/batch.py` turns a plan and
the sequences into device buffers. A device is an index into the flattened data-parallel
devices (0..D-1), in the order of the mesh's device array.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Row:
  """The sequences one attention group processes together in a microbatch.

  Their tokens are concatenated (segment ids tell them apart) and cut into `len(devices)`
  contiguous slices of `capacity` tokens, slice k on devices[k]; degree 1 is plain packing
  (packed_dp), degree sp Ulysses. A row may be empty.
  """

  devices: tuple[int, ...]  # attention group, in slice order; len = Ulysses degree
  seqs: tuple[int, ...]  # sequence indices, in buffer order

  @property
  def degree(self) -> int:
    return len(self.devices)


@dataclasses.dataclass(frozen=True)
class Plan:
  """Rows per microbatch plus the static capacity every device buffer gets.

  Every device is in one row per microbatch (one per level in FlexUlysses plans,
  `levels`); gradients accumulate over microbatches.

  Attributes:
    strategy: the strategy name that made it.
    num_devices: D, the data-parallel devices.
    capacity: tokens per device per microbatch (a static bucket).
    microbatches: microbatches[m] = rows of microbatch m; every device appears
      in exactly one row of each microbatch.
    lengths: token count of every sequence of the batch (for checks and costs).
    levels: (degree, capacity) of each buffer section, highest degree first
      (FlexUlysses: a device takes part in one row per level); () = one
      section holding all of `capacity`, whatever its rows' degree.
  """

  strategy: str
  num_devices: int
  capacity: int
  microbatches: tuple[tuple[Row, ...], ...]
  lengths: tuple[int, ...]
  levels: tuple[tuple[int, int], ...] = ()

  @property
  def num_microbatches(self) -> int:
    return len(self.microbatches)

  def level_layout(self) -> tuple[tuple[int, int, int], ...]:
    """(degree, capacity, offset) of each buffer section, highest degree first.

    Without levels there is one section; its degree is that of the non-empty
    rows (0 when there are none).
    """
    if not self.levels:
      degrees = {r.degree for rows in self.microbatches for r in rows if r.seqs}
      return ((max(degrees, default=0), self.capacity, 0),)
    out, offset = [], 0
    for degree, cap in self.levels:
      out.append((degree, cap, offset))
      offset += cap
    return tuple(out)

  @functools.cached_property
  def _sections(self) -> dict[int, tuple[int, int]]:
    """degree -> (capacity, offset); one table, as plans are read row by row."""
    return {degree: (cap, offset) for degree, cap, offset in self.level_layout()}

  def section(self, row: Row) -> tuple[int, int]:
    """(capacity, offset) of the buffer section a row's slices go to."""
    if not self.levels:
      return self.capacity, 0
    try:
      return self._sections[len(row.devices)]
    except KeyError:
      raise ValueError(f"no level of degree {row.degree} in {self.levels}") from None

  def slot(self, row: Row, pos: int) -> tuple[int, int]:
    """(device, buffer index) of token `pos` of a row's stream."""
    cap, offset = self.section(row)
    return row.devices[pos // cap], offset + pos % cap

  def validate(self) -> None:
    """Raises ValueError unless every sequence is placed exactly once and fits."""
    if self.levels and sum(c for _, c in self.levels) != self.capacity:
      raise ValueError(f"levels {self.levels} do not add up to capacity {self.capacity}")
    seen = [0] * len(self.lengths)
    for m, rows in enumerate(self.microbatches):
      if self.levels:
        used_by_degree: dict[int, list[int]] = {}
        for r in rows:
          used_by_degree.setdefault(len(r.devices), []).extend(r.devices)
        for degree, used in used_by_degree.items():
          if len(used) != len(set(used)):
            raise ValueError(f"microbatch {m}: a device is in two rows of degree {degree}")
      else:
        used = sorted(d for r in rows for d in r.devices)
        if used != list(range(self.num_devices)):
          raise ValueError(f"microbatch {m}: devices {used} are not each used once")
      for r in rows:
        tokens = sum(map(self.lengths.__getitem__, r.seqs))
        cap = self.section(r)[0] if r.seqs else self.capacity
        if tokens > r.degree * cap:
          raise ValueError(
            f"microbatch {m}: row on {r.devices} holds {tokens} tokens > "
            f"{r.degree} x capacity {cap}"
          )
        for s in r.seqs:
          seen[s] += 1
    bad = [i for i, n in enumerate(seen) if n != 1]
    if bad:
      raise ValueError(f"sequences {bad[:10]} placed {[seen[i] for i in bad[:10]]} times")

  def describe(self) -> str:
    lines = [
      f"{self.strategy}: {len(self.lengths)} sequences, {self.num_devices} devices, "
      f"{self.num_microbatches} microbatches x {self.capacity} tokens/device"
    ]
    for m, rows in enumerate(self.microbatches):
      for r in rows:
        if r.seqs:
          tokens = sum(self.lengths[s] for s in r.seqs)
          lines.append(f"  mb{m} devices {list(r.devices)}: seqs {list(r.seqs)} ({tokens} tok)")
    return "\n".join(lines)


def capacity_bucket(tokens: int, buckets: Sequence[int], what: str = "tokens") -> int:
  """The smallest bucket >= tokens, so the step compiles once per bucket."""
  for b in sorted(buckets):
    if tokens <= b:
      return b
  raise ValueError(f"{tokens} {what} per device exceed the largest capacity bucket {max(buckets)}")


def doubling_bucket(n: int, smallest: int) -> int:
  """The smallest `smallest * 2**k` >= n: an open ladder of static sizes, so
  a shape compiles once per doubling and no size is out of range."""
  b = smallest
  while b < n:
    b *= 2
  return b


def bucketed(
  plan: Plan,
  token_buckets: Sequence[int],
  microbatch_buckets: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
) -> Plan:
  """Rounds capacity and microbatch count up to static buckets.

  Capacity becomes the smallest bucket that holds the fullest device slice
  (any plan's rows fit it); microbatches are padded with empty ones. The step
  then compiles once per (capacity, microbatch) bucket pair, not per batch.
  """
  m = capacity_bucket(plan.num_microbatches, microbatch_buckets)
  empty = tuple(Row((d,), ()) for d in range(plan.num_devices))
  padding = (empty,) * (m - plan.num_microbatches)
  if plan.levels:  # sections are bucketed by the planner that made them
    return dataclasses.replace(plan, microbatches=plan.microbatches + padding)
  need = 1
  for rows in plan.microbatches:
    for r in rows:
      tokens = sum(plan.lengths[s] for s in r.seqs)
      need = max(need, -(-tokens // r.degree))
  capacity = capacity_bucket(need, token_buckets)
  return dataclasses.replace(plan, capacity=capacity, microbatches=plan.microbatches + padding)


def default_buckets(max_capacity: int, smallest: int = 256) -> tuple[int, ...]:
  """Powers of two from `smallest` up to, and including, `max_capacity`."""
  out, b = [], smallest
  while b < max_capacity:
    out.append(b)
    b *= 2
  return tuple(out) + (max_capacity,)
