"""Packed-segment flash attention on GPUs: Pallas kernels, Triton lowering.

The `pallas_gpu` backend of `fluxjax.models.attention`, with the same masking as the
`xla` reference (segment ids and in-sequence positions, never buffer indices; queries
that see no key return zeros). Entry point: `pallas_attention`, whose docstring tells
the kernels, the block skipping and the padding.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from fluxjax.models.attention import xla

# Masked logits take this finite value, not -inf: the running max of a row
# that has seen only masked keys stays finite, so exp2(m_old - m_new) never
# becomes exp2(-inf + inf) = NaN. Probabilities of masked keys are zeroed by
# an explicit select, not by underflow.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2_E = math.log2(math.e)
# Below this query length (decode steps, a few speculative tokens) the XLA
# reference is the better tool: its logits are [N, T, S] with T tiny, so it
# never holds a T x S square, and a Triton tile would be mostly padding.
MIN_QUERY_LEN = 16
# Larger heads would not fit a useful tile in registers and shared memory.
MAX_HEAD_DIM = 256


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (rows of queries / keys) and Triton launch settings.

  Each kernel has its own tiles: the forward and dq kernels hold a query tile
  and stream key tiles, the dk/dv kernel holds a key tile and streams query
  tiles. All must be powers of two >= 16.
  """

  fwd_q: int = 128
  fwd_k: int = 64
  dq_q: int = 64
  dq_k: int = 64
  dkv_q: int = 64
  dkv_k: int = 64
  num_warps_fwd: int = 8
  num_warps_bwd: int = 4
  num_stages: int = 2

  @property
  def pad_multiple(self) -> int:
    return max(self.fwd_q, self.fwd_k, self.dq_q, self.dq_k, self.dkv_q, self.dkv_k)

  def capped(self, t: int, s: int) -> BlockSizes:
    """Shrinks tiles to the (power-of-two) lengths, so short inputs pad little."""
    cq = max(16, pl.next_power_of_2(t))
    ck = max(16, pl.next_power_of_2(s))
    return dataclasses.replace(
      self,
      fwd_q=min(self.fwd_q, cq),
      fwd_k=min(self.fwd_k, ck),
      dq_q=min(self.dq_q, cq),
      dq_k=min(self.dq_k, ck),
      dkv_q=min(self.dkv_q, cq),
      dkv_k=min(self.dkv_k, ck),
    )


