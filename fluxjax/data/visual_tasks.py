"""Small-picture tasks with headroom: read the pixels, then combine what they show.

The `reasoning` mix of fluxjax/data/synth.py. Every sample is a 112 px PNG or
a short 56 px MP4 with a verifiable answer computed from what was drawn, and
a difficulty level that sets how much there is to tell apart:

  count_colour    (image) how many shapes of a named colour, among others;
                  easy 2-3 shapes, medium 4-5, hard 6-7.
  left_of         (image) is the {c1} shape left of the {c2} shape (yes/no);
                  horizontal gap easy >= 40 px, medium 20-40, hard 8-20, with
                  0 / 1 / 2 distractor shapes.
  bigger          (image) which of two shapes of one kind, named by colour, is
                  bigger; size ratio easy 2, medium 1.5, hard 1.25.
  digit_sum       (image) the sum of two digits drawn in the picture; digits
                  easy 0-4, medium 0-6, hard 0-9, smaller glyphs when harder.
  colour_changes  (video) how many times one shape changes colour over the
                  clip; easy 1, medium 2, hard 3 changes.

Answers are one token of the tiny tokenizer's vocabulary or a small number,
so the `accuracy` reward is exact; the prompt asks for the answer in
<answer></answer> and leaves room for a short <think> span before it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont

from fluxjax.data.drawing import BACKGROUND, draw_shape
from fluxjax.models.tokenizer import COLORS, SHAPES

LEVELS = ("easy", "medium", "hard")
IMAGE_SIZE = 112  # the tiny preset's largest image side
VIDEO_SIZE = 56  # the tiny preset's video frame side
VIDEO_FRAMES = 8  # at 2 fps: what the processor samples, within its 8-frame cap
VIDEO_FPS = 2.0
INSTRUCTION = " Answer in <answer></answer>."


@dataclasses.dataclass
class Sample:
  """One drawn task.

  Attributes:
    task: the task's name.
    difficulty: one of LEVELS.
    question: the prompt text.
    answer: the reference answer.
    image: the picture (image tasks), else None.
    frames: uint8 [F, H, W, 3] (video tasks), else None.
  """

  task: str
  difficulty: str
  question: str
  answer: str
  image: PIL.Image.Image | None = None
  frames: np.ndarray | None = None


def _canvas(size: int = IMAGE_SIZE) -> tuple[PIL.Image.Image, PIL.ImageDraw.ImageDraw]:
  image = PIL.Image.new("RGB", (size, size), BACKGROUND)
  return image, PIL.ImageDraw.Draw(image)


def _colours(rng: np.random.Generator, k: int) -> list[str]:
  return [str(c) for c in rng.permutation(COLORS)[:k]]


def count_colour(rng: np.random.Generator, level: str) -> Sample:
  total = int(rng.integers(*{"easy": (2, 4), "medium": (4, 6), "hard": (6, 8)}[level]))
  target, *others = _colours(rng, 4)
  count = int(rng.integers(1, min(3, total - 1) + 1))
  colours = [target] * count + [str(rng.choice(others)) for _ in range(total - count)]
  image, draw = _canvas()
  cell = IMAGE_SIZE / 3  # one shape per cell of a 3 x 3 grid: none overlap
  for c, where in zip(colours, rng.permutation(9)[:total]):
    cx, cy = (where % 3 + 0.5) * cell, (where // 3 + 0.5) * cell
    jx, jy = rng.uniform(-0.08, 0.08, 2) * cell
    draw_shape(draw, str(rng.choice(SHAPES)), c, cx + jx, cy + jy, 0.34 * cell)
  return Sample(
    "count_colour",
    level,
    f"How many {target} shapes are in the image?" + INSTRUCTION,
    str(count),
    image=image,
  )


def left_of(rng: np.random.Generator, level: str) -> Sample:
  lo, hi = {"easy": (40, 70), "medium": (20, 40), "hard": (8, 20)}[level]
  distractors = {"easy": 0, "medium": 1, "hard": 2}[level]
  c1, c2, *rest = _colours(rng, 2 + distractors)
  r = 11.0
  gap = float(rng.uniform(lo, hi))
  left = float(rng.uniform(r + 2, IMAGE_SIZE - r - 2 - gap))
  first_is_left = bool(rng.random() < 0.5)
  x1, x2 = (left, left + gap) if first_is_left else (left + gap, left)
  # The two named shapes in separate bands of rows; distractors in the third.
  rows = rng.permutation([IMAGE_SIZE / 6, IMAGE_SIZE / 2, 5 * IMAGE_SIZE / 6])
  image, draw = _canvas()
  draw_shape(draw, str(rng.choice(SHAPES)), c1, x1, rows[0], r)
  draw_shape(draw, str(rng.choice(SHAPES)), c2, x2, rows[1], r)
  for k, c in enumerate(rest):
    x = (k + 0.5) * IMAGE_SIZE / len(rest) + rng.uniform(-6, 6)
    draw_shape(draw, str(rng.choice(SHAPES)), c, x, rows[2], r)
  return Sample(
    "left_of",
    level,
    f"Is the {c1} shape left of the {c2} shape? Answer yes or no." + INSTRUCTION,
    "yes" if first_is_left else "no",
    image=image,
  )


def bigger(rng: np.random.Generator, level: str) -> Sample:
  ratio = {"easy": 2.0, "medium": 1.5, "hard": 1.25}[level]
  c1, c2 = _colours(rng, 2)
  small = float(rng.uniform(9, 13))
  sizes = [small * ratio, small] if rng.random() < 0.5 else [small, small * ratio]
  image, draw = _canvas()
  xs = rng.permutation([IMAGE_SIZE / 4, 3 * IMAGE_SIZE / 4])
  shape = str(rng.choice(SHAPES))  # one shape for both: size alone differs
  for c, r, x in zip((c1, c2), sizes, xs):
    y = IMAGE_SIZE / 2 + rng.uniform(-15, 15)
    draw_shape(draw, shape, c, x, y, r)
  return Sample(
    "bigger",
    level,
    f"Which shape is bigger, the {c1} one or the {c2} one?" + INSTRUCTION,
    c1 if sizes[0] > sizes[1] else c2,
    image=image,
  )


def digit_sum(rng: np.random.Generator, level: str) -> Sample:
  top = {"easy": 4, "medium": 6, "hard": 9}[level]
  font_size = {"easy": 44, "medium": 38, "hard": 32}[level]
  a, b = (int(x) for x in rng.integers(0, top + 1, 2))
  image = PIL.Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
  draw = PIL.ImageDraw.Draw(image)
  font = PIL.ImageFont.load_default(size=font_size)
  for digit, x in ((a, IMAGE_SIZE / 4), (b, 3 * IMAGE_SIZE / 4)):
    y = IMAGE_SIZE / 2 + rng.uniform(-12, 12)
    draw.text((x + rng.uniform(-6, 6), y), str(digit), fill=(0, 0, 0), font=font, anchor="mm")
  return Sample(
    "digit_sum",
    level,
    "What is the sum of the two digits in the image?" + INSTRUCTION,
    str(a + b),
    image=image,
  )


def colour_changes(rng: np.random.Generator, level: str) -> Sample:
  changes = {"easy": 1, "medium": 2, "hard": 3}[level]
  # Segment starts: frame 0, then `changes` distinct later frames.
  starts = [0, *sorted(int(f) for f in rng.choice(np.arange(1, VIDEO_FRAMES), changes, False))]
  colours: list[str] = []
  for _ in starts:  # consecutive segments differ, so every boundary is a change
    colours.append(str(rng.choice([c for c in COLORS if not colours or c != colours[-1]])))
  shape = str(rng.choice(SHAPES))
  pictures = []
  for c in colours:
    image, draw = _canvas(VIDEO_SIZE)
    draw_shape(draw, shape, c, VIDEO_SIZE / 2, VIDEO_SIZE / 2, 0.35 * VIDEO_SIZE)
    pictures.append(np.asarray(image))
  segment = np.searchsorted(np.asarray(starts), np.arange(VIDEO_FRAMES), side="right") - 1
  return Sample(
    "colour_changes",
    level,
    "How many times does the shape change colour in the video?" + INSTRUCTION,
    str(changes),
    frames=np.stack([pictures[s] for s in segment]),
  )


TASKS: dict[str, Callable[[np.random.Generator, str], Sample]] = {
  "count_colour": count_colour,
  "left_of": left_of,
  "bigger": bigger,
  "digit_sum": digit_sum,
  "colour_changes": colour_changes,
}


def draw(rng: np.random.Generator, task: str | None = None, level: str | None = None) -> Sample:
  """One sample; the task and level are drawn uniformly unless given."""
  task = task or str(rng.choice(sorted(TASKS)))
  level = level or str(rng.choice(LEVELS))
  if task not in TASKS:
    raise ValueError(f"unknown task {task!r}; choose one of {sorted(TASKS)}")
  if level not in LEVELS:
    raise ValueError(f"unknown difficulty {level!r}; choose one of {LEVELS}")
  return TASKS[task](rng, level)
