"""Attention inputs as the trainer and the engine produce them, and more, for
every backend's parity test against the xla reference: packed rows with
padding, tokens in shuffled buffer order (positions not monotonic), junk
positions under the padding, GQA, queries whose segment has no key.
"""

import jax.numpy as jnp
import numpy as np


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
