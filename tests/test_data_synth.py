"""Synthetic datasets (fluxjax.data.synth) and dataset readers (readers.py)."""

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fluxjax.data import drawing, readers, synth
from fluxjax.models import media

TINY = synth.SynthConfig(fps=2.0, video_scale=0.15, image_scale=0.3, max_seconds=6.0)


def _digest(folder):
  h = hashlib.sha256()
  for name in sorted(os.listdir(folder / "media")):
    h.update(name.encode())
    h.update((folder / "media" / name).read_bytes())
  h.update((folder / "manifest.jsonl").read_bytes())
  return h.hexdigest()


@pytest.fixture(scope="module")
def video_heavy(tmp_path_factory):
  out = tmp_path_factory.mktemp("vh")
  synth.generate(str(out), "video_heavy", 12, seed=3, synth=TINY)
  return out


def test_same_seed_writes_the_same_dataset(tmp_path, video_heavy):
  synth.generate(str(tmp_path), "video_heavy", 12, seed=3, synth=TINY)
  assert _digest(tmp_path) == _digest(video_heavy)


def test_cli_writes_every_mix(tmp_path):
  for mix in synth.MIXES:
    synth.main(
      [
        "--out",
        str(tmp_path / mix),
        "--mix",
        mix,
        "--n",
        "6",
        "--seed",
        "1",
        "--fps",
        "2",
        "--video-scale",
        "0.15",
        "--image-scale",
        "0.3",
        "--max-seconds",
        "6",
      ]
    )
    rows = readers.read_rows(tmp_path / mix / "manifest.jsonl")
    assert len(rows) == 6
    if mix == "text":
      assert all(not r["images"] and not r["videos"] for r in rows)
    if mix == "only_video":
      assert all(r["source"] == "longvila" for r in rows)


def test_answers_are_verifiable_from_the_files(video_heavy):
  rows = readers.read_rows(video_heavy / "manifest.jsonl")
  kinds = {r["source"] for r in rows}
  assert kinds >= {"nextqa", "longvila"}
  cfg = media.processor.VisionProcessorConfig()
  for r in rows:
    for path in r["images"]:
      assert media.probe_image(path) == media.load_image(path).size[::-1]
      if r["prompt"].startswith("What is"):
        expr = r["prompt"][len("What is ") :].split("?")[0]
        assert str(eval(expr)) == r["answer"]  # pylint: disable=eval-used
    for path in r["videos"]:
      info = media.probe_video(path)
      assert info.codec == "h264"
      # The last frame's centre shows the answer's colour or shape.
      frames, _ = media.load_video(path, cfg)
      if r["task"] == "last_colour":
        centre = frames[-1, info.height // 2, info.width // 2].astype(int)
        dist = {c: np.abs(centre - np.array(v)).sum() for c, v in drawing.RGB.items()}
        assert min(dist, key=dist.get) == r["answer"]


def test_frame_counts_follow_the_durations(video_heavy):
  for line in open(video_heavy / "manifest.jsonl"):
    r = json.loads(line)
    if r["videos"]:
      info = media.probe_video(video_heavy / r["videos"][0])
      assert info.num_frames == r["frames"]
      assert r["frames"] == max(4, round(min(r["seconds"], 6.0) * 2))


def test_readers_accept_rl_rows_in_jsonl_and_parquet(tmp_path):
  (tmp_path / "img").mkdir()
  raw = [
    {
      "prompt": [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}
      ],
      "reward_model": {"ground_truth": 3},
      "images": [{"path": "img/a.png"}],
      "data_source": "geo3k",
    },
    {"id": "x", "question": "Which colour?", "answer": "red", "video": "/abs/v.mp4"},
  ]
  with open(tmp_path / "d.jsonl", "w") as f:
    for r in raw:
      f.write(json.dumps(r) + "\n")
  pq.write_table(
    pa.Table.from_pylist(
      [
        {
          "id": "p0",
          "prompt": "What is 1 + 2?",
          "answer": "3",
          "images": ["img/a.png"],
          "videos": [],
        }
      ]
    ),
    tmp_path / "d.parquet",
  )
  a, b = readers.read_rows(tmp_path / "d.jsonl")
  assert a == {
    "id": "0",
    "prompt": "How many?",
    "answer": "3",
    "images": [str(tmp_path / "img/a.png")],
    "videos": [],
    "source": "geo3k",
    "task": "",
    "difficulty": "",
    "solution": "",
    "extra": {"reward_model": {"ground_truth": 3}},
    "turns": [
      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}
    ],
    "media_order": ["image"],
  }
  assert b["id"] == "x" and b["videos"] == ["/abs/v.mp4"]
  assert b["answer"] == "red" and b["prompt"] == "Which colour?"
  (p,) = readers.read_rows(tmp_path / "d.parquet")
  assert p["images"] == [str(tmp_path / "img/a.png")] and p["answer"] == "3"
  with pytest.raises(ValueError):
    readers.read_rows(tmp_path / "d.csv")


def test_shapes_answers_are_verifiable_from_the_pixels(tmp_path):
  synth.generate(str(tmp_path), "shapes", 24, seed=5)
  rows = readers.read_rows(tmp_path / "manifest.jsonl")
  assert {r["task"] for r in rows} == {"colour", "shape_count"}
  bg = np.array(drawing.BACKGROUND)
  for r in rows:
    (path,) = r["images"]
    pixels = np.asarray(media.load_image(path)).astype(int)
    size = synth.SynthConfig().shapes_size
    assert pixels.shape == (size, size, 3)
    drawn = np.abs(pixels - bg).sum(-1) > 0
    if r["task"] == "colour":
      # The colour of the drawn pixels, by nearest palette colour.
      mean = pixels[drawn].mean(0)
      dist = {c: np.abs(mean - np.array(v)).sum() for c, v in drawing.RGB.items()}
      assert min(dist, key=dist.get) == r["answer"]
      assert drawn.mean() > 0.1  # one large shape
    else:
      half = size // 2
      quads = [drawn[y : y + half, x : x + half].any() for y in (0, half) for x in (0, half)]
      assert str(sum(quads)) == r["answer"]
