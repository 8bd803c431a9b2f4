"""Synthetic multimodal RL datasets: real JPEG/PNG images and H.264 MP4 videos.

Run: python -m fluxjax.data.synth --out DIR --mix image_heavy --n 64 --seed 0
Every task is verifiable: its answer is computed from what was drawn. The tasks,
their size distributions (bench/mixtures.py), the mix weights and the two knobs
that keep files small are told in docs/data.md, "Synthetic data".
"""

from __future__ import annotations

import argparse
import dataclasses
import fractions
import hashlib
import json
import logging
import os
import time
from collections.abc import Mapping

import av
import numpy as np
import PIL.Image
import PIL.ImageDraw
import PIL.ImageFont

from fluxjax.data import cot_tasks, distributions, visual_tasks
from fluxjax.data.drawing import BACKGROUND, draw_shape
from fluxjax.models import media as media_lib
from fluxjax.models.tokenizer import COLORS, SHAPES

log = logging.getLogger(__name__)

MIXES = {
  "image_heavy": (5, 2, 1),
  "video_heavy": (1, 2, 5),
  "only_video": (0, 0, 1),
  "text": None,
  # Task weights rather than source weights: the small-image tasks.
  "shapes": {"colour": 1, "shape_count": 1},
  # Tasks with difficulty levels that need combining what the pixels show
  # (fluxjax/data/visual_tasks.py): five image tasks and two video tasks.
  "reasoning": {task: 1 for task in visual_tasks.TASKS},
  # The shapes tasks with two reasoning tasks (bench/README.md: with the tiny
  # preset GRPO lifts only the shapes tasks of it).
  "mixed": {"colour": 1, "shape_count": 1, "count_colour": 1, "colour_changes": 1},
  # Tasks whose worked solution grows with the instance
  # (fluxjax/data/cot_tasks.py): a scan of an image before a count, the
  # segments of a clip before a count of changes, column addition in text.
  "reasoning_cot": {task: 1 for task in cot_tasks.TASKS},
  # The shapes colour task, counting by a
  # named colour (an image) and the colour at the end of a clip (a video).
  # GRPO lifts both colour tasks from the pixels in minutes on a CPU; on the
  # count it learns only the answer prior (bench/README.md).
  "reasoning_tiny": {"colour": 1, "count_colour": 1, "last_colour": 1},
  # reasoning_tiny's tasks, answered at once, with colour_list, whose worked
  # solution grows with the list (up to about 57 tokens): short responses
  # with a long tail.
  "reasoning_tail": {"colour": 1, "count_colour": 1, "last_colour": 1, "colour_list": 1},
  # The tiny job's post-training mix (configs/vlm.py tiny_base): 55%
  # prompts answered at once (the reasoning_tiny tasks) and 45% chain tasks
  # at medium and hard, where a chain has work to do; the base
  # (configs/pretrain.py) may reason first or answer directly.
  "post_train": {
    **{
      f"{task}@{level}": 45 / (2 * len(cot_tasks.TASKS))
      for task in cot_tasks.TASKS
      for level in ("medium", "hard")
    },
    "colour": 55 / 3,
    "count_colour": 55 / 3,
    "last_colour": 55 / 3,
  },
  # The pretraining pool of the base model (configs/pretrain.py): every
  # chain task, the text-only copy drills, and the post-training job's
  # direct-answer tasks, whose direct answers the pretraining teaches as
  # guesses (`sft.guess`): the base knows their answer format and prior, and
  # RL has their pixels to teach.
  "pretrain": {
    **{task: 2 for task in cot_tasks.TASKS},
    **{task: 1 for task in cot_tasks.DRILLS},
    "colour": 1,
    "count_colour": 1,
    "last_colour": 1,
  },
}
SOURCES = ("geo3k", "nextqa", "longvila")


