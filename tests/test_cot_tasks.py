"""The CoT tasks: solutions read back from the pixels and decoded videos, balanced
answers at every level, held-out items disjoint from training by content."""

import collections
import dataclasses
import itertools
import json
import os
import re

import av
import numpy as np
import PIL.Image
import pytest
from scipy import ndimage

from fluxjax import config_args
from fluxjax.data import cot_tasks, drawing, readers, synth, visual_tasks
from fluxjax.data.meta import ToMeta
from fluxjax.models import media, processor
from fluxjax.models.tokenizer import COLORS, Tokenizer
from fluxjax.rl import reward_fns, sft
from fluxjax.settings import Settings
from helpers import ROOT

NAMES = list(drawing.RGB)
TOKENIZER = Tokenizer.default()
PALETTE = np.asarray(list(drawing.RGB.values()), np.float64)


def _colour_at(pixels, y, x):
  patch = pixels[y - 1 : y + 2, x - 1 : x + 2].reshape(-1, 3).mean(0)
  return NAMES[int(np.abs(PALETTE - patch).sum(1).argmin())]


def _steps(solution):
  """(item, running count) of each step of a solution ("a red circle1 b blue star1")."""
  steps = re.findall(r"\s*([^\d]+?)(\d+)", solution)
  assert " ".join(f"{item}{n}" for item, n in steps) == solution  # one form for every step
  return [item for item, _ in steps], [int(n) for _, n in steps]


def _listed(question):
  return question.split(": ", 1)[1].split("?")[0].split(", ")


def _colour(item):
  """The colour an item names ("a red circle" -> "red")."""
  (colour,) = [w for w in item.split() if w in COLORS]
  return colour


