"""Qwen2.5-VL chat formatting and vision-token expansion.

`render_chat` reproduces the Qwen2-VL / Qwen2.5-VL Hugging Face chat template, and
`tokenize_chat` then does what `Qwen2_5_VLProcessor` does: each vision placeholder
becomes one pad per merged 2x2 patch of its grid (`expand_vision_tokens`). Expansion
happens on token ids, not on text.
"""

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fluxjax.models import processor
from fluxjax.models import tokenizer as tokenizer_lib

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"

# HF's `mm_token_type_ids` convention.
TEXT_TYPE, IMAGE_TYPE, VIDEO_TYPE = 0, 1, 2

Message = Mapping[str, Any]
Grid = Sequence[int]


@dataclasses.dataclass(frozen=True, eq=False)
class PromptTokens:
  """A tokenized, vision-expanded prompt.

  Attributes:
    input_ids: int32 [T] token ids with every vision pad expanded.
    mm_token_type_ids: int32 [T], 0 text, 1 image pad, 2 video pad.
    num_image_tokens: total `<|image_pad|>` tokens (over all images).
    num_video_tokens: total `<|video_pad|>` tokens (over all videos).
  """

  input_ids: np.ndarray
  mm_token_type_ids: np.ndarray
  num_image_tokens: int
  num_video_tokens: int

  def __len__(self) -> int:
    return int(self.input_ids.shape[0])


def _part_kind(part: Mapping[str, Any]) -> str:
  """Classifies a content part in the template's order of tests."""
  kind = part.get("type")
  if kind == "image" or "image" in part or "image_url" in part:
    return "image"
  if kind == "video" or "video" in part:
    return "video"
  if "text" in part:
    return "text"
  raise ValueError(
    f"unsupported content part {dict(part)!r}: expected "
    "type 'text' (with 'text'), 'image' or 'video'"
  )


