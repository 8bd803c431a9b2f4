"""The contiguous layout the range kernels (cudnn, tokamax_gpu) read.

On a GPU the kernels themselves are compared with xla by
`python bench/attention.py --backends xla,cudnn,tokamax_gpu` (its shuffled
parity case). Here, on any platform, attention computed from the layout's
ranges alone (sorted buffer, per-query key range, index-causal) must equal
the reference, which masks by segment ids and positions: that is the whole
contract the kernels rely on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fluxjax.models import attention as attn_lib
from fluxjax.models.attention import layout as layout_lib


def packed_row(rng, t, lengths, shuffle):
  seg = np.zeros(t, np.int32)
  pos = rng.integers(0, 1000, t).astype(np.int32)  # padding carries junk positions
  start = 0
  for i, n in enumerate(lengths):
    seg[start : start + n] = rng.integers(1, 50) * 100 + i  # ids need not be dense
    pos[start : start + n] = np.arange(n)
    start += n
  if shuffle:
    perm = rng.permutation(t)
    seg, pos = seg[perm], pos[perm]
  return seg, pos


def range_kernel(causal):
  """A kernel that knows only the layout: sorted slots and key ranges."""

  def kernel(qs, ks, vs, lay):
    groups = qs.shape[2] // ks.shape[2]
    ks, vs = jnp.repeat(ks, groups, axis=2), jnp.repeat(vs, groups, axis=2)
    i = jnp.arange(qs.shape[1])
    visible = (i[None, None, :] >= lay.k_start_BT[:, :, None]) & (
      i[None, None, :] < lay.k_end_BT[:, :, None]
    )
    if causal:
      visible &= i[None, None, :] <= i[None, :, None]
    logits = jnp.einsum("btnh,bsnh->bnts", qs, ks) * qs.shape[-1] ** -0.5
    probs = jax.nn.softmax(jnp.where(visible[:, None], logits, -1e30), axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", probs, vs)

  return kernel


def range_attention(q, k, v, seg, pos, causal, max_segments):
  """What the cudnn and tokamax_gpu backends do, with range_kernel as the kernel."""
  return layout_lib.sorted_self_attention(
    range_kernel(causal),
    q,
    k,
    v,
    segment_ids=seg,
    positions=pos,
    causal=causal,
    max_segments=max_segments,
    backend="test",
  )


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_range_attention_from_the_layout_equals_the_reference(seed, shuffle, causal):
  rng = np.random.default_rng(seed)
  t = 96
  lengths = [int(n) for n in rng.integers(1, 24, 5)]
  rows = [packed_row(rng, t, lengths, shuffle), packed_row(rng, t, lengths[::-1], shuffle)]
  seg = jnp.asarray(np.stack([r[0] for r in rows]))
  pos = jnp.asarray(np.stack([r[1] for r in rows]))
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (2, t, 6, 8))
  k = jax.random.normal(keys[1], (2, t, 2, 8))
  v = jax.random.normal(keys[2], (2, t, 2, 8))
  kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
  lay = layout_lib.packed_layout(seg, pos, max_segments=len(lengths) + 1)
  assert not bool(lay.overflow_B.any())
  ref = attn_lib.xla_attention(q, k, v, causal=causal, **kw)
  got = range_attention(q, k, v, seg, pos, causal, len(lengths) + 1)
  np.testing.assert_allclose(got, ref, atol=2e-6)
  # The cuDNN form describes the same segments: lengths sum to the row, offsets
  # are their running starts, padding is the last segment.
  seqlens, offsets = np.asarray(lay.seqlens_BM), np.asarray(lay.offsets_BM1)
  for row, n_pad in zip(range(2), (t - sum(lengths),) * 2):
    lens = seqlens[row][seqlens[row] >= 0]
    assert lens.sum() == t and lens[-1] == n_pad
    np.testing.assert_array_equal(offsets[row][: len(lens)], np.cumsum(lens) - lens)
    assert (offsets[row][len(lens) :] == -1).all()
    assert sorted(lens[:-1]) == sorted(lengths)


def test_gradients_through_the_layout_match_and_padding_gets_none():
  rng = np.random.default_rng(3)
  t = 64
  seg, pos = packed_row(rng, t, [20, 9, 17], shuffle=True)
  seg, pos = jnp.asarray(seg[None]), jnp.asarray(pos[None])
  keys = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(keys[0], (1, t, 4, 8))
  k = jax.random.normal(keys[1], (1, t, 2, 8))
  v = jax.random.normal(keys[2], (1, t, 2, 8))
  do = jax.random.normal(keys[3], q.shape)
  kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
  got = jax.vjp(lambda *a: range_attention(*a, seg, pos, True, 4), q, k, v)[1](do)
  ref = jax.vjp(lambda *a: attn_lib.xla_attention(*a, causal=True, **kw), q, k, v)[1](do)
  for g, r in zip(got, ref):
    np.testing.assert_allclose(g, r, atol=2e-5)
  pad = np.asarray(seg[0] == 0)
  assert pad.any() and all(float(jnp.abs(g[0][pad]).max()) == 0.0 for g in got)


def test_a_row_with_too_many_segments_is_flagged_and_poisoned():
  rng = np.random.default_rng(4)
  seg, pos = packed_row(rng, 48, [5, 5, 5, 5, 5], shuffle=False)
  lay = layout_lib.packed_layout(jnp.asarray(seg[None]), jnp.asarray(pos[None]), max_segments=4)
  assert bool(lay.overflow_B[0])
  out = layout_lib.finish(jnp.ones((1, 48, 2, 4)), lay)
  assert bool(jnp.isnan(out).all())
  with pytest.raises(ValueError, match="max_segments"):
    layout_lib.packed_layout(jnp.asarray(seg[None]), jnp.asarray(pos[None]), max_segments=0)


@pytest.mark.parametrize("backend", ["cudnn", "tokamax_gpu"])
def test_range_backends_refuse_cross_attention_with_a_clear_error(backend):
  q = jnp.zeros((1, 32, 4, 8))
  kv = jnp.zeros((1, 16, 2, 8))
  seg = jnp.ones((1, 32), jnp.int32)
  with pytest.raises(ValueError, match="use 'xla'"):
    attn_lib.attention(
      q,
      kv,
      kv,
      backend=backend,
      q_segment_ids=seg,
      kv_segment_ids=seg[:, :16],
      q_positions=seg,
      kv_positions=seg[:, :16],
      causal=True,
    )