# The parameters bench/mixtures.py uses too (one definition, see distributions).
LogNormal = distributions.LogNormal
GEO3K_LONG_SIDE = distributions.GEO3K_LONG_SIDE
NEXTQA_SECONDS = distributions.NEXTQA_SECONDS
NEXTQA_RESOLUTIONS = distributions.NEXTQA_RESOLUTIONS
LONGVILA_SECONDS = distributions.LONGVILA_SECONDS
LONGVILA_RESOLUTIONS = distributions.LONGVILA_RESOLUTIONS
LONGVILA_RES_P = distributions.LONGVILA_RES_P


@dataclasses.dataclass(frozen=True)
class SynthConfig:
  """Knobs of the generator (why they exist: docs/data.md, "Synthetic data").

  Attributes:
    fps: frames written per second of video.
    video_scale: factor on the modelled video resolutions.
    image_scale: factor on the modelled image sizes.
    max_seconds: cap on a video's duration.
    shapes_size: side in pixels of the `shapes` mix's square images.
  """

  fps: float = 1.0
  video_scale: float = 0.25
  image_scale: float = 1.0
  max_seconds: float = 600.0
  shapes_size: int = 112


def _even(x: float) -> int:
  # H.264 in yuv420p needs even sides.
  return max(16, round(x / 2) * 2)


def _image_size(rng: np.random.Generator, synth: SynthConfig) -> tuple[int, int]:
  long_side = GEO3K_LONG_SIDE.sample(rng) * synth.image_scale
  short = long_side * rng.uniform(0.5, 1.0)
  if rng.random() < 0.5:
    return max(32, round(short)), max(32, round(long_side))
  return max(32, round(long_side)), max(32, round(short))


