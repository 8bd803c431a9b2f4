"""Sequence-length mixtures for the balance benchmark, drawn from documented models.

A length is what the trainer packs: chat-template tokens + prompt text +
vision tokens + response. Vision tokens are not guessed: they come from the
Qwen2.5-VL resize rule (`fluxjax.models.processor.grid_for_size`, which
reproduces transformers / qwen-vl-utils) applied to a sampled image size or
video duration and resolution. What no paper states (image sizes, durations,
resolutions, text and response lengths) is a log-normal with a stated median
and p99, clipped to stated bounds; every such assumption is marked ASSUMED
below so it can be replaced when real metadata is at hand.

Sources:
  FlexRL (ICLR 2026), section 5.1 and Table 2: the three RL mixes of Geo3K
    (image), NExTQA (short video) and LongVILA-Reason (long video) with
    sampling weights 5:2:1 (image-heavy), 1:2:5 (video-heavy) and
    LongVILA-Reason only (only-video); GRPO with at most 1024 response tokens;
    at most 64/128/256 video frames (7B runs: image-heavy mostly 128,
    video-heavy and only-video mostly 64, our defaults). The paper gives no
    token-count statistics beyond its Figure 3 histogram.
  Geo3K (Lu et al., 2021, Inter-GPS): one geometry diagram per problem.
  NExT-QA (Xiao et al., 2021): 5,440 videos averaging 44 s, multiple choice.
  LongVILA-Reason (Chen et al., 2025): long videos (minutes) with reasoning
    QA; at 2 fps every video over max_frames / 2 seconds hits the frame cap,
    so the frame cap and resolution, not the duration, set its length.
  ODC (parameter server revisited), section 5, Appendix E and Table 6:
    LongAlign SFT with max length 64K whose 1/8-truncated variant has max 8K
    and mean 2K, i.e. mean about 16K; its bubble rates calibrate the spread.

Every function takes a seed or a numpy Generator and is deterministic.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from fluxjax.data import distributions
from fluxjax.models import processor

# <|im_start|>system ... <|im_end|> <|im_start|>user <|vision_start|> ...
# <|vision_end|> ... <|im_end|> <|im_start|>assistant: Qwen's default chat
# template around one media item, about 24 tokens.
TEMPLATE_TOKENS = 24
MAX_RESPONSE = 1024  # FlexRL section 5.1

# The published Qwen2.5-VL preprocessor_config.json image bounds; video bounds
# are the transformers / qwen-vl-utils defaults (768 merged tokens per frame
# pair, a 128K-token whole-video budget), which FlexRL does not say it changes.
_PROCESSOR = processor.VisionProcessorConfig(image_min_pixels=56 * 56, image_max_pixels=12845056)


LogNormal = distributions.LogNormal


# ASSUMED: Geo3K prompts are a short problem statement plus a reasoning
# instruction; diagrams are small line drawings (longer side ~420 px).
GEO3K_TEXT = LogNormal(median=110, p99=320, lo=30, hi=1024)
GEO3K_LONG_SIDE = distributions.GEO3K_LONG_SIDE
GEO3K_RESPONSE = LogNormal(median=450, p99=1600, lo=16, hi=MAX_RESPONSE)
# NExT-QA: mean duration 44 s (Xiao et al.); median 40 s and p99 115 s give a
# log-normal mean of 44 s. ASSUMED: half 640x480, half 640x360 (VidOR sources).
NEXTQA_SECONDS = distributions.NEXTQA_SECONDS
NEXTQA_RESOLUTIONS = distributions.NEXTQA_RESOLUTIONS
NEXTQA_TEXT = LogNormal(median=90, p99=220, lo=30, hi=512)
NEXTQA_RESPONSE = LogNormal(median=300, p99=1400, lo=16, hi=MAX_RESPONSE)
# LongVILA-Reason. ASSUMED: median 5 min, p99 30 min; 16:9 sources at
# 360p/480p/720p/1080p with probabilities 0.2/0.3/0.4/0.1.
LONGVILA_SECONDS = distributions.LONGVILA_SECONDS
LONGVILA_RESOLUTIONS = distributions.LONGVILA_RESOLUTIONS
LONGVILA_RES_P = distributions.LONGVILA_RES_P
LONGVILA_TEXT = LogNormal(median=150, p99=420, lo=40, hi=1024)
LONGVILA_RESPONSE = LogNormal(median=500, p99=1600, lo=16, hi=MAX_RESPONSE)
SOURCE_FPS = 30  # ASSUMED: frame rate of the source files

# long_context_sft: log-normal(mu = ln 9000, sigma = 1.1) truncated to
# [4096, 65536] by redrawing: mean ~16.4K, median ~12K, p99 ~60K. Max and mean
# are ODC's LongAlign figures; sigma and the floor were then chosen so that the
# 7B cost model gives ODC Table 6's minibatch-1 bubble rate on 8 devices
# (63.85%; we get ~64%). The floor sits below LongAlign-10k's 8K: a fit with
# an 8K floor and the same mean (sigma 0.7) gives only ~54%, so ODC's lengths
# must spread wider than 8K-64K.
SFT_MEDIAN, SFT_SIGMA, SFT_MIN, SFT_MAX = 9000.0, 1.1, 4096, 65536


def _rng(seed: int | np.random.Generator) -> np.random.Generator:
  return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


@functools.cache
def _video_tokens(height: int, width: int, seconds: int, max_frames: int) -> int:
  """Vision tokens of a video: 2 fps clamped to [4, max_frames], even count."""
  total = seconds * SOURCE_FPS
  cfg = dataclasses.replace(_PROCESSOR, video_max_frames=max_frames)
  # The frame-count rule of fluxjax.models.media.sample_frame_indices.
  tp = cfg.temporal_patch_size
  cap = math.floor(min(cfg.video_max_frames, total) / tp) * tp
  count = min(max(seconds * cfg.video_fps, cfg.video_min_frames), cap, total)
  frames = math.floor(count / tp) * tp
  return processor.num_vision_tokens(processor.grid_for_size("video", height, width, frames, cfg))


def _image_tokens(height: int, width: int) -> int:
  return processor.num_vision_tokens(processor.grid_for_size("image", height, width, 1, _PROCESSOR))


def geo3k(n: int, seed: int | np.random.Generator = 0) -> np.ndarray:
  """Geo3K-like lengths: one diagram, a short problem, a reasoning response."""
  rng = _rng(seed)
  long_side = GEO3K_LONG_SIDE.sample(rng, n)
  aspect = rng.uniform(0.5, 1.0, n)  # ASSUMED: short/long side ratio
  text = GEO3K_TEXT.sample(rng, n)
  resp = GEO3K_RESPONSE.sample(rng, n)
  vision = np.array(
    [_image_tokens(max(1, round(a * s)), round(s)) for s, a in zip(long_side, aspect)],
    dtype=np.int64,
  )
  return TEMPLATE_TOKENS + text.astype(np.int64) + vision + resp.astype(np.int64)


def _videos(n, rng, seconds, resolutions, res_p, text, response, max_frames):
  secs = seconds.sample(rng, n)
  res = rng.choice(len(resolutions), size=n, p=res_p)
  t = text.sample(rng, n)
  r = response.sample(rng, n)
  vision = np.array(
    [_video_tokens(*resolutions[i], round(s), max_frames) for s, i in zip(secs, res)],
    dtype=np.int64,
  )
  return TEMPLATE_TOKENS + t.astype(np.int64) + vision + r.astype(np.int64)


def nextqa(n: int, seed: int | np.random.Generator = 0, max_frames: int = 64) -> np.ndarray:
  """NExT-QA-like lengths: a ~44 s video at 2 fps, a multiple-choice question."""
  return _videos(
    n,
    _rng(seed),
    NEXTQA_SECONDS,
    NEXTQA_RESOLUTIONS,
    (0.5, 0.5),
    NEXTQA_TEXT,
    NEXTQA_RESPONSE,
    max_frames,
  )


def longvila_reason(
  n: int, seed: int | np.random.Generator = 0, max_frames: int = 64
) -> np.ndarray:
  """LongVILA-Reason-like lengths: a long video (frame-capped) and a reasoning answer."""
  return _videos(
    n,
    _rng(seed),
    LONGVILA_SECONDS,
    LONGVILA_RESOLUTIONS,
    LONGVILA_RES_P,
    LONGVILA_TEXT,
    LONGVILA_RESPONSE,
    max_frames,
  )


def mixture(
  n: int,
  weights: tuple[float, float, float],
  seed: int | np.random.Generator = 0,
  max_frames: int = 64,
) -> np.ndarray:
  """Lengths drawn from Geo3K : NExTQA : LongVILA-Reason with the given weights.

  Args:
    n: number of sequences.
    weights: relative sampling weights of the three datasets.
    seed: an int seed or a numpy Generator.
    max_frames: the video frame cap.

  Returns:
    int64 lengths [n]; the dataset of each sequence is drawn independently.
  """
  rng = _rng(seed)
  p = np.asarray(weights, dtype=np.float64)
  which = rng.choice(3, size=n, p=p / p.sum())
  out = np.zeros(n, dtype=np.int64)
  draws = (
    geo3k,
    lambda m, g: nextqa(m, g, max_frames),
    lambda m, g: longvila_reason(m, g, max_frames),
  )
  for d, draw in enumerate(draws):
    idx = np.flatnonzero(which == d)
    if idx.size:
      out[idx] = draw(idx.size, rng)
  return out


def image_heavy(n: int, seed: int | np.random.Generator = 0, max_frames: int = 128) -> np.ndarray:
  """FlexRL's Image-Heavy mix: Geo3K : NExTQA : LongVILA-Reason = 5 : 2 : 1."""
  return mixture(n, (5, 2, 1), seed, max_frames)


