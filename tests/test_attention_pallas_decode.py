"""The in-place decode attention kernel against the xla reference.

On the CPU the kernel runs in Pallas interpret mode; on a GPU the same checks
run the compiled Triton kernel:

  FLUXJAX_PALLAS_INTERPRET=0 python -m pytest -q -p no:cacheprovider --noconftest \
      tests/test_attention_pallas_decode.py

The cases are what the engine produces: slots of different lengths (one at
0, one past the window), a capacity that is not a block multiple, GQA with
fewer query heads per kv head than a Triton tile, a layer inside the stack,
bf16 bits in an unsigned cache.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fluxjax.models import config, decode, vlm
from fluxjax.models.attention import pallas_decode
from fluxjax.models.attention import xla as attn_xla

INTERPRET = os.environ.get("FLUXJAX_PALLAS_INTERPRET", "1") != "0"


def _cache(dtype, layers=3, slots=5, kv_heads=2, capacity=75, head_dim=32, seed=0):
  rng = np.random.default_rng(seed)
  k, v = (
    jnp.asarray(rng.normal(size=(layers, slots, kv_heads, capacity, head_dim)), dtype)
    for _ in range(2)
  )
  return decode.KVCache.from_values(k, v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("window", [75, 40])
@pytest.mark.parametrize("split_keys", [None, 32])  # one program per slot and head, or 2-3
def test_the_kernel_reads_the_cache_as_the_reference_attends_the_window(dtype, window, split_keys):
  cache = _cache(dtype)
  slots, heads = 4, 6  # the first 4 of 5 slots; 3 query heads per kv head
  q = jnp.asarray(np.random.default_rng(1).normal(size=(slots, heads, 32)), dtype)
  lengths = jnp.asarray([0, 17, 63, 74])  # 63 and 74 lie past a window of 40
  layer = jnp.int32(1)
  want = attn_xla.decode_attention(
    q,
    cache.keys(layer, slots, window),
    cache.values(layer, slots, window),
    jnp.minimum(lengths, window - 1),
  )
  got = pallas_decode.cache_decode_attention(
    q,
    cache.k_LSKCH,
    cache.v_LSKCH,
    cache.dtype,
    layer,
    lengths,
    window,
    block_k=16,
    split_keys=split_keys,
    interpret=INTERPRET,
  )
  assert got.shape == want.shape == (slots, 1, heads, 32) and got.dtype == want.dtype
  tol = 1e-5 if dtype == "float32" else 2e-2
  np.testing.assert_allclose(np.float32(got), np.float32(want), rtol=tol, atol=tol)
  # A slot that sees no key (a negative length: nothing cached) reads zeros, not NaN.
  none = pallas_decode.cache_decode_attention(
    q,
    cache.k_LSKCH,
    cache.v_LSKCH,
    cache.dtype,
    layer,
    lengths.at[0].set(-1),
    window,
    block_k=16,
    split_keys=split_keys,
    interpret=INTERPRET,
  )
  assert not np.asarray(none[0], np.float32).any() and np.isfinite(np.float32(none)).all()


def test_a_head_dim_triton_cannot_tile_is_refused_by_name():
  cache = _cache("float32", head_dim=24)
  q = jnp.zeros((2, 6, 24), jnp.float32)
  with pytest.raises(ValueError, match=r"head_dim 24 is not a power of 2.*decode_attention=xla"):
    pallas_decode.cache_decode_attention(
      q, cache.k_LSKCH, cache.v_LSKCH, cache.dtype, 0, jnp.zeros(2, jnp.int32), 16, interpret=True
    )


def test_a_decode_step_with_the_kernel_gives_the_reference_logits_and_cache(monkeypatch):
  # model.decode_attention picks the kernel inside decode_step's layer scan
  # (a traced layer index); the same weights give the same step.
  monkeypatch.setattr(
    pallas_decode,
    "cache_decode_attention",
    functools.partial(pallas_decode.cache_decode_attention, block_k=16, interpret=INTERPRET),
  )
  models = {
    b: vlm.create_model(config.preset("tiny", decode_attention=b), seed=0)
    for b in ("xla", "pallas_gpu")
  }
  cache = _cache("float32", layers=2, slots=3, kv_heads=2, capacity=64, head_dim=16)
  tokens_S = jnp.asarray([5, 9, 11], jnp.int32)
  lengths_S = jnp.asarray([3, 40, 0], jnp.int32)
  step = jax.jit(decode.decode_step, static_argnames="window")
  (want, want_cache), (got, got_cache) = (
    step(models[b], cache, tokens_S, lengths_S, lengths_S, window=48) for b in models
  )
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
  for a, b in ((got_cache.k_LSKCH, want_cache.k_LSKCH), (got_cache.v_LSKCH, want_cache.v_LSKCH)):
    values = [np.asarray(jax.lax.bitcast_convert_type(x, jnp.float32)) for x in (a, b)]
    np.testing.assert_allclose(*values, rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match=r"unknown model\.decode_attention 'flash'"):
    step(
      vlm.create_model(config.preset("tiny", decode_attention="flash"), 0),
      cache,
      tokens_S,
      lengths_S,
      lengths_S,
    )


def test_an_engine_spanning_devices_refuses_the_one_device_kernel(devices):
  from fluxjax.models import sharded
  from fluxjax.models.tokenizer import Tokenizer
  from fluxjax.rollout import engine as engine_lib
  from fluxjax.sharding import mesh as mesh_lib

  cfg = config.preset("tiny", decode_attention="pallas_gpu")
  model = sharded.create_sharded_model(cfg, mesh_lib.make_mesh(), seed=0, log_table=False)
  with pytest.raises(ValueError, match=r"reads the cache on one device; .* spans 8 devices"):
    engine_lib.Engine(model, Tokenizer.default(), num_slots=8, capacity=64)
