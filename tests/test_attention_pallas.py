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
import numpy as np
import pytest
from attention_cases import assert_close, cross_batch, qkv, self_batch

from fluxjax.models import attention as attn_lib
from fluxjax.models.attention import pallas as ap
from fluxjax.models.attention import xla as attn_xla

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
      ap._visit_table(
        attn_xla.block_ranges(seg, pos, bq), attn_xla.block_ranges(seg, pos, bk), True, True
      )
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
