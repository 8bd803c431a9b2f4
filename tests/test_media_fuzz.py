"""Hostile media bytes through probe and decode: a result or MediaError, nothing else.

Small valid seed files of every format the loader reads (JPEG, PNG, GIF and
WebP written by PIL; MP4, MKV and WebM written by PyAV) are mutated: bits
flipped, cut short, junk inserted, and header fields made to lie (PNG IHDR
with a valid CRC, JPEG SOF, GIF screen and frame sizes, the VP8 frame header
in WebP and WebM, MP4 sample counts, time scales and sizes, Matroska pixel
sizes and time scale). Each file goes through what the controller does
(`meta.media_ref`: header probe, budgets, the processor's resize rule) and
what a preprocessor worker or a rollout server does
(`media.preprocess_file`: decode, budgets, preprocessing). Each call must
return or raise MediaError with a reason the loader's metrics classify;
anything else is a bug. A SIGALRM bounds each file, so a decoder that loops
fails the test instead of hanging it. Hypothesis is derandomized: CI runs the
same examples every time.
"""

import contextlib
import dataclasses
import io
import itertools
import re
import signal
import struct
import zlib

import av
import hypothesis
import numpy as np
import PIL.Image
import PIL.ImageFile
import PIL.WebPImagePlugin
import pytest
from hypothesis import strategies as st

from fluxjax.data import meta, pipeline
from fluxjax.models import media
from fluxjax.models import processor as vp
from helpers import video_codec, write_video

# Small budgets, so that a header lying within them still decodes in
# milliseconds; the default budgets are tested separately below.
LIMITS = media.MediaLimits(
  max_image_pixels=1 << 20,
  max_video_frames=600,
  max_frame_pixels=1 << 18,
  max_sampled_video_pixels=1 << 22,
)
CFG = vp.VisionProcessorConfig(
  image_min_pixels=28 * 28 * 4,
  image_max_pixels=28 * 28 * 16,
  video_min_pixels=28 * 28 * 4,
  video_max_pixels=28 * 28 * 8,
  video_max_frames=8,
)
FILE_SECONDS = 5  # a generous bound on one file's probe and decode
_IMAGES = {"jpeg": "JPEG", "png": "PNG", "gif": "GIF", "webp": "WEBP"}
# name -> (encoder, container format, extension)
_VIDEOS = {
  "mp4": (video_codec(), "mp4", "mp4"),
  "mkv": (video_codec(), "matroska", "mkv"),
  "webm-vp8": ("libvpx", "webm", "webm"),
  "webm-vp9": ("libvpx-vp9", "webm", "webm"),
}


@dataclasses.dataclass(frozen=True)
class Seed:
  kind: str
  ext: str
  data: bytes


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Seed]:
  """A valid small file of each format (a format without an encoder is absent)."""
  d = tmp_path_factory.mktemp("seeds")
  rng = np.random.default_rng(0)
  out = {}
  for name, fmt in _IMAGES.items():
    buf = io.BytesIO()
    PIL.Image.fromarray(rng.integers(0, 256, (16, 24, 3), np.uint8)).save(buf, fmt)
    out[name] = Seed("image", name, buf.getvalue())
  for name, (codec, container, ext) in _VIDEOS.items():
    if codec not in av.codecs_available:
      continue
    path = write_video(
      d / f"{name}.{ext}",
      num_frames=6,
      fps=10,
      height=32,
      width=48,
      codec=codec,
      container_format=container,
    )
    out[name] = Seed("video", ext, path.read_bytes())
  return out


def _seed(seeds, name) -> Seed:
  if name not in seeds:
    pytest.skip(f"this PyAV has no {_VIDEOS[name][0]} encoder to write a {name} seed")
  return seeds[name]


# --- header fields a lie can patch ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Field:
  """An unsigned integer in a file's header: where, how wide, which byte order."""

  name: str
  offset: int
  size: int
  order: str  # "big" or "little" (endian)


def _png_fields(data: bytes) -> list[Field]:
  assert data[12:16] == b"IHDR"
  return [Field("width", 16, 4, "big"), Field("height", 20, 4, "big")]


def _jpeg_fields(data: bytes) -> list[Field]:
  sof = re.search(rb"\xff[\xc0-\xc3]", data)
  assert sof is not None
  i = sof.start()
  return [Field("height", i + 5, 2, "big"), Field("width", i + 7, 2, "big")]


def _gif_fields(data: bytes) -> list[Field]:
  fields = [Field("screen width", 6, 2, "little"), Field("screen height", 8, 2, "little")]
  i = 13 + (3 << ((data[10] & 7) + 1) if data[10] & 0x80 else 0)
  while data[i] == 0x21:  # extension blocks up to the first image
    i += 2
    while data[i]:
      i += data[i] + 1
    i += 1
  assert data[i] == 0x2C
  return fields + [
    Field("frame width", i + 5, 2, "little"),
    Field("frame height", i + 7, 2, "little"),
  ]


def _vp8_fields(data: bytes) -> list[Field]:
  # A VP8 key frame: a 3-byte tag, the start code, 14-bit width and height.
  i = data.find(b"\x9d\x01\x2a")
  if i < 0:
    return []
  return [Field("vp8 width", i + 3, 2, "little"), Field("vp8 height", i + 5, 2, "little")]


