"""Datasets as users bring them: chat rows with system turns and placeholders,
media as paths, bytes or HF datasets' dicts, in JSONL, JSON and Parquet; and a
run without an evaluation file."""

import io
import json
import logging
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from fluxjax import config_args
from fluxjax.data import convert, readers
from fluxjax.data import meta as meta_lib
from fluxjax.models import chat, processor
from fluxjax.rl import loop, summary
from fluxjax.settings import Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _jpeg(colour, size=(56, 56)) -> bytes:
  buf = io.BytesIO()
  Image.new("RGB", size, colour).save(buf, "JPEG")
  return buf.getvalue()


def test_a_chat_row_keeps_its_turns_and_its_placeholders(tmp_path):
  """The system turn stays the system turn (no default one is added), each
  <image> stands where the text put it, and only user text is the prompt."""
  raw = {
    "prompt": [
      {"role": "system", "content": "Answer in one word."},
      {"role": "user", "content": "Left: <image> Right: <image> Which is redder?"},
    ],
    "images": [{"bytes": _jpeg("red"), "path": "a.jpg"}, {"bytes": _jpeg("blue"), "path": None}],
    "answer": "left",
  }
  row = readers.normalize_row(raw, 0, str(tmp_path), str(tmp_path / "media"))
  assert "error" not in row and row["media_order"] == ["image", "image"]
  assert row["turns"] == [
    {"role": "system", "content": [{"type": "text", "text": "Answer in one word."}]},
    {
      "role": "user",
      "content": [
        {"type": "text", "text": "Left: "},
        {"type": "image"},
        {"type": "text", "text": " Right: "},
        {"type": "image"},
        {"type": "text", "text": " Which is redder?"},
      ],
    },
  ]
  assert row["prompt"] == "Left: \n Right: \n Which is redder?"
  rendered = chat.render_chat(row["turns"])
  assert rendered.startswith("<|im_start|>system\nAnswer in one word.<|im_end|>")
  assert chat.DEFAULT_SYSTEM_PROMPT not in rendered
  vision = "<|vision_start|><|image_pad|><|vision_end|>"
  assert f"Left: {vision} Right: {vision} Which" in rendered
  # The bytes became files, once each, named by their content.
  first, second = row["images"]
  assert first.endswith(".jpg") and open(first, "rb").read() == raw["images"][0]["bytes"]
  again = readers.normalize_row(raw, 0, str(tmp_path), str(tmp_path / "media"))
  assert again["images"] == row["images"] and len(list((tmp_path / "media").iterdir())) == 2
  # The sample's messages are those turns, its media in their order.
  sample = meta_lib.ToMeta(processor.VisionProcessorConfig())(0, row)
  assert sample.error is None and sample.messages() == row["turns"]
  assert [m.path for m in sample.media] == [first, second]


def test_interleaved_kinds_keep_their_order_and_placeless_media_go_first(tmp_path):
  (tmp_path / "a.jpg").write_bytes(_jpeg("red"))
  raw = {
    "prompt": [
      {
        "role": "user",
        "content": [
          {"type": "text", "text": "Photo:"},
          {"type": "image", "image": "a.jpg"},
          {"type": "text", "text": "then the clip <video> and"},
        ],
      }
    ],
    "videos": ["/data/clip.mp4"],
  }
  row = readers.normalize_row(raw, 3, str(tmp_path))
  assert row["media_order"] == ["image", "video"]
  assert row["images"] == [str(tmp_path / "a.jpg")] and row["videos"] == ["/data/clip.mp4"]
  # No placeholder at all: media first, images then videos (the old layout).
  plain = readers.normalize_row(
    {"prompt": "Q?", "images": ["b.png"], "video": "c.mp4"}, 4, str(tmp_path)
  )
  assert plain["turns"] == [
    {
      "role": "user",
      "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Q?"}],
    }
  ]


@pytest.mark.parametrize(
  "raw, why",
  [
    ({"prompt": "<image> and <image>", "images": ["a.png"]}, "2 <image> placeholders for 1 image"),
    ({"prompt": "Q", "images": [b"\xff\xd8\xff"]}, "need a media directory"),
    ({"prompt": "Q", "images": [7]}, "must be a path, bytes"),
    ({"prompt": 5}, "prompt must be text or chat messages"),
    (
      {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
      "a content part of type 'image_url'",
    ),
  ],
)
def test_a_row_that_does_not_fit_is_a_counted_skip_naming_why(raw, why, tmp_path):
  row = readers.normalize_row(raw, 9, str(tmp_path))
  assert why in row["error"] and row["error"].startswith("row 9: ")
  sample = meta_lib.ToMeta(processor.VisionProcessorConfig())(0, row)
  assert sample.error == row["error"]  # the loader counts and logs it


def test_json_arrays_jsonl_and_parquet_read_the_same_rows(tmp_path):
  rows = [
    {"id": "a", "prompt": "<image>What colour?", "images": [{"bytes": _jpeg("red"), "path": "x"}]},
    {"id": "b", "prompt": "Why?", "answer": "because"},
  ]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
  plain = [{**r, "images": ["x.jpg"]} if r.get("images") else r for r in rows]
  (tmp_path / "d.json").write_text(json.dumps(plain))
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in plain) + "\n")
  media = str(tmp_path / "media")
  from_parquet = readers.read_rows(tmp_path / "d.parquet", media)
  assert [r["id"] for r in from_parquet] == ["a", "b"]
  assert from_parquet[0]["images"][0].startswith(media)
  for name in ("d.json", "d.jsonl"):
    back = readers.read_rows(tmp_path / name, media)
    assert [r["turns"] for r in back] == [r["turns"] for r in from_parquet]
    assert back[0]["images"] == [str(tmp_path / "x.jpg")]


