"""Ulysses sequence parallelism for the text attention, inside `jax.shard_map`.

Layout: batch arrays are [D, C, ...] with one row per device. A Ulysses group of degree
sp is `sp` consecutive devices along the mesh's sequence axes; their rows are consecutive
slices of one token stream. `make_attention_fn` builds the fixed-degree attention,
`make_flex_attention_fn` FlexUlysses' per-level one; both run `_section`'s round trip.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fluxjax.models import attention as attn_lib

P = jax.sharding.PartitionSpec


def degree_problem(sp: int, num_heads: int, num_kv_heads: int) -> str:
  """Why `sp` cannot be a Ulysses degree for these heads; "" when it can."""
  if sp < 1 or sp & (sp - 1):
    return f"Ulysses degree {sp} must be a power of two"
  if num_heads % sp:
    return f"Ulysses degree {sp} does not divide the {num_heads} query heads"
  if num_kv_heads % sp and sp % num_kv_heads:
    return f"Ulysses degree {sp} and {num_kv_heads} kv heads: one must divide the other"
  return ""


def check_degree(sp: int, num_heads: int, num_kv_heads: int) -> None:
  problem = degree_problem(sp, num_heads, num_kv_heads)
  if problem:
    raise ValueError(problem)


def _replicate_kv(k_BTKH: jax.Array, sp: int) -> jax.Array:
  kv = k_BTKH.shape[2]
  return k_BTKH if kv >= sp else jnp.repeat(k_BTKH, sp // kv, axis=2)


def _section(q, k, v, q_seg, kv_seg, q_pos, kv_pos, *, axes, degree, causal, backend):
  """One Ulysses all-to-all round trip over `axes` (none: local attention).

    1. all-to-all q, k, v over the group: [1, C, N, H] -> [1, sp*C, N/sp, H] (every
       device now holds the whole stream for N/sp heads);
    2. all-gather segment ids and in-sequence positions over the group, so masks are
       built from ids and positions, never buffer indices;
    3. attend locally, then all-to-all back to [1, C, N, H].
  KV heads are replicated when there are fewer than sp of them, so each device gets the
  kv head its query heads use (GQA grouping is preserved).
  """
  if axes:
    k, v = _replicate_kv(k, degree), _replicate_kv(v, degree)
    to_heads = lambda x: jax.lax.all_to_all(x, axes, split_axis=2, concat_axis=1, tiled=True)
    q, k, v = to_heads(q), to_heads(k), to_heads(v)
    gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)
    q_seg, kv_seg, q_pos, kv_pos = gather(q_seg), gather(kv_seg), gather(q_pos), gather(kv_pos)
  out = attn_lib.attention(
    q,
    k,
    v,
    backend=backend,
    q_segment_ids=q_seg,
    kv_segment_ids=kv_seg,
    q_positions=q_pos,
    kv_positions=kv_pos,
    causal=causal,
  )
  if axes:
    out = jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)
  return out


def _wrap(local, mesh, batch_axes, inside_shard_map):
  """The decoder's attention_fn interface around a per-device function."""
  rows = P(tuple(batch_axes))
  act = P(tuple(batch_axes), None, None, None)

  def attention_fn(q, k, v, *, q_segment_ids, kv_segment_ids, q_positions, kv_positions, causal):
    args = (q, k, v, q_segment_ids, kv_segment_ids, q_positions, kv_positions)
    if inside_shard_map:  # the caller already runs per device (minibatch sync)
      return local(*args, causal=causal)
    fn = jax.shard_map(
      lambda *a: local(*a, causal=causal),
      mesh=mesh,
      in_specs=(act, act, act, rows, rows, rows, rows),
      out_specs=act,
    )
    return fn(*args)

  return attention_fn


def make_attention_fn(
  mesh: jax.sharding.Mesh,
  sp_axes: Sequence[str],
  batch_axes: Sequence[str],
  backend: str = "auto",
  inside_shard_map: bool = False,
):
  """An `attention_fn` for the text decoder (see models/text.py) doing Ulysses.

  Args:
    mesh: the mesh; `batch_axes` shard the leading (row) axis of activations.
    sp_axes: the mesh axes forming one Ulysses group (their product = degree).
    batch_axes: all mesh axes, outermost first.
    backend: the local attention backend.
    inside_shard_map: the caller is already per-device (no shard_map wrapper).
  """
  sp_axes = tuple(sp_axes)
  sp = 1
  for a in sp_axes:
    sp *= mesh.shape[a]
  axes = sp_axes if sp > 1 else ()

  def local(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal):
    return _section(
      q, k, v, q_seg, kv_seg, q_pos, kv_pos, axes=axes, degree=sp, causal=causal, backend=backend
    )

  return _wrap(local, mesh, batch_axes, inside_shard_map)


def binary_axes(p_max: int) -> tuple[tuple[str, int], ...]:
  """FlexUlysses' nested binary sequence axes: (sp_0, 2), (sp_1, 2), ... ."""
  if p_max < 1 or p_max & (p_max - 1):
    raise ValueError(f"p_max {p_max} must be a power of two")
  return tuple((f"sp_{i}", 2) for i in range(p_max.bit_length() - 1))


def level_axes(degree: int, sp_axes: Sequence[str]) -> tuple[str, ...]:
  """A degree-2^j group is the last j binary axes (groups nest by construction)."""
  j = degree.bit_length() - 1
  return tuple(sp_axes[len(sp_axes) - j :]) if j else ()


def make_flex_attention_fn(
  mesh: jax.sharding.Mesh,
  layout: Sequence[tuple[int, int, int]],
  sp_axes: Sequence[str],
  batch_axes: Sequence[str],
  backend: str = "auto",
  inside_shard_map: bool = False,
):
  """Attention over a buffer cut into per-degree sections (FlexUlysses).

  `layout` is the plan's (degree, capacity, offset) per section, highest degree
  first. Every device runs the same program: the sections in that order
  (highest-sharding-first), each with its all-to-alls over its own axes, so all
  members of a group issue the same collectives in the same order and nested
  groups cannot deadlock. XLA's scheduler may overlap one section's
  all-to-all with another's attention.
  """
  layout = tuple(layout)

  def local(q, k, v, q_seg, kv_seg, q_pos, kv_pos, causal):
    outs = []
    for degree, cap, off in layout:  # program order = highest-sharding-first
      cut = lambda x: jax.lax.slice_in_dim(x, off, off + cap, axis=1)
      degree = max(degree, 1)
      outs.append(
        _section(
          cut(q),
          cut(k),
          cut(v),
          cut(q_seg),
          cut(kv_seg),
          cut(q_pos),
          cut(kv_pos),
          axes=level_axes(degree, sp_axes),
          degree=degree,
          causal=causal,
          backend=backend,
        )
      )
    return jnp.concatenate(outs, axis=1)

  return _wrap(local, mesh, batch_axes, inside_shard_map)
