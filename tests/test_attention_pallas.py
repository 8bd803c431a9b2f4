"""The pallas_gpu attention kernels against the xla reference: outputs and gradients.

On the CPU the kernels run in Pallas interpret mode (same kernel code, run by
XLA). On a GPU the same checks run the compiled Triton kernels:

  FLUXJAX_PALLAS_INTERPRET=0 python -m pytest -q -p no:cacheprovider --noconftest \
      tests/test_attention_pallas.py

(--noconftest: tests/conftest.py pins JAX to the CPU; nothing here needs its
fake mesh.)

The inputs are what the trainer produces and more: packed rows with padding,
tokens in shuffled buffer order (positions are not monotonic), padding with
junk positions, GQA, lengths that are not block multiples, queries whose
segment has no key, head dims that need padding.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fluxjax.models import attention as attn_lib
from fluxjax.models import attention_pallas as ap

INTERPRET = os.environ.get("FLUXJAX_PALLAS_INTERPRET", "1") != "0"
# Small tiles so that short rows span several blocks and block skipping is
# exercised; the tiles of the three kernels differ on purpose.
SMALL = ap.BlockSizes(
  fwd_q=32,
  fwd_k=16,
  dq_q=16,
  dq_k=32,
  dkv_q=16,
  dkv_k=32,
  num_warps_fwd=4,
  num_warps_bwd=4,
  num_stages=2,
)


def packed_row(rng, length, pad, shuffle, first_id=1):
  """(segment ids, positions) of one row: random sequences, `pad` padding tokens."""
  seg = np.zeros(length, np.int32)
  pos = rng.integers(0, 1000, length).astype(np.int32)  # junk under the padding
  filled, sid = 0, first_id
  while filled < length - pad:
    n = int(min(rng.integers(1, 40), length - pad - filled))
    seg[filled : filled + n] = sid
    pos[filled : filled + n] = np.arange(n)
    filled += n
    sid += int(rng.integers(1, 3))  # ids need not be consecutive
  if shuffle:
    perm = rng.permutation(length)
    seg, pos = seg[perm], pos[perm]
  return seg, pos


def self_batch(rng, b, t, shuffle=True):
  rows = [packed_row(rng, t, pad=int(rng.integers(0, t // 3)), shuffle=shuffle) for _ in range(b)]
  seg = jnp.asarray(np.stack([r[0] for r in rows]))
  pos = jnp.asarray(np.stack([r[1] for r in rows]))
  return dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


def cross_batch(rng, b, t, s):
  """Queries are a shuffled subset of the keys' tokens (a prefill chunk over a
  cache), plus a few queries of a segment that has no key: they must get zeros."""
  kv = [packed_row(rng, s, pad=int(rng.integers(0, s // 4)), shuffle=True) for _ in range(b)]
  q_seg, q_pos = [], []
  for seg, pos in kv:
    idx = rng.choice(np.flatnonzero(seg), size=t, replace=True)
    qs, qp = seg[idx].copy(), pos[idx].copy()
    qs[:3], qp[:3] = 10_000, 5  # no key has this segment
    qs[3:5] = 0  # padding queries
    q_seg.append(qs)
    q_pos.append(qp)
  return dict(
    q_segment_ids=jnp.asarray(np.stack(q_seg)),
    kv_segment_ids=jnp.asarray(np.stack([r[0] for r in kv])),
    q_positions=jnp.asarray(np.stack(q_pos)),
    kv_positions=jnp.asarray(np.stack([r[1] for r in kv])),
  )


def qkv(rng, b, t, s, n, k, h, dtype=jnp.float32):
  draw = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  return draw(b, t, n, h), draw(b, s, k, h), draw(b, s, k, h), draw(b, t, n, h)


def assert_close(got, want, what, tol=1e-5):
  """Max abs error within tol of the largest reference entry (fp32 arithmetic)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(got)), what
  scale = max(np.abs(want).max(), 1e-30)
  err = np.abs(got - want).max() / scale
  assert err < tol, f"{what}: max error {err:.2e} of max |ref| {scale:.3g}"


