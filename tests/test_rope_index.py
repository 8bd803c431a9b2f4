"""M-RoPE position ids against transformers' Qwen2_5_VLModel.get_rope_index.

"grid_extent" mode must equal transformers 5.x exactly. "max_plus_one" mode
must equal transformers for text and images, and for videos equal the original
Qwen2.5-VL / SGLang rule, re-implemented below independently.
"""

import functools
import types

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from transformers import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as hf_qwen

from fluxjax.models import rope_index

IMAGE, VIDEO = 502, 503  # the shipped synthetic tokenizer's pads
VISION_START, VISION_END, PAD = 499, 500, 490
MERGE = 2
TPS = 2
IDS = dict(image_token_id=IMAGE, video_token_id=VIDEO)


def _hf_model(tokens_per_second=TPS):
  """An object that `Qwen2_5_VLModel.get_rope_index` can run on unbound."""
  cfg = Qwen2_5_VLConfig(
    vision_config=dict(spatial_merge_size=MERGE, tokens_per_second=tokens_per_second)
  )
  model = types.SimpleNamespace(config=cfg)
  model.get_vision_position_ids = functools.partial(
    hf_qwen.Qwen2_5_VLModel.get_vision_position_ids, model
  )
  return model


_HF = {TPS: _hf_model(TPS)}


def hf_rope_index(ids_BT, images, videos, seconds, mask_BT=None, tps=TPS):
  """transformers' positions [3, B, T] and deltas [B] as numpy."""
  if tps not in _HF:
    _HF[tps] = _hf_model(tps)
  ids_BT = np.asarray(ids_BT, dtype=np.int64)
  types_BT = np.zeros_like(ids_BT)
  types_BT[ids_BT == IMAGE] = 1
  types_BT[ids_BT == VIDEO] = 2
  # As the HF processor hands them over: long grids, float32 seconds.
  pos, deltas = hf_qwen.Qwen2_5_VLModel.get_rope_index(
    _HF[tps],
    torch.from_numpy(ids_BT),
    mm_token_type_ids=torch.from_numpy(types_BT),
    image_grid_thw=torch.tensor(images, dtype=torch.long) if images else None,
    video_grid_thw=torch.tensor(videos, dtype=torch.long) if videos else None,
    second_per_grid_ts=(torch.tensor(seconds, dtype=torch.float32) if videos else None),
    attention_mask=None if mask_BT is None else torch.tensor(mask_BT),
  )
  return pos.numpy(), deltas.numpy().reshape(-1)