@pytest.mark.parametrize("level", visual_tasks.LEVELS)
def test_a_scan_lists_the_shapes_in_reading_order_and_counts_the_named_colour(level):
  rng = np.random.default_rng(0)
  lo, hi = cot_tasks.SCAN_SHAPES[level]
  for _ in range(20):
    count = int(rng.integers(1, cot_tasks.SCAN_COUNTS[level][1] + 1))
    s = cot_tasks.draw(rng, "scan_count", level, count)
    pixels = np.asarray(s.image)
    occupied = (pixels != drawing.BACKGROUND).any(-1)
    cell = visual_tasks.CELL
    seen = []
    for row, col in itertools.product(range(visual_tasks.GRID), repeat=2):
      y, x = (row * cell + cell // 2, col * cell + cell // 2)
      if occupied[row * cell : (row + 1) * cell, col * cell : (col + 1) * cell].any():
        seen.append(_colour_at(pixels, y, x))
    colours, counts = _steps(s.solution)
    assert colours == seen and lo <= len(seen) <= hi
    target = re.search(r"how many are (\w+)\?", s.question).group(1)
    rises = [b - a for a, b in zip([0, *counts], counts)]
    assert rises == [int(c == target) for c in seen] and s.answer == str(count) == str(counts[-1])
    assert sum(c == target for c in seen) == count
    assert ndimage.label(occupied)[1] == len(seen)  # one shape per cell


@pytest.mark.parametrize("task", ["pair_census", "colour_census"])
@pytest.mark.parametrize("level", visual_tasks.LEVELS)
def test_a_census_names_each_item_in_order_and_counts_those_the_image_holds(task, level):
  """Read back from the pixels: the shapes drawn are the named items present
  and at most CENSUS_DISTRACTORS of items not named, and the running count
  rises exactly at the named items whose colour is drawn (for colours alone:
  no named colour that is not counted is drawn)."""
  rng = np.random.default_rng(0)
  lo, hi = cot_tasks.CENSUS_NAMED[task][level]
  for present in cot_tasks.TASKS[task].answers(level):
    s = cot_tasks.draw(rng, task, level, present)
    listed = _listed(s.question)
    assert lo <= len(listed) <= hi and len(set(listed)) == len(listed)
    items, counts = _steps(s.solution)
    assert items == listed
    steps = list(zip(items, counts))
    assert counts[-1] == present and s.answer == str(present)
    assert all(b - a in (0, 1) for a, b in zip([0, *counts], counts))
    pixels = np.asarray(s.image)
    occupied = (pixels != drawing.BACKGROUND).any(-1)
    shapes = ndimage.label(occupied)[1]
    assert present <= shapes <= present + cot_tasks.CENSUS_DISTRACTORS
    drawn = collections.Counter()
    cell = visual_tasks.CELL
    for row, col in itertools.product(range(visual_tasks.GRID), repeat=2):
      if occupied[row * cell : (row + 1) * cell, col * cell : (col + 1) * cell].any():
        drawn[_colour_at(pixels, row * cell + cell // 2, col * cell + cell // 2)] += 1
    counted = [item for (item, n), before in zip(steps, [0, *counts]) if n > before]
    for item in counted:
      assert drawn[_colour(item)] >= 1, (item, drawn)
    if task == "colour_census":
      assert not set(drawn) & (set(listed) - set(counted)), (listed, counted, drawn)


def _drawn_colours(image) -> collections.Counter:
  pixels = np.asarray(image)
  occupied = (pixels != drawing.BACKGROUND).any(-1)
  drawn = collections.Counter()
  cell = visual_tasks.CELL
  for row, col in itertools.product(range(visual_tasks.GRID), repeat=2):
    if occupied[row * cell : (row + 1) * cell, col * cell : (col + 1) * cell].any():
      drawn[_colour_at(pixels, row * cell + cell // 2, col * cell + cell // 2)] += 1
  return drawn


@pytest.mark.parametrize("level", visual_tasks.LEVELS)
def test_a_colour_list_counts_every_mention_of_a_drawn_colour(level):
  """Read back from the pixels: the running count rises at a mention exactly
  when its colour is drawn, repeats count each time, and the chain is as long
  as the list (k mentions of the level's range)."""
  rng = np.random.default_rng(1)
  lo, hi = cot_tasks.LIST_MENTIONS[level]
  for present in cot_tasks.TASKS["colour_list"].answers(level):
    s = cot_tasks.draw(rng, "colour_list", level, present)
    listed = _listed(s.question)
    assert lo <= len(listed) <= hi
    assert [item.split()[0] for item in listed] == list(cot_tasks.KEYS[: len(listed)])
    items, counts = _steps(s.solution)
    assert items == listed
    drawn = _drawn_colours(s.image)
    rises = [b - a for a, b in zip([0, *counts], counts)]
    assert rises == [int(_colour(c) in drawn) for c in listed], (listed, drawn, s.solution)
    assert counts[-1] == present and s.answer == str(present)
    unlisted = set(drawn) - {_colour(c) for c in listed}
    assert len(unlisted) <= cot_tasks.CENSUS_DISTRACTORS and sum(drawn.values()) <= 16
    if level == "hard":  # the long tail the reasoning workload needs
      assert len(sft.answer_ids(TOKENIZER, s.answer, s.solution)) >= 48


@pytest.mark.parametrize("level", visual_tasks.LEVELS)
def test_a_palette_scan_counts_the_colours_drawn_in_a_fixed_order(level):
  """Read back from the pixels: the solution names every colour in the
  tokenizer's order, and its count rises exactly at the colours drawn."""
  rng = np.random.default_rng(2)
  for present in cot_tasks.TASKS["palette_scan"].answers(level):
    s = cot_tasks.draw(rng, "palette_scan", level, present)
    items, counts = _steps(s.solution)
    assert items == list(COLORS)
    drawn = _drawn_colours(s.image)
    rises = [b - a for a, b in zip([0, *counts], counts)]
    assert rises == [int(c in drawn) for c in COLORS], (drawn, s.solution)
    assert len(drawn) == present == counts[-1] and s.answer == str(present)


def _clips(tmp_path, seed):
  """(changes, sample, MP4 path) of a count_changes clip per level and answer."""
  rng = np.random.default_rng(seed)
  for level in visual_tasks.LEVELS:
    for changes in cot_tasks.TASKS["count_changes"].answers(level):
      s = cot_tasks.draw(rng, "count_changes", level, changes)
      path = str(tmp_path / f"{level}{changes}.mp4")
      f, h, w, _ = s.frames.shape
      synth.write_video(path, lambda i, fr=s.frames: fr[i], f, h, w, visual_tasks.VIDEO_FPS)
      yield changes, s, path


def test_a_clip_lists_its_segments_and_counts_the_changes(tmp_path):
  for changes, s, path in _clips(tmp_path, 1):
    _, h, w, _ = s.frames.shape
    with av.open(path) as container:
      frames = [x.to_ndarray(format="rgb24") for x in container.decode(video=0)]
    assert len(frames) == cot_tasks.CHANGE_FRAMES
    seen = [_colour_at(fr, h // 2, w // 2) for fr in frames]
    assert all(seen[i] == seen[i + 1] for i in range(0, len(seen), 2))  # per temporal patch
    segments = [c for c, _ in itertools.groupby(seen)]
    colours, counts = _steps(s.solution)
    assert colours == segments and counts == list(range(changes + 1))
    assert s.answer == str(changes) == str(len(segments) - 1)


def test_column_addition_carries_and_sums():
  assert cot_tasks.column_steps(37, 45) == "7+5=12 3+4+1=8"
  assert cot_tasks.column_steps(5, 4) == "5+4=9"
  rng = np.random.default_rng(2)
  for level in visual_tasks.LEVELS:
    lo, hi = cot_tasks.ADD_DIGITS[level]
    for _ in range(30):
      s = cot_tasks.draw(rng, "add_columns", level, None)
      a, b = (int(x) for x in re.findall(r"\d+", s.question))
      assert int(s.answer) == a + b and lo <= len(str(max(a, b))) <= hi
      assert len(str(a)) == len(str(b))
      # The written columns give the sum's digits from the right, the last carry first.
      sums = [int(step.split("=")[1]) for step in s.solution.split()]
      digits = [x % 10 for x in sums] + ([1] if sums[-1] >= 10 else [])
      assert "".join(map(str, reversed(digits))) == s.answer


def test_every_level_deals_its_answers_evenly(tmp_path):
  manifest = synth.generate(str(tmp_path), "reasoning_cot", 240, seed=4)
  with open(manifest) as f:
    rows = [json.loads(line) for line in f]
  by_level = collections.defaultdict(collections.Counter)
  for r in rows:
    by_level[(r["task"], r["difficulty"])][r["answer"]] += 1
  assert {t for t, _ in by_level} == set(cot_tasks.TASKS)
  for (task, level), counts in by_level.items():
    answers = cot_tasks.TASKS[task].answers(level)
    if answers is None:  # sums of 2+ digits: drawn, no answer repeats much
      assert max(counts.values()) <= 2, (task, level, counts)
      continue
    n, k = sum(counts.values()), len(answers)
    assert set(counts) <= {str(a) for a in answers}
    assert all(n // k <= counts[str(a)] <= -(-n // k) for a in answers), (task, level, counts)


def test_rows_carry_their_solution_which_the_warm_up_teaches(tmp_path):
  manifest = synth.generate(str(tmp_path), "reasoning_cot", 30, seed=5)
  rows = readers.read_rows(manifest)
  builder = ToMeta(processor.VisionProcessorConfig(video_max_frames=cot_tasks.CHANGE_FRAMES))
  metas = [builder(i, r) for i, r in enumerate(rows)]
  assert all(m.error is None and m.solution for m in metas)
  for m in metas:
    target = visual_tasks.reference_response(m.answer, m.solution)
    assert target == f"<think> {m.solution}</think><answer>{m.answer}</answer>"
    assert reward_fns.accuracy_with_format(target, m.answer) == 1.0
  easy = sft.warm_up_rows(rows, ("easy",))
  assert easy and {r["difficulty"] for r in easy} == {"easy"}
  with pytest.raises(ValueError, match=r"sft\.levels"):
    sft.warm_up_rows(rows, ("impossible",))
  # The same seed writes the same dataset.
  again = synth.generate(str(tmp_path / "again"), "reasoning_cot", 30, seed=5)
  assert synth.content_keys(again) == synth.content_keys(manifest)


def test_a_held_out_set_shares_no_item_with_training(tmp_path):
  # One-digit sums have 100 distinct questions: a second set of 120 repeats many.
  train = synth.generate(str(tmp_path / "train"), "add_columns", 150, seed=0)
  keys = synth.content_keys(train)
  again = synth.generate(str(tmp_path / "plain"), "add_columns", 120, seed=1)
  assert synth.content_keys(again) & keys, "the test needs repeats to remove"
  held_out = synth.generate(str(tmp_path / "eval"), "add_columns", 120, seed=1, exclude=keys)
  assert sum(1 for _ in open(held_out)) == 120
  assert not synth.content_keys(held_out) & keys
  # Identical images or clips repeat as identical bytes (the key hashes the files).
  shapes = synth.generate(str(tmp_path / "s1"), "scan_count", 6, seed=7)
  assert synth.content_keys(shapes) == synth.content_keys(
    synth.generate(str(tmp_path / "s2"), "scan_count", 6, seed=7)
  )


def test_the_blind_copy_keeps_questions_and_shapes_but_no_pixels(tmp_path):
  rows = []
  for mix in ("scan_count", "count_changes"):
    src = synth.generate(str(tmp_path / mix), mix, 3, seed=2)
    blind = synth.blind_copy(src, str(tmp_path / f"{mix}_blind"))
    original = [json.loads(line) for line in open(src)]
    copied = [json.loads(line) for line in open(blind)]
    assert copied == original  # same questions, answers, solutions and media paths
    rows += [(tmp_path / mix, tmp_path / f"{mix}_blind", row) for row in original]
  for src_dir, blind_dir, row in rows:
    for rel in row["images"]:
      seen = np.asarray(PIL.Image.open(src_dir / rel).convert("RGB"))
      flat = np.asarray(PIL.Image.open(blind_dir / rel).convert("RGB"))
      assert flat.shape == seen.shape and seen.std() > 0 and flat.std() == 0
    for rel in row["videos"]:
      with av.open(str(src_dir / rel)) as a, av.open(str(blind_dir / rel)) as b:
        fa = [f.to_ndarray(format="rgb24") for f in a.decode(video=0)]
        fb = [f.to_ndarray(format="rgb24") for f in b.decode(video=0)]
      assert len(fa) == len(fb) and fa[0].shape == fb[0].shape
      # H.264 leaves a grey frame within a step of flat; the colours are gone.
      assert max(int(np.ptp(f)) for f in fb) <= 2 < max(int(np.ptp(f)) for f in fa)
  with pytest.raises(ValueError, match="not relative"):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "images": ["/etc/x.png"], "videos": []}) + "\n")
    synth.blind_copy(str(bad), str(tmp_path / "bad_blind"))


def test_a_blind_run_trains_and_evaluates_on_the_pixel_free_copies(tmp_path):
  from fluxjax import config_args
  from fluxjax.rl import loop

  config = config_args.load_config(arg="tiny")
  config.data.update(mix="scan_count", synth_train=4, synth_eval=2, blind=True)
  paths = loop.dataset_paths(config.data, str(tmp_path))
  for split, path in zip(("train", "eval"), paths):
    assert path == str(tmp_path / "data_blind" / split / "manifest.jsonl")
    assert open(path).read() == open(tmp_path / "data" / split / "manifest.jsonl").read()


def _template(question):
  """A question with its colours, shapes, keys and numbers blanked out."""
  words = "|".join(sorted((*COLORS, *visual_tasks.SHAPES), key=len, reverse=True))
  q = re.sub(rf"\b(?:{words})s?\b", "{}", question)
  q = re.sub(rf"\b[{cot_tasks.KEYS}] \{{\}}", "{}", q)
  return re.sub(r"\d+", "{}", q)


def test_every_task_asks_in_words_of_its_own():
  """No two tasks share a question (blanks aside): one wording taught with a
  chain and the same wording taught without one gave a prompt two formats."""
  rng = np.random.default_rng(0)
  asked = collections.defaultdict(set)
  for level in visual_tasks.LEVELS:
    for _ in range(12):
      for task in visual_tasks.TASKS:
        asked[task].add(_template(visual_tasks.draw(rng, task, level).question))
      decks = cot_tasks.AnswerDecks(rng)
      for task in cot_tasks.ALL:
        asked[task].add(
          _template(cot_tasks.draw(rng, task, level, decks.deal(task, level)).question)
        )
  for task, shapes_task in synth.SHAPES_TASKS.items():
    asked[task] = {_template(shapes_task(rng, 56)[1]) for _ in range(12)}
  for a, b in itertools.combinations(asked, 2):
    assert not asked[a] & asked[b], (a, b, asked[a] & asked[b])


def _at(ids, sub):
  """Where `sub` starts in `ids` (every start)."""
  return [i for i in range(len(ids) - len(sub) + 1) if ids[i : i + len(sub)] == sub]


@pytest.mark.parametrize("task", ["colour_list", "pair_census", "colour_census"])
def test_a_copied_item_is_unique_in_its_question_and_the_same_tokens_in_the_chain(task):
  """A chain step copies its item from the question: the item is there once
  (keys make repeated colours distinct), and its tokens are those of the
  chain's step, the first step included (the space after <think>)."""
  rng = np.random.default_rng(3)
  for level in visual_tasks.LEVELS:
    for answer in cot_tasks.TASKS[task].answers(level):
      s = cot_tasks.draw(rng, task, level, answer)
      listed = _listed(s.question)
      assert len(set(listed)) == len(listed)
      question = TOKENIZER.encode(s.question)
      response = sft.answer_ids(TOKENIZER, s.answer, s.solution)
      for item in listed:
        ids = TOKENIZER.encode(" " + item)
        assert len(_at(question, ids)) == 1, (item, s.question)
        assert _at(response, ids), (item, TOKENIZER.decode(response))
      think = TOKENIZER.encode("<think>")
      first = TOKENIZER.encode(" " + listed[0])
      assert response[: len(think) + len(first)] == think + first


def test_a_clip_through_the_loaders_sampling_shows_every_change_between_patches(tmp_path):
  """At the default job's limits the processor keeps every frame of a
  count_changes clip, so each temporal patch is one colour and the patches'
  colours change exactly as the solution counts."""
  vision = Settings.of(config_args.load_config(arg="tiny")).data.vision
  cfg = processor.VisionProcessorConfig(**dataclasses.asdict(vision))
  tp = cfg.temporal_patch_size
  for changes, s, path in _clips(tmp_path, 4):
    _, h, w, _ = s.frames.shape
    frames, _ = media.load_video(path, cfg)
    patches = [
      {_colour_at(fr, h // 2, w // 2) for fr in frames[i : i + tp]}
      for i in range(0, len(frames), tp)
    ]
    assert all(len(p) == 1 for p in patches), (s.difficulty, changes, patches)
    segments = [c for c, _ in itertools.groupby(p.pop() for p in patches)]
    assert segments == _steps(s.solution)[0] and len(segments) == changes + 1


@pytest.mark.parametrize("level", visual_tasks.LEVELS)
def test_the_drills_copy_from_a_keyed_list(level):
  """key_lookup answers the colour its key names; list_repeat answers the
  list itself: pure copies, text only, no chain to show."""
  rng = np.random.default_rng(5)
  for _ in range(30):
    s = cot_tasks.draw(rng, "key_lookup", level, None)
    listed = _listed(s.question)
    key = re.search(r"the key (\w):", s.question).group(1)
    lo, hi = cot_tasks.LOOKUP_ITEMS[level]
    assert lo <= len(listed) <= hi and [i.split()[0] for i in listed] == list(
      cot_tasks.KEYS[: len(listed)]
    )
    assert s.answer == dict(i.split() for i in listed)[key] and s.solution is None
    r = cot_tasks.draw(rng, "list_repeat", level, None)
    listed = r.question.split(": ", 1)[1].split(".")[0].split(", ")
    lo, hi = cot_tasks.REPEAT_ITEMS[level]
    assert lo <= len(listed) <= hi and r.answer == " ".join(listed) and r.solution is None
    assert s.image is s.frames is r.image is r.frames is None


def test_the_pretraining_pool_holds_chains_drills_and_the_guessed_rl_tasks(tmp_path):
  """Every chain task and drill, and the post-training job's direct-answer
  tasks, each of which the pretraining teaches only as guesses (RL is left
  to teach them)."""
  manifest = synth.generate(str(tmp_path), "pretrain", 1000, 0)
  rows = readers.read_rows(manifest)
  tasks = collections.Counter(r["task"] for r in rows)
  direct = {k for k in synth.MIXES["post_train"] if k.partition("@")[0] not in cot_tasks.TASKS}
  assert set(tasks) == {*cot_tasks.TASKS, *cot_tasks.DRILLS, *direct}
  guess = config_args.load_config(os.path.join(ROOT, "configs", "pretrain.py")).sft.guess
  assert set(guess.tasks) == direct and set(guess.levels) == {"medium", "hard"}
  for r in rows:
    assert (r["task"] in cot_tasks.TASKS) == bool(r.get("solution"))
    if r["task"] in cot_tasks.DRILLS:
      assert not r["images"] and not r["videos"]


def test_a_mix_key_may_name_the_level_of_its_task(tmp_path, monkeypatch):
  monkeypatch.setitem(
    synth.MIXES, "levelled", {"scan_count@hard": 1, "count_colour@easy": 1, "colour": 1}
  )
  rows = readers.read_rows(synth.generate(str(tmp_path), "levelled", 30, 0))
  levels = collections.Counter((r["task"], r.get("difficulty", "")) for r in rows)
  assert set(levels) == {("scan_count", "hard"), ("count_colour", "easy"), ("colour", "")}
  for bad, why in (("scan_count@expert", "names no level"), ("colour@hard", "names no level")):
    monkeypatch.setitem(synth.MIXES, "bad", {bad: 1})
    with pytest.raises(ValueError, match=why):
      synth.generate(str(tmp_path / "bad"), "bad", 1, 0)
  monkeypatch.setitem(synth.MIXES, "bad", {"scan": 1})
  with pytest.raises(ValueError, match="unknown task 'scan'"):
    synth.generate(str(tmp_path / "bad"), "bad", 1, 0)
