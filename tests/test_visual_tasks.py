"""The reasoning tasks' answers, read back from the pixels of the written files."""

import itertools
import json

import av
import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont
import pytest
from scipy import ndimage

from fluxjax.data import drawing, readers, synth, visual_tasks
from fluxjax.data.meta import ToMeta
from fluxjax.models import processor


def _mask(image, colour):
  return (np.asarray(image.convert("RGB")) == drawing.RGB[colour]).all(-1)


def _named(question, count):
  """The colour words of the question, in order (the task's named shapes)."""
  words = [w.strip("?,.") for w in question.split()]
  return [w for w in words if w in drawing.RGB][:count]


@pytest.mark.parametrize("level", visual_tasks.LEVELS)
def test_image_answers_match_the_pixels(level):
  rng = np.random.default_rng(0)
  for _ in range(30):
    s = visual_tasks.draw(rng, "count_colour", level)
    (colour,) = _named(s.question, 1)
    _, blobs = ndimage.label(_mask(s.image, colour))
    assert str(blobs) == s.answer
    total = ndimage.label((np.asarray(s.image) != drawing.BACKGROUND).any(-1))[1]
    assert total in {"easy": (2, 3), "medium": (4, 5, 6), "hard": (7, 8, 9)}[level]
    _assert_one_shape_per_cell(s.image)

    s = visual_tasks.draw(rng, "left_of", level)
    c1, c2 = _named(s.question, 2)
    x1 = np.nonzero(_mask(s.image, c1))[1].mean()
    x2 = np.nonzero(_mask(s.image, c2))[1].mean()
    assert s.answer == ("yes" if x1 < x2 else "no")

    s = visual_tasks.draw(rng, "bigger", level)
    c1, c2 = _named(s.question, 2)
    a1, a2 = _mask(s.image, c1).sum(), _mask(s.image, c2).sum()
    assert s.answer == (c1 if a1 > a2 else c2)
    ratio = {"easy": 4.0, "medium": 2.25, "hard": 1.5625}[level]  # area ratio = ratio^2
    assert max(a1, a2) / min(a1, a2) == pytest.approx(ratio, rel=0.2)
    _assert_one_shape_per_cell(s.image)

    s = visual_tasks.draw(rng, "colour_of_shape", level)
    kind = s.question.removeprefix("What colour is the ").split("?")[0]
    labels, blobs = ndimage.label((np.asarray(s.image) != drawing.BACKGROUND).any(-1))
    assert blobs == {"easy": 1, "medium": 2, "hard": 3}[level]
    kinds = {}
    for box, k in zip(ndimage.find_objects(labels), range(1, blobs + 1)):
      blob = labels[box] == k
      colour = tuple(np.asarray(s.image)[box][blob][0])
      kinds[_kind(blob)] = next(c for c, rgb in drawing.RGB.items() if rgb == colour)
    assert len(kinds) == blobs  # distinct kinds: the question names one shape
    assert kinds[kind] == s.answer
    _assert_one_shape_per_cell(s.image)


def _kind(blob):
  """A filled shape's kind from how much of its bounding box it fills."""
  fills = {"square": 1.0, "circle": np.pi / 4, "triangle": 0.5, "star": 0.34}
  return min(fills, key=lambda k: abs(fills[k] - blob.mean()))


def _assert_one_shape_per_cell(image):
  """Every shape lies inside one cell of the merged-token grid (28 px)."""
  labels, _ = ndimage.label((np.asarray(image) != drawing.BACKGROUND).any(-1))
  cell = visual_tasks.CELL
  for box in ndimage.find_objects(labels):
    rows, cols = box
    assert rows.start // cell == (rows.stop - 1) // cell, box
    assert cols.start // cell == (cols.stop - 1) // cell, box


def _glyph(digit, size):
  font = PIL.ImageFont.load_default(size=size)
  image = PIL.Image.new("L", (size * 2, size * 2), 255)
  PIL.ImageDraw.Draw(image).text((size, size), str(digit), fill=0, font=font, anchor="mm")
  ink = np.asarray(image) < 128
  rows, cols = np.nonzero(ink)
  return ink[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]


