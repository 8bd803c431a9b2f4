"""Qwen2.5-VL as a Flax NNX module: vision tower + text decoder + LM head.

`Qwen25VL` runs a `PackedInputs` batch; `create_model` and `abstract_model` build it.
Shapes: B rows, T tokens per row, D text width, V vocabulary, M merged vision tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fluxjax.models import layers
from fluxjax.models import logprobs as logprobs_lib
from fluxjax.models.config import ModelConfig
from fluxjax.models.text import AttentionFn, TextDecoder
from fluxjax.models.vision import VisionInputs, VisionTower
from fluxjax.sharding import axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PackedInputs:
  """One packed batch for the forward pass.

  Built on the host as numpy arrays; device arrays once placed or traced.

  Attributes:
    tokens_BT: int token ids; image/video pad tokens mark where vision goes.
    positions_3BT: int M-RoPE positions (rope_index.get_rope_index).
    segment_ids_BT: int sequence id inside the row, 0 = padding.
    segment_pos_BT: int index of the token inside its sequence (causal order).
    vision: VisionInputs for all images/frames of the call, or None.
    vision_index_BT: int; for each image/video pad token, the index of its merged
      embedding in the flattened [B * N/4] tower output (a gather: the plan routes
      embeddings to any token position); -1 marks a text position, whatever its token
      id. When None, the k-th pad token in row-major order takes the k-th merged
      embedding, which is right when patches follow token order with padding only at
      the end (one row).
  """

  tokens_BT: jax.Array | np.ndarray
  positions_3BT: jax.Array | np.ndarray
  segment_ids_BT: jax.Array | np.ndarray
  segment_pos_BT: jax.Array | np.ndarray
  vision: VisionInputs | None = None
  vision_index_BT: jax.Array | np.ndarray | None = None


class Qwen25VL(nnx.Module):
  """The Qwen2.5-VL architecture (HF `Qwen2_5_VLForConditionalGeneration`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.visual = VisionTower(cfg, rngs=rngs)
    self.model = TextDecoder(cfg, rngs=rngs)
    self.lm_head = (
      None
      if cfg.text.tie_word_embeddings
      else layers.param(rngs, (cfg.text.hidden_size, cfg.text.vocab_size), (axes.EMBED, axes.VOCAB))
    )

  @property
  def dtype(self):
    return jnp.dtype(self.cfg.dtype)

  def head_DV(self) -> jax.Array:
    if self.lm_head is None:
      return self.model.embed_tokens[...].T
    return self.lm_head[...]

  def embed(
    self,
    tokens_BT: jax.Array | np.ndarray,
    vision: VisionInputs | None,
    vision_index_BT: jax.Array | np.ndarray | None = None,
    vision_gather_fn=None,
  ) -> jax.Array:
    """Token embeddings with vision embeddings spliced over the pad tokens.

    `vision_gather_fn` (merged [B*N/4, E] -> what `vision_index_BT` indexes) lets
    per-device code (minibatch sync) collect other devices' embeddings.
    """
    x = self.model.embed(tokens_BT, self.dtype)
    if vision is None:
      return x
    merged = self.visual(vision).astype(x.dtype)
    merged = merged.reshape(-1, merged.shape[-1])  # [B * N/4, E]
    if vision_gather_fn is not None:
      merged = vision_gather_fn(merged)
    if vision_index_BT is None:
      is_vis = (tokens_BT == self.cfg.image_token_id) | (tokens_BT == self.cfg.video_token_id)
      vision_index_BT = (jnp.cumsum(is_vis.reshape(-1)) - 1).reshape(is_vis.shape)
    else:
      # Only positions the plan routed are vision: a pad id the policy sampled
      # in a response is text, as the rollout engine embedded it.
      is_vis = vision_index_BT >= 0
    index = jnp.clip(vision_index_BT, 0, merged.shape[0] - 1)
    spliced = jnp.take(merged, index, axis=0)  # a gather: works sharded
    return jnp.where(is_vis[..., None], spliced, x)

  def hidden_states(
    self, batch: PackedInputs, attention_fn: AttentionFn | None = None, vision_gather_fn=None
  ) -> jax.Array:
    """Final-norm hidden states [B, T, D]."""
    x = self.embed(batch.tokens_BT, batch.vision, batch.vision_index_BT, vision_gather_fn)
    return self.model(
      x, batch.positions_3BT, batch.segment_ids_BT, batch.segment_pos_BT, attention_fn
    )

  def logits(self, batch: PackedInputs, attention_fn: AttentionFn | None = None) -> jax.Array:
    """Full [B, T, V] logits in fp32: for inference and tests, not training."""
    h = self.hidden_states(batch, attention_fn)
    return jnp.einsum(
      "btd,dv->btv", h, self.head_DV().astype(h.dtype), preferred_element_type=jnp.float32
    )

  def token_logprobs(
    self,
    batch: PackedInputs,
    targets_BT: jax.Array,
    *,
    attention_fn: AttentionFn | None = None,
    vision_gather_fn=None,
    with_entropy: bool = False,
    temperature: float = 1.0,
  ):
    """log softmax(logits / temperature)[targets] per token, chunked over the vocabulary."""
    h = self.hidden_states(batch, attention_fn, vision_gather_fn)
    return logprobs_lib.token_logprobs(
      h,
      targets_BT,
      self.head_DV(),
      chunk=self.cfg.logprob_vocab_chunk,
      with_entropy=with_entropy,
      temperature=temperature,
    )

  def __call__(self, batch: PackedInputs) -> jax.Array:
    return self.logits(batch)


def create_model(cfg: ModelConfig, seed: int | jax.Array = 0) -> Qwen25VL:
  """Builds the model with random weights, unsharded (tests, notebooks).

  Sharded creation (abstract init, then a jitted init with out_shardings) lives
  in fluxjax.sharding; this path never needs a mesh.
  """
  with nnx.use_eager_sharding(False):
    return Qwen25VL(cfg, rngs=nnx.Rngs(seed))


def abstract_model(cfg: ModelConfig) -> Qwen25VL:
  """The model with ShapeDtypeStruct leaves: shapes and logical axes, no memory."""
  with nnx.use_eager_sharding(False):
    return nnx.eval_shape(lambda: Qwen25VL(cfg, rngs=nnx.Rngs(0)))


def padded_inputs(
  input_ids_BL: np.ndarray,
  attention_mask_BL: np.ndarray,
  positions_3BL: np.ndarray,
  vision: VisionInputs | None = None,
) -> PackedInputs:
  """A padded batch (HF style, any padding side) as packed inputs, one row each.

  Each row is one segment; `segment_pos` counts only real tokens, so left
  padding gives the same result as right padding.
  """
  mask = np.asarray(attention_mask_BL).astype(bool)
  segment_ids = mask.astype(np.int32)
  segment_pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return PackedInputs(
    tokens_BT=np.asarray(input_ids_BL, np.int32),
    positions_3BT=np.asarray(positions_3BL, np.int32),
    segment_ids_BT=segment_ids,
    segment_pos_BT=segment_pos,
    vision=vision,
  )