def check(q, k, v, cot, kw, causal, blocks):
  pallas = lambda q, k, v: ap.pallas_attention(
    q, k, v, causal=causal, interpret=INTERPRET, block_sizes=blocks, **kw
  )
  ref = lambda q, k, v: attn_lib.xla_attention(q, k, v, causal=causal, **kw)
  with jax.default_matmul_precision("highest"):
    out_ref, vjp_ref = jax.vjp(ref, q, k, v)
    grads_ref = vjp_ref(cot)
  out, vjp = jax.vjp(jax.jit(pallas), q, k, v)
  grads = jax.jit(vjp)(cot)
  assert_close(out, out_ref, "output")
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    assert_close(g, g_ref, name)
  return out


@pytest.mark.parametrize("causal", [True, False])
def test_packed_shuffled_gqa(causal):
  """4 query heads over 2 kv heads, T = 90 (not a block multiple), shuffled rows."""
  rng = np.random.default_rng(0 if causal else 1)
  kw = self_batch(rng, 2, 90)
  if not causal:
    kw = dict(q_segment_ids=kw["q_segment_ids"], kv_segment_ids=kw["kv_segment_ids"])
  q, k, v, cot = qkv(rng, 2, 90, 90, 4, 2, 16)
  out = check(q, k, v, cot, kw, causal, SMALL)
  pad = np.asarray(kw["q_segment_ids"]) == 0
  assert pad.any() and not np.asarray(out)[pad].any(), "padded queries must return zeros"


def test_cross_odd_groups_padded_head_dim():
  """Queries vs a longer key row, 3 query heads over 1 kv head (an odd group),
  head dim 20 (padded to 32 inside), queries with no visible key."""
  rng = np.random.default_rng(2)
  kw = cross_batch(rng, 2, 40, 100)
  q, k, v, cot = qkv(rng, 2, 40, 100, 3, 1, 20)
  out = check(q, k, v, cot, kw, True, SMALL)
  assert not np.asarray(out)[:, :5].any(), "queries with no visible key must return zeros"


def test_default_tiles_sorted_rows():
  """The default (capped) tiles of each kernel, buffer order = sequence order."""
  rng = np.random.default_rng(3)
  kw = self_batch(rng, 1, 200, shuffle=False)
  q, k, v, cot = qkv(rng, 1, 200, 200, 4, 2, 32)
  check(q, k, v, cot, kw, True, None)


def test_block_skipping_is_conservative_and_skips():
  """Every block pair that holds a visible key is visited, for shuffled and
  sorted rows; on sorted packed rows most pairs are skipped."""
  rng = np.random.default_rng(4)
  for shuffle in (True, False):
    kw = self_batch(rng, 2, 256, shuffle=shuffle)
    seg, pos = kw["q_segment_ids"], kw["q_positions"]
    mask = attn_lib.segment_mask(seg, seg, pos, pos, causal=True)  # [B, T, S]
    bq, bk = 32, 16
    need = np.asarray(mask.reshape(2, 256 // bq, bq, 256 // bk, bk).any(axis=(2, 4)))
    table = np.asarray(
      ap._visit_table(ap._block_ranges(seg, pos, bq), ap._block_ranges(seg, pos, bk), True, True)
    )
    visited = np.zeros_like(need)
    for b in range(2):
      for i in range(need.shape[1]):
        visited[b, i, table[b, i, 1 : 1 + table[b, i, 0]]] = True
    assert not (need & ~visited).any()
    if not shuffle:
      assert visited.mean() < 0.35, visited.mean()


def test_registered_backend_and_decode_fallback():
  """`attention(backend="pallas_gpu")` reaches this module; a decode-sized
  query (T < MIN_QUERY_LEN) takes the reference path."""
  rng = np.random.default_rng(5)
  kw = cross_batch(rng, 1, 8, 64)
  q, k, v, _ = qkv(rng, 1, 8, 64, 4, 2, 16)
  out = attn_lib.attention(q, k, v, backend="pallas_gpu", causal=True, **kw)
  assert attn_lib._BACKENDS["pallas_gpu"] is ap.pallas_attention
  np.testing.assert_array_equal(out, attn_lib.xla_attention(q, k, v, causal=True, **kw))
