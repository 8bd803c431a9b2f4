"""Parity of fluxjax.models.processor with transformers' Qwen2-VL processors."""

import contextlib
import importlib
import importlib.machinery
import sys
import types

import hypothesis
import numpy as np
import PIL.Image
import pytest
import torch
from hypothesis import strategies as st
from transformers import video_utils
from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as hf_pil

from fluxjax.models import media
from fluxjax.models import processor as vp

_HF_VIDEO_MODULE = "transformers.models.qwen2_vl.video_processing_qwen2_vl"
_TORCHVISION_NAMES = (
  "torchvision",
  "torchvision.transforms",
  "torchvision.transforms.v2",
  "torchvision.transforms.v2.functional",
)


def _smooth_noisy_image(rng, height, width, channels=3):
  """uint8 [H, W, C]: gradients plus noise, so resampling errors show."""
  y = np.linspace(0, 1, height)[:, None, None]
  x = np.linspace(0, 1, width)[None, :, None]
  phase = np.arange(channels)[None, None, :]
  base = 127 + 100 * np.sin(6 * x + 4 * y + phase)
  noise = rng.normal(0, 20, (height, width, channels))
  return np.clip(base + noise, 0, 255).astype(np.uint8)


def _hf_image(image, cfg):
  """transformers' PIL-backend output for one image: (patches, grid)."""
  hf = hf_pil.Qwen2VLImageProcessorPil(
    min_pixels=cfg.image_min_pixels, max_pixels=cfg.image_max_pixels
  )
  out = hf(image, return_tensors="np")
  return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


@pytest.fixture(scope="module")
def hf_video_cls():
  """transformers' Qwen2VLVideoProcessor, imported without torchvision.

  The module imports torchvision only for its resize kernel. With that import
  stubbed, its pure-torch parts (sample_frames, patchify, the pixel-cap rule)
  can serve as a peer. The stub is removed right after the import.
  """
  stubs = {}
  for name in _TORCHVISION_NAMES:
    if name not in sys.modules:  # a real torchvision is left alone
      stub = types.ModuleType(name)
      stub.__spec__ = importlib.machinery.ModuleSpec(name, None)
      stubs[name] = stub
  sys.modules.update(stubs)
  try:
    module = importlib.import_module(_HF_VIDEO_MODULE)
  except Exception as e:  # pylint: disable=broad-except
    pytest.skip(f"cannot import the HF video processor as a peer: {e}")
  finally:
    for name in stubs:
      sys.modules.pop(name, None)
  yield module.Qwen2VLVideoProcessor
  if stubs:  # do not leave a module built on stubs for other tests to import
    sys.modules.pop(_HF_VIDEO_MODULE, None)
    with contextlib.suppress(KeyError, AttributeError):
      delattr(sys.modules["transformers.models.qwen2_vl"], "video_processing_qwen2_vl")


# --- smart_resize and config ------------------------------------------------


@hypothesis.settings(max_examples=400, deadline=None)
@hypothesis.given(
  height=st.integers(1, 20000),
  width=st.integers(1, 20000),
  factor=st.sampled_from([14, 28, 32]),
  min_pixels=st.sampled_from([56 * 56, 128 * 28 * 28, 4 * 28 * 28]),
  max_pixels=st.sampled_from([28 * 28 * 1280, 768 * 28 * 28, 200_000]),
)
def test_smart_resize_matches_hf(height, width, factor, min_pixels, max_pixels):
  try:
    expected = hf_pil.smart_resize(height, width, factor, min_pixels, max_pixels)
  except ValueError:
    with pytest.raises(ValueError, match="aspect ratio"):
      vp.smart_resize(height, width, factor, min_pixels, max_pixels)
    return
  got = vp.smart_resize(height, width, factor, min_pixels, max_pixels)
  assert got == expected
  assert got[0] % factor == 0 and got[1] % factor == 0


def test_smart_resize_rejects_extreme_aspect_and_empty():
  with pytest.raises(ValueError, match="aspect ratio"):
    vp.smart_resize(10, 2010)
  with pytest.raises(ValueError, match="positive"):
    vp.smart_resize(0, 28)


