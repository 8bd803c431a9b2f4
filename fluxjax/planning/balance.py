"""Cost model and balancing algorithms: Karmarkar-Karp, LB-Micro, LB-Mini.

Everything here works from sequence lengths alone (host-side numpy, no jax),
so the controller can plan a step before any pixel or token is materialized.
Entry points: `sequence_cost` (the cost model, told in its docstring),
`karmarkar_karp` (veRL's multiway LDM), `lb_micro` and `lb_mini` (ODC's balancers)
and `bubble_rate` (ODC's idle fraction).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np

# schedule[device][microbatch] = item indices: one minibatch of LB-Micro/LB-Mini.
Schedule = list[list[list[int]]]
SyncMode = Literal["layer", "minibatch"]


@dataclasses.dataclass(frozen=True)
class CostShape:
  """The decoder dimensions the cost model needs (`ModelConfig.cost_shape()`).

  Attributes:
    num_layers: decoder layers.
    hidden: model width.
    num_heads: query heads.
    num_kv_heads: key/value heads (GQA).
    head_dim: width of one head.
    intermediate: SwiGLU hidden width.
    vocab: output vocabulary (the LM head is a per-token matmul too).
    bytes_per_elem: activation element size on the wire (2 for bf16).
  """

  num_layers: int
  hidden: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  intermediate: int
  vocab: int
  bytes_per_elem: int = 2

  @property
  def matmul_params_per_token(self) -> int:
    """Weights every token multiplies through once: q, k, v, o, SwiGLU, LM head."""
    q = self.num_heads * self.head_dim
    kv = self.num_kv_heads * self.head_dim
    per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate
    return self.num_layers * per_layer + self.hidden * self.vocab


def attention_cost(length, shape: CostShape):
  """Causal attention forward FLOPs of one sequence (or an array of them).

  Args:
    length: tokens of a sequence; an int or an array of lengths.
    shape: the model's dimensions.

  Returns:
    layers * 4 * L(L+1)/2 * heads * head_dim, as a float (or float64 array).
  """
  n = np.asarray(length, dtype=np.float64)
  out = shape.num_layers * 4.0 * (n * (n + 1) / 2) * shape.num_heads * shape.head_dim
  return float(out) if out.ndim == 0 else out


def linear_cost(length, shape: CostShape):
  """Forward FLOPs of every per-token matmul of one sequence (or an array).

  Args:
    length: tokens of a sequence; an int or an array of lengths.
    shape: the model's dimensions.

  Returns:
    2 * matmul_params_per_token * L, as a float (or float64 array).
  """
  out = 2.0 * shape.matmul_params_per_token * np.asarray(length, dtype=np.float64)
  return float(out) if out.ndim == 0 else out


def sequence_cost(length, shape: CostShape):
  """attention_cost + linear_cost: the work a sequence puts on its devices.

  Cost model (forward FLOPs of the Qwen2 decoder; a training step costs about
  three times as much, which no balance ratio depends on):

    attention_cost(L) = layers * 2 matmuls (QK^T, PV) * 2 flops per MAC
                        * L(L+1)/2 causal query-key pairs * heads * head_dim
    linear_cost(L)    = 2 flops per MAC * matmul parameters per token * L

  GQA shrinks K and V but not the score and value matmuls, which run once per
  query head, so `num_kv_heads` enters only the linear term. The vision tower is
  balanced separately (by patch count) and is not part of a sequence's cost.
  """
  return attention_cost(length, shape) + linear_cost(length, shape)


def ulysses_all_to_all_bytes(tokens, sp: int, shape: CostShape):
  """Bytes one device sends in Ulysses all-to-alls, forward, summed over layers.

  Before attention each device holds `tokens` positions of q, k and v for all
  heads and must end with all positions of its share of heads; after attention
  the output goes back. It keeps 1/sp of what it holds and sends the rest.
  Heads are padded to a multiple of sp (28 query heads at sp=8 travel as 32),
  and KV heads are replicated up to sp when num_kv_heads < sp, so each device
  still receives one KV head.

  Args:
    tokens: positions the device holds before the exchange (int or array).
    sp: the Ulysses degree; 1 sends nothing.
    shape: the model's dimensions.

  Returns:
    (sp-1)/sp * tokens * head_dim * (2 * q_heads + 2 * kv_heads) * bytes * layers,
    where q (in) and the output (back) each move q_heads, and k, v move kv_heads.
  """
  q_heads = -(-shape.num_heads // sp) * sp
  kv_heads = -(-shape.num_kv_heads // sp) * sp
  per_token = (
    shape.head_dim * (2 * q_heads + 2 * kv_heads) * shape.bytes_per_elem * shape.num_layers
  )
  out = (sp - 1) / sp * np.asarray(tokens, dtype=np.float64) * per_token
  return float(out) if out.ndim == 0 else out


def balance_ratio(loads) -> float:
  """max / mean of per-device loads (FlexRL's balance ratio); 1.0 when all are 0."""
  x = np.asarray(loads, dtype=np.float64)
  mean = float(x.mean()) if x.size else 0.0
  return float(x.max()) / mean if mean > 0 else 1.0


# --- Karmarkar-Karp ---------------------------------------------------------------


def karmarkar_karp(costs: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
  """Splits items into k parts of near-equal total cost (largest differencing).

  Multiway LDM: every item starts as a k-tuple of sums (the item, then zeros);
  the two tuples with the largest spread (max - min) are repeatedly combined,
  largest sum of one with smallest of the other, until one tuple is left. The
  spread of a combination never exceeds the larger spread combined, so the
  final max - min part is at most the largest item, and the largest part is at
  most (4/3 - 1/(3k)) of the optimum (Michiels et al., 2007).

  Ties are broken by cost, then item index, then creation order: equal inputs
  give equal outputs, and the part sums depend only on the multiset of costs.

  Args:
    costs: non-negative cost of every item.
    k: the number of parts (>= 1); parts may be empty when items are fewer.
    equal_size: give every part len(costs) / k items (veRL's equal_size): the
      sorted items are cut into runs of k that start as full k-tuples.

  Returns:
    k lists of item indices, heaviest part first, each in ascending index order.

  Raises:
    ValueError: k < 1, a negative or non-finite cost, or equal_size with
      len(costs) not a multiple of k.
  """
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  c = np.asarray(costs, dtype=np.float64).reshape(-1)
  n = c.size
  if n and (not np.all(np.isfinite(c)) or c.min() < 0):
    raise ValueError("costs must be finite and non-negative")
  if equal_size and n % k:
    raise ValueError(f"equal_size needs a multiple of k={k} items, got {n}")
  if n == 0:
    return [[] for _ in range(k)]
  order = np.lexsort((np.arange(n), c))  # ascending cost, then index
  # A part is a tree of merged nodes: ids < n are items; id n + j joins
  # left[j] and right[j]. Only the roots travel with the tuples.
  left: list[np.ndarray] = []
  right: list[np.ndarray] = []
  next_id = n
  # A tuple keeps only its non-zero parts (sums descending, root ids); the
  # zeros are implicit, so combining sparse tuples is a concatenation.
  heap: list = []
  tick = itertools.count()

  def push(sums: np.ndarray, roots: np.ndarray) -> None:
    spread = sums[0] - (sums[-1] if sums.size == k else 0.0)
    heapq.heappush(heap, (-spread, -sums[0], next(tick), sums, roots))

  if equal_size:
    for g in range(n // k):
      run = order[g * k : (g + 1) * k][::-1]
      push(c[run], run.astype(np.int64))
  else:
    for i in order[::-1]:
      push(c[i : i + 1], np.array([i], dtype=np.int64))

  while len(heap) > 1:
    _, _, _, a_sums, a_roots = heapq.heappop(heap)
    _, _, _, b_sums, b_roots = heapq.heappop(heap)
    m0, m1 = a_sums.size, b_sums.size
    if m0 + m1 <= k:
      # b's non-zero parts meet a's implicit zeros.
      sums = np.concatenate([a_sums, b_sums])
      roots = np.concatenate([a_roots, b_roots])
    else:
      # Full pairing: position i gets a[i] + b[k-1-i]; one side may be a zero.
      sums = np.zeros(k)
      roots = np.full(k, -1, dtype=np.int64)
      sums[:m0] = a_sums
      roots[:m0] = a_roots
      pos = k - 1 - np.arange(m1)  # where b's parts land
      both = pos < m0
      only_b = pos[~both]
      sums[only_b] = b_sums[~both]
      roots[only_b] = b_roots[~both]
      joined = pos[both]
      sums[joined] += b_sums[both]
      count = joined.size
      left.append(roots[joined].copy())
      right.append(b_roots[both])
      roots[joined] = np.arange(next_id, next_id + count)
      next_id += count
    idx = np.argsort(-sums, kind="stable")
    push(sums[idx], roots[idx])

  _, _, _, sums, roots = heap[0]
  lefts = np.concatenate(left).tolist() if left else []
  rights = np.concatenate(right).tolist() if right else []
  parts = []
  for r in roots.tolist():
    items, stack = [], [r]
    while stack:
      node = stack.pop()
      if node < n:
        items.append(node)
      else:
        stack.append(lefts[node - n])
        stack.append(rights[node - n])
    parts.append(sorted(items))
  parts.extend([] for _ in range(k - len(parts)))
  return parts


def first_fit_decreasing(
  lengths: Sequence[int], capacity: int, items: Sequence[int] | None = None
) -> list[list[int]]:
  """Packs items into as few bins of `capacity` tokens as first-fit decreasing finds.

  Args:
    lengths: tokens of every item of the batch.
    capacity: tokens a bin holds.
    items: the item indices to pack (all when None).

  Returns:
    Bins of item indices, in the order they were opened; each bin in ascending
    index order.

  Raises:
    ValueError: an item is longer than `capacity`.
  """
  if items is None:
    items = range(len(lengths))
  todo = sorted(items, key=lambda i: (-lengths[i], i))
  bins: list[list[int]] = []
  free: list[int] = []
  for i in todo:
    if lengths[i] > capacity:
      raise ValueError(f"item {i} has {lengths[i]} tokens > capacity {capacity}")
    for b, room in enumerate(free):
      if lengths[i] <= room:
        bins[b].append(i)
        free[b] -= lengths[i]
        break
    else:
      bins.append([i])
      free.append(capacity - lengths[i])
  return [sorted(b) for b in bins]


# --- ODC's LB-Micro and LB-Mini ------------------------------------------------------


def _check_items(costs, lengths, num_devices, max_tokens):
  c = np.asarray(costs, dtype=np.float64).reshape(-1)
  lens = [int(x) for x in lengths]
  if c.size != len(lens):
    raise ValueError(f"{c.size} costs but {len(lens)} lengths")
  if num_devices < 1:
    raise ValueError(f"num_devices must be >= 1, got {num_devices}")
  for i, n in enumerate(lens):
    if n > max_tokens:
      raise ValueError(f"item {i} has {n} tokens > microbatch cap {max_tokens}")
  return c, lens


def _minibatches(n: int, num_devices: int, minibatch_size: int | None) -> list[np.ndarray]:
  """Consecutive global minibatches of minibatch_size items per device (ODC Listing 3)."""
  if minibatch_size is None:
    return [np.arange(n)]
  if minibatch_size < 1:
    raise ValueError(f"minibatch_size must be >= 1, got {minibatch_size}")
  step = minibatch_size * num_devices
  return [np.arange(s, min(s + step, n)) for s in range(0, n, step)]


def _fits(parts: list[list[int]], lens: list[int], max_tokens: int) -> bool:
  return all(sum(lens[i] for i in p) <= max_tokens for p in parts)


def _split_microbatches(items: np.ndarray, c: np.ndarray, k: int) -> list[list[int]]:
  """KK of one device's items into k microbatches, heaviest first, global ids."""
  parts = karmarkar_karp(c[items], k)
  return [[int(items[j]) for j in p] for p in parts]


def lb_micro(
  costs: Sequence[float],
  lengths: Sequence[int],
  num_devices: int,
  max_tokens: int,
  minibatch_size: int | None = None,
) -> list[Schedule]:
  """ODC's LB-Micro: every device runs the same number of microbatches.

  Per minibatch (ODC Appendix C, Listings 1 and 3 with the baseline settings):
  KK balances the items over devices with equal item counts (veRL's constraint;
  relaxed when the minibatch does not divide evenly); then the smallest common
  microbatch count M is found for which KK splits every device's items into M
  microbatches under `max_tokens` (the all-reduced OOM check). Microbatch m of
  every device is its m-th heaviest, so the steps that per-layer sync
  serializes line up heavy with heavy.

  Args:
    costs: per-item cost (e.g. `sequence_cost` of the lengths).
    lengths: per-item tokens, checked against `max_tokens`.
    num_devices: data-parallel devices.
    max_tokens: token cap of one microbatch on one device.
    minibatch_size: items per device per minibatch; None = one minibatch.

  Returns:
    One schedule per minibatch: schedule[device][microbatch] = item indices.

  Raises:
    ValueError: an item is longer than `max_tokens`, or a size is invalid.
  """
  c, lens = _check_items(costs, lengths, num_devices, max_tokens)
  out = []
  for mb in _minibatches(len(lens), num_devices, minibatch_size):
    equal = mb.size % num_devices == 0
    per_device = [mb[p] for p in karmarkar_karp(c[mb], num_devices, equal_size=equal)]
    # No M below the token lower bound can fit, so start there (same result).
    k = max([1] + [math.ceil(sum(lens[i] for i in d) / max_tokens) for d in per_device])
    while True:
      split = [_split_microbatches(d, c, k) for d in per_device]
      if all(_fits(s, lens, max_tokens) for s in split):
        break
      k += 1
    out.append(split)
  return out


def lb_mini(
  costs: Sequence[float],
  lengths: Sequence[int],
  num_devices: int,
  max_tokens: int,
  minibatch_size: int | None = None,
) -> list[Schedule]:
  """ODC's LB-Mini: balance whole minibatches; each device packs on its own.

  Per minibatch (ODC Appendix C, Listings 1 and 3 with the LB-Mini settings):
  KK balances the items over devices with no count constraint; then each
  device alone takes the smallest M for which KK splits its items into M
  microbatches under `max_tokens`. Devices may run different numbers of
  microbatches, which only minibatch-level sync (ODC) can execute.

  Args:
    costs: per-item cost (e.g. `sequence_cost` of the lengths).
    lengths: per-item tokens, checked against `max_tokens`.
    num_devices: data-parallel devices.
    max_tokens: token cap of one microbatch on one device.
    minibatch_size: items per device per minibatch; None = one minibatch.

  Returns:
    One schedule per minibatch: schedule[device][microbatch] = item indices,
    heaviest microbatch first; a device with no items has no microbatches.

  Raises:
    ValueError: an item is longer than `max_tokens`, or a size is invalid.
  """
  c, lens = _check_items(costs, lengths, num_devices, max_tokens)
  out = []
  for mb in _minibatches(len(lens), num_devices, minibatch_size):
    schedule: Schedule = []
    for p in karmarkar_karp(c[mb], num_devices):
      items = mb[p]
      if not items.size:
        schedule.append([])
        continue
      k = max(1, math.ceil(sum(lens[i] for i in items) / max_tokens))
      while True:
        split = _split_microbatches(items, c, k)
        if _fits(split, lens, max_tokens):
          break
        k += 1
      schedule.append([s for s in split if s])
    out.append(schedule)
  return out


def bubble_rate(
  schedules: Sequence[Schedule], costs: Sequence[float], sync: SyncMode = "layer"
) -> float:
  """Idle device time over total device time, as ODC defines its bubble rate.

  With per-layer sync (FSDP collectives) every microbatch step m lasts as long
  as its slowest device, so a device idles max_d t[d][m] - t[d][m] in it; a
  device with fewer microbatches idles through the steps it lacks. With
  minibatch sync (ODC) only each device's total matters: it idles
  max_d T_d - T_d. Minibatches run one after another and add up.

  Args:
    schedules: per-minibatch schedules from `lb_micro` / `lb_mini`.
    costs: per-item cost (time is taken as proportional to it).
    sync: "layer" or "minibatch".

  Returns:
    sum of idle time / (devices * elapsed time), in [0, 1); 0.0 for no work.
  """
  if sync not in ("layer", "minibatch"):
    raise ValueError(f"sync must be 'layer' or 'minibatch', got {sync!r}")
  c = np.asarray(costs, dtype=np.float64).reshape(-1)
  work = device_time = 0.0
  for schedule in schedules:
    steps = max((len(d) for d in schedule), default=0)
    t = np.zeros((len(schedule), steps))
    for d, mbs in enumerate(schedule):
      for m, items in enumerate(mbs):
        t[d, m] = c[items].sum() if len(items) else 0.0
    if t.size:
      work += t.sum()
      elapsed = t.max(axis=0).sum() if sync == "layer" else t.sum(axis=1).max()
      device_time += len(schedule) * elapsed
  if device_time <= 0:
    return 0.0
  return 1.0 - work / device_time