def test_digit_sum_answer_is_the_sum_of_the_drawn_glyphs():
  """Each drawn digit is identified by matching its ink against rendered glyphs."""
  rng = np.random.default_rng(1)
  for level in visual_tasks.LEVELS:
    size = {"easy": 44, "medium": 38, "hard": 32}[level]
    glyphs = {d: _glyph(d, size) for d in range(10)}
    for _ in range(10):
      s = visual_tasks.draw(rng, "digit_sum", level)
      ink = np.asarray(s.image.convert("L")) < 128
      read = []
      for half in (ink[:, : visual_tasks.IMAGE_SIZE // 2], ink[:, visual_tasks.IMAGE_SIZE // 2 :]):
        rows, cols = np.nonzero(half)
        crop = half[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]

        def iou(g, crop=crop):
          h, w = min(g.shape[0], crop.shape[0]), min(g.shape[1], crop.shape[1])
          a, b = g[:h, :w], crop[:h, :w]
          shape_penalty = abs(g.shape[0] - crop.shape[0]) + abs(g.shape[1] - crop.shape[1])
          return (a & b).sum() / max((a | b).sum(), 1) - 0.05 * shape_penalty

        read.append(max(glyphs, key=lambda d: iou(glyphs[d])))
      assert str(sum(read)) == s.answer, (read, s.answer)


@pytest.mark.parametrize("task", ["colour_changes", "last_colour"])
def test_video_answers_are_read_from_the_decoded_video(tmp_path, task):
  rng = np.random.default_rng(2)
  names = list(drawing.RGB)
  palette = np.asarray(list(drawing.RGB.values()), np.float64)
  for level in visual_tasks.LEVELS:
    for k in range(4):
      s = visual_tasks.draw(rng, task, level)
      path = str(tmp_path / f"{level}{k}.mp4")
      f, h, w, _ = s.frames.shape
      synth.write_video(path, lambda i, fr=s.frames: fr[i], f, h, w, visual_tasks.VIDEO_FPS)
      with av.open(path) as container:
        frames = [x.to_ndarray(format="rgb24") for x in container.decode(video=0)]
      assert len(frames) == visual_tasks.VIDEO_FRAMES
      centre = [fr[h // 2 - 2 : h // 2 + 2, w // 2 - 2 : w // 2 + 2].mean((0, 1)) for fr in frames]
      seen = [int(np.abs(palette - c).sum(1).argmin()) for c in centre]
      changes = sum(a != b for a, b in itertools.pairwise(seen))
      assert changes == {"easy": 1, "medium": 2, "hard": 3}[level]
      # Changes fall between frame pairs: each temporal patch (2 frames) shows one colour.
      assert all(seen[i] == seen[i + 1] for i in range(0, len(seen), 2))
      assert s.answer == (str(changes) if task == "colour_changes" else names[seen[-1]])


def test_reasoning_mix_rows_carry_task_difficulty_and_load(tmp_path):
  manifest = synth.generate(str(tmp_path), "reasoning", 60, seed=3)
  with open(manifest) as f:
    raw = [json.loads(line) for line in f]
  assert {r["task"] for r in raw} == set(visual_tasks.TASKS)
  assert {r["difficulty"] for r in raw} == set(visual_tasks.LEVELS)
  assert all(("<answer></answer>" in r["prompt"]) for r in raw)
  assert sum(bool(r["videos"]) for r in raw) > 0 and sum(bool(r["images"]) for r in raw) > 0
  rows = readers.read_rows(manifest)
  builder = ToMeta(processor.VisionProcessorConfig(video_max_frames=8))
  metas = [builder(i, r) for i, r in enumerate(rows)]
  assert all(m.error is None for m in metas)
  assert [m.difficulty for m in metas] == [r["difficulty"] for r in raw]
  # The same seed writes the same dataset.
  again = synth.generate(str(tmp_path / "again"), "reasoning", 60, seed=3)
  with open(again) as f:
    assert [json.loads(line)["answer"] for line in f] == [r["answer"] for r in raw]
  with pytest.raises(ValueError, match="unknown task"):
    visual_tasks.draw(np.random.default_rng(0), "juggle")
