"""Probing and decoding real image and video files (fluxjax.models.media)."""

import base64
import concurrent.futures
import functools
import os
import time

import av
import hypothesis
import numpy as np
import PIL.Image
import PIL.ImageFile
import pytest
from hypothesis import strategies as st

from fluxjax.data import pipeline
from fluxjax.models import media
from fluxjax.models import processor as vp
from fluxjax.rollout import json_body, media_cache, prompt, protocol, sampling_params
from helpers import grey_level, lying_png, video_codec, write_video

_CODEC = video_codec()
_FRAMES, _FPS, _H, _W = 30, 10, 64, 96
_level = grey_level


_write_video = functools.partial(write_video, num_frames=_FRAMES, fps=_FPS, height=_H, width=_W)


def _image_array(height, width, channels=3, seed=0):
  rng = np.random.default_rng(seed)
  return rng.integers(0, 256, (height, width, channels), np.uint8)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
  """Real files written once per module: JPEG, PNG, GIF, WebP, MP4, MKV."""
  d = tmp_path_factory.mktemp("media")
  PIL.Image.fromarray(_image_array(37, 53)).save(d / "a.jpg", quality=95)
  PIL.Image.fromarray(_image_array(41, 29, channels=4)).save(d / "a.png")
  PIL.Image.fromarray(_image_array(37, 53)).save(d / "a.gif")
  PIL.Image.fromarray(_image_array(37, 53)).save(d / "a.webp")
  # faststart puts the index first, so a cut file still opens (see below).
  _write_video(d / "a.mp4", options={"movflags": "faststart"})
  _write_video(d / "plain.mp4")  # index at the end, as ffmpeg writes by default
  _write_video(d / "a.mkv", container_format="matroska")
  _write_video(d / "one.mp4", num_frames=1)
  return d


def _cut(src, dst, fraction):
  data = src.read_bytes()
  dst.write_bytes(data[: int(len(data) * fraction)])
  return dst


# --- images -----------------------------------------------------------------


@pytest.mark.parametrize("name,size", [("a.jpg", (37, 53)), ("a.png", (41, 29))])
def test_probe_and_load_image(media_dir, name, size):
  assert media.probe_image(media_dir / name) == size
  image = media.load_image(media_dir / name)
  assert image.mode == "RGB"
  assert (image.height, image.width) == size


def test_png_alpha_is_composited_onto_white(media_dir):
  rgba = np.asarray(PIL.Image.open(media_dir / "a.png"))
  loaded = np.asarray(media.load_image(media_dir / "a.png")).astype(np.float64)
  alpha = rgba[..., 3:4] / 255
  expected = alpha * rgba[..., :3] + (1 - alpha) * 255
  np.testing.assert_allclose(loaded, expected, atol=1)


@pytest.mark.parametrize(
  "name,size", [("a.jpg", (37, 53)), ("a.png", (41, 29)), ("a.gif", (37, 53)), ("a.webp", (37, 53))]
)
def test_probe_image_does_not_decode(media_dir, monkeypatch, name, size):
  # PNG's getexif() would decode the whole image: the probe must not call it.
  decoded = []
  monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", lambda self: decoded.append(self))
  assert media.probe_image(media_dir / name) == size
  assert not decoded


def test_bad_file_turns_any_exception_into_one_media_error(tmp_path):
  path = tmp_path / "x.png"
  for exc in (KeyError("k"), ZeroDivisionError("z"), av.error.InvalidDataError(1, "bad")):
    with pytest.raises(media.MediaError) as e, media.bad_file(path, "decode image"):
      raise exc
    assert e.value.path == str(path) and e.value.__cause__ is exc
    assert e.value.reason.startswith(f"cannot decode image: {type(exc).__name__}: ")
    assert pipeline.skip_kind(e.value.reason) == "corrupt"
  with pytest.raises(media.MediaError) as e, media.bad_file(path, "decode image"):
    raise PIL.Image.DecompressionBombError("Image size (1 pixels) exceeds limit")
  assert pipeline.skip_kind(e.value.reason) == "size"
  with pytest.raises(media.MediaError) as e, media.bad_file(path, "decode video"):
    raise MemoryError()
  assert e.value.reason.startswith("out of memory: cannot decode video")
  assert pipeline.skip_kind(e.value.reason) == "size"
  original = media.MediaError(path, "stream ended early")
  with pytest.raises(media.MediaError) as e, media.bad_file(path, "decode video"):
    raise original
  assert e.value is original
  # An interrupt is not the file's fault.
  for interrupt in (KeyboardInterrupt, SystemExit):
    with pytest.raises(interrupt), media.bad_file(path, "decode image"):
      raise interrupt()