def original_rule(ids, images, videos, seconds, tps=TPS):
  """The original Qwen2.5-VL rule as SGLang writes it (loops, not reuse).

  Vision spans are found from <|vision_start|>; text after a span starts at
  the previous chunk's max + 1; video temporal positions are
  long(k * second_per_grid_t * tokens_per_second) in float32.
  """
  chunks, st_pos, i = [], 0, 0
  image_it, video_it, sec_it = iter(images), iter(videos), iter(seconds)
  text_start = 0
  while i < len(ids):
    if ids[i] == VISION_START and i + 1 < len(ids) and ids[i + 1] in (IMAGE, VIDEO):
      text_len = i + 1 - text_start
      chunks.append(np.tile(np.arange(text_len) + st_pos, (3, 1)))
      st_pos += text_len
      is_video = ids[i + 1] == VIDEO
      t, h, w = next(video_it if is_video else image_it)
      spg = torch.tensor(next(sec_it) if is_video else 0.0, dtype=torch.float32)
      rng = torch.arange(t).view(-1, 1).expand(-1, (h // MERGE) * (w // MERGE))
      t_idx = (rng * spg * tps).long().flatten().numpy()
      if not is_video:
        assert t == 1, "real images have one temporal patch"
      rows = []
      for k in range(t):
        for y in range(h // MERGE):
          for x in range(w // MERGE):
            rows.append((t_idx[k * (h // MERGE) * (w // MERGE)], y, x))
      chunks.append(np.array(rows).T + st_pos)
      st_pos = int(chunks[-1].max()) + 1
      i += 1 + t * (h // MERGE) * (w // MERGE)
      text_start = i
    else:
      i += 1
  if text_start < len(ids):
    chunks.append(np.tile(np.arange(len(ids) - text_start) + st_pos, (3, 1)))
  pos = np.concatenate(chunks, axis=1)
  return pos, int(pos.max()) + 1 - len(ids)


# --- sequence builders -------------------------------------------------------


def build(segments):
  """segments: ("text", n) | ("image", (t,h,w)) | ("video", ((t,h,w), spg))."""
  ids, images, videos, seconds = [], [], [], []
  for n, (kind, arg) in enumerate(segments):
    if kind == "text":
      ids += [(17 * n + j) % 480 + 1 for j in range(arg)]
    else:
      grid = arg if kind == "image" else arg[0]
      count = grid[0] * grid[1] * grid[2] // MERGE**2
      ids += [VISION_START] + [IMAGE if kind == "image" else VIDEO] * count
      ids += [VISION_END]
      if kind == "image":
        images.append(list(grid))
      else:
        videos.append(list(grid))
        seconds.append(arg[1])
  return ids, images, videos, seconds


_side = st.integers(1, 4).map(lambda k: MERGE * k)
_image = st.tuples(st.just(1), _side, _side).map(lambda g: ("image", g))
_spg = st.sampled_from([0.5, 1.0, 2.0, 0.25, 1.5, 0.3, 2 / 3, 4 / 3, 0.1])
_video = st.tuples(st.tuples(st.integers(1, 6), _side, _side), _spg).map(lambda a: ("video", a))
_text = st.integers(1, 5).map(lambda n: ("text", n))


_VISION = st.one_of(_image, _video)


@st.composite
def layouts(draw, vision=_VISION):
  segs = [draw(_text)]
  for _ in range(draw(st.integers(0, 4))):
    segs += [draw(vision), draw(_text)]
  if len(segs) > 1 and draw(st.booleans()):
    segs.pop()  # may end on a vision span
  return segs


def ours(ids, images, videos, seconds, mode, tps=TPS):
  return rope_index.get_rope_index(
    ids,
    images or None,
    videos or None,
    seconds or None,
    **IDS,
    spatial_merge_size=MERGE,
    tokens_per_second=tps,
    text_after_vision=mode,
  )


# --- grid_extent == transformers ---------------------------------------------

CASES = {
  "text_only": [("text", 7)],
  "one_image": [("text", 3), ("image", (1, 4, 6)), ("text", 4)],
  "images_of_different_sizes": [
    ("text", 2),
    ("image", (1, 4, 4)),
    ("text", 1),
    ("image", (1, 8, 2)),
    ("text", 3),
    ("image", (1, 2, 10)),
    ("text", 2),
  ],
  "video_half_second": [("text", 3), ("video", ((4, 4, 4), 0.5)), ("text", 3)],
  "video_one_second": [("text", 3), ("video", ((4, 4, 4), 1.0)), ("text", 3)],
  "video_fractional": [("text", 1), ("video", ((5, 2, 4), 0.3)), ("text", 2)],
  "image_and_video": [
    ("text", 2),
    ("image", (1, 6, 4)),
    ("text", 2),
    ("video", ((3, 4, 2), 1.0)),
    ("text", 1),
    ("image", (1, 2, 2)),
    ("text", 2),
  ],
  "ends_on_vision": [("text", 2), ("image", (1, 4, 4))],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_grid_extent_matches_transformers(name):
  ids, images, videos, seconds = build(CASES[name])
  want_pos, want_delta = hf_rope_index([ids], images, videos, seconds)
  pos, delta = ours(ids, images, videos, seconds, "grid_extent")
  assert pos.dtype == np.int32 and pos.shape == (3, len(ids))
  np.testing.assert_array_equal(pos, want_pos[:, 0])
  assert delta == want_delta[0]


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(layouts())
def test_grid_extent_matches_transformers_random(segments):
  ids, images, videos, seconds = build(segments)
  want_pos, want_delta = hf_rope_index([ids], images, videos, seconds)
  pos, delta = ours(ids, images, videos, seconds, "grid_extent")
  np.testing.assert_array_equal(pos, want_pos[:, 0])
  assert delta == want_delta[0]


def test_image_with_several_temporal_patches_matches_transformers():
  # Not produced by the processor, but transformers defines it (interval 1);
  # such an image then outlasts its spatial extent, like a long video.
  ids, images, videos, seconds = build([("text", 2), ("image", (3, 4, 2)), ("text", 2)])
  want_pos, _ = hf_rope_index([ids], images, videos, seconds)
  ext, _ = ours(ids, images, videos, seconds, "grid_extent")
  np.testing.assert_array_equal(ext, want_pos[:, 0])
  mpo, _ = ours(ids, images, videos, seconds, "max_plus_one")
  np.testing.assert_array_equal(mpo[:, :9], want_pos[:, 0, :9])
  np.testing.assert_array_equal(mpo[:, 9:], rope_index.text_positions(3, 6))


def test_other_tokens_per_second_matches_transformers():
  ids, images, videos, seconds = build([("text", 2), ("video", ((6, 4, 4), 0.7)), ("text", 2)])
  want_pos, want_delta = hf_rope_index([ids], images, videos, seconds, tps=25)
  pos, delta = ours(ids, images, videos, seconds, "grid_extent", tps=25)
  np.testing.assert_array_equal(pos, want_pos[:, 0])
  assert delta == want_delta[0]


# --- max_plus_one: transformers for images, the original rule for videos -----


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(layouts(vision=_image))
def test_max_plus_one_equals_transformers_without_video(segments):
  ids, images, videos, seconds = build(segments)
  want_pos, want_delta = hf_rope_index([ids], images, videos, seconds)
  pos, delta = ours(ids, images, videos, seconds, "max_plus_one")
  np.testing.assert_array_equal(pos, want_pos[:, 0])
  assert delta == want_delta[0]


@hypothesis.settings(max_examples=80, deadline=None)
@hypothesis.given(layouts())
def test_max_plus_one_equals_original_rule(segments):
  ids, images, videos, seconds = build(segments)
  want_pos, want_delta = original_rule(ids, images, videos, seconds)
  pos, delta = ours(ids, images, videos, seconds, "max_plus_one")
  np.testing.assert_array_equal(pos, want_pos)
  assert delta == want_delta


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(layouts(vision=_video))
def test_vision_positions_identical_in_both_modes_up_to_offset(segments):
  # Each span's positions relative to its own start are the same in both
  # modes and in transformers; only where spans start differs.
  ids, images, videos, seconds = build(segments)
  hf_pos = hf_rope_index([ids], images, videos, seconds)[0][:, 0]
  pos, _ = ours(ids, images, videos, seconds, "max_plus_one")
  is_vision = np.isin(np.asarray(ids), [IMAGE, VIDEO])
  starts = np.flatnonzero(is_vision & ~np.roll(is_vision, 1))
  for s in starts:
    e = s
    while e < len(ids) and is_vision[e]:
      e += 1
    rel_hf = hf_pos[:, s:e] - hf_pos[1, s]
    rel_ours = pos[:, s:e] - pos[1, s]
    np.testing.assert_array_equal(rel_ours, rel_hf)


def test_modes_differ_only_after_long_videos():
  # grid (4, 4, 4), 1 s per grid, 2 tokens/s: temporal 0, 2, 4, 6 past the
  # spatial extent 2. The span starts at 4 (3 text + vision_start).
  ids, images, videos, seconds = build([("text", 3), ("video", ((4, 4, 4), 1.0)), ("text", 2)])
  ext, _ = ours(ids, images, videos, seconds, "grid_extent")
  mpo, delta = ours(ids, images, videos, seconds, "max_plus_one")
  np.testing.assert_array_equal(np.unique(mpo[0, 4:20]), [4, 6, 8, 10])
  assert ext[0, 20] == 4 + 2  # <|vision_end|>, grid extent
  assert mpo[0, 20] == 10 + 1  # <|vision_end|>, max + 1
  np.testing.assert_array_equal(mpo[:, -1], [13, 13, 13])
  assert delta == 14 - len(ids)


# --- batches ----------------------------------------------------------------


def _pad(rows, left=True):
  t = max(len(r) for r in rows) + 1  # at least one pad somewhere
  ids = np.full((len(rows), t), PAD, dtype=np.int64)
  mask = np.zeros((len(rows), t), dtype=np.int64)
  for b, r in enumerate(rows):
    span = slice(t - len(r), t) if left else slice(0, len(r))
    ids[b, span] = r
    mask[b, span] = 1
  return ids, mask


@pytest.mark.parametrize("mode", ["grid_extent", "max_plus_one"])
def test_left_padded_batch_matches_transformers(mode):
  seqs = [
    CASES["one_image"],
    CASES["image_and_video"],
    CASES["text_only"],
    CASES["images_of_different_sizes"],
  ]
  if mode == "max_plus_one":  # transformers' rule differs after videos
    seqs[1] = [s for s in seqs[1] if s[0] != "video"]
  built = [build(s) for s in seqs]
  ids, mask = _pad([b[0] for b in built])
  images = [g for b in built for g in b[1]]
  videos = [g for b in built for g in b[2]]
  seconds = [s for b in built for s in b[3]]
  want_pos, want_deltas = hf_rope_index(ids, images, videos, seconds, mask)
  pos, deltas = rope_index.get_rope_index_batch(
    ids,
    mask,
    images,
    videos or None,
    seconds or None,
    **IDS,
    tokens_per_second=TPS,
    text_after_vision=mode,
  )
  assert pos.shape == (3,) + ids.shape and pos.dtype == np.int32
  np.testing.assert_array_equal(pos, want_pos)
  np.testing.assert_array_equal(deltas, want_deltas)
  assert (pos[:, mask == 0] == 0).all()


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(st.lists(layouts(), min_size=1, max_size=4), st.booleans())
def test_random_padded_batch_matches_transformers(seqs, left):
  built = [build(s) for s in seqs]
  ids, mask = _pad([b[0] for b in built], left=left)
  images = [g for b in built for g in b[1]]
  videos = [g for b in built for g in b[2]]
  seconds = [s for b in built for s in b[3]]
  want_pos, want_deltas = hf_rope_index(ids, images, videos, seconds, mask)
  pos, deltas = rope_index.get_rope_index_batch(
    ids,
    mask,
    images or None,
    videos or None,
    seconds or None,
    **IDS,
    text_after_vision="grid_extent",
  )
  np.testing.assert_array_equal(pos, want_pos)
  np.testing.assert_array_equal(deltas, want_deltas)


def test_batch_without_mask_equals_single_rows():
  built = [build(CASES["image_and_video"]), build(CASES["image_and_video"])]
  ids = np.array([built[0][0], built[1][0]])
  images = built[0][1] + built[1][1]
  videos = built[0][2] + built[1][2]
  seconds = built[0][3] + built[1][3]
  pos, deltas = rope_index.get_rope_index_batch(ids, None, images, videos, seconds, **IDS)
  one, delta = ours(*built[0], "max_plus_one")
  np.testing.assert_array_equal(pos[:, 0], one)
  np.testing.assert_array_equal(pos[:, 1], one)
  np.testing.assert_array_equal(deltas, [delta, delta])


# --- helpers and errors -------------------------------------------------------


def test_text_positions_and_delta():
  np.testing.assert_array_equal(rope_index.text_positions(3, start=5), [[5, 6, 7]] * 3)
  assert rope_index.text_positions(0).shape == (3, 0)
  pos, delta = rope_index.get_rope_index(np.arange(9), **IDS)
  np.testing.assert_array_equal(pos, rope_index.text_positions(9))
  assert delta == 0


def test_decoding_continues_at_length_plus_delta():
  ids, images, videos, seconds = build(CASES["image_and_video"])
  prompt, delta = ours(ids, images, videos, seconds, "max_plus_one")
  full, _ = ours(ids + [7, 8, 9], images, videos, seconds, "max_plus_one")
  np.testing.assert_array_equal(full[:, len(ids) :], rope_index.text_positions(3, len(ids) + delta))
  np.testing.assert_array_equal(full[:, : len(ids)], prompt)


def test_explicit_token_types_equal_derived():
  ids, images, videos, seconds = build(CASES["image_and_video"])
  types_T = np.where(np.asarray(ids) == IMAGE, 1, np.where(np.asarray(ids) == VIDEO, 2, 0))
  a = ours(ids, images, videos, seconds, "max_plus_one")
  b = rope_index.get_rope_index(ids, images, videos, seconds, **IDS, mm_token_type_ids_T=types_T)
  np.testing.assert_array_equal(a[0], b[0])
  assert a[1] == b[1]


def test_back_to_back_spans_are_split_by_grid():
  # Two images with no text between: one run of pads, two grids.
  ids = [1, 2] + [IMAGE] * 4 + [IMAGE] * 2 + [3]
  pos, _ = rope_index.get_rope_index(ids, [[1, 4, 4], [1, 2, 4]], **IDS)
  np.testing.assert_array_equal(pos[:, 2:6], [[2] * 4, [2, 2, 3, 3], [2, 3, 2, 3]])
  np.testing.assert_array_equal(pos[:, 6:8], [[4, 4], [4, 4], [4, 5]])
  np.testing.assert_array_equal(pos[:, 8], [6, 6, 6])


@pytest.mark.parametrize(
  "images,videos,seconds,match",
  [
    ([[1, 4, 4]], None, None, "more image tokens"),
    ([[1, 4, 4], [1, 4, 4], [1, 4, 4]], None, None, "more image grids"),
    ([[1, 2, 2]], None, None, "more image tokens"),
    ([[1, 8, 8], [1, 4, 4]], None, None, "needs 16 tokens"),
    ([[1, 4, 4], [1, 4, 4]], [[1, 2, 2]], None, "more video grids"),
    ([[1, 4, 4], [1, 4, 4]], None, [1.0], "second_per_grid_ts"),
  ],
)
def test_mismatched_grids_raise(images, videos, seconds, match):
  ids = [1] + [IMAGE] * 4 + [2] + [IMAGE] * 4 + [3]
  with pytest.raises(ValueError, match=match):
    rope_index.get_rope_index(ids, images, videos, seconds, **IDS)


def test_missing_grid_raises_and_bad_mode_raises():
  with pytest.raises(ValueError, match="more image tokens than image grids"):
    rope_index.get_rope_index([1, IMAGE, IMAGE, 2], None, **IDS)
  with pytest.raises(ValueError, match="text_after_vision"):
    rope_index.get_rope_index([1, 2], **IDS, text_after_vision="nope")
