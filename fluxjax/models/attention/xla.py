"""The reference attention over packed sequences: plain XLA, runs everywhere.

Masks come from segment ids and in-sequence positions, never from buffer
indices, so a sharding strategy may reorder or split tokens freely:
  key j is visible to query i  iff  seg[i] == seg[j] != 0  (and pos[j] <= pos[i]
  when causal).
Segment id 0 marks padding; padded queries return zeros. Every other backend
is tested against this one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -0.7 * float(jnp.finfo(jnp.float32).max)


def segment_mask(
  q_segment_ids: jax.Array,
  kv_segment_ids: jax.Array,
  q_positions: jax.Array | None,
  kv_positions: jax.Array | None,
  causal: bool,
) -> jax.Array:
  """bool [B, T, S]: which keys each query may attend to."""
  mask = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (
    q_segment_ids[:, :, None] != 0
  )
  if causal:
    if q_positions is None or kv_positions is None:
      raise ValueError("causal attention needs query and key positions")
    mask &= kv_positions[:, None, :] <= q_positions[:, :, None]
  return mask


def block_ranges(seg_BT: jax.Array, pos_BT: jax.Array, block: int):
  """Per block of `block` tokens: (any real token, segment id min, max, position
  min, max), each [B, T / block]; padding (segment 0) is left out of every range.
  """
  b, t = seg_BT.shape
  seg = seg_BT.reshape(b, t // block, block)
  pos = pos_BT.reshape(b, t // block, block)
  real = seg != 0
  big = jnp.iinfo(jnp.int32).max
  small = jnp.iinfo(jnp.int32).min
  return (
    real.any(-1),
    jnp.where(real, seg, big).min(-1),
    jnp.where(real, seg, small).max(-1),
    jnp.where(real, pos, big).min(-1),
    jnp.where(real, pos, small).max(-1),
  )


def blocks_may_see(q_ranges, kv_ranges, causal: bool) -> jax.Array:
  """Whether a query block may see a key block (`block_ranges`, broadcast).

  Their segment ranges must overlap and, when causal, the smallest key position
  must not exceed the largest query position. Conservative (a pair it keeps may
  be fully masked); exact for contiguously packed sequences.
  """
  q_any, q_smin, q_smax, _, q_pmax = q_ranges
  k_any, k_smin, k_smax, k_pmin, _ = kv_ranges
  ok = q_any & k_any & (q_smin <= k_smax) & (k_smin <= q_smax)
  if causal:
    ok &= k_pmin <= q_pmax
  return ok


def xla_attention(
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
  """Reference attention with grouped KV heads; softmax in fp32."""
  b, t, n, h = q_BTNH.shape
  kv_heads = k_BSKH.shape[2]
  if n % kv_heads:
    raise ValueError(f"{n} query heads do not group over {kv_heads} kv heads")
  q = q_BTNH.reshape(b, t, kv_heads, n // kv_heads, h)
  logits = jnp.einsum("btkgh,bskh->bkgts", q, k_BSKH, preferred_element_type=jnp.float32) * (
    h**-0.5
  )
  mask = segment_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal)
  logits = jnp.where(mask[:, None, None], logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  # A padded query sees no key; its softmax is uniform garbage, so zero it.
  probs = jnp.where(mask.any(-1)[:, None, None, :, None], probs, 0.0)
  out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v_BSKH.dtype), v_BSKH)
  return out.reshape(b, t, n, h)


def decode_attention(
  q_SNH: jax.Array, k_SKWH: jax.Array, v_SKWH: jax.Array, lengths_S: jax.Array
) -> jax.Array:
  """One causal query per slot over its cached keys, kv-head-major.

  The query of slot s sits at cache index lengths_S[s] and sees keys 0..that
  index, as `xla_attention` with segment ids 1 and positions = cache index
  computes it (the same products, fp32 softmax and casts). Keys and values
  are [slots, kv heads, window, head dim], so both products batch over
  (slot, kv head) with no transpose of the cache: 3x faster on XLA:CPU in
  bf16 than the token-major layout at 16 slots x 2048 keys.

  Returns [S, 1, N, H].
  """
  s, n, h = q_SNH.shape
  kv_heads, window = k_SKWH.shape[1], k_SKWH.shape[2]
  if n % kv_heads:
    raise ValueError(f"{n} query heads do not group over {kv_heads} kv heads")
  q = q_SNH.reshape(s, kv_heads, n // kv_heads, h)
  logits = jnp.einsum("skgh,skwh->skgw", q, k_SKWH, preferred_element_type=jnp.float32) * (h**-0.5)
  visible_SW = jnp.arange(window, dtype=lengths_S.dtype)[None] <= lengths_S[:, None]
  logits = jnp.where(visible_SW[:, None, None], logits, _NEG_INF)
  probs = jax.nn.softmax(logits, axis=-1)
  # fp32 accumulation, rounded once (a bf16-output dot is 2x slower on XLA:CPU).
  out = jnp.einsum(
    "skgw,skwh->skgh", probs.astype(v_SKWH.dtype), v_SKWH, preferred_element_type=jnp.float32
  )
  return out.astype(v_SKWH.dtype).reshape(s, 1, n, h)
