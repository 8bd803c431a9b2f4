"""Contiguous layout of a packed buffer, for kernels that mask by ranges.

The model's attention masks by segment ids and in-sequence positions (`attention.xla`),
so tokens may sit in any buffer order; vendor kernels (cuDNN's packed THD layout,
tokamax's Mosaic GPU kernel) instead take each sequence as a contiguous range of the
buffer, in position order. `packed_layout` sorts a row so, and `sorted_self_attention`
runs a range kernel on it. Everything here is plain jnp (it runs, and is tested, on any
platform); the kernels that consume it are GPU-only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedLayout:
  """A row-wise sort of a packed buffer into contiguous segments.

  It describes the ranges in the two forms the range kernels read: per-segment lengths
  and start offsets (cuDNN), and per-token key ranges (tokamax).

  order_BT     buffer index of the token at each sorted slot.
  inverse_BT   sorted slot of each buffer token.
  valid_BT     sorted slot holds a real token (not padding).
  seqlens_BM   tokens per segment, sorted order; -1 past the last segment.
  offsets_BM1  first slot of each segment; -1 past the last segment.
  k_start_BT   first slot of the segment of the token at each sorted slot.
  k_end_BT     one past its last slot.
  overflow_B   the row has more than M segments (padding counts as one);
               the ranges past M are dropped, so the caller must not trust
               that row's result.
  """

  order_BT: jax.Array
  inverse_BT: jax.Array
  valid_BT: jax.Array
  seqlens_BM: jax.Array
  offsets_BM1: jax.Array
  k_start_BT: jax.Array
  k_end_BT: jax.Array
  overflow_B: jax.Array

  def gather(self, x_BT: jax.Array) -> jax.Array:
    """Buffer order -> sorted order along axis 1."""
    idx = self.order_BT.reshape(self.order_BT.shape + (1,) * (x_BT.ndim - 2))
    return jnp.take_along_axis(x_BT, idx, axis=1)

  def scatter(self, x_BT: jax.Array) -> jax.Array:
    """Sorted order -> buffer order along axis 1 (the inverse of gather)."""
    idx = self.inverse_BT.reshape(self.inverse_BT.shape + (1,) * (x_BT.ndim - 2))
    return jnp.take_along_axis(x_BT, idx, axis=1)


def packed_layout(
  segment_ids_BT: jax.Array, positions_BT: jax.Array | None, max_segments: int
) -> PackedLayout:
  """Sorts each row by (segment, position); padding becomes the last segment.

  Padding (segment 0) is gathered into one trailing segment. Inside one sorted segment,
  buffer order is position order, so a kernel's index-causal mask equals the
  position-causal mask when positions within a sequence are distinct, which the packers
  guarantee.
  """
  b, t = segment_ids_BT.shape
  if max_segments < 1:
    raise ValueError(f"max_segments must be >= 1, got {max_segments}")
  seg = segment_ids_BT.astype(jnp.int32)
  pos = jnp.zeros_like(seg) if positions_BT is None else positions_BT.astype(jnp.int32)
  key = jnp.where(seg != 0, seg, jnp.iinfo(jnp.int32).max)
  # lexsort: the last key is the primary one; the sort is stable.
  order = jnp.lexsort((pos, key), axis=-1).astype(jnp.int32)
  key_s = jnp.take_along_axis(key, order, axis=1)
  slots = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  inverse = jnp.zeros_like(order).at[jnp.arange(b)[:, None], order].set(slots)
  start = jnp.concatenate([jnp.ones((b, 1), bool), key_s[:, 1:] != key_s[:, :-1]], axis=1)
  seg_index = jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1
  n_segments = seg_index[:, -1] + 1
  rows = jnp.arange(b)[:, None]
  m = max_segments
  lengths = jnp.zeros((b, m), jnp.int32).at[rows, seg_index].add(1, mode="drop")
  in_range = jnp.arange(m)[None, :] < n_segments[:, None]
  seqlens = jnp.where(in_range, lengths, -1)
  offsets = (
    jnp.full((b, m + 1), -1, jnp.int32)
    .at[rows, jnp.where(start, seg_index, m + 1)]
    .set(slots, mode="drop")
  )
  k_start = jax.lax.cummax(jnp.where(start, slots, 0), axis=1)
  end = jnp.concatenate([start[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  k_end = jax.lax.cummin(jnp.where(end, slots + 1, t), axis=1, reverse=True)
  return PackedLayout(
    order_BT=order,
    inverse_BT=inverse,
    valid_BT=key_s != jnp.iinfo(jnp.int32).max,
    seqlens_BM=seqlens,
    offsets_BM1=offsets,
    k_start_BT=k_start,
    k_end_BT=k_end,
    overflow_B=n_segments > m,
  )


def check_self_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, backend: str) -> None:
  """Range kernels serve self-attention over one packed buffer only."""
  if q_BTNH.shape[1] != k_BSKH.shape[1]:
    raise ValueError(
      f"the {backend} backend attends within one packed buffer (query and key lengths "
      f"equal); got {q_BTNH.shape[1]} queries over {k_BSKH.shape[1]} keys: use 'xla'"
    )
  if q_BTNH.shape[2] % k_BSKH.shape[2]:
    raise ValueError(f"{q_BTNH.shape[2]} query heads do not group over {k_BSKH.shape[2]}")


def finish(out_BTNH: jax.Array, layout: PackedLayout) -> jax.Array:
  """Zeroes padding, poisons overflowing rows with NaN, restores buffer order.

  A row with more segments than the kernel was built for has lost some of
  its ranges; NaN makes the step non-finite (and skipped) instead of wrong.
  """
  keep = layout.valid_BT[:, :, None, None]
  out = jnp.where(keep, out_BTNH, jnp.zeros((), out_BTNH.dtype))
  out = jnp.where(layout.overflow_B[:, None, None, None], jnp.nan, out).astype(out_BTNH.dtype)
  return layout.scatter(out)


def sorted_self_attention(
  kernel: Callable[[jax.Array, jax.Array, jax.Array, PackedLayout], jax.Array],
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  segment_ids: jax.Array,
  positions: jax.Array | None,
  causal: bool,
  max_segments: int,
  backend: str,
) -> jax.Array:
  """Runs a range kernel on the sorted buffer and returns buffer order.

  `kernel(q, k, v, layout)` sees sorted q, k, v and the layout describing
  them; the query's segment ids and positions describe the keys too.
  """
  check_self_attention(q_BTNH, k_BSKH, backend)
  if causal and positions is None:
    raise ValueError("causal attention needs query and key positions")
  lay = packed_layout(segment_ids, positions, max_segments)
  out = kernel(lay.gather(q_BTNH), lay.gather(k_BSKH), lay.gather(v_BSKH), lay)
  return finish(out, lay)