def video_heavy(n: int, seed: int | np.random.Generator = 0, max_frames: int = 64) -> np.ndarray:
  """FlexRL's Video-Heavy mix: Geo3K : NExTQA : LongVILA-Reason = 1 : 2 : 5."""
  return mixture(n, (1, 2, 5), seed, max_frames)


def only_video(n: int, seed: int | np.random.Generator = 0, max_frames: int = 64) -> np.ndarray:
  """FlexRL's Only-Video setting: LongVILA-Reason alone."""
  return longvila_reason(n, seed, max_frames)


def long_context_sft(n: int, seed: int | np.random.Generator = 0) -> np.ndarray:
  """ODC's long-context SFT (LongAlign-like): 4K-64K tokens, mean ~16K.

  Args:
    n: number of sequences.
    seed: an int seed or a numpy Generator.

  Returns:
    int64 lengths [n], redrawn until inside [SFT_MIN, SFT_MAX].
  """
  rng = _rng(seed)
  out = np.empty(n)
  todo = np.arange(n)
  while todo.size:
    x = SFT_MEDIAN * np.exp(SFT_SIGMA * rng.standard_normal(todo.size))
    out[todo] = x
    todo = todo[(x < SFT_MIN) | (x > SFT_MAX)]
  return out.astype(np.int64)


MIXTURES = {
  "image_heavy": image_heavy,
  "video_heavy": video_heavy,
  "only_video": only_video,
  "long_context_sft": long_context_sft,
}
