"""Packed-segment attention on cuDNN's fused flash kernels (GPU only).

Sorts the buffer into contiguous segments (`attention.layout`) and calls
JAX's cuDNN SDPA in its packed (THD) form: per-segment lengths and offsets
with a padding(-causal) mask. Needs a Hopper or newer GPU, bf16 or fp16
inputs, head dim <= 256 and a multiple of 8. `max_segments` is the largest
number of segments (sequences, plus one for padding) a row may hold: it is
static, and cuDNN's work grows with it, so set it close to what the packer
produces. A row that holds more comes back as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fluxjax.models.attention import layout as layout_lib

DEFAULT_MAX_SEGMENTS = 64

# jax < 0.11.1 scales packed key offsets by the query head count, which is
# wrong under grouped-query attention; there the kv heads are repeated.
_GQA_OFFSETS_FIXED = jax.__version_info__ >= (0, 11, 1)


def cudnn_attention(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_segment_ids: jax.Array,
  kv_segment_ids: jax.Array,
  q_positions: jax.Array | None = None,
  kv_positions: jax.Array | None = None,
  causal: bool,
  max_segments: int = DEFAULT_MAX_SEGMENTS,
) -> jax.Array:
  """Self-attention over one packed buffer; kv ids must equal the query's."""
  from jax._src.cudnn import fused_attention_stablehlo as sdpa

  del kv_segment_ids, kv_positions  # self-attention: the query's describe both

  def kernel(q, k, v, lay: layout_lib.PackedLayout) -> jax.Array:
    n, kv = q.shape[2], k.shape[2]
    if not _GQA_OFFSETS_FIXED and n != kv:
      k, v = jnp.repeat(k, n // kv, axis=2), jnp.repeat(v, n // kv, axis=2)
    return sdpa.dot_product_attention(
      q,
      k,
      v,
      q_seqlen=lay.seqlens_BM,
      kv_seqlen=lay.seqlens_BM,
      q_offsets=lay.offsets_BM1,
      kv_offsets=lay.offsets_BM1,
      scale=q.shape[-1] ** -0.5,
      mask_type=sdpa.MaskType.PADDING_CAUSAL if causal else sdpa.MaskType.PADDING,
      qkv_layout="BTNH",
    )

  return layout_lib.sorted_self_attention(
    kernel,
    q_BTNH,
    k_BSKH,
    v_BSKH,
    segment_ids=q_segment_ids,
    positions=q_positions,
    causal=causal,
    max_segments=max_segments,
    backend="cudnn",
  )
