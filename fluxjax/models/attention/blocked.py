"""Blockwise attention over packed sequences in plain XLA, skipping masked blocks.

The `xla` reference materializes every row's [T, S] scores; a packed row's mask is
block-diagonal and causal, so most of that work is masked away. `blocked_attention` walks
query blocks and key blocks with an online softmax (flash attention's recurrence) and
runs a block pair only if some query of it may see some key (`_visible`).

Shapes: B rows, T queries, S keys, N query heads, K kv heads, G = N / K,
H head dim; blocks of Q queries and C keys, nq and nk of them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fluxjax.models.attention import xla
from fluxjax.models.attention.xla import _NEG_INF

DEFAULT_BLOCK = 64


def blocked_attention(
  q_BTNH: jax.Array,
  k_BSKH: jax.Array,
  v_BSKH: jax.Array,
  *,
  q_segment_ids: jax.Array,
  kv_segment_ids: jax.Array,
  q_positions: jax.Array | None = None,
  kv_positions: jax.Array | None = None,
  causal: bool,
  block: int = DEFAULT_BLOCK,
) -> jax.Array:
  """The reference's attention (attention.xla.xla_attention), blockwise.

  Masks and results are the reference's (tests/test_attention_blocked.py). The rows stay
  inside each block, so sharding over rows needs no gather; a pair runs if any row needs
  it. A pair is skipped with `lax.cond`, which executes one branch.
  """
  b, t, n, h = q_BTNH.shape
  s, kv_heads = k_BSKH.shape[1], k_BSKH.shape[2]
  if n % kv_heads:
    raise ValueError(f"{n} query heads do not group over {kv_heads} kv heads")
  if causal and (q_positions is None or kv_positions is None):
    raise ValueError("causal attention needs query and key positions")
  q_pos = jnp.zeros((b, t), jnp.int32) if q_positions is None else q_positions
  kv_pos = jnp.zeros((b, s), jnp.int32) if kv_positions is None else kv_positions
  bq, bk = min(block, t), min(block, s)
  tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
  q = _to_blocks(_pad(q_BTNH, tp).reshape(b, tp, kv_heads, n // kv_heads, h), bq)
  k = _to_blocks(_pad(k_BSKH, sp), bk)
  v = _to_blocks(_pad(v_BSKH, sp), bk)
  q_ids = _ids_to_blocks(_pad(q_segment_ids, tp), _pad(q_pos, tp), bq)
  kv_ids = _ids_to_blocks(_pad(kv_segment_ids, sp), _pad(kv_pos, sp), bk)
  out = _attend(causal, q, k, v, q_ids, kv_ids)  # [nq, B, K, G, Q, H]
  out = jnp.moveaxis(out, 4, 1).reshape(tp, b, n, h)[:t]
  return jnp.moveaxis(out, 0, 1).astype(q_BTNH.dtype)


# -- layout --------------------------------------------------------------------


def _pad(x: jax.Array, size: int) -> jax.Array:
  """Pads axis 1 to `size` with zeros (segment id 0: padding)."""
  extra = size - x.shape[1]
  return x if extra == 0 else jnp.pad(x, [(0, 0), (0, extra)] + [(0, 0)] * (x.ndim - 2))


def _to_blocks(x_BT, block: int) -> jax.Array:
  """[B, T, K, (G,) H] -> [nb, B, K, (G,) block, H]."""
  b, t = x_BT.shape[:2]
  x = x_BT.reshape(b, t // block, block, *x_BT.shape[2:])
  return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, -2)


def _ids_to_blocks(seg_BT, pos_BT, block: int) -> tuple:
  """(segment ids [nb, B, block], positions [nb, B, block], block ranges each [nb, B])."""
  b, t = seg_BT.shape
  seg = jnp.moveaxis(seg_BT.reshape(b, t // block, block), 1, 0)
  pos = jnp.moveaxis(pos_BT.reshape(b, t // block, block), 1, 0)
  ranges = tuple(r.T for r in xla.block_ranges(seg_BT, pos_BT, block))
  return seg, pos, ranges


def _visible(q_ids, kv_ids, causal: bool) -> jax.Array:
  """Whether a (query block, key block) pair may hold a visible entry in any row.

  The rule is `attention.xla.blocks_may_see`, the one the Pallas kernel skips by:
  conservative (a kept pair may still be fully masked, which the per-element mask
  handles), exact for contiguously packed sequences.
  """
  return xla.blocks_may_see(q_ids[2], kv_ids[2], causal).any()


def _scores(q_BKGQH, k_BKCH, q_ids, kv_ids, causal: bool):
  """(fp32 scaled scores, masked entries at _NEG_INF; the mask), [B, K, G, Q, C]."""
  mask = xla.segment_mask(q_ids[0], kv_ids[0], q_ids[1], kv_ids[1], causal)
  mask = mask[:, None, None]
  s = jnp.einsum("bkgqh,bkch->bkgqc", q_BKGQH, k_BKCH, preferred_element_type=jnp.float32)
  return jnp.where(mask, s * q_BKGQH.shape[-1] ** -0.5, _NEG_INF), mask


# -- forward and backward ------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attend(causal, q, k, v, q_ids, kv_ids):
  return _forward(causal, q, k, v, q_ids, kv_ids)[0]


def _forward(causal, q, k, v, q_ids, kv_ids):
  """-> (out [nq, B, K, G, Q, H] fp32, log-sum-exp [nq, B, K, G, Q])."""

  def query_block(args):
    q_i, q_ids_i = args

    def key_block(carry, xs):
      k_j, v_j, kv_ids_j = xs

      def run(c):
        m, denom, acc = c
        s, mask = _scores(q_i, k_j, q_ids_i, kv_ids_j, causal)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        pv = jnp.einsum(
          "bkgqc,bkch->bkgqh", p.astype(v_j.dtype), v_j, preferred_element_type=jnp.float32
        )
        return m_new, denom * corr + p.sum(-1), acc * corr[..., None] + pv

      return lax.cond(_visible(q_ids_i, kv_ids_j, causal), run, lambda c: c, carry), None

    # *_like: inside shard_map the carries vary over the mesh axes q does.
    init = (
      jnp.full_like(q_i[..., 0], _NEG_INF, jnp.float32),
      jnp.zeros_like(q_i[..., 0], jnp.float32),
      jnp.zeros_like(q_i, jnp.float32),
    )
    (m, denom, acc), _ = lax.scan(key_block, init, (k, v, kv_ids))
    seen = denom > 0  # a padded query sees no key: zeros, as the reference
    denom = jnp.where(seen, denom, 1.0)
    out = jnp.where(seen[..., None], acc / denom[..., None], 0.0)
    return out, jnp.where(seen, m + jnp.log(denom), jnp.inf)

  return lax.map(query_block, (q, q_ids))


def _attend_fwd(causal, q, k, v, q_ids, kv_ids):
  out, lse = _forward(causal, q, k, v, q_ids, kv_ids)
  return out, (q, k, v, q_ids, kv_ids, out, lse)


def _attend_bwd(causal, res, d_out):
  """Flash attention's backward: per key block, the visible query blocks' terms.

  Each visible block is recomputed from the saved log-sum-exp, so the backward keeps
  O(T) beside the inputs.
  """
  q, k, v, q_ids, kv_ids, out, lse = res
  delta = (d_out * out).sum(-1)  # [nq, B, K, G, Q]
  scale = q.shape[-1] ** -0.5

  def key_block(dq, xs):
    k_j, v_j, kv_ids_j = xs

    def query_block(carry, ys):
      q_i, q_ids_i, do_i, lse_i, delta_i = ys

      def run(c):
        dk, dv = c
        s, mask = _scores(q_i, k_j, q_ids_i, kv_ids_j, causal)
        p = jnp.where(mask, jnp.exp(s - lse_i[..., None]), 0.0)  # [B, K, G, Q, C]
        dv = dv + jnp.einsum("bkgqc,bkgqh->bkch", p, do_i)
        dp = jnp.einsum("bkgqh,bkch->bkgqc", do_i, v_j.astype(jnp.float32))
        ds = p * (dp - delta_i[..., None]) * scale
        dq_i = jnp.einsum("bkgqc,bkch->bkgqh", ds, k_j.astype(jnp.float32))
        dk = dk + jnp.einsum("bkgqc,bkgqh->bkch", ds, q_i.astype(jnp.float32))
        return (dk, dv), dq_i

      skip = lambda c: (c, jnp.zeros_like(q_i, jnp.float32))
      return lax.cond(_visible(q_ids_i, kv_ids_j, causal), run, skip, carry)

    zeros = jnp.zeros_like(k_j, jnp.float32)
    (dk, dv), dq_j = lax.scan(query_block, (zeros, zeros), (q, q_ids, d_out, lse, delta))
    return dq + dq_j, (dk, dv)

  dq, (dk, dv) = lax.scan(key_block, jnp.zeros_like(q, jnp.float32), (k, v, kv_ids))
  int_zeros = jax.tree.map(lambda a: np.zeros(a.shape, jax.dtypes.float0), (q_ids, kv_ids))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *int_zeros)


_attend.defvjp(_attend_fwd, _attend_bwd)
