"""Qwen2 text decoder with multimodal RoPE (M-RoPE).

Shapes: B rows, T tokens per row, D width, N query heads, K kv heads, H head dim.

Inputs are packed: a row may hold several sequences told apart by segment ids
(0 = padding), with `segment_pos` the index of each token inside its sequence
(the causal order) and `positions_3BT` the M-RoPE (temporal, height, width)
positions. A sharding strategy may swap the attention core by passing
`attention_fn`; everything else is per-token and layout-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fluxjax.models import attention as attn_lib
from fluxjax.models import layers
from fluxjax.models.config import ModelConfig, TextConfig
from fluxjax.sharding import axes

# attention_fn(q_BTNH, k_BTKH, v_BTKH, *, q_segment_ids, kv_segment_ids,
#              q_positions, kv_positions, causal) -> out_BTNH
AttentionFn = Callable[..., jax.Array]


def mrope_cos_sin(positions_3BT: jax.Array, cfg: TextConfig):
  """cos/sin [B, T, H] for M-RoPE.

  Frequency band i of the half head takes its angle from the temporal, height
  or width position according to `mrope_section` (e.g. 16/24/24 of 64); the
  half is then repeated, as in HF's `recomposition_frequencies`.
  """
  inv = layers.inverse_frequencies(cfg.head_dim, cfg.rope_theta)  # [H/2]
  freqs = positions_3BT[..., None].astype(jnp.float32) * inv  # [3, B, T, H/2]
  band = jnp.repeat(
    jnp.arange(3), jnp.array(cfg.mrope_section), total_repeat_length=cfg.head_dim // 2
  )  # [H/2] in {0,1,2}
  # A gather, not a one-hot matmul: TF32 matmuls on GPU would round the angles.
  index = jnp.broadcast_to(band, (1,) + freqs.shape[1:])
  freqs = jnp.take_along_axis(freqs, index, axis=0)[0]  # [B, T, H/2]
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb), jnp.sin(emb)


def packed_self_attention(attention_fn: Callable, q, k, v, segment_ids, positions):
  """Causal attention of a packed row on itself: tokens attend within their
  segment (a sequence), by position; training and the engine's prefill."""
  return attention_fn(
    q,
    k,
    v,
    q_segment_ids=segment_ids,
    kv_segment_ids=segment_ids,
    q_positions=positions,
    kv_positions=positions,
    causal=True,
  )


class SelfAttention(nnx.Module):
  """GQA self-attention with q/k/v biases and no output bias."""

  def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs):
    d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.q_proj = layers.Dense(
      d, (n, h), (axes.EMBED,), (axes.Q_HEADS, axes.HEAD_DIM), use_bias=True, rngs=rngs
    )
    self.k_proj = layers.Dense(
      d, (k, h), (axes.EMBED,), (axes.KV_HEADS, axes.HEAD_DIM), use_bias=True, rngs=rngs
    )
    self.v_proj = layers.Dense(
      d, (k, h), (axes.EMBED,), (axes.KV_HEADS, axes.HEAD_DIM), use_bias=True, rngs=rngs
    )
    self.o_proj = layers.Dense(
      (n, h), d, (axes.Q_HEADS, axes.HEAD_DIM), (axes.EMBED,), use_bias=False, rngs=rngs
    )

  def qkv(self, x_BTD, cos, sin):
    """(q, k, v) of x, queries and keys rotated (M-RoPE)."""
    q = layers.apply_rotary(self.q_proj(x_BTD), cos, sin)
    k = layers.apply_rotary(self.k_proj(x_BTD), cos, sin)
    return q, k, self.v_proj(x_BTD)


class DecoderLayer(nnx.Module):
  def __init__(self, cfg: TextConfig, *, rngs: nnx.Rngs):
    self.input_layernorm = layers.RMSNorm(
      cfg.hidden_size, axes.EMBED, eps=cfg.rms_norm_eps, rngs=rngs
    )
    self.self_attn = SelfAttention(cfg, rngs=rngs)
    self.post_attention_layernorm = layers.RMSNorm(
      cfg.hidden_size, axes.EMBED, eps=cfg.rms_norm_eps, rngs=rngs
    )
    self.mlp = layers.SwiGLU(
      cfg.hidden_size, cfg.intermediate_size, axes.EMBED, axes.MLP, use_bias=False, rngs=rngs
    )

  def block(self, x, cos, sin, attend: Callable) -> tuple[jax.Array, Any]:
    """The residual block, for training, prefill and decode alike.

    `attend(q, k, v) -> (attention output, aux)` is the caller's: packed
    rows with segment masks in training; the KV cache in prefill and decode,
    whose updated cache is the aux. Returns (x, aux).
    """
    q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
    out, aux = attend(q, k, v)
    x = x + self.self_attn.o_proj(out)
    return x + self.mlp(self.post_attention_layernorm(x)), aux

  def __call__(self, x, cos, sin, segment_ids, segment_pos, attention_fn):
    def attend(q, k, v):
      return packed_self_attention(attention_fn, q, k, v, segment_ids, segment_pos), None

    return self.block(x, cos, sin, attend)[0]


class TextDecoder(nnx.Module):
  """Embedding, stacked decoder layers and the final norm (no LM head)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    t = cfg.text
    self.cfg = t
    self.remat = cfg.remat
    self.backend = cfg.attention_backend
    self.embed_tokens = layers.param(rngs, (t.vocab_size, t.hidden_size), (axes.VOCAB, axes.EMBED))
    self.layers = layers.stacked(t.num_layers, lambda r: DecoderLayer(t, rngs=r), rngs)
    self.norm = layers.RMSNorm(t.hidden_size, axes.EMBED, eps=t.rms_norm_eps, rngs=rngs)

  def embed(self, tokens_BT: jax.Array | np.ndarray, dtype) -> jax.Array:
    return jnp.take(self.embed_tokens[...], tokens_BT, axis=0).astype(dtype)

  def __call__(
    self,
    x_BTD,
    positions_3BT,
    segment_ids_BT,
    segment_pos_BT,
    attention_fn: AttentionFn | None = None,
  ) -> jax.Array:
    if attention_fn is None:
      backend = self.backend
      attention_fn = lambda q, k, v, **kw: attn_lib.attention(q, k, v, backend=backend, **kw)
    cos, sin = mrope_cos_sin(positions_3BT, self.cfg)

    def body(layer, x, _):
      return layer(x, cos, sin, segment_ids_BT, segment_pos_BT, attention_fn)

    x = layers.scan_layers(self.layers, x_BTD, body, remat=self.remat)
    return self.norm(x)