def test_image_budgets_are_checked_from_the_header_before_decoding(media_dir, monkeypatch):
  decoded = []
  monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", lambda self: decoded.append(self))
  cases = [
    (media.MediaLimits(max_image_pixels=37 * 53 - 1), "image exceeds the limit of 1960 pixels"),
    (media.MediaLimits(min_side=38), "side below the limit 38: 37x53"),
  ]
  for limits, reason in cases:
    with pytest.raises(media.MediaError, match=reason) as e:
      media.load_image(media_dir / "a.jpg", limits)
    assert pipeline.skip_kind(e.value.reason) == "size"
  assert not decoded
  monkeypatch.undo()
  limits = media.MediaLimits(max_image_pixels=37 * 53)
  assert media.load_image(media_dir / "a.jpg", limits).size == (53, 37)


@pytest.mark.parametrize(
  "limits,reason",
  [
    (media.MediaLimits(max_video_frames=_FRAMES - 1), f"{_FRAMES} frames exceed the limit"),
    (media.MediaLimits(max_frame_pixels=_H * _W - 1), f"{_H}x{_W} frames exceed the limit"),
    (media.MediaLimits(max_sampled_video_pixels=_H * _W), "sampled frames of 64x96 exceed"),
    (media.MediaLimits(min_side=_H + 1), "side below the limit"),
  ],
)
def test_video_budgets_are_checked_from_the_header_before_decoding(media_dir, limits, reason):
  with pytest.raises(media.MediaError, match=reason) as e:
    media.load_video(media_dir / "a.mp4", vp.VisionProcessorConfig(), limits)
  assert pipeline.skip_kind(e.value.reason) == "size"


def test_frame_count_by_demuxing_is_bounded(media_dir):
  # Matroska stores no frame count: the probe counts packets, up to the limit.
  limits = media.MediaLimits(max_video_frames=10)
  with pytest.raises(media.MediaError, match="frames exceed the limit 10") as e:
    media.probe_video(media_dir / "a.mkv", limits)
  assert pipeline.skip_kind(e.value.reason) == "size"
  assert media.probe_video(media_dir / "a.mkv").num_frames == _FRAMES


def test_preprocessing_failure_is_a_media_error(tmp_path):
  path = tmp_path / "sliver.png"
  PIL.Image.fromarray(_image_array(1, 300)).save(path)  # aspect ratio 300 > 200
  with pytest.raises(media.MediaError, match=r"cannot preprocess image: ValueError: .*aspect") as e:
    media.preprocess_file("image", path, vp.VisionProcessorConfig())
  assert pipeline.skip_kind(e.value.reason) == "preprocess"


def test_exif_rotation_is_applied_in_probe_and_load(tmp_path):
  path = tmp_path / "rotated.jpg"
  exif = PIL.Image.Exif()
  exif[0x0112] = 6  # rotate 90 degrees on display
  PIL.Image.fromarray(_image_array(20, 50)).save(path, exif=exif)
  assert media.probe_image(path) == (50, 20)
  image = media.load_image(path)
  assert (image.height, image.width) == (50, 20)


def test_truncated_jpeg_probes_but_fails_to_load(media_dir, tmp_path):
  path = _cut(media_dir / "a.jpg", tmp_path / "cut.jpg", 0.5)
  # The header survives, so probing (header only) still works...
  assert media.probe_image(path) == (37, 53)
  # ...but the pixels do not.
  with pytest.raises(media.MediaError, match="cannot decode image") as e:
    media.load_image(path)
  assert e.value.path == str(path)


