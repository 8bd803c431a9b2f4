"""The xla_blocked attention against the xla reference: outputs and gradients.

Blocks of 16 so that short rows span many blocks and both the skipped and the
run pairs are exercised; the inputs are tests/attention_cases.py's.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import assert_close, cross_batch, qkv, self_batch

from fluxjax.models import attention as attn_lib
from fluxjax.models.attention import blocked as ab
from fluxjax.models.attention import xla as attn_xla


def check(q, k, v, cot, kw, causal, block=16, tol=1e-5):
  blocked = functools.partial(ab.blocked_attention, causal=causal, block=block, **kw)
  ref = functools.partial(attn_xla.xla_attention, causal=causal, **kw)
  with jax.default_matmul_precision("highest"):
    out_ref, vjp_ref = jax.vjp(ref, q, k, v)
    grads_ref = vjp_ref(cot)
    out, vjp = jax.vjp(jax.jit(blocked), q, k, v)
    grads = jax.jit(vjp)(cot)
  assert_close(out, out_ref, "output", tol)
  for name, g, g_ref in zip(("dq", "dk", "dv"), grads, grads_ref):
    assert_close(g, g_ref, name, tol)
  return out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_packed_rows_gqa(causal, shuffle):
  """4 query heads over 2 kv heads, T = 90 (not a block multiple), two rows
  packed differently; padded queries return zeros."""
  rng = np.random.default_rng(int(causal) + 2 * int(shuffle))
  kw = self_batch(rng, 2, 90, shuffle=shuffle)
  if not causal:
    kw = dict(q_segment_ids=kw["q_segment_ids"], kv_segment_ids=kw["kv_segment_ids"])
  q, k, v, cot = qkv(rng, 2, 90, 90, 4, 2, 16)
  out = check(q, k, v, cot, kw, causal)
  pad = np.asarray(kw["q_segment_ids"]) == 0
  assert pad.any() and not np.asarray(out)[pad].any(), "padded queries must return zeros"


def test_cross_odd_groups_and_queries_without_keys():
  """Queries against a longer key row (a prefill chunk over a cache), 3 query
  heads over 1 kv head, head dim 20, queries with no visible key."""
  rng = np.random.default_rng(4)
  kw = cross_batch(rng, 2, 40, 100)
  q, k, v, cot = qkv(rng, 2, 40, 100, 3, 1, 20)
  out = check(q, k, v, cot, kw, True)
  assert not np.asarray(out)[:, :5].any(), "queries with no visible key must return zeros"


def test_one_block_and_bfloat16():
  """A row shorter than a block is one block; bf16 inputs give the reference's
  bf16 result within bf16 rounding."""
  rng = np.random.default_rng(5)
  kw = self_batch(rng, 1, 48, shuffle=False)
  q, k, v, cot = qkv(rng, 1, 48, 48, 4, 2, 16)
  check(q, k, v, cot, kw, True, block=64)
  as_bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  out = ab.blocked_attention(*as_bf16, causal=True, block=16, **kw)
  ref = attn_xla.xla_attention(*as_bf16, causal=True, **kw)
  assert out.dtype == jnp.bfloat16
  assert_close(out, ref, "bf16 output", tol=2e-2)


def test_skipped_pairs_hold_no_visible_key():
  """The pairs the backend skips are masked entirely, for sorted and shuffled
  rows; on sorted packed rows most pairs are skipped."""
  rng = np.random.default_rng(6)
  for shuffle in (True, False):
    kw = self_batch(rng, 1, 256, shuffle=shuffle)
    seg, pos = kw["q_segment_ids"], kw["q_positions"]
    mask = attn_xla.segment_mask(seg, seg, pos, pos, causal=True)
    need = np.asarray(mask.reshape(1, 16, 16, 16, 16).any(axis=(2, 4)))[0]
    q_ids = ab._ids_to_blocks(seg, pos, 16)
    block = lambda i, ids=q_ids: jax.tree.map(lambda a: a[i], ids)
    run = np.array(
      [[bool(ab._visible(block(i), block(j), True)) for j in range(16)] for i in range(16)]
    )
    assert not (need & ~run).any()
    if not shuffle:
      assert run.mean() < 0.35, run.mean()


def test_auto_picks_blocked_for_long_rows_on_cpus():
  long_keys = attn_lib.AUTO_DENSE_MAX_KEYS + 1
  assert attn_lib.default_backend(long_keys, "cpu") == "xla_blocked"
  assert attn_lib.default_backend(attn_lib.AUTO_DENSE_MAX_KEYS, "cpu") == "xla"
  assert attn_lib.default_backend(long_keys, "gpu") == "pallas_gpu"
  assert attn_lib.default_backend(16, "gpu") == "pallas_gpu"
  assert attn_lib.default_backend(long_keys, "tpu") == "xla"
  rng = np.random.default_rng(7)
  kw = self_batch(rng, 1, long_keys)
  q, k, v, _ = qkv(rng, 1, long_keys, long_keys, 2, 1, 8)
  out = attn_lib.attention(q, k, v, backend="auto", causal=True, **kw)
  want = ab.blocked_attention(q, k, v, causal=True, **kw)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