def render_chat(
  messages: Sequence[Message], add_generation_prompt: bool = True, add_vision_id: bool = False
) -> str:
  """Renders messages with Qwen2.5-VL's chat template.

  The template: a default system turn, `<|im_start|>role\\n...<|im_end|>\\n` turns, each
  image as `<|vision_start|><|image_pad|><|vision_end|>`, each video with
  `<|video_pad|>`. Unlike the jinja template, which silently drops content parts it does
  not recognise, it raises on them: a dropped image would shift every later image onto
  the wrong grid.

  Args:
    messages: HF-style dicts `{"role": ..., "content": str | list of parts}`,
      parts being `{"type": "text", "text": ...}`, `{"type": "image"}` or
      `{"type": "video"}`.
    add_generation_prompt: append `<|im_start|>assistant\\n`.
    add_vision_id: prefix each image/video with "Picture n: " / "Video n: ",
      as the template's `add_vision_id` does.

  Returns:
    The prompt text, with one placeholder pad per image and per video.
  """
  out = []
  images = videos = 0
  for i, message in enumerate(messages):
    role = message.get("role")
    if not isinstance(role, str):
      raise ValueError(f"message {i} has no string 'role': {message!r}")
    if i == 0 and role != "system":
      out.append(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n")
    out.append(f"<|im_start|>{role}\n")
    content = message.get("content")
    if isinstance(content, str):
      out.append(content)
    elif isinstance(content, Sequence):
      for part in content:
        if not isinstance(part, Mapping):
          raise ValueError(f"message {i}: content part {part!r} is not a dict")
        kind = _part_kind(part)
        if kind == "image":
          images += 1
          if add_vision_id:
            out.append(f"Picture {images}: ")
          out.append(IMAGE_PLACEHOLDER)
        elif kind == "video":
          videos += 1
          if add_vision_id:
            out.append(f"Video {videos}: ")
          out.append(VIDEO_PLACEHOLDER)
        else:
          out.append(str(part["text"]))
    else:
      raise ValueError(
        f"message {i}: content must be a str or a list of parts, got {type(content).__name__}"
      )
    out.append("<|im_end|>\n")
  if add_generation_prompt:
    out.append("<|im_start|>assistant\n")
  return "".join(out)


def expand_vision_tokens(
  ids: Sequence[int],
  *,
  image_pad_id: int,
  video_pad_id: int,
  image_grids: Sequence[Grid] = (),
  video_grids: Sequence[Grid] = (),
  merge_size: int = 2,
) -> PromptTokens:
  """Expands each single vision pad id into its grid's number of pads.

  Every placeholder pad becomes t*h*w // merge**2 pads, one per merged 2x2 patch of its
  (t, h, w) grid, and `mm_token_type_ids` marks them 0 text / 1 image / 2 video. On ids,
  each pad id is repeated: the same ids as HF's text-level expansion (pads are added
  tokens and never merge with neighbours in BPE), without encoding strings of thousands
  of pads.

  Args:
    ids: token ids holding one `<|image_pad|>` per image and one
      `<|video_pad|>` per video (an unexpanded prompt).
    image_pad_id: id of `<|image_pad|>`.
    video_pad_id: id of `<|video_pad|>`.
    image_grids: (t, h, w) per image, in order of appearance.
    video_grids: (t, h, w) per video, in order of appearance.
    merge_size: the vision merger's spatial merge size.

  Returns:
    The expanded `PromptTokens`.

  Raises:
    ValueError: if the number of placeholders and grids differ.
  """
  ids_T = np.asarray(ids, dtype=np.int64).reshape(-1)
  image_grids = [] if image_grids is None else list(image_grids)
  video_grids = [] if video_grids is None else list(video_grids)
  is_image_T = ids_T == image_pad_id
  is_video_T = ids_T == video_pad_id
  for name, mask, grids in (("image", is_image_T, image_grids), ("video", is_video_T, video_grids)):
    if int(mask.sum()) != len(grids):
      raise ValueError(
        f"{int(mask.sum())} {name} placeholder(s) in the prompt but "
        f"{len(grids)} {name} grid(s); an already expanded prompt cannot "
        "be expanded again"
      )
  image_counts = [processor.num_vision_tokens(g, merge_size) for g in image_grids]
  video_counts = [processor.num_vision_tokens(g, merge_size) for g in video_grids]
  repeats_T = np.ones(ids_T.shape, dtype=np.int64)
  repeats_T[is_image_T] = image_counts
  repeats_T[is_video_T] = video_counts
  out_T = np.repeat(ids_T, repeats_T).astype(np.int32)
  types_T = np.zeros(out_T.shape, dtype=np.int32)
  types_T[out_T == image_pad_id] = IMAGE_TYPE
  types_T[out_T == video_pad_id] = VIDEO_TYPE
  return PromptTokens(
    input_ids=out_T,
    mm_token_type_ids=types_T,
    num_image_tokens=sum(image_counts),
    num_video_tokens=sum(video_counts),
  )


def tokenize_chat(
  messages: Sequence[Message],
  tokenizer: tokenizer_lib.Tokenizer,
  image_grids: Sequence[Grid] = (),
  video_grids: Sequence[Grid] = (),
  merge_size: int = 2,
  add_generation_prompt: bool = True,
) -> PromptTokens:
  """Renders, tokenizes and vision-expands a conversation.

  Args:
    messages: HF-style chat messages (see `render_chat`).
    tokenizer: a Qwen2.5-VL-compatible `Tokenizer`.
    image_grids: (t, h, w) per image in patch units, in order of appearance.
    video_grids: (t, h, w) per video in patch units, in order of appearance.
    merge_size: the vision merger's spatial merge size.
    add_generation_prompt: end with `<|im_start|>assistant\\n`.

  Returns:
    `PromptTokens` equal to `Qwen2_5_VLProcessor`'s `input_ids` and
    `mm_token_type_ids` for the same prompt and grids.

  Raises:
    ValueError: on malformed messages, or placeholder/grid count mismatch.
  """
  text = render_chat(messages, add_generation_prompt=add_generation_prompt)
  return expand_vision_tokens(
    tokenizer.encode(text),
    image_pad_id=tokenizer.image_pad_id,
    video_pad_id=tokenizer.video_pad_id,
    image_grids=image_grids,
    video_grids=video_grids,
    merge_size=merge_size,
  )
