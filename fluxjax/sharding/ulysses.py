"""Ulysses sequence parallelism for the text attention, inside `jax.shard_map`.

Layout: batch arrays are [D, C, ...] with one row per device. A Ulysses group of
degree sp is `sp` consecutive devices along the mesh's sequence axes; their rows
are consecutive slices of one token stream. Attention:
  1. all-to-all q, k, v over the group: [1, C, N, H] -> [1, sp*C, N/sp, H]
     (every device now holds the whole stream for N/sp heads);
  2. all-gather segment ids and in-sequence positions over the group, so masks
     are built from ids and positions, never buffer indices;
  3. attend locally, then all-to-all back to [1, C, N, H].
KV heads are replicated when there are fewer than sp of them, so each device
gets the kv head its query heads use (GQA grouping is preserved).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fluxjax.models import attention as attn_lib

P = jax.sharding.PartitionSpec


def check_degree(sp: int, num_heads: int, num_kv_heads: int) -> None:
  if sp < 1 or sp & (sp - 1):
    raise ValueError(f"Ulysses degree {sp} must be a power of two")
  if num_heads % sp:
    raise ValueError(f"Ulysses degree {sp} does not divide the {num_heads} query heads")
  if num_kv_heads % sp and sp % num_kv_heads:
    raise ValueError(f"Ulysses degree {sp} and {num_kv_heads} kv heads: one must divide "
                     "the other")


def _replicate_kv(k_BTKH: jax.Array, sp: int) -> jax.Array:
  kv = k_BTKH.shape[2]
  return k_BTKH if kv >= sp else jnp.repeat(k_BTKH, sp // kv, axis=2)


def make_attention_fn(mesh: jax.sharding.Mesh, sp_axes: Sequence[str], batch_axes: Sequence[str],
                      backend: str = "xla"):
  """An `attention_fn` for the text decoder (see models/text.py) doing Ulysses.

  Args:
    mesh: the mesh; `batch_axes` shard the leading (row) axis of activations.
    sp_axes: the mesh axes forming one Ulysses group (their product = degree).
    batch_axes: all mesh axes, outermost first.
    backend: the local attention backend.
  """
  sp_axes = tuple(sp_axes)
  sp = 1
  for a in sp_axes:
    sp *= mesh.shape[a]
  rows = P(tuple(batch_axes))
  act = P(tuple(batch_axes), None, None, None)

  def local(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal):
    if sp > 1:
      k, v = _replicate_kv(k, sp), _replicate_kv(v, sp)
      to_heads = lambda x: jax.lax.all_to_all(x, sp_axes, split_axis=2, concat_axis=1,
                                              tiled=True)
      q, k, v = to_heads(q), to_heads(k), to_heads(v)
      gather = lambda x: jax.lax.all_gather(x, sp_axes, axis=1, tiled=True)
      q_seg, kv_seg, q_pos, kv_pos = gather(q_seg), gather(kv_seg), gather(q_pos), gather(kv_pos)
    out = attn_lib.attention(q, k, v, backend=backend, q_segment_ids=q_seg,
                             kv_segment_ids=kv_seg, q_positions=q_pos, kv_positions=kv_pos,
                             causal=causal)
    if sp > 1:
      out = jax.lax.all_to_all(out, sp_axes, split_axis=1, concat_axis=2, tiled=True)
    return out

  def attention_fn(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                   causal):
    fn = jax.shard_map(
        lambda *a: local(*a, causal=causal), mesh=mesh,
        in_specs=(act, act, act, rows, rows, rows, rows), out_specs=act)
    return fn(q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)

  return attention_fn
