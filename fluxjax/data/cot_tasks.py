"""Tasks with a worked solution whose length grows with the instance.

The `reasoning_cot` mix of fluxjax/data/synth.py: one generator per task (`scan_count`,
`count_changes`, `pair_census`, `colour_census`, `colour_list`, `palette_scan`,
`add_columns`, the `DRILLS`), each level's answers dealt by `AnswerDecks`. Each sample
carries its reference chain of thought (`Sample.solution`). The tasks, their levels and
the form of a solution step are told in docs/data.md, "The `reasoning_cot` tasks".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from fluxjax.data import visual_tasks
from fluxjax.data.drawing import draw_shape
from fluxjax.data.visual_tasks import CELL, GRID, INSTRUCTION, Sample
from fluxjax.models.tokenizer import COLORS, SHAPES

# Inclusive ranges per level.
SCAN_SHAPES = {"easy": (1, 3), "medium": (4, 8), "hard": (9, GRID * GRID)}
SCAN_COUNTS = {"easy": (1, 3), "medium": (1, 4), "hard": (1, 6)}
CHANGES = {"easy": (1, 2), "medium": (3, 4), "hard": (5, 7)}
# Named items and how many of them are present, per level.
CENSUS_NAMED = {
  "pair_census": {"easy": (2, 3), "medium": (5, 7), "hard": (9, 12)},
  "colour_census": {"easy": (2, 3), "medium": (4, 5), "hard": (6, 8)},
}
CENSUS_PRESENT = {
  "pair_census": {"easy": (0, 2), "medium": (0, 5), "hard": (0, 9)},
  "colour_census": {"easy": (0, 2), "medium": (0, 4), "hard": (0, 6)},
}
CENSUS_DISTRACTORS = 3  # at most this many shapes of pairs not named
LIST_MENTIONS = {"easy": (1, 3), "medium": (6, 10), "hard": (12, 15)}
LIST_PRESENT = {"easy": (0, 2), "medium": (0, 5), "hard": (0, 9)}
LIST_MAX_COLOURS = 4  # distinct colours the present (or absent) mentions use, at most
LOOKUP_ITEMS = {"easy": (3, 5), "medium": (6, 10), "hard": (11, 15)}
REPEAT_ITEMS = {"easy": (2, 4), "medium": (5, 8), "hard": (9, 12)}
PALETTE_PRESENT = {"easy": (1, 2), "medium": (3, 4), "hard": (5, 7)}
ADD_DIGITS = {"easy": (1, 1), "medium": (2, 3), "hard": (4, 6)}
CHANGE_FRAMES = 16  # 8 temporal patches: up to 7 changes
# The keys of a keyed list, one letter per item (one token each with a space).
KEYS = "abcdefghijklmno"
# How often each level is drawn (visual_tasks.LEVELS order).
LEVEL_P = (1 / 3, 1 / 3, 1 / 3)
# A level's answers are dealt from a deck when there are at most this many;
# past it (sums of 2+ digits) a uniform draw leaves no answer a visible share.
_DECK_MAX = 64


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
  return int(rng.integers(bounds[0], bounds[1] + 1))


def running_count(items: list[str], counted: list[bool]) -> str:
  """The items in order, each tagged with the running count of counted ones."""
  out, n = [], 0
  for item, count in zip(items, counted):
    n += count
    out.append(f"{item}{n}")
  return " ".join(out)


def keyed(items: list[str]) -> list[str]:
  """Each item behind its own key letter ("a red", "b blue", "c red")."""
  if len(items) > len(KEYS):
    raise ValueError(f"{len(items)} items but {len(KEYS)} keys")
  return [f"{key} {item}" for key, item in zip(KEYS, items)]


def _dealt(answer: int | None, task: str) -> int:
  if answer is None:
    raise ValueError(f"{task} builds around a dealt answer")
  return answer


def scan_count(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  count = _dealt(answer, "scan_count")
  lo, hi = SCAN_SHAPES[level]
  total = _uniform(rng, (max(lo, count), hi))
  target, *others = (str(c) for c in rng.permutation(COLORS))
  colours = [target] * count + [str(rng.choice(others)) for _ in range(total - count)]
  colours = [colours[k] for k in rng.permutation(total)]
  cells = np.sort(rng.permutation(GRID * GRID)[:total])  # reading order
  image, draw = visual_tasks.canvas()
  for c, cell in zip(colours, cells):
    cx, cy = visual_tasks.centre(int(cell) % GRID, int(cell) // GRID)
    draw_shape(draw, str(rng.choice(SHAPES)), c, cx, cy, 0.36 * CELL)
  return Sample(
    "scan_count",
    level,
    f"Go through the shapes in reading order: how many are {target}?" + INSTRUCTION,
    str(count),
    image=image,
    solution=running_count(colours, [c == target for c in colours]),
  )


def count_changes(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  changes = _dealt(answer, "count_changes")
  colours, frames = visual_tasks.changing_clip(rng, changes, CHANGE_FRAMES)
  return Sample(
    "count_changes",
    level,
    "Follow the shape's colour from start to end: how many changes are there?" + INSTRUCTION,
    str(changes),
    frames=frames,
    solution=running_count(colours, [k > 0 for k in range(len(colours))]),
  )


def _census(
  rng: np.random.Generator,
  task: str,
  level: str,
  answer: int | None,
  items: list[tuple[str, str | None]],
  keys: bool = False,
) -> Sample:
  """k of `items` (colour, shape or None: any shape) named, `answer` of them
  drawn; `keys`: each named item behind its key letter."""
  present = _dealt(answer, task)
  lo, hi = CENSUS_NAMED[task][level]
  k = _uniform(rng, (max(lo, present), hi))
  order = rng.permutation(len(items))
  named = [items[i] for i in order[:k]]
  others = [items[i] for i in order[k:]]
  shown = [named[i] for i in sorted(rng.permutation(k)[:present])]
  extra = _uniform(rng, (0, min(CENSUS_DISTRACTORS, len(others), GRID * GRID - present)))
  drawn = shown + [others[i] for i in rng.permutation(len(others))[:extra]]
  image = visual_tasks.scattered(rng, [c for c, _ in drawn], [s for _, s in drawn])
  listed = [" ".join(x for x in item if x) for item in named]
  listed = keyed(listed) if keys else listed
  return Sample(
    task,
    level,
    f"How many of these are in the image: {', '.join(listed)}?" + INSTRUCTION,
    str(present),
    image=image,
    solution=running_count(listed, [p in shown for p in named]),
  )


def pair_census(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  pairs: list[tuple[str, str | None]] = [(str(c), str(s)) for c in COLORS for s in SHAPES]
  return _census(rng, "pair_census", level, answer, pairs, keys=True)


def colour_census(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  return _census(rng, "colour_census", level, answer, [(str(c), None) for c in COLORS])


def _split(rng: np.random.Generator, mentions: int, colours: list[str]) -> list[str]:
  """`mentions` mentions using every one of `colours` (none if mentions is 0)."""
  if not mentions:
    return []
  used = colours[: min(len(colours), mentions)]
  return used + [str(c) for c in rng.choice(used, mentions - len(used))]


def colour_list(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  present = _dealt(answer, "colour_list")
  k = _uniform(rng, (max(LIST_MENTIONS[level][0], present), LIST_MENTIONS[level][1]))
  palette = [str(c) for c in rng.permutation(COLORS)]
  shown = palette[: _uniform(rng, (1, min(LIST_MAX_COLOURS, present)))] if present else []
  rest = palette[len(shown) :]
  missing = rest[: _uniform(rng, (1, min(LIST_MAX_COLOURS, k - present)))] if k > present else []
  listed = _split(rng, present, shown) + _split(rng, k - present, missing)
  listed = [listed[i] for i in rng.permutation(k)]
  others = rest[len(missing) :]
  drawn = shown + others[: _uniform(rng, (0, min(CENSUS_DISTRACTORS, len(others))))]
  return Sample(
    "colour_list",
    level,
    f"How many of these colours are in the image: {', '.join(keyed(listed))}?" + INSTRUCTION,
    str(present),
    image=visual_tasks.scattered(rng, drawn),
    solution=running_count(keyed(listed), [c in shown for c in listed]),
  )


def palette_scan(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  present = _dealt(answer, "palette_scan")
  shown = [str(c) for c in rng.permutation(COLORS)[:present]]
  return Sample(
    "palette_scan",
    level,
    "How many different colours are in the image?" + INSTRUCTION,
    str(present),
    image=visual_tasks.scattered(rng, shown),
    solution=running_count([str(c) for c in COLORS], [c in shown for c in COLORS]),
  )


def _sum_range(digits: int) -> tuple[int, int]:
  """The sums of two numbers of `digits` digits (0-9 for one digit)."""
  lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
  return 2 * lo, 2 * hi


def _addends(rng: np.random.Generator, digits: int, total: int) -> tuple[int, int]:
  """Two numbers of `digits` digits adding up to `total`."""
  lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
  a = int(rng.integers(max(lo, total - hi), min(hi, total - lo) + 1))
  return a, total - a


def column_steps(a: int, b: int) -> str:
  """Column addition from the right: "7+5=12 3+4+1=8"."""
  steps, carry = [], 0
  for x, y in zip(reversed(str(a)), reversed(str(b))):
    s = int(x) + int(y) + carry
    steps.append(f"{x}+{y}" + ("+1" if carry else "") + f"={s}")
    carry = s // 10
  return " ".join(steps)


def add_columns(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  """`answer` is the sum where the level's sums are dealt; else it is drawn here."""
  digits = _uniform(rng, ADD_DIGITS[level])
  total = answer if answer is not None else _uniform(rng, _sum_range(digits))
  a, b = _addends(rng, digits, total)
  return Sample(
    "add_columns",
    level,
    f"What is {a} + {b}?" + INSTRUCTION,
    str(total),
    solution=column_steps(a, b),
  )


