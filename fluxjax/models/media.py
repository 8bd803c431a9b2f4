"""Decoding and header-only probing of image and video files (PIL, PyAV).

Probing reads headers only, so the metadata pipeline can count vision tokens
without pixels; loading decodes and is done by preprocessor workers. Every
failure (missing, unsupported, corrupt or truncated file) surfaces as one
exception type, `MediaError`, so callers can count and skip the sample.
"""

import dataclasses
import math
import os
import warnings

import av
import numpy as np
import PIL.Image
import PIL.ImageOps

from fluxjax.models import processor

# EXIF orientations 5-8 rotate by 90 degrees, swapping height and width.
_EXIF_ORIENTATION = 0x0112
_TRANSPOSING_ORIENTATIONS = (5, 6, 7, 8)


class MediaError(Exception):
  """An image or video that cannot be probed or decoded.

  Attributes:
    path: the file.
    reason: what went wrong, for logs and skip counters.
  """

  def __init__(self, path: str | os.PathLike, reason: str):
    self.path = os.fspath(path)
    self.reason = reason
    super().__init__(f"{self.path}: {reason}")


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


def _check_file(path: str | os.PathLike) -> None:
  # A FIFO or device would block the decoder forever; only plain files pass.
  if not os.path.exists(path):
    raise MediaError(path, "file not found")
  if not os.path.isfile(path):
    raise MediaError(path, "not a regular file")


def load_image(path: str | os.PathLike) -> PIL.Image.Image:
  """Decodes an image fully into RGB.

  EXIF orientation is applied (as transformers' `load_image` does) and alpha
  is composited onto white (as the Qwen2-VL processor does).

  Args:
    path: image file.

  Returns:
    A loaded RGB PIL image.

  Raises:
    MediaError: missing, unreadable, truncated or oversized file.
  """
  _check_file(path)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
      with PIL.Image.open(path) as image:
        # load() decodes every byte, so a truncated file fails here, not later.
        image.load()
        return processor.to_rgb(PIL.ImageOps.exif_transpose(image))
  except (
    OSError,
    ValueError,
    SyntaxError,
    PIL.Image.DecompressionBombError,
    PIL.Image.DecompressionBombWarning,
  ) as e:
    raise MediaError(path, f"cannot decode image: {e}") from e


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
  try:
    # PIL.Image.open parses the header and defers decoding to load().
    with PIL.Image.open(path) as image:
      width, height = image.size
      orientation = image.getexif().get(_EXIF_ORIENTATION, 1)
  except (OSError, ValueError, SyntaxError) as e:
    raise MediaError(path, f"cannot read image header: {e}") from e
  if width < 1 or height < 1:
    raise MediaError(path, f"empty image {height}x{width}")
  if orientation in _TRANSPOSING_ORIENTATIONS:
    return width, height
  return height, width


def _open_video(path: str | os.PathLike):
  """Opens a container and its first video stream, mapping errors."""
  _check_file(path)
  try:
    container = av.open(os.fspath(path), mode="r")
  except (av.FFmpegError, OSError, ValueError) as e:
    raise MediaError(path, f"cannot open video: {e}") from e
  if not container.streams.video:
    container.close()
    raise MediaError(path, "no video stream")
  return container, container.streams.video[0]


def _probe_open(path, container, stream) -> VideoInfo:
  """VideoInfo from an open container, header first, demux as a fallback."""
  rate = stream.average_rate or stream.guessed_rate or stream.base_rate
  if not rate or rate <= 0:
    raise MediaError(path, "unknown frame rate")
  fps = float(rate)
  num_frames = stream.frames
  if num_frames <= 0:
    # Some containers (Matroska, MPEG-TS) store no frame count. Count packets:
    # this demuxes but decodes nothing, and it is exact where the duration
    # estimate is not (load_video must find every frame it was promised).
    try:
      num_frames = sum(1 for pkt in container.demux(stream) if pkt.size)
      container.seek(0)
    except av.FFmpegError as e:
      raise MediaError(path, f"cannot demux video: {e}") from e
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


def probe_video(path: str | os.PathLike) -> VideoInfo:
  """Reads a video's frame count, rate and size from its headers.

  Nothing is decoded. Where the container stores no frame count, packets are
  counted by demuxing (still no decode).

  Args:
    path: video file.

  Returns:
    The stream's VideoInfo.

  Raises:
    MediaError: missing, unsupported or unreadable file.
  """
  container, stream = _open_video(path)
  with container:
    return _probe_open(path, container, stream)


def sample_frame_indices(
  num_frames: int, video_fps: float, cfg: processor.VisionProcessorConfig
) -> tuple[np.ndarray, float]:
  """Which frames to keep, following HF `Qwen2VLVideoProcessor.sample_frames`.

  cfg.video_fps frames per second, clamped to [min_frames, max_frames] and the
  video length, floored to a multiple of temporal_patch_size, evenly spaced.

  Two deliberate departures from HF: HF's `torch.arange(0, n, n / k)` returns
  k + 1 indices (the last one out of range) when n / (n / k) rounds above k;
  exactly k are returned here, equal to HF's first k. And a video shorter than
  temporal_patch_size keeps all its frames where HF divides by zero
  (preprocessing then pads by repeating the last frame).

  Args:
    num_frames: frames in the video.
    video_fps: the video's frame rate.
    cfg: the processor configuration.

  Returns:
    (indices, sampled_fps): sorted int64 frame indices and the frame rate of
      the sampled frames (len(indices) / num_frames * video_fps).
  """
  if num_frames < 1:
    raise ValueError(f"num_frames must be positive, got {num_frames}")
  if not (math.isfinite(video_fps) and video_fps > 0):
    raise ValueError(f"video_fps must be positive and finite, got {video_fps}")
  tp = cfg.temporal_patch_size
  max_frames = math.floor(min(cfg.video_max_frames, num_frames) / tp) * tp
  count = num_frames / video_fps * cfg.video_fps
  count = min(max(count, cfg.video_min_frames), max_frames, num_frames)
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
  path: str | os.PathLike, cfg: processor.VisionProcessorConfig
) -> tuple[np.ndarray, float]:
  """Decodes the frames `sample_frame_indices` picks, as RGB.

  Frames are decoded in order and only the kept ones are converted to RGB;
  decoding stops after the last kept frame.

  Args:
    path: video file.
    cfg: the processor configuration (sampling rate and frame limits).

  Returns:
    (frames_FHWC, sampled_fps): uint8 [F, H, W, 3] and the sampled frame rate.

  Raises:
    MediaError: missing, unsupported, corrupt or truncated file.
  """
  container, stream = _open_video(path)
  with container:
    info = _probe_open(path, container, stream)
    indices, sampled_fps = sample_frame_indices(info.num_frames, info.fps, cfg)
    wanted = set(indices.tolist())
    last = int(indices[-1])
    frames = []
    stream.thread_type = "AUTO"
    try:
      for i, frame in enumerate(container.decode(stream)):
        if i in wanted:
          frames.append(frame.to_ndarray(format="rgb24"))
        if i >= last:
          break
    except (av.FFmpegError, OSError, ValueError) as e:
      raise MediaError(path, f"decode failed after {len(frames)} kept frames: {e}") from e
  if len(frames) < len(indices):
    raise MediaError(
      path,
      f"stream ended early: kept {len(frames)} of {len(indices)} frames,"
      f" header promised {info.num_frames} (truncated file?)",
    )
  shapes = {f.shape for f in frames}
  if len(shapes) != 1:
    raise MediaError(path, f"frame size changes mid-stream: {sorted(shapes)}")
  return np.stack(frames), sampled_fps
