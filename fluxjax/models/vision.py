"""Qwen2.5-VL vision tower: patch embed, window/full attention blocks, 2x2 merger.

HF reorders patches so that each attention window is contiguous and passes `cu_seqlens`;
we keep the processor's patch order and give every patch a window id and a frame id
instead (`patch_layout`). Attention is masked by those ids, which is the same computation
(attention is permutation-equivariant) and lets a strategy place images and frames on any
device. Shapes: B rows (one per device on a mesh), N patches per row, M = N / 4 merged
tokens, D vision width, E text width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fluxjax.models import attention as attn_lib
from fluxjax.models import layers
from fluxjax.models.config import ModelConfig, VisionConfig
from fluxjax.sharding import axes


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class VisionInputs:
  """Inputs of the vision tower for a set of images/frames.

  Built on the host as numpy arrays; device arrays once placed or traced.

  Attributes:
    patches_BNP: float [B, N, C*T*P*P] flattened patches; every image/frame
      lies within one row, padding after the real patches.
    frame_ids_BN: int [B, N] full-attention group (one per image or video
      frame); 0 marks a padding patch.
    window_ids_BN: int [B, N] window-attention group; 0 marks padding.
    hw_BN2: int [B, N, 2] (row, column) of each patch inside its frame (2D RoPE).
  """

  patches_BNP: jax.Array | np.ndarray
  frame_ids_BN: jax.Array | np.ndarray
  window_ids_BN: jax.Array | np.ndarray
  hw_BN2: jax.Array | np.ndarray

  @property
  def num_patches(self) -> int:
    return self.patches_BNP.shape[1]


def patch_layout(
  grids_thw: Sequence[Sequence[int]],
  cfg: VisionConfig,
  first_frame_id: int = 1,
  first_window_id: int = 1,
):
  """Host-side ids for the patches of several images/videos, in processor order.

  Processor order: per frame, per merged 2x2 unit in row-major order, the 4 sub-patches.
  Four consecutive patches therefore form one merged token, and merged tokens come out in
  the order the text expects.

  Args:
    grids_thw: (t, h, w) per image or video, in patch units.
    cfg: the vision config (merge size, window size).
    first_frame_id, first_window_id: where numbering starts, so that callers
      packing several batches keep ids unique.

  Returns:
    (frame_ids_N, window_ids_N, hw_N2) as int32 numpy arrays.
  """
  m, win = cfg.spatial_merge_size, cfg.window_merged_units
  frames, windows, hws = [], [], []
  next_frame, next_window = first_frame_id, first_window_id
  for t, h, w in grids_thw:
    if h % m or w % m:
      raise ValueError(f"grid {(t, h, w)} not divisible by merge size {m}")
    bh, bw = h // m, w // m
    # Indices over (frame, unit_row, unit_col, sub_row, sub_col), processor order.
    f, bi, bj, si, sj = np.meshgrid(
      np.arange(t), np.arange(bh), np.arange(bw), np.arange(m), np.arange(m), indexing="ij"
    )
    rows, cols = bi * m + si, bj * m + sj
    nwh, nww = -(-bh // win), -(-bw // win)
    window = (f * nwh + bi // win) * nww + bj // win
    frames.append((f + next_frame).ravel())
    windows.append((window + next_window).ravel())
    hws.append(np.stack([rows.ravel(), cols.ravel()], axis=-1))
    next_frame += t
    next_window += t * nwh * nww
  if not frames:
    empty = np.zeros((0,), np.int32)
    return empty, empty, np.zeros((0, 2), np.int32)
  return (
    np.concatenate(frames).astype(np.int32),
    np.concatenate(windows).astype(np.int32),
    np.concatenate(hws).astype(np.int32),
  )


def make_vision_inputs(
  patches: Sequence[np.ndarray],
  grids_thw: Sequence[Sequence[int]],
  cfg: VisionConfig,
  capacity: int | None = None,
) -> VisionInputs:
  """Concatenates processed images/videos into one row of `capacity` patches.

  Padding patches get frame and window id 0, so they attend to nothing and
  their merged outputs are never spliced into the text.
  """
  frame_ids, window_ids, hw = patch_layout(grids_thw, cfg)
  n = frame_ids.shape[0]
  flat = (
    np.concatenate([np.asarray(p, np.float32) for p in patches])
    if patches
    else np.zeros((0, cfg.patch_dim), np.float32)
  )
  if flat.shape != (n, cfg.patch_dim):
    raise ValueError(f"patches {flat.shape} do not match grids ({n}, {cfg.patch_dim})")
  capacity = n if capacity is None else capacity
  if capacity < n or capacity % cfg.merge_unit:
    raise ValueError(
      f"capacity {capacity} must be >= {n} patches and a multiple of {cfg.merge_unit}"
    )
  pad = capacity - n
  return VisionInputs(
    patches_BNP=np.pad(flat, ((0, pad), (0, 0)))[None],
    frame_ids_BN=np.pad(frame_ids, (0, pad))[None],
    window_ids_BN=np.pad(window_ids, (0, pad))[None],
    hw_BN2=np.pad(hw, ((0, pad), (0, 0)))[None],
  )


class VisionAttention(nnx.Module):
  """Bidirectional attention with 2D rotary; q, k, v from one fused projection."""

  def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
    d, n, h = cfg.hidden_size, cfg.num_heads, cfg.head_dim
    self.qkv = layers.Dense(
      d,
      (3, n, h),
      (axes.VIS_EMBED,),
      (None, axes.VIS_HEADS, axes.HEAD_DIM),
      use_bias=True,
      rngs=rngs,
    )
    self.proj = layers.Dense(
      (n, h), d, (axes.VIS_HEADS, axes.HEAD_DIM), (axes.VIS_EMBED,), use_bias=True, rngs=rngs
    )

  def __call__(self, x_BND, cos_BNH, sin_BNH, group_ids_BN, backend: str):
    qkv = self.qkv(x_BND)  # [B, N, 3, n, h]
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q = layers.apply_rotary(q, cos_BNH, sin_BNH)
    k = layers.apply_rotary(k, cos_BNH, sin_BNH)
    out = attn_lib.attention(
      q,
      k,
      v,
      backend=backend,
      q_segment_ids=group_ids_BN,
      kv_segment_ids=group_ids_BN,
      causal=False,
    )
    return self.proj(out)


class VisionBlock(nnx.Module):
  def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
    self.norm1 = layers.RMSNorm(cfg.hidden_size, axes.VIS_EMBED, eps=cfg.rms_norm_eps, rngs=rngs)
    self.attn = VisionAttention(cfg, rngs=rngs)
    self.norm2 = layers.RMSNorm(cfg.hidden_size, axes.VIS_EMBED, eps=cfg.rms_norm_eps, rngs=rngs)
    self.mlp = layers.SwiGLU(
      cfg.hidden_size, cfg.intermediate_size, axes.VIS_EMBED, axes.VIS_MLP, use_bias=True, rngs=rngs
    )

  def __call__(self, x, cos, sin, group_ids, backend):
    x = x + self.attn(self.norm1(x), cos, sin, group_ids, backend)
    return x + self.mlp(self.norm2(x))


class PatchMerger(nnx.Module):
  """RMSNorm, then 4 neighbouring patches concatenated -> MLP(GELU) -> text width."""

  def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs):
    merged = cfg.hidden_size * cfg.merge_unit
    self.merge_unit = cfg.merge_unit
    self.ln_q = layers.RMSNorm(cfg.hidden_size, axes.VIS_EMBED, eps=cfg.rms_norm_eps, rngs=rngs)
    self.fc1 = layers.Dense(
      merged, merged, (axes.MERGED,), (axes.VIS_MLP,), use_bias=True, rngs=rngs
    )
    self.fc2 = layers.Dense(
      merged, cfg.out_hidden_size, (axes.VIS_MLP,), (axes.EMBED,), use_bias=True, rngs=rngs
    )

  def __call__(self, x_BND):
    b, n, d = x_BND.shape
    x = self.ln_q(x_BND).reshape(b, n // self.merge_unit, self.merge_unit * d)
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


class VisionTower(nnx.Module):
  """Patches [B, N, C*T*P*P] -> merged embeddings [B, N/4, text width].

  Rows never attend to each other, so the tower is batch-parallel: sharding rows over
  devices needs no communication.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    v = cfg.vision
    self.cfg = v
    self.backend = cfg.attention_backend
    self.remat = cfg.remat
    self.dtype = jnp.dtype(cfg.dtype)
    # Conv3d with stride == kernel is a linear map of each flattened patch.
    self.patch_embed = layers.Dense(
      v.patch_dim, v.hidden_size, (axes.PATCH,), (axes.VIS_EMBED,), use_bias=False, rngs=rngs
    )
    self.blocks = layers.stacked(v.depth, lambda r: VisionBlock(v, rngs=r), rngs)
    self.merger = PatchMerger(v, rngs=rngs)

  def rotary(self, hw_BN2):
    """2D RoPE: rows rotate the first half of each head, columns the second."""
    inv = layers.inverse_frequencies(self.cfg.head_dim // 2, self.cfg.rope_theta)
    freqs = hw_BN2[..., None].astype(jnp.float32) * inv  # [B, N, 2, H/4]
    freqs = freqs.reshape(*freqs.shape[:2], -1)  # [B, N, H/2]: rows then columns
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)

  def __call__(self, vis: VisionInputs) -> jax.Array:
    x = self.patch_embed(vis.patches_BNP.astype(self.dtype))
    cos, sin = self.rotary(vis.hw_BN2)
    backend = self.backend

    def body(block, x, is_full):
      group = jnp.where(is_full, vis.frame_ids_BN, vis.window_ids_BN)
      return block(x, cos, sin, group, backend)

    is_full = jnp.asarray(np.isin(np.arange(self.cfg.depth), self.cfg.fullatt_block_indexes))
    x = layers.scan_layers(self.blocks, x, body, is_full, remat=self.remat)
    return self.merger(x)
