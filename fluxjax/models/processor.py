"""Qwen2.5-VL vision preprocessing (resize, normalize, patchify) in numpy + PIL.

This reproduces transformers' `Qwen2VLImageProcessorPil` and
`Qwen2VLVideoProcessor` (which Qwen2.5-VL uses unchanged) without torch, so the
preprocessor workers stay light. The patches must match HF's bit for bit in
layout: the vision tower's 2x2 merger and window attention assume HF's
flattening order.

Shape letters: F frames, H height, W width, C channels, T temporal patch,
P patch side, N patches (= grid t * h * w), D = C * T * P * P.
"""

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np
import PIL.Image

# OPENAI CLIP statistics, as in transformers.image_utils.
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# HF's smart_resize refuses aspect ratios beyond this.
MAX_ASPECT_RATIO = 200

Kind = Literal["image", "video"]


@dataclasses.dataclass(frozen=True)
class VisionProcessorConfig:
  """Vision preprocessing settings; defaults are transformers' Qwen2-VL ones.

  The image pixel limits are the `Qwen2VLImageProcessor` class defaults. Note
  that the published Qwen2.5-VL checkpoints' preprocessor_config.json raises
  `max_pixels` to 12845056 (16384 * 28 * 28); pass that to match them.

  Attributes:
    patch_size: spatial patch side of the vision tower.
    temporal_patch_size: frames per temporal patch (an image is repeated).
    merge_size: side of the patch merger window (2x2 patches -> 1 token).
    image_min_pixels: lower pixel bound of the image resize rule.
    image_max_pixels: upper pixel bound of the image resize rule.
    video_min_pixels: lower per-frame pixel bound for videos.
    video_max_pixels: upper per-frame pixel bound for videos.
    video_fps: frames per second to sample from a video.
    video_min_frames: fewest frames to sample from a video.
    video_max_frames: most frames to sample from a video.
    video_cap_pixels_per_frame: also bound each frame by an even share of a
      whole-video budget (HF's `cap_pixels_per_frame`, qwen-vl-utils' rule).
    video_max_tokens: the context length that budget assumes.
    image_mean: per-channel mean after rescaling.
    image_std: per-channel std after rescaling.
    rescale_factor: uint8 -> [0, 1] factor.
    resample: PIL resampling filter.
  """

  patch_size: int = 14
  temporal_patch_size: int = 2
  merge_size: int = 2
  image_min_pixels: int = 56 * 56
  image_max_pixels: int = 28 * 28 * 1280
  video_min_pixels: int = 128 * 28 * 28
  video_max_pixels: int = 768 * 28 * 28
  video_fps: float = 2.0
  video_min_frames: int = 4
  video_max_frames: int = 768
  # HF announced True as its future default and it is the reference
  # (qwen-vl-utils / SGLang) behaviour; without it long videos get no bound.
  video_cap_pixels_per_frame: bool = True
  video_max_tokens: int = 128000
  image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
  image_std: tuple[float, float, float] = OPENAI_CLIP_STD
  rescale_factor: float = 1 / 255
  resample: PIL.Image.Resampling = PIL.Image.Resampling.BICUBIC

  def hf_files(self) -> dict[str, dict]:
    """preprocessor_config.json and video_preprocessor_config.json as
    transformers' Qwen2-VL image and video processors read them."""
    shared = {
      "patch_size": self.patch_size,
      "temporal_patch_size": self.temporal_patch_size,
      "merge_size": self.merge_size,
      "image_mean": list(self.image_mean),
      "image_std": list(self.image_std),
      "rescale_factor": self.rescale_factor,
      "resample": int(self.resample),
      "do_resize": True,
      "do_rescale": True,
      "do_normalize": True,
      "do_convert_rgb": True,
      "processor_class": "Qwen2_5_VLProcessor",
    }
    image = {
      "image_processor_type": "Qwen2VLImageProcessor",
      "min_pixels": self.image_min_pixels,
      "max_pixels": self.image_max_pixels,
    }
    video = {
      "video_processor_type": "Qwen2VLVideoProcessor",
      "min_pixels": self.video_min_pixels,
      "max_pixels": self.video_max_pixels,
      "fps": self.video_fps,
      "min_frames": self.video_min_frames,
      "max_frames": self.video_max_frames,
    }
    return {
      "preprocessor_config.json": {**image, **shared},
      "video_preprocessor_config.json": {**video, **shared},
    }

  @staticmethod
  def read_hf_files(folder: str) -> dict[str, int]:
    """The pixel and frame limits an HF checkpoint's preprocessor_config.json
    (and video_preprocessor_config.json, where there is one) give, under this
    class's field names; {} when the folder has neither."""
    out: dict[str, int] = {}
    for name, kind in (
      ("preprocessor_config.json", "image"),
      ("video_preprocessor_config.json", "video"),
    ):
      path = os.path.join(folder, name)
      if not os.path.exists(path):
        continue
      with open(path) as f:
        d = json.load(f)
      size = d.get("size") or {}
      for ours, theirs, alt in (
        ("min_pixels", "min_pixels", "shortest_edge"),
        ("max_pixels", "max_pixels", "longest_edge"),
      ):
        value = d.get(theirs, size.get(alt))
        if value is not None:
          out[f"{kind}_{ours}"] = int(value)
      if kind == "video" and d.get("max_frames") is not None:
        out["video_max_frames"] = int(d["max_frames"])
    return out

  @property
  def factor(self) -> int:
    """Side multiple of resized images: one merged token covers factor^2."""
    return self.patch_size * self.merge_size