def _mp4_fields(data: bytes) -> list[Field]:
  fields = []
  boxes = {
    b"stts": [("stts entries", 8), ("stts sample count", 12), ("stts sample delta", 16)],
    b"stsz": [("stsz sample count", 12)],
    b"mdhd": [("mdhd timescale", 16), ("mdhd duration", 20)],
    b"mvhd": [("mvhd timescale", 16)],
    b"tkhd": [("tkhd width", 80), ("tkhd height", 84)],
  }
  for box, names in boxes.items():
    i = data.find(box)
    if i >= 0:
      fields += [Field(n, i + off, 4, "big") for n, off in names]
  stsd = data.find(b"stsd")
  entry = re.compile(rb"avc1|mp4v").search(data, stsd)
  if stsd >= 0 and entry is not None:
    i = entry.start()
    fields += [Field("sample entry width", i + 28, 2, "big")]
    fields += [Field("sample entry height", i + 30, 2, "big")]
  return fields


def _matroska_fields(data: bytes) -> list[Field]:
  """PixelWidth, PixelHeight and TimecodeScale: an element ID, a one-byte size
  (0x80 | n), then an n-byte value."""
  fields = []
  for name, element in (
    ("pixel width", b"\xb0"),
    ("pixel height", b"\xba"),
    ("timecode scale", b"\x2a\xd7\xb1"),
  ):
    tracks = data.find(b"\x16\x54\xae\x6b") if element != b"\x2a\xd7\xb1" else 0
    found = re.compile(re.escape(element) + rb"[\x81-\x88]").search(data, max(tracks, 0))
    if found is not None:
      size = data[found.end() - 1] & 0x7F
      fields.append(Field(name, found.end(), size, "big"))
  return fields + _vp8_fields(data)


_FIELDS = {
  "jpeg": _jpeg_fields,
  "png": _png_fields,
  "gif": _gif_fields,
  "webp": _vp8_fields,
  "mp4": _mp4_fields,
  "mkv": _matroska_fields,
  "webm-vp8": _matroska_fields,
  "webm-vp9": _matroska_fields,
}


def lie(name: str, data: bytes, field: Field, value: int) -> bytes:
  """`data` with one header field set to `value` (cut to its width); a PNG's
  IHDR CRC is recomputed so that the lie is believed."""
  out = bytearray(data)
  value &= (1 << (8 * field.size)) - 1
  out[field.offset : field.offset + field.size] = value.to_bytes(field.size, field.order)
  if name == "png":
    out[29:33] = struct.pack(">I", zlib.crc32(bytes(out[12:29])))
  return bytes(out)


# --- the check every file goes through ---------------------------------------------


class Hung(BaseException):
  """A probe or decode overran FILE_SECONDS (not an Exception: bad_file lets it through)."""


@contextlib.contextmanager
def bounded(seconds: float):
  def on_alarm(signum, frame):
    raise Hung(f"probe and decode of one file took over {seconds} s")

  previous = signal.signal(signal.SIGALRM, on_alarm)
  signal.setitimer(signal.ITIMER_REAL, seconds)
  try:
    yield
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


_names = itertools.count()


def check(tmp_dir, seed: Seed, data: bytes, limits=LIMITS) -> list[str]:
  """Runs the controller's and the worker's path on `data`; returns the
  MediaError reasons (empty: both succeeded). Anything else raises."""
  path = tmp_dir / f"{next(_names)}.{seed.ext}"  # a new name: the probe cache keys on it
  path.write_bytes(data)
  reasons = []
  with bounded(FILE_SECONDS):
    for call in (
      lambda: meta.media_ref("m", seed.kind, str(path), CFG, limits),
      lambda: media.preprocess_file(seed.kind, path, CFG, limits),
    ):
      try:
        call()
      except media.MediaError as e:
        assert e.path == str(path)
        kind = pipeline.skip_kind(e.reason)
        assert kind != "other", f"unclassified skip reason: {e.reason}"
        reasons.append(e.reason)
  return reasons


# --- the seeds are valid ------------------------------------------------------------


@pytest.mark.parametrize("name", [*_IMAGES, *_VIDEOS])
def test_each_seed_decodes_and_has_header_fields_to_lie_with(seeds, name, tmp_path):
  seed = _seed(seeds, name)
  assert check(tmp_path, seed, seed.data) == []
  assert _FIELDS[name](seed.data), f"no header field found in the {name} seed"


# --- lying headers, one by one ------------------------------------------------------


def test_decompression_bomb_png_is_a_size_error(seeds, tmp_path):
  seed = seeds["png"]
  bomb = lie(
    "png",
    lie("png", seed.data, Field("w", 16, 4, "big"), 100_000),
    Field("h", 20, 4, "big"),
    100_000,
  )
  reasons = check(tmp_path, seed, bomb, media.MediaLimits())
  assert len(reasons) == 2 and all("decompression-bomb" in r for r in reasons)
  assert {pipeline.skip_kind(r) for r in reasons} == {"size"}