def test_garbage_and_missing_images_raise(tmp_path):
  garbage = tmp_path / "garbage.jpg"
  garbage.write_bytes(np.random.default_rng(0).bytes(4096))
  for fn in (media.probe_image, media.load_image):
    with pytest.raises(media.MediaError, match="image") as e:
      fn(garbage)
    assert e.value.reason
    with pytest.raises(media.MediaError, match="not found"):
      fn(tmp_path / "missing.png")
    with pytest.raises(media.MediaError, match="not a regular file"):
      fn(tmp_path)


# --- videos -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["a.mp4", "plain.mp4", "a.mkv"])
def test_probe_video(media_dir, name):
  info = media.probe_video(media_dir / name)
  assert info.num_frames == _FRAMES
  assert info.fps == pytest.approx(_FPS)
  assert (info.height, info.width) == (_H, _W)
  assert info.duration_s == pytest.approx(_FRAMES / _FPS, abs=0.15)
  assert info.codec == ("h264" if _CODEC == "libx264" else "mpeg4")


@pytest.mark.parametrize("name", ["a.mp4", "plain.mp4", "a.mkv"])
def test_load_video_keeps_the_sampled_frames(media_dir, name):
  cfg = vp.VisionProcessorConfig()
  frames, sampled_fps = media.load_video(media_dir / name, cfg)
  indices, expected_fps = media.sample_frame_indices(_FRAMES, _FPS, cfg)
  assert frames.dtype == np.uint8
  assert frames.shape == (len(indices), _H, _W, 3)
  assert sampled_fps == pytest.approx(expected_fps)
  # Each frame is flat grey at its index's level: the right frames were kept.
  levels = frames[:, _H // 2, _W // 2].astype(np.int64).mean(axis=-1)
  expected = np.array([_level(i) for i in indices])
  np.testing.assert_allclose(levels, expected, atol=4)


def test_load_video_then_preprocess_agrees_with_probe(media_dir):
  cfg = vp.VisionProcessorConfig()
  info = media.probe_video(media_dir / "a.mp4")
  indices, _ = media.sample_frame_indices(info.num_frames, info.fps, cfg)
  grid = vp.grid_for_size("video", info.height, info.width, len(indices), cfg)
  frames, fps = media.load_video(media_dir / "a.mp4", cfg)
  out = vp.preprocess_video(frames, cfg, fps)
  assert out.grid_thw == grid
  assert out.second_per_grid == pytest.approx(cfg.temporal_patch_size / fps)


def test_single_frame_video_is_padded(media_dir):
  cfg = vp.VisionProcessorConfig()
  frames, fps = media.load_video(media_dir / "one.mp4", cfg)
  assert frames.shape[0] == 1
  out = vp.preprocess_video(frames, cfg, fps)
  assert out.grid_thw[0] == 1


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
  num_frames=st.integers(1, 20000),
  video_fps=st.floats(1.0, 240.0),
  target_fps=st.sampled_from([0.5, 1.0, 2.0, 4.0]),
)
def test_sample_frame_indices_properties(num_frames, video_fps, target_fps):
  cfg = vp.VisionProcessorConfig(video_fps=target_fps)
  indices, sampled_fps = media.sample_frame_indices(num_frames, video_fps, cfg)
  k = len(indices)
  assert np.all(np.diff(indices) > 0)
  assert indices[0] == 0 and indices[-1] < num_frames
  if num_frames >= cfg.temporal_patch_size:
    assert k % cfg.temporal_patch_size == 0
    assert k <= cfg.video_max_frames
    wanted = num_frames / video_fps * target_fps
    # Never more than the rate asks for, unless the min_frames floor applies.
    assert k <= max(wanted, cfg.video_min_frames)
  else:
    assert k == num_frames
  assert sampled_fps == pytest.approx(k / num_frames * video_fps)


def test_sample_frame_indices_rejects_bad_metadata():
  cfg = vp.VisionProcessorConfig()
  with pytest.raises(ValueError, match="num_frames"):
    media.sample_frame_indices(0, 30.0, cfg)
  with pytest.raises(ValueError, match="video_fps"):
    media.sample_frame_indices(10, 0.0, cfg)