def test_default_config_matches_hf_class_defaults(hf_video_cls):
  cfg = vp.VisionProcessorConfig()
  img = hf_pil.Qwen2VLImageProcessorPil
  assert cfg.image_min_pixels == img.size["shortest_edge"]
  assert cfg.image_max_pixels == img.size["longest_edge"]
  assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (
    img.patch_size,
    img.temporal_patch_size,
    img.merge_size,
  )
  np.testing.assert_array_equal(cfg.image_mean, img.image_mean)
  np.testing.assert_array_equal(cfg.image_std, img.image_std)
  assert cfg.resample == img.resample
  vid = hf_video_cls
  assert cfg.video_min_pixels == vid.size["shortest_edge"]
  assert cfg.video_max_pixels == vid.size["longest_edge"]
  assert (cfg.video_min_frames, cfg.video_max_frames) == (vid.min_frames, vid.max_frames)
  assert cfg.video_max_tokens == vid.max_video_tokens
  assert cfg.temporal_patch_size == vid.temporal_patch_size


# --- images -----------------------------------------------------------------

_SMALL_MAX = 200_000  # keeps the "above max_pixels" cases fast on both sides


@pytest.mark.parametrize(
  "height,width,max_pixels",
  [
    (10, 20, None),  # below min_pixels: upscaled
    (28, 28, None),
    (123, 457, None),  # odd sizes
    (457, 123, None),
    (37, 1001, None),
    (56, 84, None),  # already a multiple of 28: no resize
    (900, 1300, _SMALL_MAX),  # above max_pixels: downscaled
    (2000, 333, _SMALL_MAX),
  ],
)
def test_image_matches_hf(height, width, max_pixels):
  cfg = vp.VisionProcessorConfig()
  if max_pixels is not None:
    cfg = vp.VisionProcessorConfig(image_max_pixels=max_pixels)
  rng = np.random.default_rng(height * 7919 + width)
  image = PIL.Image.fromarray(_smooth_noisy_image(rng, height, width))
  expected, expected_grid = _hf_image(image, cfg)
  out = vp.preprocess_image(image, cfg)
  assert out.kind == "image" and out.second_per_grid is None
  assert out.grid_thw == expected_grid
  assert out.patches.dtype == np.float32
  assert out.patches.shape == expected.shape
  np.testing.assert_allclose(out.patches, expected, rtol=0, atol=1e-5)
  assert out.grid_thw == vp.grid_for_size("image", height, width, 1, cfg)


def _mode_image(mode, rng, height=61, width=95):
  rgba = _smooth_noisy_image(rng, height, width, channels=4)
  rgba[..., 3] = rng.integers(0, 256, (height, width))  # real transparency
  base = PIL.Image.fromarray(rgba)
  if mode == "P_transparent":
    pal = base.convert("RGB").convert("P", palette=PIL.Image.Palette.ADAPTIVE)
    pal.info["transparency"] = 3
    return pal
  return base if mode == "RGBA" else base.convert(mode)


