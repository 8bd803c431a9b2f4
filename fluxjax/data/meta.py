"""Sample metadata without pixels: `SampleMeta`, `MediaRef` and header probing.

`MediaRef` is FlexRL's FakeTensor: an image or video described by its file,
its size and the patch grid the processor's resize rule gives it, with
`slice()` over temporal groups so a planner can split a video and a
materializer fetch only the frames one device needs. It is a media item for
`fluxjax.models.inputs` and `fluxjax.parallel.batch` (`kind`, `grid_thw`,
`second_per_grid`, `id`). Probing reads headers only and is cached per file
(path, size, mtime), so the controller never decodes or holds pixels.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

from fluxjax.models import media as media_lib
from fluxjax.models import processor
from fluxjax.settings import MediaLimits


@dataclasses.dataclass(frozen=True)
class MediaRef:
  """An image or video (or a slice of one) known by metadata only.

  Attributes:
    media_id: store key of the whole item (sample uid / position).
    kind: "image" or "video".
    path: the file.
    height: source height in pixels (after EXIF rotation).
    width: source width in pixels.
    frames: frames in the file (1 for an image).
    fps: the file's frame rate (None for an image).
    sampled_frames: frames the processor keeps (1 for an image).
    full_grid: (t, h, w) patch grid of the whole item.
    second_per_grid: seconds per temporal grid step (videos), else None.
    t_start: first temporal group of this slice.
    t_stop: one past its last temporal group.
  """

  media_id: str
  kind: processor.Kind
  path: str
  height: int
  width: int
  frames: int
  fps: float | None
  sampled_frames: int
  full_grid: tuple[int, int, int]
  second_per_grid: float | None
  t_start: int = 0
  t_stop: int = -1

  def __post_init__(self):
    if self.t_stop < 0:
      object.__setattr__(self, "t_stop", self.full_grid[0])
    if not 0 <= self.t_start < self.t_stop <= self.full_grid[0]:
      raise ValueError(
        f"temporal slice [{self.t_start}:{self.t_stop}] outside grid {self.full_grid}"
      )

  @property
  def id(self) -> str:
    """Unique name of this item or slice (the store key plus the slice)."""
    if self.is_whole:
      return self.media_id
    return f"{self.media_id}[{self.t_start}:{self.t_stop}]"

  @property
  def is_whole(self) -> bool:
    return self.t_start == 0 and self.t_stop == self.full_grid[0]

  @property
  def grid_thw(self) -> tuple[int, int, int]:
    _, h, w = self.full_grid
    return self.t_stop - self.t_start, h, w

  @property
  def num_patches(self) -> int:
    return processor.num_patches(self.grid_thw)

  def num_tokens(self, merge_size: int = 2) -> int:
    """LLM pad tokens of this item after the merge_size^2 merger."""
    return processor.num_vision_tokens(self.grid_thw, merge_size)

  @property
  def patch_rows(self) -> tuple[int, int]:
    """[start, stop) rows of the whole item's patches that this slice holds."""
    _, h, w = self.full_grid
    return self.t_start * h * w, self.t_stop * h * w

  def nbytes(self, patch_dim: int) -> int:
    """float32 bytes of the whole item's patches (what a worker stores)."""
    return processor.num_patches(self.full_grid) * patch_dim * 4

  def slice(self, frames: slice | tuple[int, int]) -> MediaRef:
    """The sub-item of some temporal groups (FlexRL's FakeTensor `shard`).

    Args:
      frames: a `slice` or (start, stop) over this item's temporal groups
        (pairs of sampled frames at temporal_patch_size 2); step must be 1.

    Returns:
      A MediaRef for those groups, with grid (stop - start, h, w).
    """
    if isinstance(frames, tuple):
      frames = slice(*frames)
    start, stop, step = frames.indices(self.t_stop - self.t_start)
    if step != 1 or stop <= start:
      raise ValueError(f"need a non-empty contiguous slice, got {frames}")
    return dataclasses.replace(self, t_start=self.t_start + start, t_stop=self.t_start + stop)


@dataclasses.dataclass(frozen=True)
class SampleMeta:
  """One prompt with its media as metadata.

  Attributes:
    uid: position in the sample stream (unique across epochs).
    id: the dataset row's id.
    prompt: prompt text.
    answer: reference answer for the reward, or None.
    source: dataset name of the row.
    media: images and videos in prompt order.
    error: why the sample cannot be used (probing failed), else None.
    difficulty: the row's difficulty label ("" = none), for evaluation.
    task: the row's task name ("" = none), for evaluation.
    solution: the reference reasoning before the answer ("" = none), which
      the SFT warm-up teaches.
    extra: the row's other fields (JSON values), for a reward that asks for
      them (rl/reward_spec.py).
    turns: the chat as the row gave it, each media item a {"type": kind}
      part where it stands (data/readers.py); () = one user turn of `prompt`
      after the media.
  """

  uid: int
  id: str
  prompt: str
  answer: str | None
  source: str = ""
  media: tuple[MediaRef, ...] = ()
  error: str | None = None
  difficulty: str = ""
  task: str = ""
  solution: str = ""
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  turns: tuple[Mapping[str, Any], ...] = ()

  def messages(self) -> list[dict]:
    """Chat messages for `fluxjax.models.inputs.sequence_from_chat`."""
    if self.turns:
      return [{"role": t["role"], "content": [dict(p) for p in t["content"]]} for t in self.turns]
    content: list[dict[str, str]] = [{"type": m.kind} for m in self.media]
    content.append({"type": "text", "text": self.prompt})
    return [{"role": "user", "content": content}]

  def num_vision_tokens(self, merge_size: int = 2) -> int:
    return sum(m.num_tokens(merge_size) for m in self.media)