class VisionMeta(Protocol):
  """An image or video as prompt building sees it: kind, patch grid, timing.

  `ProcessedVision` holds the pixels too; the ShadowLoader's `MediaRef`
  (fluxjax/data/meta.py) only the metadata, its pixels decoded elsewhere
  until a batch is materialized.
  """

  @property
  def kind(self) -> str: ...

  @property
  def grid_thw(self) -> tuple[int, int, int]: ...

  @property
  def second_per_grid(self) -> float | None: ...


@dataclasses.dataclass
class ProcessedVision:
  """One image or video, ready for the vision tower.

  Attributes:
    patches: float32 [N, C * T * P * P] in HF's flattening order.
    grid_thw: (t, h, w) in patch units; N = t * h * w.
    second_per_grid: seconds one temporal grid step spans (videos), else None.
    kind: "image" or "video".
  """

  patches: np.ndarray
  grid_thw: tuple[int, int, int]
  second_per_grid: float | None
  kind: Kind


def smart_resize(
  height: int,
  width: int,
  factor: int = 28,
  min_pixels: int = 56 * 56,
  max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
  """HF's resize rule: sides multiple of factor, pixels in bounds, ratio kept.

  Args:
    height: input height in pixels.
    width: input width in pixels.
    factor: both output sides are multiples of this.
    min_pixels: lower bound on output height * width.
    max_pixels: upper bound on output height * width.

  Returns:
    (height, width) after resizing.

  Raises:
    ValueError: a side is below 1, or the aspect ratio exceeds 200.
  """
  if height < 1 or width < 1:
    raise ValueError(f"image size must be positive, got {height}x{width}")
  ratio = max(height, width) / min(height, width)
  if ratio > MAX_ASPECT_RATIO:
    raise ValueError(
      f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got"
      f" {ratio} ({height}x{width})"
    )
  # Python's round() (banker's rounding) on purpose: HF uses it too.
  h_bar = round(height / factor) * factor
  w_bar = round(width / factor) * factor
  if h_bar * w_bar > max_pixels:
    beta = math.sqrt((height * width) / max_pixels)
    h_bar = max(factor, math.floor(height / beta / factor) * factor)
    w_bar = max(factor, math.floor(width / beta / factor) * factor)
  elif h_bar * w_bar < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h_bar = math.ceil(height * beta / factor) * factor
    w_bar = math.ceil(width * beta / factor) * factor
  return h_bar, w_bar


def _video_max_pixels(num_frames: int, proc: VisionProcessorConfig) -> int:
  """Per-frame pixel cap of a video of num_frames sampled frames (HF resize)."""
  max_pixels = proc.video_max_pixels
  if proc.video_cap_pixels_per_frame:
    total_pixels = int(proc.video_max_tokens * proc.factor * proc.factor * 0.9)
    share = total_pixels * proc.temporal_patch_size // num_frames
    max_pixels = max(min(max_pixels, share), int(proc.video_min_pixels * 1.05))
  return max_pixels


def resized_size(
  kind: Kind,
  height: int,
  width: int,
  num_frames: int,
  proc: VisionProcessorConfig,
) -> tuple[int, int]:
  """The (height, width) that preprocessing resizes an image or video to.

  Args:
    kind: "image" or "video".
    height: input height in pixels.
    width: input width in pixels.
    num_frames: frames given to `preprocess_video` (1 for images).
    proc: the processor configuration.

  Returns:
    (height, width) in pixels, multiples of `proc.factor`.
  """
  if kind == "image":
    return smart_resize(height, width, proc.factor, proc.image_min_pixels, proc.image_max_pixels)
  if kind == "video":
    if num_frames < 1:
      raise ValueError(f"a video needs at least one frame, got {num_frames}")
    return smart_resize(
      height,
      width,
      proc.factor,
      proc.video_min_pixels,
      _video_max_pixels(num_frames, proc),
    )
  raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")


def grid_for_size(
  kind: Kind,
  height: int,
  width: int,
  num_frames: int,
  proc: VisionProcessorConfig,
) -> tuple[int, int, int]:
  """Patch grid (t, h, w) that preprocessing yields, from sizes alone.

  Args:
    kind: "image" or "video".
    height: input height in pixels.
    width: input width in pixels.
    num_frames: sampled frames of a video (1 for images).
    proc: the processor configuration.

  Returns:
    (t, h, w) in patch units, equal to `preprocess_*(...).grid_thw`.
  """
  if kind == "image" and num_frames != 1:
    raise ValueError(f"an image has one frame, got num_frames={num_frames}")
  h, w = resized_size(kind, height, width, num_frames, proc)
  t = -(-num_frames // proc.temporal_patch_size)  # ceil: frames are padded
  return t, h // proc.patch_size, w // proc.patch_size


def num_patches(grid_thw: Sequence[int]) -> int:
  """Patches of an image/video: t * h * w of its (t, h, w) patch grid."""
  t, h, w = (int(x) for x in grid_thw)
  return t * h * w


def num_vision_tokens(grid_thw: Sequence[int], merge_size: int = 2) -> int:
  """LLM tokens one image/video occupies after the merge_size^2 merger.

  Args:
    grid_thw: (t, h, w) patch grid, as preprocessing reports it.
    merge_size: side of the merger window.

  Returns:
    t * h * w // merge_size^2: the number of pad tokens its placeholder expands into.
  """
  t, h, w = (int(x) for x in grid_thw)
  if t <= 0 or h <= 0 or w <= 0:
    raise ValueError(f"grid {tuple(grid_thw)} must be positive")
  # The merger folds merge x merge patches into one token; a grid it cannot
  # tile has no valid token count.
  if h % merge_size or w % merge_size:
    raise ValueError(
      f"grid {tuple(grid_thw)}: h and w must be multiples of merge_size={merge_size}"
    )
  return t * h * w // merge_size**2


def to_rgb(image: PIL.Image.Image | np.ndarray) -> PIL.Image.Image:
  """RGB PIL image, alpha composited onto white (HF's `convert_to_rgb`)."""
  if isinstance(image, PIL.Image.Image):
    if "A" in image.getbands() or image.info.get("transparency") is not None:
      rgba = image.convert("RGBA")
      white = PIL.Image.new("RGBA", rgba.size, (255, 255, 255, 255))
      return PIL.Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
  if not isinstance(image, np.ndarray):
    raise ValueError(f"image must be a PIL image or numpy array, got {type(image).__name__}")
  if image.dtype != np.uint8:
    raise ValueError(f"image array must be uint8, got {image.dtype}")
  if image.ndim == 2:
    image = image[:, :, None]
  if image.ndim != 3 or image.shape[-1] not in (1, 3, 4):
    raise ValueError(
      f"image array must be [H, W] or [H, W, C] with C in (1, 3, 4), got shape {image.shape}"
    )
  if image.shape[-1] == 1:
    image = np.repeat(image, 3, axis=-1)
  elif image.shape[-1] == 4:
    # HF blends arrays numerically (not with PIL), rounding to uint8.
    alpha = image[..., 3:4] / 255
    blended = alpha * image[..., :3] + (1 - alpha) * 255
    image = np.round(blended).astype(np.uint8)
  return PIL.Image.fromarray(np.ascontiguousarray(image))


def _normalize(pixels_HWC: np.ndarray, proc: VisionProcessorConfig) -> np.ndarray:
  """uint8 -> float32 (x * scale - mean) / std, as HF's PIL backend does."""
  # HF rescales in float64 and casts to float32 before normalizing in float32;
  # doing the same keeps the parity exact rather than within rounding.
  x = (pixels_HWC.astype(np.float64) * proc.rescale_factor).astype(np.float32)
  mean = np.asarray(proc.image_mean, dtype=np.float32)
  std = np.asarray(proc.image_std, dtype=np.float32)
  return (x - mean) / std


def _patchify(frames_FHWC: np.ndarray, proc: VisionProcessorConfig) -> np.ndarray:
  """HF's flattening of normalized frames into [N, C*T*P*P] patches.

  Args:
    frames_FHWC: float32 frames, F a multiple of temporal_patch_size and H, W
      multiples of patch_size * merge_size.
    proc: the processor configuration.

  Returns:
    float32 [N, C * T * P * P], rows ordered (t, h_block, w_block, h_in, w_in)
    so that each merge_size^2 group of rows is one merged token.
  """
  f, height, width, c = frames_FHWC.shape
  p, m, tp = proc.patch_size, proc.merge_size, proc.temporal_patch_size
  gt, gh, gw = f // tp, height // p, width // p
  frames_FCHW = frames_FHWC.transpose(0, 3, 1, 2)
  x = frames_FCHW.reshape(gt, tp, c, gh // m, m, p, gw // m, m, p)
  # -> (gt, gh/m, gw/m, m_h, m_w, C, T, P_h, P_w): HF's video permutation.
  x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
  return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tp * p * p))


def preprocess_image(
  image: PIL.Image.Image | np.ndarray, proc: VisionProcessorConfig
) -> ProcessedVision:
  """Resize, normalize and patchify one image as Qwen2VLImageProcessorPil does.

  Args:
    image: a PIL image (any mode) or a uint8 [H, W] / [H, W, C] array.
    proc: the processor configuration.

  Returns:
    The patches, with grid (1, h, w); the image fills every temporal slot.
  """
  rgb = to_rgb(image)
  width, height = rgb.size
  new_h, new_w = resized_size("image", height, width, 1, proc)
  if (new_h, new_w) != (height, width):
    rgb = rgb.resize((new_w, new_h), resample=proc.resample)
  pixels_HWC = _normalize(np.asarray(rgb), proc)
  frames_FHWC = np.broadcast_to(pixels_HWC[None], (proc.temporal_patch_size, *pixels_HWC.shape))
  patches_ND = _patchify(frames_FHWC, proc)
  grid = (1, new_h // proc.patch_size, new_w // proc.patch_size)
  return ProcessedVision(patches_ND, grid, None, "image")


def preprocess_video(
  frames_FHWC: np.ndarray, proc: VisionProcessorConfig, fps: float
) -> ProcessedVision:
  """Resize, normalize and patchify sampled frames as Qwen2VLVideoProcessor.

  HF resizes videos with torchvision (bicubic, antialiased); this uses PIL's
  bicubic, which torchvision's uint8 antialias path was ported from, so pixels
  can differ by a rounding step. The resize rule, padding and layout are HF's.

  Args:
    frames_FHWC: uint8 RGB frames [F, H, W, 3], already sampled.
    proc: the processor configuration.
    fps: frame rate of the sampled frames (sets `second_per_grid`).

  Returns:
    The patches with grid (ceil(F / T), h, w); F is padded to a multiple of T
    by repeating the last frame.
  """
  if not isinstance(frames_FHWC, np.ndarray):
    raise ValueError(f"frames must be a numpy array, got {type(frames_FHWC).__name__}")
  if frames_FHWC.dtype != np.uint8:
    raise ValueError(f"frames must be uint8, got {frames_FHWC.dtype}")
  if frames_FHWC.ndim != 4 or frames_FHWC.shape[-1] != 3:
    raise ValueError(f"frames must be [F, H, W, 3], got {frames_FHWC.shape}")
  num_frames, height, width, _ = frames_FHWC.shape
  if num_frames == 0:
    raise ValueError("a video needs at least one frame, got 0")
  if not (math.isfinite(fps) and fps > 0):
    raise ValueError(f"fps must be positive and finite, got {fps}")
  new_h, new_w = resized_size("video", height, width, num_frames, proc)
  tp = proc.temporal_patch_size
  padded_f = -(-num_frames // tp) * tp
  out_FHWC = np.empty((padded_f, new_h, new_w, 3), np.float32)
  for i, frame_HWC in enumerate(frames_FHWC):
    if (new_h, new_w) != (height, width):
      frame = PIL.Image.fromarray(np.ascontiguousarray(frame_HWC))
      frame_HWC = np.asarray(frame.resize((new_w, new_h), proc.resample))
    out_FHWC[i] = _normalize(frame_HWC, proc)
  # HF pads with copies of the last frame so the temporal grid is whole.
  out_FHWC[num_frames:] = out_FHWC[num_frames - 1]
  patches_ND = _patchify(out_FHWC, proc)
  grid = (padded_f // tp, new_h // proc.patch_size, new_w // proc.patch_size)
  return ProcessedVision(patches_ND, grid, tp / fps, "video")