def _keyed_colours(rng: np.random.Generator, bounds: tuple[int, int]) -> list[str]:
  """A keyed list of colours (repeats allowed) of a length within `bounds`."""
  return keyed([str(c) for c in rng.choice(COLORS, _uniform(rng, bounds))])


def key_lookup(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  del answer  # a colour, drawn here
  items = _keyed_colours(rng, LOOKUP_ITEMS[level])
  key, colour = items[int(rng.integers(len(items)))].split()
  return Sample(
    "key_lookup",
    level,
    f"Which colour has the key {key}: {', '.join(items)}?" + INSTRUCTION,
    colour,
  )


def list_repeat(rng: np.random.Generator, level: str, answer: int | None) -> Sample:
  del answer  # the list itself
  items = _keyed_colours(rng, REPEAT_ITEMS[level])
  return Sample(
    "list_repeat",
    level,
    f"Repeat this list without its commas: {', '.join(items)}." + INSTRUCTION,
    " ".join(items),
  )


@dataclasses.dataclass(frozen=True)
class Task:
  """A task: its answers per level (None: too many to deal) and its builder."""

  answers: Callable[[str], list[int] | None]
  build: Callable[[np.random.Generator, str, int | None], Sample]


def _range(bounds: tuple[int, int]) -> list[int]:
  return list(range(bounds[0], bounds[1] + 1))


def _add_answers(level: str) -> list[int] | None:
  lo, hi = ADD_DIGITS[level]
  ranges = [_sum_range(d) for d in range(lo, hi + 1)]
  if sum(b - a + 1 for a, b in ranges) > _DECK_MAX:
    return None
  return sorted({s for r in ranges for s in _range(r)})


TASKS: dict[str, Task] = {
  "scan_count": Task(lambda level: _range(SCAN_COUNTS[level]), scan_count),
  "count_changes": Task(lambda level: _range(CHANGES[level]), count_changes),
  "pair_census": Task(lambda level: _range(CENSUS_PRESENT["pair_census"][level]), pair_census),
  "colour_census": Task(
    lambda level: _range(CENSUS_PRESENT["colour_census"][level]), colour_census
  ),
  "colour_list": Task(lambda level: _range(LIST_PRESENT[level]), colour_list),
  "palette_scan": Task(lambda level: _range(PALETTE_PRESENT[level]), palette_scan),
  "add_columns": Task(_add_answers, add_columns),
}
DRILLS: dict[str, Task] = {
  "key_lookup": Task(lambda level: None, key_lookup),
  "list_repeat": Task(lambda level: None, list_repeat),
}
ALL: dict[str, Task] = {**TASKS, **DRILLS}


class AnswerDecks:
  """Deals each (task, level)'s answers from shuffled decks.

  Each answer holds floor(n/k) or ceil(n/k) of a level's n items (docs/data.md,
  "The `reasoning_cot` tasks").
  """

  def __init__(self, rng: np.random.Generator):
    self._rng = rng
    self._decks: dict[tuple[str, str], list[int]] = {}

  def deal(self, task: str, level: str) -> int | None:
    answers = ALL[task].answers(level)
    if answers is None:
      return None
    deck = self._decks.setdefault((task, level), [])
    if not deck:
      deck.extend(int(a) for a in self._rng.permutation(answers))
    return deck.pop()


def draw(rng: np.random.Generator, task: str, level: str, answer: int | None) -> Sample:
  """One sample of `task` (a chain task or a drill) at `level` whose answer
  is `answer` (if dealt)."""
  if task not in ALL:
    raise ValueError(f"unknown task {task!r}; choose one of {sorted(ALL)}")
  if level not in visual_tasks.LEVELS:
    raise ValueError(f"unknown difficulty {level!r}; choose one of {visual_tasks.LEVELS}")
  return ALL[task].build(rng, level, answer)