def default_block_sizes(head_dim_padded: int, itemsize: int) -> BlockSizes:
  """Tiles that fit an H100's registers and 228 KB of shared memory per SM.

  bf16 / head dim 128, measured on an H100 (`bench/attention.py --variants`,
  16k tokens, forward + backward): 64x64 backward tiles with 4 warps took
  25.2 ms; the tiles of Triton's fused-attention tutorial (dk/dv 32x128, dq
  128x32) 89.8 ms, 8 backward warps 42.9 ms, a 128x128 forward tile 24.4 ms
  (within the spread between runs), 3 pipeline stages 25.4 ms. Rows twice as
  wide (fp32, or head dim 256) get smaller tiles, or the kernels would run out
  of shared memory.
  """
  row_bytes = head_dim_padded * itemsize
  if row_bytes <= 256:
    return BlockSizes()
  if row_bytes <= 512:
    return BlockSizes(
      fwd_q=64, fwd_k=32, dq_q=64, dq_k=32, dkv_q=32, dkv_k=64, num_warps_fwd=4, num_stages=2
    )
  return BlockSizes(
    fwd_q=32, fwd_k=32, dq_q=32, dq_k=32, dkv_q=32, dkv_k=32, num_warps_fwd=4, num_stages=1
  )


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything about one call that shapes the kernels (hashable)."""

  causal: bool
  sm_scale: float
  blocks: BlockSizes
  interpret: bool


# --- block tables (XLA side) -------------------------------------------------------


def _visit_table(rows, cols, causal: bool, rows_are_queries: bool) -> jax.Array:
  """int32 [B, R, 1 + C]: per row block, the count of column blocks that may hold a
  visible pair, then their indices (ascending), then the others.

  `rows` / `cols` are `attention.xla.block_ranges` of the blocks one program holds and of
  the blocks it streams.
  """
  r = tuple(x[:, :, None] for x in rows)
  c = tuple(x[:, None, :] for x in cols)
  may_see = xla.blocks_may_see
  visit = may_see(r, c, causal) if rows_are_queries else may_see(c, r, causal)
  count = visit.sum(-1, dtype=jnp.int32)
  order = jnp.argsort(~visit, axis=-1, stable=True).astype(jnp.int32)
  return jnp.concatenate([count[..., None], order], axis=-1)


# --- kernels -----------------------------------------------------------------------


def _mask(q_seg, q_pos, k_seg, k_pos, causal: bool):
  """bool [bq, bk] visibility, exactly as `attention.xla.segment_mask`."""
  mask = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] != 0)
  if causal:
    mask &= k_pos[None, :] <= q_pos[:, None]
  return mask


def _dot_general(a, b, contract):
  # fp32 operands: IEEE fp32 products whatever jax_default_matmul_precision
  # says; Pallas-Triton lowers the DEFAULT precision to tf32 (3e-4 errors
  # against the reference, measured on an H100). bf16: tensor cores, fp32
  # accumulation.
  precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
  return lax.dot_general(
    a, b, (contract, ((), ())), precision=precision, preferred_element_type=jnp.float32
  )


def _dot_nt(a, b):
  """a @ b.T with fp32 accumulation."""
  return _dot_general(a, b, ((1,), (1,)))


def _dot_tn(a, b):
  """a.T @ b with fp32 accumulation."""
  return _dot_general(a, b, ((0,), (0,)))


def _dot(a, b):
  return _dot_general(a, b, ((1,), (0,)))


def _fwd_kernel(
  table_ref,
  q_ref,
  k_ref,
  v_ref,
  q_seg_ref,
  k_seg_ref,
  q_pos_ref,
  k_pos_ref,
  o_ref,
  lse_ref,
  *,
  st: _Static,
):
  block_k = st.blocks.fwd_k
  q = q_ref[...]
  q_seg, q_pos = q_seg_ref[...], q_pos_ref[...]
  bq, hp = q.shape
  scale = st.sm_scale * _LOG2_E  # logits in base 2: exp2 is the native instruction

  def body(j, carry):
    acc, m, denom = carry
    start = pl.multiple_of(table_ref[1 + j] * block_k, block_k)
    ks = pl.ds(start, block_k)
    mask = _mask(q_seg, q_pos, k_seg_ref[ks], k_pos_ref[ks], st.causal)
    s = jnp.where(mask, _dot_nt(q, k_ref[ks, :]) * scale, _MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.where(mask, jnp.exp2(s - m_new[:, None]), 0.0)
    v = v_ref[ks, :]
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
    return acc, m_new, denom * alpha + p.sum(axis=-1)

  init = (
    jnp.zeros((bq, hp), jnp.float32),
    jnp.full((bq,), _MASK_VALUE, jnp.float32),
    jnp.zeros((bq,), jnp.float32),
  )
  acc, m, denom = lax.fori_loop(0, table_ref[0], body, init)
  seen = denom > 0.0  # False for padding and for queries whose segment has no key here
  denom_safe = jnp.where(seen, denom, 1.0)
  o_ref[...] = jnp.where(seen[:, None], acc / denom_safe[:, None], 0.0).astype(o_ref.dtype)
  # Unseen rows get lse 0; the backward kernels zero their probabilities by
  # the mask anyway.
  lse_ref[...] = jnp.where(seen, m + jnp.log2(denom_safe), 0.0)


def _dq_kernel(
  table_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  q_seg_ref,
  k_seg_ref,
  q_pos_ref,
  k_pos_ref,
  dq_ref,
  *,
  st: _Static,
):
  block_k = st.blocks.dq_k
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_seg, q_pos = q_seg_ref[...], q_pos_ref[...]
  scale = st.sm_scale * _LOG2_E

  def body(j, dq):
    start = pl.multiple_of(table_ref[1 + j] * block_k, block_k)
    ks = pl.ds(start, block_k)
    k, v = k_ref[ks, :], v_ref[ks, :]
    mask = _mask(q_seg, q_pos, k_seg_ref[ks], k_pos_ref[ks], st.causal)
    p = jnp.where(mask, jnp.exp2(_dot_nt(q, k) * scale - lse[:, None]), 0.0)
    ds = p * (_dot_nt(do, v) - delta[:, None])
    return dq + _dot(ds.astype(k.dtype), k)

  dq = lax.fori_loop(0, table_ref[0], body, jnp.zeros(q.shape, jnp.float32))
  dq_ref[...] = (dq * st.sm_scale).astype(dq_ref.dtype)


def _dkv_kernel(
  table_ref,
  q_ref,
  k_ref,
  v_ref,
  do_ref,
  lse_ref,
  delta_ref,
  q_seg_ref,
  k_seg_ref,
  q_pos_ref,
  k_pos_ref,
  dk_ref,
  dv_ref,
  *,
  st: _Static,
  groups: int,
):
  block_q = st.blocks.dkv_q
  k, v = k_ref[...], v_ref[...]
  k_seg, k_pos = k_seg_ref[...], k_pos_ref[...]
  scale = st.sm_scale * _LOG2_E
  count = table_ref[0]

  # One loop over (query head of this kv group, visible query block): the
  # group's heads share this program's K/V tile, and one flat loop keeps
  # Triton's software pipelining across the head boundary.
  def body(i, carry):
    dk, dv = carry
    g = lax.div(i, count)
    start = pl.multiple_of(table_ref[1 + lax.rem(i, count)] * block_q, block_q)
    qs = pl.ds(start, block_q)
    q, do = q_ref[qs, g, :], do_ref[qs, g, :]
    mask = _mask(q_seg_ref[qs], q_pos_ref[qs], k_seg, k_pos, st.causal)
    p = jnp.where(mask, jnp.exp2(_dot_nt(q, k) * scale - lse_ref[g, qs][:, None]), 0.0)
    dv = dv + _dot_tn(p.astype(do.dtype), do)
    ds = p * (_dot_nt(do, v) - delta_ref[g, qs][:, None])
    return dk + _dot_tn(ds.astype(q.dtype), q), dv

  zeros = jnp.zeros(k.shape, jnp.float32)
  dk, dv = lax.fori_loop(0, groups * count, body, (zeros, zeros))
  dk_ref[...] = (dk * st.sm_scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


# --- pallas_call wrappers -------------------------------------------------------------


def _shape_like(shape, dtype, like: jax.Array) -> jax.ShapeDtypeStruct:
  """An out_shape varying over the same shard_map axes as `like`.

  Inside `jax.shard_map(check_vma=True)` (the Ulysses strategies) pallas_call
  must be told how each output varies over the manual mesh axes.
  """
  aval = jax.typeof(like)
  if hasattr(aval, "manual_axis_type"):
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=aval.manual_axis_type)
  # JAX before manual_axis_type took `vma`; the installed JAX's stubs (newer)
  # do not know the keyword.
  return jax.ShapeDtypeStruct(shape, dtype, vma=aval.vma)  # type: ignore[call-arg]


def _compiler_params(num_warps: int, st: _Static):
  # Naming Triton's params also selects the Triton lowering (not Mosaic GPU).
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=st.blocks.num_stages)


def _forward(st: _Static, q, k, v, q_seg, k_seg, q_pos, k_pos):
  b, t, n, hp = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  groups = n // kv_heads
  bq, bk = st.blocks.fwd_q, st.blocks.fwd_k
  table = _visit_table(
    xla.block_ranges(q_seg, q_pos, bq),
    xla.block_ranges(k_seg, k_pos, bk),
    st.causal,
    rows_are_queries=True,
  )
  nk1 = table.shape[-1]
  out, lse = pl.pallas_call(
    functools.partial(_fwd_kernel, st=st),
    grid=(t // bq, b, n),
    in_specs=[
      pl.BlockSpec((None, None, nk1), lambda i, j, h: (j, i, 0)),
      pl.BlockSpec((None, bq, None, hp), lambda i, j, h: (j, i, h, 0)),
      pl.BlockSpec((None, s, None, hp), lambda i, j, h: (j, 0, h // groups, 0)),
      pl.BlockSpec((None, s, None, hp), lambda i, j, h: (j, 0, h // groups, 0)),
      pl.BlockSpec((None, bq), lambda i, j, h: (j, i)),
      pl.BlockSpec((None, s), lambda i, j, h: (j, 0)),
      pl.BlockSpec((None, bq), lambda i, j, h: (j, i)),
      pl.BlockSpec((None, s), lambda i, j, h: (j, 0)),
    ],
    out_specs=[
      pl.BlockSpec((None, bq, None, hp), lambda i, j, h: (j, i, h, 0)),
      pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i)),
    ],
    out_shape=[_shape_like(q.shape, q.dtype, q), _shape_like((b, n, t), jnp.float32, q)],
    compiler_params=_compiler_params(st.blocks.num_warps_fwd, st),
    interpret=st.interpret,
    name="packed_flash_fwd",
  )(table, q, k, v, q_seg, k_seg, q_pos, k_pos)
  return out, lse


def _backward(st: _Static, q, k, v, out, lse, do, q_seg, k_seg, q_pos, k_pos):
  b, t, n, hp = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  groups = n // kv_heads
  # delta_i = sum_h o_i * do_i = sum_j p_ij dp_ij: one elementwise pass in XLA.
  delta = jnp.einsum("btnh,btnh->bnt", out.astype(jnp.float32), do.astype(jnp.float32))

  bq, bk = st.blocks.dq_q, st.blocks.dq_k
  table = _visit_table(
    xla.block_ranges(q_seg, q_pos, bq),
    xla.block_ranges(k_seg, k_pos, bk),
    st.causal,
    rows_are_queries=True,
  )
  nk1 = table.shape[-1]
  row = lambda i, j, h: (j, i, h, 0)
  kv_full = lambda i, j, h: (j, 0, h // groups, 0)
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, st=st),
    grid=(t // bq, b, n),
    in_specs=[
      pl.BlockSpec((None, None, nk1), lambda i, j, h: (j, i, 0)),
      pl.BlockSpec((None, bq, None, hp), row),
      pl.BlockSpec((None, s, None, hp), kv_full),
      pl.BlockSpec((None, s, None, hp), kv_full),
      pl.BlockSpec((None, bq, None, hp), row),
      pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i)),
      pl.BlockSpec((None, None, bq), lambda i, j, h: (j, h, i)),
      pl.BlockSpec((None, bq), lambda i, j, h: (j, i)),
      pl.BlockSpec((None, s), lambda i, j, h: (j, 0)),
      pl.BlockSpec((None, bq), lambda i, j, h: (j, i)),
      pl.BlockSpec((None, s), lambda i, j, h: (j, 0)),
    ],
    out_specs=pl.BlockSpec((None, bq, None, hp), row),
    out_shape=_shape_like(q.shape, q.dtype, q),
    compiler_params=_compiler_params(st.blocks.num_warps_bwd, st),
    interpret=st.interpret,
    name="packed_flash_dq",
  )(table, q, k, v, do, lse, delta, q_seg, k_seg, q_pos, k_pos)

  bq, bk = st.blocks.dkv_q, st.blocks.dkv_k
  table = _visit_table(
    xla.block_ranges(k_seg, k_pos, bk),
    xla.block_ranges(q_seg, q_pos, bq),
    st.causal,
    rows_are_queries=False,
  )
  nq1 = table.shape[-1]
  # Each program holds one key tile of kv head h and reads the whole query
  # sequence of that head's G query heads (heads h*G .. h*G+G-1).
  q_group = lambda i, j, h: (j, 0, h, 0)
  key_tile = lambda i, j, h: (j, i, h, 0)
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, st=st, groups=groups),
    grid=(s // bk, b, kv_heads),
    in_specs=[
      pl.BlockSpec((None, None, nq1), lambda i, j, h: (j, i, 0)),
      pl.BlockSpec((None, t, groups, hp), q_group),
      pl.BlockSpec((None, bk, None, hp), key_tile),
      pl.BlockSpec((None, bk, None, hp), key_tile),
      pl.BlockSpec((None, t, groups, hp), q_group),
      pl.BlockSpec((None, groups, t), lambda i, j, h: (j, h, 0)),
      pl.BlockSpec((None, groups, t), lambda i, j, h: (j, h, 0)),
      pl.BlockSpec((None, t), lambda i, j, h: (j, 0)),
      pl.BlockSpec((None, bk), lambda i, j, h: (j, i)),
      pl.BlockSpec((None, t), lambda i, j, h: (j, 0)),
      pl.BlockSpec((None, bk), lambda i, j, h: (j, i)),
    ],
    out_specs=[
      pl.BlockSpec((None, bk, None, hp), key_tile),
      pl.BlockSpec((None, bk, None, hp), key_tile),
    ],
    out_shape=[_shape_like(k.shape, k.dtype, k), _shape_like(v.shape, v.dtype, v)],
    compiler_params=_compiler_params(st.blocks.num_warps_bwd, st),
    interpret=st.interpret,
    name="packed_flash_dkv",
  )(table, q, k, v, do, lse, delta, q_seg, k_seg, q_pos, k_pos)
  return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, q_seg, k_seg, q_pos, k_pos):
  return _forward(st, q, k, v, q_seg, k_seg, q_pos, k_pos)[0]


def _flash_fwd(st, q, k, v, q_seg, k_seg, q_pos, k_pos):
  out, lse = _forward(st, q, k, v, q_seg, k_seg, q_pos, k_pos)
  return out, (q, k, v, out, lse, q_seg, k_seg, q_pos, k_pos)


def _flash_bwd(st, res, do):
  q, k, v, out, lse, q_seg, k_seg, q_pos, k_pos = res
  dq, dk, dv = _backward(st, q, k, v, out, lse, do, q_seg, k_seg, q_pos, k_pos)
  return dq, dk, dv, None, None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)


# --- entry point ----------------------------------------------------------------------


def pallas_attention(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_segment_ids: jax.Array,
  kv_segment_ids: jax.Array,
  q_positions: jax.Array | None = None,
  kv_positions: jax.Array | None = None,
  causal: bool,
  interpret: bool = False,
  block_sizes: BlockSizes | None = None,
) -> jax.Array:
  """Flash attention over packed segments; same contract as `attention.xla.xla_attention`.

  Structure (FlashAttention-2, after jax/experimental/pallas/ops/gpu/attention.py,
  which masks causality by index and so cannot serve packed, reordered rows):
    forward   grid (query blocks, B, N): online softmax over the key blocks,
              stores the base-2 logsumexp for the backward pass;
    dq        grid (query blocks, B, N): recomputes the probabilities per key
              block;
    dk, dv    grid (key blocks, B, K): loops over the G = N / K query heads of
              its kv head and their query blocks, so GQA never materializes
              repeated K/V (nor per-query-head dK/dV).
  Softmax statistics and accumulators are fp32. fp32 inputs use IEEE fp32 dots
  (Triton's default for fp32 would be tf32, too coarse for the parity checks);
  bf16 inputs use the tensor cores with fp32 accumulation.

  Block skipping: before the kernels run, XLA reduces every block of queries
  and of keys to [min, max] of its nonzero segment ids and of its positions. A
  (query block, key block) pair can hold a visible pair only if
    - both blocks hold a non-padding token,
    - their segment-id ranges overlap (equal ids need overlapping ranges), and
    - when causal, min pos over the key block <= max pos over the query block
      (otherwise every key position exceeds every query position, whatever the
      segments and the token order).
  Each test is a necessary condition for visibility in any token order, so a
  skipped pair never holds a visible key; the element mask inside a visited
  pair decides the rest. Each program loops only over the list of the blocks
  that pass (built per row with a stable argsort), so a packed row of short
  sequences costs about its block-diagonal, not T x S.

  T and S are padded internally to block multiples with segment id 0, and the
  head dim to a power of two (at least 16, Triton's smallest dot) with zeros.

  Args:
    q_BTNH, k_BSKH, v_BSKH: queries [B, T, N, H] and keys/values [B, S, K, H]
      with N % K == 0 (GQA), one dtype.
    q_segment_ids, kv_segment_ids: int [B, T] / [B, S]; 0 marks padding.
    q_positions, kv_positions: int [B, T] / [B, S] in-sequence positions
      (needed when causal).
    causal: mask keys whose position exceeds the query's.
    interpret: run the Pallas kernels in interpret mode (any backend, CPU tests).
    block_sizes: tile sizes; default from the head dim and dtype.

  Returns:
    [B, T, N, H] in the dtype of q.
  """
  b, t, n, h = q_BTNH.shape
  s, kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
  if n % kv_heads:
    raise ValueError(f"{n} query heads do not group over {kv_heads} kv heads")
  if causal and (q_positions is None or kv_positions is None):
    raise ValueError("causal attention needs query and key positions")
  if t < MIN_QUERY_LEN or h > MAX_HEAD_DIM:
    # Decode-sized queries or oversized heads: see MIN_QUERY_LEN / MAX_HEAD_DIM.
    return xla.xla_attention(
      q_BTNH,
      k_BSKH,
      v_BSKH,
      q_segment_ids=q_segment_ids,
      kv_segment_ids=kv_segment_ids,
      q_positions=q_positions,
      kv_positions=kv_positions,
      causal=causal,
    )

  hp = max(16, pl.next_power_of_2(h))
  itemsize = jnp.dtype(q_BTNH.dtype).itemsize
  blocks = (block_sizes or default_block_sizes(hp, itemsize)).capped(t, s)
  mult = blocks.pad_multiple
  tp, sp = -(-t // mult) * mult, -(-s // mult) * mult
  if not causal:
    # Positions only enter the causal test; any placeholder will do.
    q_positions = jnp.zeros((b, t), jnp.int32)
    kv_positions = jnp.zeros((b, s), jnp.int32)
  assert q_positions is not None and kv_positions is not None  # causal: checked above

  def pad(x, length, head_pad):
    widths = [(0, 0), (0, length - x.shape[1])] + [(0, 0)] * (x.ndim - 2)
    if head_pad:
      widths[-1] = (0, hp - h)
    return jnp.pad(x, widths) if any(w != (0, 0) for w in widths) else x

  q_seg = pad(q_segment_ids.astype(jnp.int32), tp, False)
  k_seg = pad(kv_segment_ids.astype(jnp.int32), sp, False)
  q_pos = pad(q_positions.astype(jnp.int32), tp, False)
  k_pos = pad(kv_positions.astype(jnp.int32), sp, False)
  st = _Static(causal=causal, sm_scale=h**-0.5, blocks=blocks, interpret=interpret)
  out = _flash(
    st,
    pad(q_BTNH, tp, True),
    pad(k_BSKH, sp, True),
    pad(v_BSKH, sp, True),
    q_seg,
    k_seg,
    q_pos,
    k_pos,
  )
  return out[:, :t, :, :h]