def count_image(rng: np.random.Generator, height: int, width: int):
  """Shapes on a grid; asks how many of one colour and shape there are.

  Returns:
    (PIL image, question, answer).
  """
  image = PIL.Image.new("RGB", (width, height), BACKGROUND)
  draw = PIL.ImageDraw.Draw(image)
  # One shape per grid cell, so shapes never overlap and stay countable.
  cols, rows = 4, 3
  cw, ch = width / cols, height / rows
  cells = rng.permutation(cols * rows)[: rng.integers(3, cols * rows + 1)]
  target_c, target_s = str(rng.choice(COLORS)), str(rng.choice(SHAPES))
  drawn = []
  for cell in cells:
    # Bias towards the asked-for pair so that answers are not mostly zero.
    if rng.random() < 0.35:
      c, s = target_c, target_s
    else:
      c, s = str(rng.choice(COLORS)), str(rng.choice(SHAPES))
    drawn.append((c, s))
    cx = (cell % cols + 0.5) * cw
    cy = (cell // cols + 0.5) * ch
    draw_shape(draw, s, c, cx, cy, 0.38 * min(cw, ch))
  answer = sum(1 for c, s in drawn if (c, s) == (target_c, target_s))
  question = f"How many {target_c} {target_s}s are in the image?"
  return image, question, str(answer)


def _arith(rng: np.random.Generator) -> tuple[str, str, int]:
  sym = str(rng.choice(["+", "-", "*"]))
  x, y = int(rng.integers(0, 101)), int(rng.integers(0, 50))
  if sym == "*":
    y = int(rng.integers(0, 10))
  if sym == "-":
    x, y = max(x, y), min(x, y)
  value = {"+": x + y, "-": x - y, "*": x * y}[sym]
  return f"{x} {sym} {y}", sym, value


def arithmetic_image(rng: np.random.Generator, height: int, width: int):
  """An expression "x op y" drawn as text; the answer is its value."""
  expr, _, value = _arith(rng)
  image = PIL.Image.new("RGB", (width, height), (255, 255, 255))
  draw = PIL.ImageDraw.Draw(image)
  size = max(10, int(min(height, width * 2 / max(len(expr), 1)) * 0.4))
  font = PIL.ImageFont.load_default(size=size)
  draw.text((width / 2, height / 2), expr, fill=(0, 0, 0), font=font, anchor="mm")
  question = f"What is {expr}? Read the expression in the image."
  return image, question, str(value)


def colour_image(rng: np.random.Generator, size: int):
  """One large shape of a random colour; asks for its colour.

  Returns:
    (PIL image, question, answer).
  """
  image = PIL.Image.new("RGB", (size, size), BACKGROUND)
  color, shape = str(rng.choice(COLORS)), str(rng.choice(SHAPES))
  r = size * rng.uniform(0.28, 0.4)
  cx, cy = size / 2 + rng.uniform(-0.08, 0.08, 2) * size
  draw_shape(PIL.ImageDraw.Draw(image), shape, color, cx, cy, r)
  return image, "What colour is the shape in the image?", color


def shape_count_image(rng: np.random.Generator, size: int):
  """1-4 shapes, at most one per quadrant; asks how many there are.

  Colours and shapes are random (never the grey background), so the answer
  is the number of quadrants that hold something.

  Returns:
    (PIL image, question, answer).
  """
  image = PIL.Image.new("RGB", (size, size), BACKGROUND)
  draw = PIL.ImageDraw.Draw(image)
  n = int(rng.integers(1, 5))
  half = size / 2
  for q in rng.permutation(4)[:n]:
    cx, cy = (q % 2 + 0.5) * half, (q // 2 + 0.5) * half
    jx, jy = rng.uniform(-0.06, 0.06, 2) * half
    draw_shape(
      draw,
      str(rng.choice(SHAPES)),
      str(rng.choice(COLORS)),
      cx + jx,
      cy + jy,
      half * rng.uniform(0.28, 0.36),
    )
  return image, "How many shapes are in the image?", str(n)


SHAPES_TASKS = {"colour": colour_image, "shape_count": shape_count_image}
# Every small-picture task is a mix of its own too (`--config.data.mix=colour`).
MIXES.update({task: {task: 1} for task in (*SHAPES_TASKS, *visual_tasks.TASKS, *cot_tasks.ALL)})


def _segments(rng: np.random.Generator, num_frames: int):
  """Splits a clip into 2-5 segments, each showing one coloured shape."""
  k = int(rng.integers(2, 6))
  k = min(k, num_frames)
  cuts = np.sort(rng.choice(np.arange(1, num_frames), k - 1, replace=False))
  bounds = [0, *cuts.tolist(), num_frames]
  colors: list[str] = []
  shapes: list[str] = []
  for _ in range(k):
    # Consecutive segments differ in colour so the last one is unambiguous.
    choices = [c for c in COLORS if not colors or c != colors[-1]]
    colors.append(str(rng.choice(choices)))
    shapes.append(str(rng.choice(SHAPES)))
  return bounds, colors, shapes


def write_video(path: str, frames_fn, num_frames: int, height: int, width: int, fps: float) -> None:
  """Encodes frames_fn(i) -> uint8 [H, W, 3] as H.264 (yuv420p) MP4."""
  # faststart puts the index first, as web-ready files have it; a file cut
  # short then still opens and fails only when decoding reaches the cut.
  with av.open(path, mode="w", options={"movflags": "faststart"}) as container:
    # A rational rate (to the millisecond): PyAV reads its numerator and
    # denominator, which a float lacks.
    stream = container.add_stream("libx264", rate=fractions.Fraction(round(fps * 1000), 1000))
    stream.height, stream.width, stream.pix_fmt = height, width, "yuv420p"
    # ultrafast: the files are test data, encode speed matters, quality not.
    stream.options = {"preset": "ultrafast", "crf": "28"}
    for i in range(num_frames):
      frame = av.VideoFrame.from_ndarray(frames_fn(i), format="rgb24")
      for packet in stream.encode(frame):
        container.mux(packet)
    for packet in stream.encode():
      container.mux(packet)


def last_colour_video(
  rng: np.random.Generator,
  path: str,
  seconds: float,
  height: int,
  width: int,
  synth: SynthConfig,
  ask_shape: bool = False,
):
  """Writes a clip of coloured shapes; asks which colour (shape) is last."""
  num_frames = max(4, round(min(seconds, synth.max_seconds) * synth.fps))
  bounds, colors, shapes = _segments(rng, num_frames)
  # Each segment's picture is drawn once; frames reuse it (cheap to encode).
  pictures = []
  for c, s in zip(colors, shapes):
    image = PIL.Image.new("RGB", (width, height), BACKGROUND)
    draw_shape(PIL.ImageDraw.Draw(image), s, c, width / 2, height / 2, 0.35 * min(height, width))
    pictures.append(np.asarray(image))
  seg_of = np.searchsorted(np.asarray(bounds[1:]), np.arange(num_frames), side="right")
  write_video(path, lambda i: pictures[seg_of[i]], num_frames, height, width, synth.fps)
  if ask_shape:
    return (f"Which shape appears last in the video? Is it a {shapes[-1]}?", shapes[-1], num_frames)
  return "Which colour appears last in the video?", colors[-1], num_frames


def make_sample(
  i: int,
  source: str | None,
  rng: np.random.Generator,
  out_dir: str,
  synth: SynthConfig,
  prefix: str,
) -> dict:
  """Generates one sample's media and returns its manifest row."""
  sid = f"{prefix}-{i:06d}"
  row: dict[str, object] = {"id": sid, "source": source or "text", "images": [], "videos": []}
  if source is None:
    expr, _, value = _arith(rng)
    row.update(prompt=f"What is {expr}?", answer=str(value), task="arith")
    return row
  if source == "geo3k":
    height, width = _image_size(rng, synth)
    if rng.random() < 0.5:
      image, q, a = count_image(rng, height, width)
      task = "count"
    else:
      image, q, a = arithmetic_image(rng, height, width)
      task = "arith_image"
    # Diagrams as PNG half the time: both decoders get exercised.
    ext = "png" if rng.random() < 0.5 else "jpg"
    rel = os.path.join("media", f"{sid}.{ext}")
    image.save(os.path.join(out_dir, rel), quality=90)
    row.update(prompt=q, answer=a, task=task, images=[rel], height=height, width=width)
    return row
  if source == "nextqa":
    seconds = NEXTQA_SECONDS.sample(rng)
    h, w = NEXTQA_RESOLUTIONS[rng.integers(len(NEXTQA_RESOLUTIONS))]
  else:
    seconds = LONGVILA_SECONDS.sample(rng)
    h, w = LONGVILA_RESOLUTIONS[rng.choice(len(LONGVILA_RESOLUTIONS), p=LONGVILA_RES_P)]
  h, w = _even(h * synth.video_scale), _even(w * synth.video_scale)
  rel = os.path.join("media", f"{sid}.mp4")
  ask_shape = source == "longvila" and rng.random() < 0.3
  q, a, frames = last_colour_video(rng, os.path.join(out_dir, rel), seconds, h, w, synth, ask_shape)
  row.update(
    prompt=q,
    answer=a,
    task="last_shape" if ask_shape else "last_colour",
    videos=[rel],
    height=h,
    width=w,
    frames=frames,
    fps=synth.fps,
    seconds=round(seconds, 2),
    scale=synth.video_scale,
  )
  return row


def make_shapes_sample(
  i: int, task: str, rng: np.random.Generator, out_dir: str, synth: SynthConfig, prefix: str
) -> dict:
  """One sample of the `shapes` mix (a lossless PNG, so colours are exact)."""
  sid = f"{prefix}-{i:06d}"
  image, q, a = SHAPES_TASKS[task](rng, synth.shapes_size)
  rel = os.path.join("media", f"{sid}.png")
  image.save(os.path.join(out_dir, rel))
  return {
    "id": sid,
    "source": "shapes",
    "images": [rel],
    "videos": [],
    "prompt": q,
    "answer": a,
    "task": task,
    "height": synth.shapes_size,
    "width": synth.shapes_size,
  }


def make_reasoning_sample(
  i: int, sample: visual_tasks.Sample, out_dir: str, prefix: str, source: str = "reasoning"
) -> dict:
  """The manifest row of a drawn task sample, its PNG or MP4 (VIDEO_FPS) written."""
  sid = f"{prefix}-{i:06d}"
  row = {
    "id": sid,
    "source": source,
    "images": [],
    "videos": [],
    "prompt": sample.question,
    "answer": sample.answer,
    "task": sample.task,
    "difficulty": sample.difficulty,
  }
  if sample.solution is not None:
    row["solution"] = sample.solution
  if sample.image is not None:
    rel = os.path.join("media", f"{sid}.png")
    sample.image.save(os.path.join(out_dir, rel))
    row["images"] = [rel]
  elif sample.frames is not None:
    frames = sample.frames
    rel = os.path.join("media", f"{sid}.mp4")
    f, h, w, _ = frames.shape
    write_video(os.path.join(out_dir, rel), lambda k: frames[k], f, h, w, visual_tasks.VIDEO_FPS)
    row["videos"] = [rel]
  return row


def _inside(out_dir: str, rel: str) -> str:
  """`out_dir`/`rel` with its folder made; a path that leaves `out_dir` is refused."""
  path = os.path.normpath(os.path.join(out_dir, rel))
  if os.path.isabs(rel) or not path.startswith(os.path.normpath(out_dir) + os.sep):
    raise ValueError(f"media path {rel!r} is not relative to its manifest's folder")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  return path


def blind_copy(manifest: str, out_dir: str) -> str:
  """The same rows with pixel-free media: every image and video frame a flat
  grey of the same size (videos keep frame count and rate). Returns the copy's
  manifest path. The control that a task's gain needs the pixels."""
  src = os.path.dirname(manifest)
  with open(manifest) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  for row in rows:
    for rel in row.get("images", ()):
      path = _inside(out_dir, rel)
      h, w = media_lib.probe_image(os.path.join(src, rel))
      PIL.Image.new("RGB", (w, h), BACKGROUND).save(path)
    for rel in row.get("videos", ()):
      path = _inside(out_dir, rel)
      info = media_lib.probe_video(os.path.join(src, rel))
      grey = np.full((info.height, info.width, 3), BACKGROUND, np.uint8)
      write_video(path, lambda _, g=grey: g, info.num_frames, info.height, info.width, info.fps)
  out = os.path.join(out_dir, "manifest.jsonl")
  with open(out, "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
  return out


def content_key(row: dict, out_dir: str) -> str:
  """What makes two items the same: prompt, answer and media bytes (a hash)."""
  h = hashlib.sha256(json.dumps([row["prompt"], row.get("answer")]).encode())
  for rel in [*row.get("images", ()), *row.get("videos", ())]:
    with open(os.path.join(out_dir, rel), "rb") as f:
      h.update(f.read())
  return h.hexdigest()


def content_keys(manifest: str) -> frozenset[str]:
  """The content keys of a written manifest's rows (computed where a row has none)."""
  out_dir = os.path.dirname(manifest)
  with open(manifest) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return frozenset(row.get("content") or content_key(row, out_dir) for row in rows)


def _task_row(
  i: int, task: str, seed: int, out_dir: str, synth: SynthConfig, prefix: str, decks
) -> dict:
  """Row i of a task-weighted mix; its own generator, so rows do not depend on
  how many draws earlier rows made (the CoT answer decks aside). `task` may
  name its level ("scan_count@hard"); otherwise the level is drawn."""
  child = np.random.default_rng([seed, i])
  task, _, level = task.partition("@")
  if task in cot_tasks.ALL:
    level = level or str(child.choice(visual_tasks.LEVELS, p=cot_tasks.LEVEL_P))
    sample = cot_tasks.draw(child, task, level, decks.deal(task, level))
    return make_reasoning_sample(i, sample, out_dir, prefix, source="reasoning_cot")
  if task in visual_tasks.TASKS:
    return make_reasoning_sample(i, visual_tasks.draw(child, task, level or None), out_dir, prefix)
  return make_shapes_sample(i, task, child, out_dir, synth, prefix)


def check_mix_weights(name: str, weights: Mapping[str, float]) -> None:
  """Raises ValueError unless each key of a task-weighted mix is a task, or a
  task with levels and one of its levels ("scan_count@hard")."""
  leveled = (*cot_tasks.ALL, *visual_tasks.TASKS)
  for key in weights:
    task, at, level = key.partition("@")
    if task not in (*leveled, *SHAPES_TASKS):
      raise ValueError(f"mix {name!r}: unknown task {task!r} in {key!r}")
    if at and (task not in leveled or level not in visual_tasks.LEVELS):
      raise ValueError(
        f"mix {name!r}: {key!r} names no level of a task with levels ({visual_tasks.LEVELS})"
      )


def _row(i: int, mix: str, rng, seed: int, out_dir: str, synth: SynthConfig, decks) -> dict:
  weights = MIXES[mix]
  prefix = f"{mix}-s{seed}"
  if isinstance(weights, dict):  # task weights (the small-picture mixes)
    tasks = sorted(weights)
    p = np.asarray([weights[t] for t in tasks], np.float64)
    task = tasks[rng.choice(len(tasks), p=p / p.sum())]
    return _task_row(i, task, seed, out_dir, synth, prefix, decks)
  if weights is None:
    source = None
  else:
    p = np.asarray(weights, np.float64)
    source = SOURCES[rng.choice(3, p=p / p.sum())]
  # One child generator per sample, as in _task_row.
  return make_sample(i, source, np.random.default_rng([seed, i]), out_dir, synth, prefix)


def generate(
  out_dir: str,
  mix: str,
  n: int,
  seed: int,
  synth: SynthConfig = SynthConfig(),
  exclude: frozenset[str] = frozenset(),
) -> str:
  """Writes n samples of a mix under out_dir; returns the manifest's path.

  Args:
    out_dir: output directory (created); media go to out_dir/media.
    mix: one of MIXES.
    n: number of samples.
    seed: generator seed; the same seed writes the same dataset.
    synth: size knobs.
    exclude: content keys (`content_key`) no row may have, e.g. the training
      set's for a held-out set: such a draw is dropped (its media removed,
      counted in the log) and the next one taken, until n rows are written.

  Returns:
    Path of out_dir/manifest.jsonl (one JSON row per sample, with its
    `content` key).
  """
  if mix not in MIXES:
    raise ValueError(f"mix must be one of {sorted(MIXES)}, got {mix!r}")
  weights = MIXES[mix]
  if isinstance(weights, dict):
    check_mix_weights(mix, weights)
  os.makedirs(os.path.join(out_dir, "media"), exist_ok=True)
  rng = np.random.default_rng(seed)
  # The answer decks draw from a stream of their own (rows use [seed, i]).
  decks = cot_tasks.AnswerDecks(np.random.default_rng([seed, 1 << 32]))
  manifest = os.path.join(out_dir, "manifest.jsonl")
  written, dropped, i = 0, 0, 0
  with open(manifest, "w") as f:
    while written < n:
      row = _row(i, mix, rng, seed, out_dir, synth, decks)
      i += 1
      row["content"] = content_key(row, out_dir)
      if row["content"] in exclude:
        dropped += 1
        for rel in [*row["images"], *row["videos"]]:
          os.remove(os.path.join(out_dir, rel))
        if dropped > 10 * n + 100:
          raise ValueError(f"{mix}: {dropped} draws all repeat excluded items")
        continue
      f.write(json.dumps(row) + "\n")
      written += 1
  if dropped:
    log.info("%s: dropped %d draws identical to excluded items", out_dir, dropped)
  return manifest


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", required=True)
  parser.add_argument("--mix", default="image_heavy", choices=sorted(MIXES))
  parser.add_argument("--n", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--fps", type=float, default=SynthConfig.fps)
  parser.add_argument("--video-scale", type=float, default=SynthConfig.video_scale)
  parser.add_argument("--image-scale", type=float, default=SynthConfig.image_scale)
  parser.add_argument("--max-seconds", type=float, default=SynthConfig.max_seconds)
  parser.add_argument("--shapes-size", type=int, default=SynthConfig.shapes_size)
  args = parser.parse_args(argv)
  synth = SynthConfig(
    args.fps, args.video_scale, args.image_scale, args.max_seconds, args.shapes_size
  )
  start = time.perf_counter()
  path = generate(args.out, args.mix, args.n, args.seed, synth)
  print(
    f"wrote {args.n} samples ({args.mix}, seed {args.seed}) to {path} in "
    f"{time.perf_counter() - start:.1f} s"
  )


if __name__ == "__main__":
  main()