def test_truncated_mp4_with_index_first(media_dir, tmp_path):
  path = _cut(media_dir / "a.mp4", tmp_path / "cut.mp4", 0.5)
  # The header still promises every frame, so probe (no decode) succeeds...
  assert media.probe_video(path).num_frames == _FRAMES
  # ...and decoding finds the data missing.
  with pytest.raises(media.MediaError, match=r"ended early|cannot decode video"):
    media.load_video(path, vp.VisionProcessorConfig())


def test_truncated_mp4_with_index_last(media_dir, tmp_path):
  path = _cut(media_dir / "plain.mp4", tmp_path / "cut.mp4", 0.5)
  for call in (media.probe_video, lambda p: media.load_video(p, vp.VisionProcessorConfig())):
    with pytest.raises(media.MediaError) as e:
      call(path)
    assert e.value.path == str(path) and e.value.reason


def test_bad_video_files_raise(tmp_path):
  cfg = vp.VisionProcessorConfig()
  garbage = tmp_path / "garbage.mp4"
  garbage.write_bytes(np.random.default_rng(1).bytes(8192))
  text = tmp_path / "notes.mp4"
  text.write_text("not a video\n" * 100)
  audio = tmp_path / "tone.wav"
  with av.open(str(audio), "w") as out:
    stream = out.add_stream("pcm_s16le", rate=8000, layout="mono")
    samples = np.zeros((1, 800), np.int16)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = 8000
    out.mux(stream.encode(frame))
    out.mux(stream.encode())
  cases = [
    (garbage, "cannot open video|no video stream"),
    (text, "cannot open video|no video stream"),
    (audio, "no video stream"),
    (tmp_path / "missing.mp4", "not found"),
    (tmp_path, "not a regular file"),
  ]
  for path, match in cases:
    with pytest.raises(media.MediaError, match=match):
      media.probe_video(path)
    with pytest.raises(media.MediaError, match=match):
      media.load_video(path, cfg)


def test_media_error_carries_path_and_reason(tmp_path):
  err = media.MediaError(tmp_path / "x.mp4", "broken")
  assert err.path == os.fspath(tmp_path / "x.mp4")
  assert err.reason == "broken"
  assert "broken" in str(err) and "x.mp4" in str(err)


def test_request_media_are_held_to_the_budgets(media_dir):
  """A rollout server decodes base64 media from requests: the same budgets,
  from the header, and a bad item is a 400 (ProtocolError), never a crash.
  (Raw base64 holds "/": it is not mistaken for a path.)"""
  bomb = base64.b64encode(lying_png(100_000, 100_000)).decode()
  jpeg = base64.b64encode((media_dir / "a.jpg").read_bytes()).decode()
  assert "/" in jpeg
  cfg = vp.VisionProcessorConfig()

  def request(**media_data):
    return protocol.GenerateRequest("r", sampling_params.SamplingParams(), **media_data)

  with pytest.raises(json_body.ProtocolError, match="decompression-bomb"):
    prompt.load_media(request(image_data=[f"data:image/png;base64,{bomb}"]), cfg)
  small = media.MediaLimits(max_image_pixels=100)
  with pytest.raises(json_body.ProtocolError, match="37x53 image exceeds the limit of 100"):
    prompt.load_media(request(image_data=[jpeg]), cfg, small)
  small = media.MediaLimits(max_video_frames=_FRAMES - 1)
  with pytest.raises(json_body.ProtocolError, match=f"{_FRAMES} frames exceed"):
    prompt.load_media(request(video_data=[str(media_dir / "a.mp4")]), cfg, small)
  (image,) = prompt.load_media(request(image_data=[jpeg]), cfg)
  assert image.kind == "image"
  with pytest.raises(json_body.ProtocolError, match="file not found"):
    prompt.load_media(request(image_data=[str(media_dir / ("x" * 64) / "gone.png")]), cfg)