@pytest.mark.parametrize("name", ["png", "jpeg", "gif", "webp"])
def test_an_image_header_over_budget_is_refused_before_any_pixel_is_decoded(
  seeds, name, tmp_path, monkeypatch
):
  """Every image field claims 200 pixels a side: 40000 pixels against a budget
  of 10000. The budget check, not a decoder, must refuse it."""
  seed = seeds[name]
  data = seed.data
  for field in _FIELDS[name](data):
    data = lie(name, data, field, 200)
  decoded = []
  for cls in (PIL.ImageFile.ImageFile, PIL.WebPImagePlugin.WebPImageFile):
    monkeypatch.setattr(cls, "load", lambda self: decoded.append(self))
  reasons = check(tmp_path, seed, data, media.MediaLimits(max_image_pixels=10_000))
  assert len(reasons) == 2
  assert all("200x200 image exceeds the limit of 10000 pixels" in r for r in reasons), reasons
  assert not decoded


def test_a_png_over_the_default_budget_but_under_pils_is_refused_by_ours(seeds, tmp_path):
  """9000 x 9000 = 81M pixels: above MediaLimits' 64M, below PIL's 89M warning."""
  data = seeds["png"].data
  for field in _png_fields(data):
    data = lie("png", data, field, 9000)
  reasons = check(tmp_path, seeds["png"], data, media.MediaLimits())
  assert reasons == ["9000x9000 image exceeds the limit of 64000000 pixels"] * 2


def test_an_mp4_claiming_two_billion_frames_is_refused_from_its_header(seeds, tmp_path):
  seed = seeds["mp4"]
  (count,) = [f for f in _mp4_fields(seed.data) if f.name == "stts sample count"]
  reasons = check(tmp_path, seed, lie("mp4", seed.data, count, 2**31 - 1), media.MediaLimits())
  assert reasons == ["2147483647 frames exceed the limit 1000000"] * 2


def test_a_frame_larger_than_its_header_is_refused(seeds, tmp_path):
  """The WebM header says 48x32; the VP8 key frame says 4000x3000."""
  seed = _seed(seeds, "webm-vp8")
  data = seed.data
  for field, value in zip(_vp8_fields(data), (4000, 3000)):
    data = lie("webm-vp8", data, field, value)
  # The probe believes the container; the decode finds the frame's size.
  assert media.probe_video(_write(tmp_path / "a.webm", data)).height == 32
  with pytest.raises(media.MediaError, match="frame 0 is 3000x4000, the header said 32x48"):
    media.load_video(tmp_path / "a.webm", CFG)
  # Within a smaller frame budget, libav refuses to allocate the frame at all.
  with pytest.raises(media.MediaError, match="cannot decode video"):
    media.load_video(tmp_path / "a.webm", CFG, media.MediaLimits(max_frame_pixels=48 * 32))


def _write(path, data):
  path.write_bytes(data)
  return path


# --- fuzzing -------------------------------------------------------------------------

_LIE_VALUES = [0, 1, 2, 255, 4097, 65535, 2**31 - 1, 2**32 - 1]


def _mutate(draw, name: str, data: bytes) -> bytes:
  """A lie in the header (sometimes), then flips, cuts and inserted junk."""
  fields = _FIELDS[name](data)
  if fields and draw(st.booleans()):
    data = lie(name, data, draw(st.sampled_from(fields)), draw(st.sampled_from(_LIE_VALUES)))
  out = bytearray(data)
  for _ in range(draw(st.integers(0, 3))):
    # Headers hold most of what a parser trusts: half the edits land there.
    head = st.integers(0, min(len(out), 512) - 1)
    pos = draw(st.one_of(head, st.integers(0, len(out) - 1)))
    op = draw(st.sampled_from(["flip", "cut", "insert"]))
    if op == "flip":
      out[pos] ^= draw(st.integers(1, 255))
    elif op == "cut":
      del out[max(pos, 1) :]
    else:
      out[pos:pos] = draw(st.binary(min_size=1, max_size=64))
  return bytes(out)


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory):
  return tmp_path_factory.mktemp("fuzz")


def _fuzz(seeds, names, data, tmp_dir):
  name = data.draw(st.sampled_from([n for n in names if n in seeds]), label="format")
  seed = seeds[name]
  mutated = _mutate(data.draw, name, seed.data)
  reasons = check(tmp_dir, seed, mutated)
  hypothesis.event(f"{name}: {'refused' if reasons else 'decoded'}")


def _bounded(examples: int) -> hypothesis.settings:
  """A fixed number of derandomized examples (the same inputs in every CI run)."""
  return hypothesis.settings(
    max_examples=examples,
    deadline=None,
    derandomize=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
  )


@_bounded(800)
@hypothesis.given(data=st.data())
def test_fuzzed_images_decode_or_raise_media_error(seeds, fuzz_dir, data):
  _fuzz(seeds, list(_IMAGES), data, fuzz_dir)


@_bounded(500)
@hypothesis.given(data=st.data())
def test_fuzzed_videos_decode_or_raise_media_error(seeds, fuzz_dir, data):
  _fuzz(seeds, list(_VIDEOS), data, fuzz_dir)