@pytest.mark.parametrize("mode", ["L", "RGBA", "LA", "P_transparent", "CMYK"])
def test_image_modes_match_hf(mode):
  cfg = vp.VisionProcessorConfig()
  image = _mode_image(mode, np.random.default_rng(len(mode)))
  expected, expected_grid = _hf_image(image, cfg)
  out = vp.preprocess_image(image, cfg)
  assert out.grid_thw == expected_grid
  np.testing.assert_allclose(out.patches, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("channels", [None, 1, 3, 4])
def test_numpy_image_matches_hf(channels):
  cfg = vp.VisionProcessorConfig()
  rng = np.random.default_rng(channels or 0)
  array = _smooth_noisy_image(rng, 47, 130, channels=channels or 1)
  hf_input = array
  if channels is None:
    # HF rejects [H, W] arrays; we read them as [H, W, 1].
    array = array[..., 0]
  expected, expected_grid = _hf_image(hf_input, cfg)
  out = vp.preprocess_image(array, cfg)
  assert out.grid_thw == expected_grid
  np.testing.assert_allclose(out.patches, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
  "bad,match",
  [
    (np.zeros((20, 30, 3), np.float32), "uint8"),
    (np.zeros((20, 30, 2), np.uint8), "shape"),
    (np.zeros((2, 20, 30, 3), np.uint8), "shape"),
    (np.zeros((0, 30, 3), np.uint8), "positive"),
    (np.zeros((2, 500, 3), np.uint8), "aspect ratio"),
    ("not an image", "PIL image or numpy"),
  ],
)
def test_bad_image_input_raises(bad, match):
  with pytest.raises(ValueError, match=match):
    vp.preprocess_image(bad, vp.VisionProcessorConfig())


def test_grid_and_token_count():
  cfg = vp.VisionProcessorConfig()
  out = vp.preprocess_image(np.zeros((300, 500, 3), np.uint8), cfg)
  t, h, w = out.grid_thw
  assert out.patches.shape[0] == t * h * w
  tokens = vp.num_vision_tokens(out.grid_thw, cfg.merge_size)
  assert tokens * cfg.merge_size**2 == out.patches.shape[0]
  with pytest.raises(ValueError, match="one frame"):
    vp.grid_for_size("image", 300, 500, 2, cfg)
  with pytest.raises(ValueError, match="kind"):
    vp.grid_for_size("audio", 300, 500, 1, cfg)


# --- videos -----------------------------------------------------------------

# Video pixel limits differ from image limits (HF: 128*28*28..768*28*28 per
# frame plus a whole-video cap, against 56*56..28*28*1280 for images). This
# config makes them coincide so image and video paths can be compared, and
# keeps small frames unresized.
_SAME_LIMITS = vp.VisionProcessorConfig(
  video_min_pixels=56 * 56,
  video_max_pixels=28 * 28 * 1280,
  video_cap_pixels_per_frame=False,
)


def _patch_by_loops(frames_FHWC, cfg):
  """Independent derivation of the layout: one row per (t, bh, bw, ih, iw)."""
  f, height, width, _ = frames_FHWC.shape
  p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
  rows = []
  for t in range(f // tp):
    for bh in range(height // (p * m)):
      for bw in range(width // (p * m)):
        for ih in range(m):
          for iw in range(m):
            y, x = (bh * m + ih) * p, (bw * m + iw) * p
            block_TPPC = frames_FHWC[t * tp : (t + 1) * tp, y : y + p, x : x + p]
            rows.append(block_TPPC.transpose(3, 0, 1, 2).reshape(-1))
  return np.stack(rows)


def _normalize_reference(frames_FHWC, cfg):
  mean = np.asarray(cfg.image_mean)
  std = np.asarray(cfg.image_std)
  return ((frames_FHWC / 255.0 - mean) / std).astype(np.float32)


@pytest.mark.parametrize("num_frames", [2, 3, 4, 5])
def test_video_layout_and_padding(num_frames):
  cfg = _SAME_LIMITS
  rng = np.random.default_rng(num_frames)
  # 56x84 is a multiple of 28 inside the limits: no resize, exact pixels.
  frames = rng.integers(0, 256, (num_frames, 56, 84, 3), dtype=np.uint8)
  out = vp.preprocess_video(frames, cfg, fps=2.0)
  padded_f = num_frames + num_frames % 2
  assert out.grid_thw == (padded_f // 2, 4, 6)
  assert out.grid_thw == vp.grid_for_size("video", 56, 84, num_frames, cfg)
  assert out.kind == "video" and out.second_per_grid == pytest.approx(1.0)
  pad = frames[-1:].repeat(padded_f - num_frames, axis=0)
  padded = np.concatenate([frames, pad])
  expected = _patch_by_loops(_normalize_reference(padded, cfg), cfg)
  np.testing.assert_allclose(out.patches, expected, rtol=0, atol=1e-5)
  # The padding slot holds the last real frame, not zeros.
  last_NCTPP = out.patches[-24:].reshape(24, 3, 2, 14, 14)
  np.testing.assert_array_equal(last_NCTPP[:, :, 1], last_NCTPP[:, :, (num_frames - 1) % 2])


def test_video_of_repeated_image_equals_image():
  cfg = _SAME_LIMITS
  frame = _smooth_noisy_image(np.random.default_rng(1), 123, 457)
  video = vp.preprocess_video(np.stack([frame, frame]), cfg, fps=4.0)
  image = vp.preprocess_image(frame, cfg)
  assert video.grid_thw == image.grid_thw
  np.testing.assert_array_equal(video.patches, image.patches)
  assert video.second_per_grid == pytest.approx(0.5)


def test_video_frames_match_hf_image_processor_per_frame():
  # Qwen2VLImageProcessorPil has no videos path (every image gets its own
  # grid (1, h, w) with the frame repeated over T), so it is used per frame:
  # temporal slot s of group g of the video must equal frame 2g+s's patches.
  cfg = _SAME_LIMITS
  rng = np.random.default_rng(2)
  frames = np.stack([_smooth_noisy_image(rng, 75, 131) for _ in range(4)])
  out = vp.preprocess_video(frames, cfg, fps=2.0)
  t, h, w = out.grid_thw
  ours_GNCTPP = out.patches.reshape(t, h * w, 3, 2, 14, 14)
  for k, frame in enumerate(frames):
    hf_patches, (_, hf_h, hf_w) = _hf_image(PIL.Image.fromarray(frame), cfg)
    assert (hf_h, hf_w) == (h, w)
    hf_NCTPP = hf_patches.reshape(h * w, 3, 2, 14, 14)
    np.testing.assert_allclose(
      ours_GNCTPP[k // 2, :, :, k % 2], hf_NCTPP[:, :, 0], rtol=0, atol=1e-5
    )


def test_video_patchify_matches_hf_peer(hf_video_cls):
  cfg = _SAME_LIMITS
  frames = np.random.default_rng(3).integers(0, 256, (5, 56, 112, 3), np.uint8)
  out = vp.preprocess_video(frames, cfg, fps=2.0)
  normalized_BFCHW = torch.from_numpy(
    _normalize_reference(frames, cfg).transpose(0, 3, 1, 2)[None].copy()
  )
  hf_patches, gt, gh, gw = hf_video_cls.patchify(
    None, normalized_BFCHW, patch_size=14, merge_size=2, temporal_patch_size=2
  )
  assert out.grid_thw == (gt, gh, gw)
  np.testing.assert_allclose(out.patches, hf_patches[0].numpy(), atol=1e-5)


@pytest.mark.parametrize(
  "num_frames,height,width",
  [(4, 360, 640), (64, 1080, 1920), (401, 720, 1280), (768, 480, 854), (2, 50, 60), (7, 3000, 200)],
)
def test_video_resize_rule_matches_hf_peer(hf_video_cls, monkeypatch, num_frames, height, width):
  cfg = vp.VisionProcessorConfig()
  seen = []

  def fake_parent_resize(self, image, size, resample, **kwargs):
    del self, resample, kwargs
    seen.append((size.height, size.width))
    return image

  # Only the target size is under test; the torchvision kernel is absent.
  monkeypatch.setattr(hf_video_cls.__mro__[1], "resize", fake_parent_resize)
  hf = hf_video_cls(cap_pixels_per_frame=cfg.video_cap_pixels_per_frame)
  # A [1, F, C, H, W] view without F*H*W memory: only shapes are read.
  videos = torch.zeros(1, 1, 3, 1, 1).expand(1, num_frames, 3, height, width)
  hf.resize(
    videos,
    size=hf.size,
    resample=None,
    factor=cfg.factor,
    temporal_factor=cfg.temporal_patch_size,
    cap_pixels_per_frame=cfg.video_cap_pixels_per_frame,
  )
  assert vp.resized_size("video", height, width, num_frames, cfg) == seen[-1]
  t, h, w = vp.grid_for_size("video", height, width, num_frames, cfg)
  assert (h * 14, w * 14) == seen[-1]
  expected_patches = hf.get_num_of_video_patches(num_frames, *seen[-1], videos_kwargs={})
  assert t * h * w == expected_patches


@pytest.mark.parametrize("total", [1, 2, 3, 17, 30, 31, 300, 1001, 5000])
@pytest.mark.parametrize("video_fps", [7.0, 23.976, 30.0, 60.0])
def test_sample_frames_matches_hf_peer(hf_video_cls, total, video_fps):
  # Lives here, with the other HF-video peer checks, rather than in test_media.
  cfg = vp.VisionProcessorConfig()
  indices, sampled_fps = media.sample_frame_indices(total, video_fps, cfg)
  peer = types.SimpleNamespace(
    num_frames=None,
    fps=cfg.video_fps,
    min_frames=cfg.video_min_frames,
    max_frames=cfg.video_max_frames,
    temporal_patch_size=cfg.temporal_patch_size,
  )
  metadata = video_utils.VideoMetadata(total_num_frames=total, fps=video_fps)
  try:
    expected = hf_video_cls.sample_frames(peer, metadata).numpy()
  except ZeroDivisionError:
    # HF cannot sample a video shorter than temporal_patch_size; we keep it.
    np.testing.assert_array_equal(indices, np.arange(total))
    return
  k = len(indices)
  assert k % cfg.temporal_patch_size == 0
  # HF's arange sometimes appends one index == total (out of range).
  assert len(expected) in (k, k + 1)
  if len(expected) == k + 1:
    assert expected[-1] >= total
  np.testing.assert_array_equal(indices, expected[:k])
  metadata.frames_indices = indices
  assert sampled_fps == pytest.approx(metadata.sampled_fps)


def test_video_pixel_cap_reduces_grid():
  capped = vp.VisionProcessorConfig(video_max_tokens=500)
  uncapped = vp.VisionProcessorConfig(video_cap_pixels_per_frame=False)
  frames = np.random.default_rng(4).integers(0, 256, (4, 480, 640, 3), np.uint8)
  out = vp.preprocess_video(frames, capped, fps=2.0)
  assert out.grid_thw == vp.grid_for_size("video", 480, 640, 4, capped)
  big = vp.grid_for_size("video", 480, 640, 4, uncapped)
  assert np.prod(out.grid_thw) < np.prod(big)
  # The cap never goes below 1.05 * min_pixels.
  _, h, w = out.grid_thw
  assert h * w * 14 * 14 >= 0.9 * capped.video_min_pixels


@pytest.mark.parametrize("num_frames,height,width", [(1, 40, 60), (4, 123, 77)])
def test_video_grid_for_size_agrees_with_defaults(num_frames, height, width):
  cfg = vp.VisionProcessorConfig()
  frames = np.zeros((num_frames, height, width, 3), np.uint8)
  out = vp.preprocess_video(frames, cfg, fps=1.0)
  assert out.grid_thw == vp.grid_for_size("video", height, width, num_frames, cfg)
  assert out.patches.shape == (np.prod(out.grid_thw), 3 * 2 * 14 * 14)


@pytest.mark.parametrize(
  "frames,fps,match",
  [
    (np.zeros((0, 28, 28, 3), np.uint8), 2.0, "at least one frame"),
    (np.zeros((2, 28, 28, 3), np.float32), 2.0, "uint8"),
    (np.zeros((2, 28, 28), np.uint8), 2.0, r"\[F, H, W, 3\]"),
    (np.zeros((2, 28, 28, 4), np.uint8), 2.0, r"\[F, H, W, 3\]"),
    (np.zeros((2, 28, 28, 3), np.uint8), 0.0, "fps"),
    (np.zeros((2, 28, 28, 3), np.uint8), float("nan"), "fps"),
    ([[0]], 2.0, "numpy array"),
  ],
)
def test_bad_video_input_raises(frames, fps, match):
  with pytest.raises(ValueError, match=match):
    vp.preprocess_video(frames, vp.VisionProcessorConfig(), fps=fps)
