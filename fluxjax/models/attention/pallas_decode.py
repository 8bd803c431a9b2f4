"""Decode attention read in place from the engine's KV cache: a Pallas kernel, Triton lowering.

The `pallas_gpu` choice of `model.decode_attention` (the `xla` reference is
`xla.decode_attention`). The reference attends over a window sliced out of the
cache, and XLA:GPU copies that window out of the cache for its batched dots
every layer and step; this kernel reads the cache where it lies, and for each
slot only the blocks up to its length, not the whole window.

One program per (slot, kv head, split): its query heads (padded to a Triton
tile of at least 16 rows) against one split of the slot's keys and values,
block by block with an online softmax in fp32, the probabilities rounded to
the cache dtype for the second product as the reference does. Long windows
split over several programs (flash-decoding), so that a few slots with long
contexts still fill the GPU; the splits' partial sums are combined after.
The cache holds the bits of its dtype (`decode.KVCache`); the kernel views
them as that dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fluxjax.models.attention.pallas import _LOG2_E, _MASK_VALUE, _dot, _dot_nt

# Keys per block: a power of two (Triton's tiles) that few short contexts waste.
BLOCK_K = 64
# Triton's dot wants at least 16 rows: a kv head's query heads are padded to it.
MIN_ROWS = 16
# Keys per split (a multiple of BLOCK_K), and the most splits of one window.
SPLIT_KEYS = 1024
MAX_SPLITS = 16


def _kernel(
  layer_ref,
  lengths_ref,
  q_ref,
  k_ref,
  v_ref,
  o_ref,
  m_ref,
  denom_ref,
  *,
  dtype,
  window,
  block_k,
  split_blocks,
  scale,
):
  slot, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  layer, length = layer_ref[0], lengths_ref[slot]
  capacity = k_ref.shape[3]
  q = q_ref[...]
  rows = q.shape[0]

  def block(ref, start):
    keys = start + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
    view = ref.at[layer, slot, head, pl.ds(start, block_k), :]
    bits = plgpu.load(view, mask=(keys < capacity)[:, None], other=0)
    return lax.bitcast_convert_type(bits, dtype), keys

  def body(j, carry):
    acc, m, denom = carry
    start = pl.multiple_of(j * block_k, block_k)
    k, keys = block(k_ref, start)
    visible = ((keys <= length) & (keys < window))[None, :]
    s = jnp.where(visible, _dot_nt(q, k) * scale, _MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(visible, jnp.exp2(s - m_new[:, None]), 0.0)
    v, _ = block(v_ref, start)
    acc = acc * alpha[:, None] + _dot(p.astype(dtype), v)
    return acc, m_new, denom * alpha + p.sum(axis=-1)

  # Keys 0..length are visible: the blocks holding them, within the window,
  # that fall in this program's split.
  blocks = jnp.minimum(length // block_k + 1, pl.cdiv(window, block_k))
  first = split * split_blocks
  init = (
    jnp.zeros((rows, q.shape[1]), jnp.float32),
    jnp.full((rows,), _MASK_VALUE, jnp.float32),
    jnp.zeros((rows,), jnp.float32),
  )
  acc, m, denom = lax.fori_loop(first, jnp.minimum(blocks, first + split_blocks), body, init)
  o_ref[...], m_ref[...], denom_ref[...] = acc, m, denom


def cache_decode_attention(
  q_SNH: jax.Array,
  k_LSKCH: jax.Array,
  v_LSKCH: jax.Array,
  dtype,
  layer: jax.Array,
  lengths_S: jax.Array,
  window: int,
  *,
  block_k: int = BLOCK_K,
  split_keys: int | None = None,
  num_warps: int = 4,
  interpret: bool = False,
) -> jax.Array:
  """`xla.decode_attention` of the first S slots, read from the cache in place.

  Args:
    q_SNH: one query per slot, [S, N, H].
    k_LSKCH, v_LSKCH: the whole cache's bits, [L, slots, K, C, H] (unsigned
      integers of `dtype`'s width).
    dtype: what the bits hold.
    layer: the layer to read (a traced int: the decoder scan's index).
    lengths_S: the query of slot s sits at cache index lengths_S[s] and sees
      keys 0..that index (min(that, window - 1)).
    window: static; at most this many leading cache entries are read.
    split_keys: keys per program (SPLIT_KEYS; a multiple of block_k): windows
      longer than it split over up to MAX_SPLITS programs per slot and head.
    interpret: run in Pallas interpret mode (any backend: the CPU tests).

  Returns [S, 1, N, H] in `dtype`.
  """
  s, n, h = q_SNH.shape
  kv_heads = k_LSKCH.shape[2]
  if h & (h - 1):
    raise ValueError(
      f"head_dim {h} is not a power of 2: Triton loads whole power-of-2 tiles and the kernel "
      "reads the cache in place, unpadded; use model.decode_attention=xla"
    )
  if n % kv_heads:
    raise ValueError(f"{n} query heads do not group over {kv_heads} kv heads")
  groups = n // kv_heads
  rows = max(MIN_ROWS, pl.next_power_of_2(groups))
  q = q_SNH.astype(dtype).reshape(s, kv_heads, groups, h)
  q = jnp.pad(q, ((0, 0), (0, 0), (0, rows - groups), (0, 0)))
  split_keys = split_keys or SPLIT_KEYS
  splits = min(MAX_SPLITS, pl.cdiv(window, split_keys))
  split_blocks = pl.cdiv(pl.cdiv(window, block_k), splits)
  whole = pl.BlockSpec()  # the whole array: the kernel picks its blocks
  part = (s, kv_heads, splits, rows)
  acc, m, denom = pl.pallas_call(
    functools.partial(
      _kernel,
      dtype=jnp.dtype(dtype),
      window=window,
      block_k=block_k,
      split_blocks=split_blocks,
      scale=h**-0.5 * _LOG2_E,
    ),
    grid=(s, kv_heads, splits),
    in_specs=[
      whole,
      whole,
      pl.BlockSpec((None, None, rows, h), lambda i, j, p: (i, j, 0, 0)),
      whole,
      whole,
    ],
    out_specs=[
      pl.BlockSpec((None, None, None, rows, h), lambda i, j, p: (i, j, p, 0, 0)),
      pl.BlockSpec((None, None, None, rows), lambda i, j, p: (i, j, p, 0)),
      pl.BlockSpec((None, None, None, rows), lambda i, j, p: (i, j, p, 0)),
    ],
    out_shape=[
      jax.ShapeDtypeStruct((*part, h), jnp.float32),
      jax.ShapeDtypeStruct(part, jnp.float32),
      jax.ShapeDtypeStruct(part, jnp.float32),
    ],
    compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
    interpret=interpret,
    name="cache_decode_attention",
  )(jnp.asarray(layer, jnp.int32).reshape(1), lengths_S.astype(jnp.int32), q, k_LSKCH, v_LSKCH)
  # The splits' online-softmax states, rescaled to their common max (a split
  # with no visible key has denominator 0 and weighs nothing; a query that
  # sees no key at all, as `pallas.py`'s, returns zeros).
  weight = jnp.exp2(m - m.max(axis=2, keepdims=True))
  denom = jnp.maximum((denom * weight).sum(axis=2), 1e-30)
  out = (acc * weight[..., None]).sum(axis=2) / denom[..., None]
  return out[:, :, :groups].astype(dtype).reshape(s, 1, n, h)
