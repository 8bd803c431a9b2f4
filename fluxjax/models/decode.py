"""KV-cache inference for `vlm.Qwen25VL`: prefill into a slot, decode all slots.

One `KVCache` holds the rollout engine's slots, one request each: `prefill` writes a
prompt's keys/values into its slot, and `decode_step` feeds one token to each of the
first S slots. Both are built from the model's own submodules (embedding to LM head), so
numbers match `Qwen25VL.hidden_states` up to summation order. The cache index is the
causal position; M-RoPE positions are the caller's (rope_index.py). Shapes: L layers,
S slots, C cache capacity, K kv heads, H head dim, N query heads, D width, V vocabulary,
P prefill bucket.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from fluxjax.models import attention as attn_lib
from fluxjax.models import text, vlm
from fluxjax.models.vision import VisionInputs

_UINT_OF_WIDTH = {2: jnp.uint16, 4: jnp.uint32}


@dataclasses.dataclass
class KVCache:
  """Keys and values of every slot, all layers stacked: [L, S, K, C, H].

  Kv-head-major (FlashInfer's HND), so a decode step's two products batch over (slot,
  kv head) without transposing what it reads.

  The arrays hold the bits of `dtype` (an unsigned integer of its width);
  `keys`/`values` view what a step reads as `dtype`. XLA:CPU has no bf16
  scatter or dynamic-update-slice: on a bf16 array it converts the whole
  cache to f32 and back around every write, each layer of each decode step
  (9x the step time at 8k tokens x 32 slots). On the bits, writes are in
  place on every backend.
  """

  k_LSKCH: jax.Array
  v_LSKCH: jax.Array
  dtype: jnp.dtype

  @classmethod
  def from_values(cls, k_LSKCH: jax.Array, v_LSKCH: jax.Array) -> KVCache:
    return cls(_bits(k_LSKCH), _bits(v_LSKCH), k_LSKCH.dtype)

  @property
  def num_slots(self) -> int:
    return self.k_LSKCH.shape[1]

  @property
  def capacity(self) -> int:
    return self.k_LSKCH.shape[3]

  def keys(self, layer: jax.Array, slots: int, window: int) -> jax.Array:
    """[slots, K, window, H] keys of `layer`'s first `slots` slots."""
    return jax.lax.bitcast_convert_type(self.k_LSKCH[layer, :slots, :, :window], self.dtype)

  def values(self, layer: jax.Array, slots: int, window: int) -> jax.Array:
    """[slots, K, window, H] values of `layer`'s first `slots` slots."""
    return jax.lax.bitcast_convert_type(self.v_LSKCH[layer, :slots, :, :window], self.dtype)

  def write_tokens(self, layer, lengths_S, k_SKH, v_SKH) -> KVCache:
    """One key/value for each of the first S slots, at index lengths_S[s] of slot s."""
    # Every dim but the head dim indexed, so the scatter writes whole trailing
    # rows. With the kv heads a window dim between the indexed slot and cache
    # index, XLA:GPU transposed the whole cache to [L, S, C, K, H] and back
    # around each step's writes: 45% of a 3B decode step at 256 slots.
    s, kv = jnp.arange(lengths_S.shape[0])[:, None], jnp.arange(k_SKH.shape[1])[None, :]
    index = (layer, s, kv, lengths_S[:, None])
    k, v = (
      cache.at[index].set(_bits(x.astype(self.dtype)), indices_are_sorted=True, unique_indices=True)
      for cache, x in ((self.k_LSKCH, k_SKH), (self.v_LSKCH, v_SKH))
    )
    return KVCache(k, v, self.dtype)

  def write_prompt(self, layer, slot, k_1PKH, v_1PKH) -> KVCache:
    """A prompt's keys/values into `slot` from index 0."""
    start = (layer, slot, 0, 0, 0)

    def block(x_1PKH):  # [1, 1, K, P, H] bits
      return _bits(x_1PKH.astype(self.dtype).transpose(0, 2, 1, 3))[None]

    k = jax.lax.dynamic_update_slice(self.k_LSKCH, block(k_1PKH), start)
    v = jax.lax.dynamic_update_slice(self.v_LSKCH, block(v_1PKH), start)
    return KVCache(k, v, self.dtype)


jax.tree_util.register_dataclass(KVCache, data_fields=["k_LSKCH", "v_LSKCH"], meta_fields=["dtype"])


def _bits(x: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(x, _UINT_OF_WIDTH[x.dtype.itemsize])


def cache_shape(model: vlm.Qwen25VL, num_slots: int, capacity: int) -> tuple[int, ...]:
  t = model.cfg.text
  return (t.num_layers, num_slots, t.num_kv_heads, capacity, t.head_dim)


def init_cache(
  model: vlm.Qwen25VL, num_slots: int, capacity: int, sharding: jax.sharding.Sharding | None = None
) -> KVCache:
  """An empty cache in the model's compute dtype, placed by `sharding` if given."""
  shape = cache_shape(model, num_slots, capacity)
  bits = _UINT_OF_WIDTH[jnp.dtype(model.dtype).itemsize]
  k, v = (jnp.zeros(shape, bits, device=sharding) for _ in range(2))
  return KVCache(k, v, jnp.dtype(model.dtype))


def _scan_decoder(model: vlm.Qwen25VL, carry, body):
  """lax.scan over the stacked decoder layers with the layer index in hand.

  The cache rides in the carry and is updated in place per layer (a
  dynamic-update-slice or scatter into the carried buffer), so no per-step
  copy of the whole cache is made.
  """
  graphdef, state = nnx.split(model.model.layers)

  def step(carry, inputs):
    layer_state, i = inputs
    return body(nnx.merge(graphdef, layer_state), i, carry), None

  carry, _ = jax.lax.scan(step, carry, (state, jnp.arange(model.cfg.text.num_layers)))
  return carry


def _head_logits(model: vlm.Qwen25VL, h_ND: jax.Array) -> jax.Array:
  """fp32 logits, computed as `Qwen25VL.logits` does."""
  return jnp.einsum(
    "nd,dv->nv", h_ND, model.head_DV().astype(h_ND.dtype), preferred_element_type=jnp.float32
  )


def prefill(
  model: vlm.Qwen25VL,
  cache: KVCache,
  slot: jax.Array,
  tokens_P: jax.Array,
  positions_3P: jax.Array,
  length: jax.Array,
  vision: VisionInputs | None = None,
) -> tuple[jax.Array, KVCache]:
  """Runs one prompt and writes its keys/values into `slot`.

  The prompt is padded to a bucket length P.

  Args:
    model: the model.
    cache: the cache; entries [0, P) of `slot` are overwritten (those past
      `length` with padding, which decode overwrites before it can see them).
    slot: int scalar, the slot to fill.
    tokens_P: int [P] prompt ids, padded after `length`.
    positions_3P: int [3, P] M-RoPE positions (padding anything).
    length: int scalar, real prompt length (>= 1).
    vision: the prompt's images/videos (one row), or None.

  Returns:
    (logits_V, cache): fp32 next-token logits after the last prompt token.
  """
  p = tokens_P.shape[0]
  x = model.embed(tokens_P[None], vision)  # [1, P, D]
  cos, sin = text.mrope_cos_sin(positions_3P[:, None], model.cfg.text)
  seg_1P = (jnp.arange(p) < length).astype(jnp.int32)[None]
  pos_1P = jnp.arange(p, dtype=jnp.int32)[None]
  attention_fn = functools.partial(attn_lib.attention, backend=model.cfg.attention_backend)

  def body(layer, i, carry):
    x, cache = carry

    def attend(q, k, v):
      out = text.packed_self_attention(attention_fn, q, k, v, seg_1P, pos_1P)
      return out, cache.write_prompt(i, slot, k, v)

    return layer.block(x, cos, sin, attend)

  x, cache = _scan_decoder(model, (x, cache), body)
  h = model.model.norm(x)[0]  # [P, D]
  last_1D = jax.lax.dynamic_slice_in_dim(h, length - 1, 1, axis=0)
  return _head_logits(model, last_1D)[0], cache


DECODE_ATTENTION = ("xla", "pallas_gpu")


def _cache_attention(backend: str, q_SNH, cache: KVCache, layer, lengths_S, window: int):
  """[S, 1, N, H]: the first S slots' queries against their cached keys.

  `xla` (the reference) slices the window out of the cache for two batched
  dots; `pallas_gpu` reads the cache in place, each slot only up to its
  length (models/attention/pallas_decode.py; the cache on one device).
  """
  if backend == "xla":
    s = q_SNH.shape[0]
    keys, values = cache.keys(layer, s, window), cache.values(layer, s, window)
    return attn_lib.decode_attention(q_SNH, keys, values, lengths_S)
  if backend == "pallas_gpu":
    from fluxjax.models.attention import pallas_decode  # loads Triton's lowering on use

    return pallas_decode.cache_decode_attention(
      q_SNH, cache.k_LSKCH, cache.v_LSKCH, cache.dtype, layer, lengths_S, window
    )
  raise ValueError(f"unknown model.decode_attention {backend!r}; available: {DECODE_ATTENTION}")


def decode_step(
  model: vlm.Qwen25VL,
  cache: KVCache,
  tokens_S: jax.Array,
  lengths_S: jax.Array,
  rope_pos_S: jax.Array,
  window: int | None = None,
) -> tuple[jax.Array, KVCache]:
  """Feeds one token to each of the first S slots; returns their next-token logits.

  Args:
    model: the model.
    cache: the cache.
    tokens_S: int [S] the token each of the cache's first S slots feeds
      (anything for idle slots); the slots past S are left alone, so decode
      cost follows the highest live slot, not the cache's slot count.
    lengths_S: int [S] tokens already cached per slot: the new token's
      key/value goes to this index, and it attends to indices <= it.
    rope_pos_S: int [S] M-RoPE text position of the fed token
      (length + mrope_delta), the same in all three sections.
    window: static; attention reads only the first `window` cache entries,
      which must hold every slot's (lengths_S < window). None = the whole
      capacity. Decode cost then follows the longest live sequence, not the
      capacity (the engine passes a bucket of it).

  Returns:
    (logits_SV fp32, cache).
  """
  s, c = tokens_S.shape[0], window or cache.capacity
  x = model.model.embed(tokens_S[:, None], model.dtype)  # [S, 1, D]
  positions = jnp.broadcast_to(rope_pos_S[None, :, None], (3, s, 1))
  cos, sin = text.mrope_cos_sin(positions, model.cfg.text)

  def body(layer, i, carry):
    x, cache = carry

    def attend(q, k, v):
      written = cache.write_tokens(i, lengths_S, k[:, 0], v[:, 0])
      return _cache_attention(
        model.cfg.decode_attention, q[:, 0], written, i, lengths_S, c
      ), written

    return layer.block(x, cos, sin, attend)

  x, cache = _scan_decoder(model, (x, cache), body)
  h = model.model.norm(x)[:, 0]  # [S, D]
  return _head_logits(model, h), cache
