"""Decoding and header-only probing of image and video files (PIL, PyAV).

Probing reads headers only, so the metadata pipeline can count vision tokens
without pixels; loading decodes and is done by preprocessor workers (and by a
rollout server for the media of a request). Every failure of one file
(missing, unsupported, corrupt, truncated, over budget, or any exception the
decoders raise) surfaces as one exception type, `MediaError`, so callers can
count and skip the sample: `bad_file` is the one rule that decides it. Size
budgets (`MediaLimits`) are checked from the header before any pixel buffer
is allocated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Iterator

import av
import numpy as np
import PIL.Image
import PIL.ImageOps

from fluxjax.models import processor
from fluxjax.settings import MediaLimits

# EXIF orientations 5-8 rotate by 90 degrees, swapping height and width.
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)


class MediaError(Exception):
  """An image or video that cannot be probed, decoded or preprocessed.

  Attributes:
    path: the file.
    reason: what went wrong, for logs and skip counters.
  """

  def __init__(self, path: str | os.PathLike, reason: str):
    self.path = os.fspath(path)
    self.reason = reason
    super().__init__(f"{self.path}: {reason}")


@contextlib.contextmanager
def bad_file(path: str | os.PathLike, what: str) -> Iterator[None]:
  """The one rule for "this file is bad": any `Exception` becomes `MediaError`.

  Decoders raise whatever they like (PIL: OSError, SyntaxError, ValueError,
  struct.error, DecompressionBombError...; PyAV: FFmpegError subclasses;
  numpy and the processor: ValueError), so no list of types is complete.
  Everything that is an `Exception` while reading one file is that file's
  fault and is reported with its type in the reason; `MediaError` passes
  through unchanged. `KeyboardInterrupt` and `SystemExit` are not `Exception`
  and propagate.

  `MemoryError` is a bad file too: the header budgets (`check_size`) should
  keep a decode within memory, so an allocation that still fails means the
  file's data asked for more than its header said. The failed allocation
  holds nothing, so the caller can go on with the next file.

  Args:
    path: the file being read.
    what: the operation, completing "cannot ..." (e.g. "decode image").
  """
  try:
    yield
  except MediaError:
    raise
  except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning) as e:
    # PIL's own header check (Image.MAX_IMAGE_PIXELS), a second guard behind
    # MediaLimits.max_image_pixels.
    raise MediaError(path, f"header size exceeds PIL's decompression-bomb limit ({e})") from e
  except MemoryError as e:
    raise MediaError(path, f"out of memory: cannot {what} (MemoryError: {e})") from e
  except Exception as e:
    raise MediaError(path, f"cannot {what}: {type(e).__name__}: {e}") from e


# The size budgets every decode checks are the run's `data.limits` section
# (settings.MediaLimits); a decode outside a run takes their defaults.
DEFAULT_LIMITS = MediaLimits()


@dataclasses.dataclass(frozen=True)
class VideoInfo:
  """Header facts about a video's first video stream.

  Attributes:
    num_frames: frames in the stream.
    fps: average frame rate.
    height: decoded frame height in pixels.
    width: decoded frame width in pixels.
    duration_s: stream duration in seconds.
    codec: codec name, e.g. "h264".
  """

  num_frames: int
  fps: float
  height: int
  width: int
  duration_s: float
  codec: str


def check_size(
  path: str | os.PathLike,
  kind: processor.Kind,
  height: int,
  width: int,
  limits: MediaLimits,
  *,
  frames: int = 1,
  sampled_frames: int = 1,
) -> None:
  """Raises MediaError when a file's header size is outside `limits`.

  Args:
    path: the file (for the error).
    kind: "image" or "video".
    height, width: the image's or a frame's size from the header.
    limits: the budgets.
    frames: frames in the file (videos).
    sampled_frames: frames a decode keeps (videos).
  """
  if min(height, width) < limits.min_side:
    raise MediaError(path, f"side below the limit {limits.min_side}: {height}x{width}")
  pixels = height * width
  if kind == "image":
    if pixels > limits.max_image_pixels:
      raise MediaError(
        path, f"{height}x{width} image exceeds the limit of {limits.max_image_pixels} pixels"
      )
    return
  if frames > limits.max_video_frames:
    raise MediaError(path, f"{frames} frames exceed the limit {limits.max_video_frames}")
  if pixels > limits.max_frame_pixels:
    raise MediaError(
      path, f"{height}x{width} frames exceed the limit of {limits.max_frame_pixels} pixels"
    )
  if sampled_frames * pixels > limits.max_sampled_video_pixels:
    raise MediaError(
      path,
      f"{sampled_frames} sampled frames of {height}x{width} exceed the limit of"
      f" {limits.max_sampled_video_pixels} pixels",
    )


def _check_file(path: str | os.PathLike) -> None:
  # A FIFO or device would block the decoder forever; only plain files pass.
  if not os.path.exists(path):
    raise MediaError(path, "file not found")
  if not os.path.isfile(path):
    raise MediaError(path, "not a regular file")


def load_image(path: str | os.PathLike, limits: MediaLimits = DEFAULT_LIMITS) -> PIL.Image.Image:
  """Decodes an image fully into RGB.

  EXIF orientation is applied (as transformers' `load_image` does) and alpha
  is composited onto white (as the Qwen2-VL processor does). The header's
  size is checked against `limits` before the pixels are decoded.

  Args:
    path: image file.
    limits: size budgets.

  Returns:
    A loaded RGB PIL image.

  Raises:
    MediaError: missing, unreadable, truncated or oversized file.
  """
  _check_file(path)
  with bad_file(path, "decode image"), PIL.Image.open(path) as image:
    # PIL.Image.open parsed the header only: nothing is allocated yet.
    check_size(path, "image", image.height, image.width, limits)
    # load() decodes every byte, so a truncated file fails here, not later.
    image.load()
    return processor.to_rgb(PIL.ImageOps.exif_transpose(image))


def _header_orientation(image: PIL.Image.Image) -> int:
  """The EXIF orientation found in an open image's header, without decoding."""
  if image.format == "PNG" and "exif" not in image.info:
    # PNG's getexif() decodes the whole image to look for an eXIf chunk after
    # the pixel data (where the PNG spec does not put it); only one before
    # them is read here.
    return 1
  return image.getexif().get(_EXIF_ORIENTATION, 1)


def probe_image(path: str | os.PathLike) -> tuple[int, int]:
  """Reads an image's (height, width) from its header, without decoding.

  Args:
    path: image file.

  Returns:
    (height, width) as `load_image` returns it (EXIF rotation applied).

  Raises:
    MediaError: missing or unrecognized file.
  """
  _check_file(path)
  # PIL.Image.open parses the header and defers decoding to load().
  with bad_file(path, "read image header"), PIL.Image.open(path) as image:
    width, height = image.size
    orientation = _header_orientation(image)
  if width < 1 or height < 1:
    raise MediaError(path, f"empty image {height}x{width}")
  if orientation in _TRANSPOSING_ORIENTATIONS:
    return width, height
  return height, width


@contextlib.contextmanager
def _open_video(
  path: str | os.PathLike,
) -> Iterator[tuple[av.container.InputContainer, av.VideoStream]]:
  """An open container and its first video stream, closed on exit."""
  _check_file(path)
  with bad_file(path, "open video"):
    container = av.open(os.fspath(path), mode="r")
  with container:
    if not container.streams.video:
      raise MediaError(path, "no video stream")
    yield container, container.streams.video[0]


def _count_frames(path, container, stream, max_frames: int) -> int:
  """Frames of a stream whose header has no count: packets, demuxed, not decoded."""
  frames = 0
  for packets, packet in enumerate(container.demux(stream), start=1):
    frames += bool(packet.size)
    # Every packet counts toward the bound (the last, empty one flushes), so a
    # demuxer that yields empty packets forever still stops.
    if packets > max_frames + 1:
      raise MediaError(path, f"frames exceed the limit {max_frames} (counting packets)")
  container.seek(0)
  return frames


def _probe_open(path, container, stream, limits: MediaLimits) -> VideoInfo:
  """VideoInfo from an open container, header first, demux as a fallback."""
  rate = stream.average_rate or stream.guessed_rate or stream.base_rate
  fps = float(rate) if rate else 0.0
  if not (math.isfinite(fps) and fps > 0):
    raise MediaError(path, f"unknown frame rate {rate}")
  num_frames = stream.frames
  if num_frames <= 0:
    # Some containers (Matroska, MPEG-TS) store no frame count. Count packets:
    # this demuxes but decodes nothing, and it is exact where the duration
    # estimate is not (load_video must find every frame it was promised).
    num_frames = _count_frames(path, container, stream, limits.max_video_frames)
  if num_frames <= 0:
    raise MediaError(path, "video stream has no frames")
  if stream.duration and stream.time_base:
    duration_s = float(stream.duration * stream.time_base)
  elif container.duration:
    duration_s = container.duration / av.time_base
  else:
    duration_s = num_frames / fps
  height, width = stream.codec_context.height, stream.codec_context.width
  if height < 1 or width < 1:
    raise MediaError(path, f"bad frame size {height}x{width}")
  return VideoInfo(
    num_frames=int(num_frames),
    fps=fps,
    height=int(height),
    width=int(width),
    duration_s=duration_s,
    codec=stream.codec_context.name,
  )


def probe_video(path: str | os.PathLike, limits: MediaLimits = DEFAULT_LIMITS) -> VideoInfo:
  """Reads a video's frame count, rate and size from its headers.

  Nothing is decoded. Where the container stores no frame count, packets are
  counted by demuxing (still no decode), at most `limits.max_video_frames`.

  Args:
    path: video file.
    limits: bounds the packet count.

  Returns:
    The stream's VideoInfo.

  Raises:
    MediaError: missing, unsupported or unreadable file.
  """
  with bad_file(path, "read video header"), _open_video(path) as (container, stream):
    return _probe_open(path, container, stream, limits)


def sample_frame_indices(
  num_frames: int, video_fps: float, proc: processor.VisionProcessorConfig
) -> tuple[np.ndarray, float]:
  """Which frames to keep, following HF `Qwen2VLVideoProcessor.sample_frames`.

  proc.video_fps frames per second, clamped to [min_frames, max_frames] and the
  video length, floored to a multiple of temporal_patch_size, evenly spaced.

  Two deliberate departures from HF: HF's `torch.arange(0, n, n / k)` returns
  k + 1 indices (the last one out of range) when n / (n / k) rounds above k;
  exactly k are returned here, equal to HF's first k. And a video shorter than
  temporal_patch_size keeps all its frames where HF divides by zero
  (preprocessing then pads by repeating the last frame).

  Args:
    num_frames: frames in the video.
    video_fps: the video's frame rate.
    proc: the processor configuration.

  Returns:
    (indices, sampled_fps): sorted int64 frame indices and the frame rate of
      the sampled frames (len(indices) / num_frames * video_fps).
  """
  if num_frames < 1:
    raise ValueError(f"num_frames must be positive, got {num_frames}")
  if not (math.isfinite(video_fps) and video_fps > 0):
    raise ValueError(f"video_fps must be positive and finite, got {video_fps}")
  tp = proc.temporal_patch_size
  max_frames = math.floor(min(proc.video_max_frames, num_frames) / tp) * tp
  count = num_frames / video_fps * proc.video_fps
  count = min(max(count, proc.video_min_frames), max_frames, num_frames)
  count = math.floor(count / tp) * tp
  if count == 0:
    count = num_frames
  step = num_frames / count
  # torch.arange builds float32 values from a float64 start + i * step and
  # .int() truncates them; the same casts give the same indices.
  positions = (np.arange(count, dtype=np.float64) * step).astype(np.float32)
  indices = positions.astype(np.int64)
  return indices, count / num_frames * video_fps


def load_video(
  path: str | os.PathLike,
  proc: processor.VisionProcessorConfig,
  limits: MediaLimits = DEFAULT_LIMITS,
) -> tuple[np.ndarray, float]:
  """Decodes the frames `sample_frame_indices` picks, as RGB.

  The header's frame count and size are checked against `limits` before
  anything is decoded, and every decoded frame must have the header's size
  before it is converted (a stream cannot grow past its budget mid-way).
  Frames are decoded in order and only the kept ones are converted to RGB;
  decoding stops after the last kept frame.

  Args:
    path: video file.
    proc: the processor configuration (sampling rate and frame limits).
    limits: size budgets.

  Returns:
    (frames_FHWC, sampled_fps): uint8 [F, H, W, 3] and the sampled frame rate.

  Raises:
    MediaError: missing, unsupported, corrupt, truncated or oversized file.
  """
  frames: list[np.ndarray] = []
  with bad_file(path, "decode video"), _open_video(path) as (container, stream):
    info = _probe_open(path, container, stream, limits)
    indices, sampled_fps = sample_frame_indices(info.num_frames, info.fps, proc)
    check_size(
      path,
      "video",
      info.height,
      info.width,
      limits,
      frames=info.num_frames,
      sampled_frames=len(indices),
    )
    wanted = set(indices.tolist())
    last = int(indices[-1])
    stream.thread_type = "AUTO"
    # A stream whose frames outgrow the budget mid-way is refused by the
    # decoder before it allocates them. libav's max_pixels counts its
    # buffers' padding (up to 192 pixels a side for mpeg4), hence the slack;
    # the exact check, against the header, is the one below.
    stream.codec_context.options = {"max_pixels": str(2 * limits.max_frame_pixels + (1 << 22))}
    for i, frame in enumerate(container.decode(stream)):
      if (frame.height, frame.width) != (info.height, info.width):
        raise MediaError(
          path,
          f"frame {i} is {frame.height}x{frame.width}, the header said {info.height}x{info.width}",
        )
      if i in wanted:
        frames.append(frame.to_ndarray(format="rgb24"))
      if i >= last:
        break
  if len(frames) < len(indices):
    raise MediaError(
      path,
      f"stream ended early: kept {len(frames)} of {len(indices)} frames,"
      f" header promised {info.num_frames} (truncated file?)",
    )
  return np.stack(frames), sampled_fps


def preprocess_file(
  kind: processor.Kind,
  path: str | os.PathLike,
  proc: processor.VisionProcessorConfig,
  limits: MediaLimits = DEFAULT_LIMITS,
) -> processor.ProcessedVision:
  """Decodes and preprocesses one file exactly as the model's processor does.

  What a preprocessor worker and a rollout server do with one media item.

  Raises:
    MediaError: the file cannot be decoded or preprocessed, or is over budget.
    ValueError: `kind` is neither "image" nor "video".
  """
  if kind == "image":
    image = load_image(path, limits)
    with bad_file(path, "preprocess image"):
      return processor.preprocess_image(image, proc)
  if kind == "video":
    frames, fps = load_video(path, proc, limits)
    with bad_file(path, "preprocess video"):
      return processor.preprocess_video(frames, proc, fps)
  raise ValueError(f"kind must be 'image' or 'video', got {kind!r}")
