"""Packed-segment attention on tokamax's Mosaic GPU flash kernel (GPU only).

Sorts the buffer into contiguous segments (`attention.layout`) and gives the
kernel each query's key range [k_start, k_end) plus, when causal, its
diagonal. Padding is one trailing segment whose output is zeroed, so it
contributes nothing to any gradient. Needs the `tokamax` package and an
sm80/sm90/sm100 GPU.
"""

from __future__ import annotations

import functools

import jax

from fluxjax.models.attention import layout as layout_lib


@functools.cache
def _kernel():
  from absl import flags
  from tokamax._src.ops.attention import base, pallas_mosaic_gpu

  # tokamax reads absl flags; outside absl.app.run they would be parsed from
  # the program's own command line and refuse its options.
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()

  return base, pallas_mosaic_gpu.PallasMosaicGpuFlashAttention()


def tokamax_attention(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_segment_ids: jax.Array,
  kv_segment_ids: jax.Array,
  q_positions: jax.Array | None = None,
  kv_positions: jax.Array | None = None,
  causal: bool,
) -> jax.Array:
  """Self-attention over one packed buffer; kv ids must equal the query's."""
  del kv_segment_ids, kv_positions  # self-attention: the query's describe both

  def kernel(q, k, v, lay: layout_lib.PackedLayout) -> jax.Array:
    base, op = _kernel()
    mask = base.Mask(
      k_start=lay.k_start_BT[:, None, :],
      k_end=None if causal else lay.k_end_BT[:, None, :],
      is_causal=causal,
    )
    return op(q, k, v, mask=mask, logits_scale=q.shape[-1] ** -0.5)

  # Every token is its own segment's member, padding included, so no row is
  # empty; the bound on segments is the row length (no overflow possible).
  return layout_lib.sorted_self_attention(
    kernel,
    q_BTNH,
    k_BSKH,
    v_BSKH,
    segment_ids=q_segment_ids,
    positions=q_positions,
    causal=causal,
    max_segments=q_BTNH.shape[1],
    backend="tokamax_gpu",
  )
