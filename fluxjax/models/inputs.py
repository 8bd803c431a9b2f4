"""From a chat prompt and its media to model inputs: one sequence, then a packed row.

This is the single path from "messages + decoded media" to what the model
consumes, shared by the rollout engine, the trainer and the tests: the token
ids with vision pads expanded, the M-RoPE positions (with the configured
text-after-vision rule), and the media in the order their pads appear.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fluxjax.models import chat, processor, rope_index, vision, vlm
from fluxjax.models.config import ModelConfig
from fluxjax.models.processor import ProcessedVision, VisionMeta
from fluxjax.models.tokenizer import Tokenizer


@dataclasses.dataclass
class SequenceInputs:
  """One sequence ready for packing.

  Attributes:
    tokens_T: int32 token ids, vision pads expanded.
    positions_3T: int32 M-RoPE positions.
    media: images/videos in order of appearance: processed, or metadata
      only (`VisionMeta`) until a batch is materialized.
    mrope_delta: max(position) + 1 - T; decoding continues at T + delta.
  """

  tokens_T: np.ndarray
  positions_3T: np.ndarray
  media: list[VisionMeta]
  mrope_delta: int

  def __len__(self) -> int:
    return int(self.tokens_T.shape[0])

  def decoded_media(self) -> list[ProcessedVision]:
    """The media with their pixels; raises for metadata-only items."""
    decoded = [m for m in self.media if isinstance(m, ProcessedVision)]
    if len(decoded) != len(self.media):
      raise TypeError(
        "this needs decoded media (ProcessedVision); metadata-only items are "
        "materialized by fluxjax.parallel.batch.materialize"
      )
    return decoded

  @property
  def num_patches(self) -> int:
    return sum(processor.num_patches(m.grid_thw) for m in self.media)

  def extend(self, new_tokens: Sequence[int]) -> SequenceInputs:
    """Appends text tokens (a response) with positions continuing the prompt's."""
    new = np.asarray(new_tokens, np.int32)
    start = len(self) + self.mrope_delta
    pos = rope_index.text_positions(len(new), start)
    return SequenceInputs(
      np.concatenate([self.tokens_T, new]),
      np.concatenate([self.positions_3T, pos], axis=1),
      self.media,
      self.mrope_delta,
    )


def sequence_from_tokens(
  tokens_T: Sequence[int] | np.ndarray, media: Sequence[VisionMeta], cfg: ModelConfig
) -> SequenceInputs:
  """Positions for already-expanded token ids (e.g. a request's input_ids)."""
  tokens = np.asarray(tokens_T, np.int32)
  images = [m for m in media if m.kind == "image"]
  videos = [m for m in media if m.kind == "video"]
  positions, delta = rope_index.get_rope_index(
    tokens,
    [m.grid_thw for m in images] or None,
    [m.grid_thw for m in videos] or None,
    [_seconds_per_grid(m) for m in videos] or None,
    image_token_id=cfg.image_token_id,
    video_token_id=cfg.video_token_id,
    spatial_merge_size=cfg.vision.spatial_merge_size,
    tokens_per_second=cfg.vision.tokens_per_second,
    text_after_vision=cfg.mrope_text_after_vision,
  )
  _check_media_order(tokens, media, cfg)
  return SequenceInputs(tokens, positions, list(media), delta)


def _seconds_per_grid(video: VisionMeta) -> float:
  assert video.second_per_grid is not None, "a video has seconds per grid step"
  return video.second_per_grid


def sequence_from_chat(
  messages,
  media: Sequence[VisionMeta],
  tokenizer: Tokenizer,
  cfg: ModelConfig,
  add_generation_prompt: bool = True,
) -> SequenceInputs:
  """Renders a chat, expands its vision placeholders and computes positions.

  Args:
    messages: HF-style chat messages with {"type": "image"} / {"type": "video"} parts.
    media: the processed images/videos, in the order their parts appear.
    tokenizer: the model's tokenizer.
    cfg: the model config (token ids, merge size, M-RoPE rule).
    add_generation_prompt: end with the assistant turn header.
  """
  prompt = chat.tokenize_chat(
    messages,
    tokenizer,
    image_grids=[m.grid_thw for m in media if m.kind == "image"],
    video_grids=[m.grid_thw for m in media if m.kind == "video"],
    merge_size=cfg.vision.spatial_merge_size,
    add_generation_prompt=add_generation_prompt,
  )
  return sequence_from_tokens(prompt.input_ids, media, cfg)


def _check_media_order(tokens_T: np.ndarray, media: Sequence[VisionMeta], cfg: ModelConfig) -> None:
  """The model splices media in pad order; a kind mismatch would mix them up."""
  kinds = []
  is_image = tokens_T == cfg.image_token_id
  is_video = tokens_T == cfg.video_token_id
  is_vis = is_image | is_video
  starts = np.flatnonzero(is_vis & ~np.concatenate([[False], is_vis[:-1]]))
  for s in starts:
    kinds.append("image" if is_image[s] else "video")
  # Adjacent spans of one kind merge into one run; compare runs of kinds.
  runs = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
  media_runs = [m.kind for i, m in enumerate(media) if i == 0 or media[i - 1].kind != m.kind]
  if runs != media_runs:
    raise ValueError(
      f"media kinds {[m.kind for m in media]} do not follow the order of "
      f"vision spans in the tokens ({runs})"
    )


def pack_row(
  seqs: Sequence[SequenceInputs],
  cfg: ModelConfig,
  *,
  token_capacity: int | None = None,
  patch_capacity: int | None = None,
) -> vlm.PackedInputs:
  """Packs sequences into one row (segment ids 1..n), padded to the capacities."""
  total = sum(len(s) for s in seqs)
  token_capacity = total if token_capacity is None else token_capacity
  if total > token_capacity:
    raise ValueError(f"{total} tokens do not fit a row of {token_capacity}")
  pad = token_capacity - total
  tokens = np.concatenate([s.tokens_T for s in seqs] + [np.zeros(pad, np.int32)])
  positions = np.concatenate([s.positions_3T for s in seqs] + [np.zeros((3, pad), np.int32)], 1)
  segment_ids = np.concatenate(
    [np.full(len(s), i + 1, np.int32) for i, s in enumerate(seqs)] + [np.zeros(pad, np.int32)]
  )
  segment_pos = np.concatenate(
    [np.arange(len(s), dtype=np.int32) for s in seqs] + [np.zeros(pad, np.int32)]
  )
  media = [m for s in seqs for m in s.decoded_media()]
  vis = None
  if media or patch_capacity:
    vis = vision.make_vision_inputs(
      [m.patches for m in media], [m.grid_thw for m in media], cfg.vision, patch_capacity
    )
  return vlm.PackedInputs(
    tokens[None], positions[:, None], segment_ids[None], segment_pos[None], vis
  )
