"""Small-picture tasks with headroom: read the pixels, then combine what they show.

The `reasoning` mix of fluxjax/data/synth.py: one generator per task, each sample a
112 px PNG or a short 56 px MP4 with a verifiable answer computed from what was drawn
and a difficulty level; `reference_response` writes a sample's reference answer. The
tasks, their levels and the grid of CELL px cells are told in docs/data.md, "The
`reasoning` tasks".
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
VIDEO_FRAMES = 8  # at 2 fps: all of them sampled, within the tiny variant's cap
VIDEO_FPS = 2.0
CELL = 28  # one merged vision token: 2 x 2 patches of 14 px
GRID = IMAGE_SIZE // CELL
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
    solution: the worked steps before the answer (data/cot_tasks.py), or
      None where the answer is given directly.
  """

  task: str
  difficulty: str
  question: str
  answer: str
  image: PIL.Image.Image | None = None
  frames: np.ndarray | None = None
  solution: str | None = None


def reference_response(answer: str, solution: str | None = None) -> str:
  """The response a sample is taught and rewarded for (`accuracy_with_format`
  gives it 1.0): its worked solution in <think></think> first where it has
  one, with a space after <think> so its first word is the token it is
  everywhere else."""
  think = f"<think> {solution}</think>" if solution else ""
  return f"{think}<answer>{answer}</answer>"


def canvas(size: int = IMAGE_SIZE) -> tuple[PIL.Image.Image, PIL.ImageDraw.ImageDraw]:
  image = PIL.Image.new("RGB", (size, size), BACKGROUND)
  return image, PIL.ImageDraw.Draw(image)


def _colours(rng: np.random.Generator, k: int) -> list[str]:
  return [str(c) for c in rng.permutation(COLORS)[:k]]


def centre(col: int, row: int) -> tuple[float, float]:
  """The pixel centre of a grid cell."""
  return (col + 0.5) * CELL, (row + 0.5) * CELL


def cells(rng: np.random.Generator, k: int) -> list[tuple[float, float]]:
  """Centres of k distinct cells of the GRID x GRID grid, in random order."""
  return [centre(c % GRID, c // GRID) for c in rng.permutation(GRID**2)[:k]]


def scattered(
  rng: np.random.Generator, colours: list[str], shapes: list[str | None] | None = None
) -> PIL.Image.Image:
  """An image of one shape per colour, in distinct random cells; a shape not
  given (None) is drawn at random."""
  image, draw = canvas()
  for i, (cx, cy) in enumerate(cells(rng, len(colours))):
    shape = shapes[i] if shapes is not None else None
    draw_shape(draw, shape or str(rng.choice(SHAPES)), colours[i], cx, cy, 0.36 * CELL)
  return image


def count_colour(rng: np.random.Generator, level: str) -> Sample:
  total = int(rng.integers(*{"easy": (2, 4), "medium": (4, 7), "hard": (7, 10)}[level]))
  target, *others = _colours(rng, 4)
  count = int(rng.integers(1, min(3, total - 1) + 1))
  colours = [target] * count + [str(rng.choice(others)) for _ in range(total - count)]
  return Sample(
    "count_colour",
    level,
    f"How many {target} shapes are in the image?" + INSTRUCTION,
    str(count),
    image=scattered(rng, colours),
  )


def left_of(rng: np.random.Generator, level: str) -> Sample:
  gaps = {"easy": (2, 3), "medium": (1, 2), "hard": (1,)}[level]
  distractors = {"easy": 0, "medium": 1, "hard": 2}[level]
  c1, c2, *rest = _colours(rng, 2 + distractors)
  gap = int(rng.choice(gaps))
  left = int(rng.integers(0, GRID - gap))
  first_is_left = bool(rng.random() < 0.5)
  col1, col2 = (left, left + gap) if first_is_left else (left + gap, left)
  rows = rng.permutation(GRID)
  image, draw = canvas()
  # The two named shapes in rows of their own; distractors share a third.
  placed = [(c1, col1, rows[0]), (c2, col2, rows[1])]
  placed += [(c, col, rows[2]) for c, col in zip(rest, rng.permutation(GRID))]
  for c, col, row in placed:
    draw_shape(draw, str(rng.choice(SHAPES)), c, *centre(col, row), 0.36 * CELL)
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
  large = 0.45 * CELL
  sizes = [large, large / ratio] if rng.random() < 0.5 else [large / ratio, large]
  image, draw = canvas()
  shape = str(rng.choice(SHAPES))  # one shape for both: size alone differs
  for c, r, (cx, cy) in zip((c1, c2), sizes, cells(rng, 2)):
    draw_shape(draw, shape, c, cx, cy, r)
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


def changing_clip(
  rng: np.random.Generator, changes: int, num_frames: int = VIDEO_FRAMES
) -> tuple[list[str], np.ndarray]:
  """One shape whose colour changes `changes` times: (colours in order, frames)."""
  # Segments start at frame 0 and at `changes` distinct later even frames, so
  # a change never falls inside a temporal patch (2 frames).
  later = rng.choice(np.arange(2, num_frames, 2), changes, False)
  starts = [0, *sorted(int(f) for f in later)]
  colours: list[str] = []
  for _ in starts:  # consecutive segments differ, so every boundary is a change
    colours.append(str(rng.choice([c for c in COLORS if not colours or c != colours[-1]])))
  shape = str(rng.choice(SHAPES))
  pictures = []
  for c in colours:
    image, draw = canvas(VIDEO_SIZE)
    draw_shape(draw, shape, c, VIDEO_SIZE / 2, VIDEO_SIZE / 2, 0.35 * VIDEO_SIZE)
    pictures.append(np.asarray(image))
  segment = np.searchsorted(np.asarray(starts), np.arange(num_frames), side="right") - 1
  return colours, np.stack([pictures[s] for s in segment])


def colour_changes(rng: np.random.Generator, level: str) -> Sample:
  changes = {"easy": 1, "medium": 2, "hard": 3}[level]
  _, frames = changing_clip(rng, changes)
  return Sample(
    "colour_changes",
    level,
    "How many times does the shape change colour in the video?" + INSTRUCTION,
    str(changes),
    frames=frames,
  )


def colour_of_shape(rng: np.random.Generator, level: str) -> Sample:
  k = {"easy": 1, "medium": 2, "hard": 3}[level]
  colours = _colours(rng, k)
  kinds = [str(x) for x in rng.permutation(SHAPES)[:k]]
  image, draw = canvas()
  for c, kind, (cx, cy) in zip(colours, kinds, cells(rng, k)):
    draw_shape(draw, kind, c, cx, cy, 0.42 * CELL)
  return Sample(
    "colour_of_shape",
    level,
    f"What colour is the {kinds[0]}?" + INSTRUCTION,
    colours[0],
    image=image,
  )


def last_colour(rng: np.random.Generator, level: str) -> Sample:
  colours, frames = changing_clip(rng, {"easy": 1, "medium": 2, "hard": 3}[level])
  return Sample(
    "last_colour",
    level,
    "What colour is the shape at the end of the video?" + INSTRUCTION,
    colours[-1],
    frames=frames,
  )


TASKS: dict[str, Callable[[np.random.Generator, str], Sample]] = {
  "count_colour": count_colour,
  "left_of": left_of,
  "bigger": bigger,
  "digit_sum": digit_sum,
  "colour_changes": colour_changes,
  "colour_of_shape": colour_of_shape,
  "last_colour": last_colour,
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