def _settings(train, holdout, prompts=256):
  config = config_args.load_config(arg="tiny")
  config.data.train, config.data.holdout, config.eval.prompts = str(train), holdout, prompts
  return Settings.of(config)


def test_without_an_eval_file_a_seeded_share_is_held_out(tmp_path, caplog):
  train = tmp_path / "train.jsonl"
  train.write_text(
    "".join(json.dumps({"id": str(i), "prompt": f"Q{i}?"}) + "\n" for i in range(200))
  )
  caplog.set_level(logging.INFO, logger="fluxjax.rl.loop")
  kept, held, held_out = loop.dataset_rows(_settings(train, 0.05), str(tmp_path))
  assert held_out and len(held) == 10 and len(kept) == 190
  assert not {r["id"] for r in kept} & {r["id"] for r in held}
  assert "10 of the 200 rows" in caplog.text
  again = loop.dataset_rows(_settings(train, 0.05), str(tmp_path))[1]
  assert [r["id"] for r in again] == [r["id"] for r in held]  # seeded
  assert len(loop.dataset_rows(_settings(train, 0.5, prompts=16), str(tmp_path))[1]) == 16
  # No share held out: evaluation reads training rows and says so.
  kept, held, held_out = loop.dataset_rows(_settings(train, 0.0), str(tmp_path))
  assert not held_out and len(kept) == 200 and "not held out" in caplog.text
  s = summary.summarize([], [], wall_s=1.0, workdir=str(tmp_path), held_out=False)
  assert s.lines()[1] == "accuracy on training rows (none held out): not evaluated"


def test_a_sample_with_turns_and_extra_survives_a_checkpoint(tmp_path):
  from fluxjax.rl import producer

  raw = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]}
  row = readers.normalize_row({**raw, "extra_info": {"index": 1}}, 0, str(tmp_path))
  sample = meta_lib.ToMeta(processor.VisionProcessorConfig())(0, row)
  back = producer.sample_from_dict(json.loads(json.dumps(producer.sample_to_dict(sample))))
  assert back == sample and back.messages()[0]["role"] == "system"


def test_the_example_file_reads_whole(tmp_path):
  """examples/data/sample.jsonl, docs/data.md's example: every row usable."""
  path = os.path.join(ROOT, "examples", "data", "sample.jsonl")
  rows = readers.read_rows(path, str(tmp_path))
  assert [r.get("error") for r in rows] == [None] * 3
  to_meta = meta_lib.ToMeta(processor.VisionProcessorConfig())
  samples = [to_meta(i, r) for i, r in enumerate(rows)]
  assert [s.error for s in samples] == [None] * 3
  assert [len(s.media) for s in samples] == [1, 2, 0]
  assert [s.answer for s in samples] == ["2", "first", "42"]
  assert samples[1].messages()[0]["role"] == "system" and samples[1].extra["index"] == 1


def test_geo3k_converts_into_rows_the_reader_takes(tmp_path):
  """The raw hub layout (images as {"bytes", "path"}, a problem with <image>)
  through the converter: veRL's layout, which reads into one image placed
  where the problem put it, with its answer."""
  raw = [
    {"images": [{"bytes": _jpeg("red"), "path": None}], "problem": "<image>Find x.", "answer": "3"},
    {
      "images": [{"bytes": _jpeg("blue"), "path": "b.png"}],
      "problem": "Angle? <image>",
      "answer": "45",
    },
  ]
  (tmp_path / "data").mkdir()
  pq.write_table(pa.Table.from_pylist(raw), tmp_path / "data" / "train-00000-of-00001.parquet")
  out = tmp_path / "geo3k_train.parquet"
  convert.main(["geo3k", str(tmp_path), str(out)])
  rows = readers.read_rows(out, str(tmp_path / "media"))
  assert [r["answer"] for r in rows] == ["3", "45"]
  assert rows[1]["turns"][0]["content"][:2] == [
    {"type": "text", "text": "Angle? "},
    {"type": "image"},
  ]
  assert (
    rows[0]["extra"]["question"] == "<image>Find x." and rows[0]["source"] == "hiyouga/geometry3k"
  )
  assert open(rows[0]["images"][0], "rb").read() == raw[0]["images"][0]["bytes"]
  with pytest.raises(SystemExit, match="no test-"):
    convert.main(["geo3k", str(tmp_path), str(out), "--split", "test"])


def test_the_run_logs_its_first_rows_as_parsed(tmp_path, caplog):
  """What a user checks first: each row's prompt as the chat template renders
  it (system turn and interleaved images where they stand), its media in
  prompt order and its answer; a bad row says why it is skipped."""
  rows = readers.read_rows(os.path.join(ROOT, "examples", "data", "sample.jsonl"), str(tmp_path))
  bad = {"id": "broken-1", "error": "media entry 0 is not a path or bytes"}
  with caplog.at_level(logging.INFO, logger=loop.log.name):
    loop.log_rows([rows[1], bad])
  parsed, skipped = (r.getMessage() for r in caplog.records)
  assert parsed.startswith("row compare-1 as parsed:\n<|im_start|>system\nAnswer with one word")
  first, second = parsed.index("First picture:"), parsed.index("Second picture:")
  assert first < parsed.index("<|vision_start|>") < second  # the image between the two texts
  assert parsed.count("<|vision_start|>") == 2 and "answer: 'first'" in parsed
  assert parsed.index("left.jpg") < parsed.index("right.jpg")  # media in prompt order
  assert skipped == "row broken-1: skipped: media entry 0 is not a path or bytes"