class _CountingDecoder:
  """Counts media.preprocess_file calls in `calls` (what the cache saves).
  While `waiters` is set, the n-th decode returns only once the cache has
  counted n * waiters hits: the other requests of the group all wait on it,
  however late their threads start."""

  def __init__(self, monkeypatch, cache: media_cache.MediaCache, waiters: int):
    self.calls: list[str] = []
    self.waiters = waiters
    self._cache, self._real = cache, media.preprocess_file
    monkeypatch.setattr(media, "preprocess_file", self._decode)

  def _decode(self, kind, path, *args):
    self.calls.append(os.path.basename(path))
    deadline = time.monotonic() + 60
    while self._cache.hits < self.waiters * len(self.calls):
      assert time.monotonic() < deadline, f"{self._cache.hits} requests joined the decode"
      time.sleep(0.005)
    return self._real(kind, path, *args)


def test_a_groups_requests_decode_each_file_once(media_dir, tmp_path, monkeypatch):
  """Eight concurrent requests naming one image and one video (a GRPO group)
  decode each once and share the result; a rewritten file is decoded again."""
  cfg, cache = vp.VisionProcessorConfig(), media_cache.MediaCache()
  image = tmp_path / "a.jpg"
  image.write_bytes((media_dir / "a.jpg").read_bytes())
  req = protocol.GenerateRequest(
    "r",
    sampling_params.SamplingParams(),
    image_data=[str(image)],
    video_data=[str(media_dir / "a.mp4")],
  )
  uncached = prompt.load_media(req, cfg)
  decoder = _CountingDecoder(monkeypatch, cache, waiters=7)
  calls = decoder.calls
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    outs = list(pool.map(lambda _: prompt.load_media(req, cfg, cache=cache), range(8)))
  assert sorted(calls) == ["a.jpg", "a.mp4"]
  assert all(o[0] is outs[0][0] and o[1] is outs[0][1] for o in outs)
  np.testing.assert_array_equal(outs[0][1].patches, uncached[1].patches)
  assert not outs[0][0].patches.flags.writeable  # shared: nobody may write them
  assert (cache.hits, cache.misses) == (14, 2)
  decoder.waiters = 0
  PIL.Image.fromarray(_image_array(37, 53, seed=1)).save(image, quality=90)
  (again, _) = prompt.load_media(req, cfg, cache=cache)
  assert calls[-1] == "a.jpg" and len(calls) == 3
  assert not np.array_equal(again.patches, outs[0][0].patches)


def test_a_failed_decode_reaches_every_waiter_and_is_not_kept(tmp_path, monkeypatch):
  bad = tmp_path / "bad.jpg"
  bad.write_bytes(b"not a jpeg at all")
  cfg, cache = vp.VisionProcessorConfig(), media_cache.MediaCache()
  decoder = _CountingDecoder(monkeypatch, cache, waiters=3)
  calls = decoder.calls
  req = protocol.GenerateRequest("r", sampling_params.SamplingParams(), image_data=[str(bad)])

  def load(_):
    with pytest.raises(json_body.ProtocolError, match="cannot load media"):
      prompt.load_media(req, cfg, cache=cache)

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    list(pool.map(load, range(4)))
  assert calls == ["bad.jpg"] and len(cache) == 0
  decoder.waiters = 0
  load(0)
  assert len(calls) == 2


def test_base64_media_are_kept_by_content_and_the_cache_by_bytes(media_dir):
  jpeg = base64.b64encode((media_dir / "a.jpg").read_bytes()).decode()
  png = base64.b64encode((media_dir / "a.png").read_bytes()).decode()
  cfg = vp.VisionProcessorConfig()
  one = prompt.load_media(
    protocol.GenerateRequest("r", sampling_params.SamplingParams(), image_data=[jpeg]), cfg
  )[0]
  cache = media_cache.MediaCache(max_bytes=one.patches.nbytes)  # room for one image
  for data in (jpeg, jpeg, png, jpeg):
    req = protocol.GenerateRequest("r", sampling_params.SamplingParams(), image_data=[data])
    prompt.load_media(req, cfg, cache=cache)
  assert (cache.hits, cache.misses, len(cache)) == (1, 3, 1)  # png evicted the jpeg
  other = vp.VisionProcessorConfig(image_max_pixels=28 * 28 * 4)
  assert media_cache.key(jpeg, "image", other, False) != media_cache.key(jpeg, "image", cfg, False)