def _stat_key(path: str) -> tuple[str, int, int]:
  try:
    st = os.stat(path)
  except OSError:
    # A missing file: let the probe raise its MediaError (not cached).
    return path, -1, -1
  return path, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=65536)
def _probe_cached(kind: str, path: str, size: int, mtime_ns: int, limits: MediaLimits):
  del size, mtime_ns  # only part of the cache key: a rewritten file re-probes
  if kind == "image":
    return media_lib.probe_image(path)
  return media_lib.probe_video(path, limits)


def probe(kind: str, path: str, limits: MediaLimits = media_lib.DEFAULT_LIMITS):
  """Header facts of a file, cached by (path, size, mtime, limits).

  Args:
    kind: "image" or "video".
    path: the file.
    limits: bounds the frames counted in a video without a frame count.

  Returns:
    (height, width) for an image, `media.VideoInfo` for a video.

  Raises:
    MediaError: the file is missing or its header is unreadable.
  """
  return _probe_cached(kind, *_stat_key(path), limits)


def probe_cache_info():
  return _probe_cached.cache_info()


def media_ref(
  media_id: str,
  kind: processor.Kind,
  path: str,
  proc: processor.VisionProcessorConfig,
  limits: MediaLimits = media_lib.DEFAULT_LIMITS,
) -> MediaRef:
  """A MediaRef from a file's headers and the processor's resize rule.

  Raises:
    MediaError: unreadable header, or a size outside `limits` or the
      processor's rule (e.g. aspect ratio above 200).
  """
  if kind == "image":
    height, width = probe(kind, path, limits)
    frames, fps, sampled = 1, None, 1
  elif kind == "video":
    info = probe(kind, path, limits)
    height, width, frames, fps = info.height, info.width, info.num_frames, info.fps
    indices, sampled_fps = media_lib.sample_frame_indices(frames, fps, proc)
    sampled = len(indices)
  else:
    raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
  media_lib.check_size(path, kind, height, width, limits, frames=frames, sampled_frames=sampled)
  try:
    grid = processor.grid_for_size(kind, height, width, sampled, proc)
  except ValueError as e:
    raise media_lib.MediaError(path, f"size rejected by processor: {e}") from e
  spg = proc.temporal_patch_size / sampled_fps if kind == "video" else None
  return MediaRef(media_id, kind, path, height, width, frames, fps, sampled, grid, spg)


class ToMeta:
  """(stream index, normalized row) -> SampleMeta; a Grain map with index.

  Probing failures do not raise: they come back as `SampleMeta.error` so the
  loader can count, log and replace the sample.
  """

  def __init__(
    self, proc: processor.VisionProcessorConfig, limits: MediaLimits = media_lib.DEFAULT_LIMITS
  ):
    self.proc = proc
    self.limits = limits

  def __call__(self, index: int, row: dict) -> SampleMeta:
    base = SampleMeta(
      uid=int(index),
      id=row["id"],
      prompt=row["prompt"],
      answer=row.get("answer"),
      source=row.get("source", ""),
      difficulty=row.get("difficulty", ""),
      task=row.get("task", ""),
      solution=row.get("solution", ""),
      extra=row.get("extra", {}),
      turns=tuple(row.get("turns", ())),
    )
    if row.get("error"):
      return dataclasses.replace(base, error=row["error"])
    images, videos = list(row.get("images", ())), list(row.get("videos", ()))
    order = row.get("media_order") or ["image"] * len(images) + ["video"] * len(videos)
    if (order.count("image"), order.count("video")) != (len(images), len(videos)):
      why = f"media_order {order} does not match {len(images)} images and {len(videos)} videos"
      return dataclasses.replace(base, error=why)
    paths = {"image": iter(images), "video": iter(videos)}
    items: list[tuple[processor.Kind, str]] = [
      ("image", next(paths["image"])) if k == "image" else ("video", next(paths["video"]))
      for k in order
    ]
    try:
      media = tuple(
        media_ref(f"{index}/{k}", kind, path, self.proc, self.limits)
        for k, (kind, path) in enumerate(items)
      )
    except media_lib.MediaError as e:
      return dataclasses.replace(base, error=f"{e.path}: {e.reason}")
    return dataclasses.replace(base, media=media)
