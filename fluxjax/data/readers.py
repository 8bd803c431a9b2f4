"""Readers of RL dataset rows (JSONL, a JSON array or Parquet) into one normalized form.

`read_rows` takes the synth manifest and the usual RL layouts (HF datasets, veRL's
preprocessing); `normalize_row` turns each row into the dict its docstring lists: the
chat `turns` with each image or video part where it stands, `prompt` (the user turns'
text), `answer`, absolute media paths with their kinds in prompt order, and `extra`
for rewards, or `error` set for a row the loader counts and logs as a skip. Only paths
are read: pixels are the preprocessor workers' business. The fields and forms accepted,
and where media go in the prompt, are told in docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Sequence
from typing import Any

_ANSWER_KEYS = ("answer", "ground_truth", "solution")
_PLACEHOLDER = re.compile(r"<(image|video)>")
# Magic numbers of the containers the decoders read, for a written file's suffix.
_MAGIC = (
  (b"\xff\xd8\xff", ".jpg"),
  (b"\x89PNG", ".png"),
  (b"GIF8", ".gif"),
  (b"RIFF", ".webp"),
  (b"BM", ".bmp"),
  (b"\x1aE\xdf\xa3", ".webm"),
)
# The fields normalize_row reads; the others go to `extra`.
_READ_KEYS = frozenset(
  {*_ANSWER_KEYS, "id", "prompt", "question", "images", "image", "videos", "video"}
  | {"source", "data_source", "task", "difficulty", "extra_info"}
)


def _extra(raw: dict) -> dict:
  """The row's unread fields that are JSON values, then veRL's extra_info's."""
  info = raw.get("extra_info")
  fields = {k: v for k, v in raw.items() if k not in _READ_KEYS}
  fields.update(info if isinstance(info, dict) else {})
  out = {}
  for key, value in fields.items():
    try:
      json.dumps(value)
    except (TypeError, ValueError):
      continue  # bytes, arrays: not a reward's business, and not checkpointable
    out[str(key)] = value
  return out


def _parts(text: str) -> list[dict]:
  """A text split at its <image> / <video> placeholders into chat parts."""
  out: list[dict] = []
  for i, piece in enumerate(_PLACEHOLDER.split(text)):
    if i % 2:
      out.append({"type": piece})
    elif piece:
      out.append({"type": "text", "text": piece})
  return out


def _turns(prompt: Any) -> tuple[list[dict], list[tuple[str, Any]]]:
  """(chat turns as given, with media parts where they stand; the media that
  parts carry inline, as (kind, source) in order) of a text or HF-style
  messages (content a string or a list of typed parts)."""
  if isinstance(prompt, str):
    return [{"role": "user", "content": _parts(prompt)}], []
  if not isinstance(prompt, Sequence):
    raise ValueError(f"prompt must be text or chat messages, got {type(prompt).__name__}")
  turns, inline = [], []
  for message in prompt:
    if not isinstance(message, dict):
      raise ValueError(f"a chat message must be a dict with role and content, got {message!r}")
    content = message.get("content") or ""
    parts: list[dict] = []
    for part in [content] if isinstance(content, str) else content:
      if isinstance(part, str):
        parts += _parts(part)
      elif part.get("type") == "text":
        parts += _parts(part.get("text") or "")
      elif part.get("type") in ("image", "video"):
        kind = part["type"]
        parts.append({"type": kind})
        source = next((part[k] for k in (kind, "path", "url", "bytes") if part.get(k)), None)
        if source is not None:
          inline.append((kind, source))
      else:  # e.g. OpenAI's image_url: dropping it would train on a prompt without it
        raise ValueError(f"a content part of type {part.get('type')!r} (want text, image, video)")
    turns.append({"role": str(message.get("role", "user")), "content": parts})
  return turns, inline


def _user_text(turns: list[dict]) -> str:
  """The text of the user turns (a reward's `prompt`, the logs' view of a row)."""
  return "\n".join(
    p["text"] for t in turns if t["role"] == "user" for p in t["content"] if p["type"] == "text"
  )


def _place_media(turns: list[dict], kinds: list[str]) -> list[str]:
  """The media kinds in prompt order; media no part places goes first in the
  first user turn, images then videos (where a row without placeholders
  always had them).

  Raises:
    ValueError: a kind has some placeholders, but not one per item.
  """
  slots = [p["type"] for t in turns for p in t["content"] if p["type"] in ("image", "video")]
  for kind in ("image", "video"):
    have, want = slots.count(kind), kinds.count(kind)
    if have and have != want:
      raise ValueError(f"the prompt has {have} <{kind}> placeholders for {want} {kind}s")
  unplaced = [k for k in kinds if k not in slots]
  if unplaced:
    first = next((t for t in turns if t["role"] == "user"), None)
    if first is None:
      first = {"role": "user", "content": []}
      turns.append(first)
    first["content"][:0] = [{"type": k} for k in unplaced]
  return [p["type"] for t in turns for p in t["content"] if p["type"] in ("image", "video")]


def _media_path(value: Any, base_dir: str, media_dir: str | None) -> str:
  """A media entry (a path, bytes, or HF datasets' {"bytes", "path"}) as a
  file path; bytes are written once to media_dir under their hash."""
  if isinstance(value, dict):
    value = value.get("bytes") or value.get("path")
  if isinstance(value, (bytes, bytearray)):
    if media_dir is None:
      raise ValueError("media given as bytes need a media directory to be written to")
    return _write_media(bytes(value), media_dir)
  if not isinstance(value, str) or not value:
    raise ValueError(f"a media entry must be a path, bytes or {{'bytes', 'path'}}, got {value!r}")
  return value if os.path.isabs(value) else os.path.join(base_dir, value)


def _write_media(data: bytes, media_dir: str) -> str:
  digest = hashlib.sha256(data).hexdigest()[:32]
  path = os.path.join(media_dir, digest + _suffix(data))
  if not os.path.exists(path):
    os.makedirs(media_dir, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  return path


def _suffix(data: bytes) -> str:
  """A file suffix from the bytes' magic number (the decoders sniff the content anyway)."""
  for magic, suffix in _MAGIC:
    if data.startswith(magic):
      return suffix
  if data[4:8] == b"ftyp":
    return ".mp4"
  return ".bin"


def _entries(value: Any) -> list:
  if value is None:
    return []
  return [value] if isinstance(value, (str, dict, bytes, bytearray)) else list(value)


def normalize_row(raw: dict, index: int, base_dir: str, media_dir: str | None = None) -> dict:
  """One raw dataset row -> {id, prompt, turns, media_order, answer, images,
  videos, source, task, difficulty, solution, extra}, with `error` set (the
  loader's counted skip) when its prompt and media do not fit.

  Args:
    raw: the row as stored.
    index: its position in the file (the id when the row has none).
    base_dir: directory that relative media paths start from.
    media_dir: where media given as bytes are written (None: such a row is
      an error).

  Returns:
    The normalized row.
  """
  answer = next((raw[k] for k in _ANSWER_KEYS if raw.get(k) is not None), None)
  if answer is None and isinstance(raw.get("reward_model"), dict):
    answer = raw["reward_model"].get("ground_truth")
  row: dict = {
    "id": str(raw.get("id", index)),
    "answer": None if answer is None else str(answer),
    "source": str(raw.get("source", raw.get("data_source", ""))),
    "task": str(raw.get("task", "")),  # the reward function's hint
    "difficulty": str(raw.get("difficulty", "")),  # evaluation breaks accuracy down by it
    # The reference reasoning before the answer (the SFT warm-up's <think> span).
    "solution": str(raw.get("solution") or ""),
    "extra": _extra(raw),
    "turns": [],
    "prompt": "",
    "media_order": [],
    "images": [],
    "videos": [],
  }
  try:
    turns, inline = _turns(raw.get("prompt", raw.get("question", "")))
    media = {kind: [v for k, v in inline if k == kind] for kind in ("image", "video")}
    for kind in ("image", "video"):  # the row's columns, where no part carries the media
      media[kind] = media[kind] or _entries(raw.get(kind + "s", raw.get(kind)))
    kinds = ["image"] * len(media["image"]) + ["video"] * len(media["video"])
    row["media_order"] = _place_media(turns, kinds)
    for kind in ("image", "video"):
      row[kind + "s"] = [_media_path(v, base_dir, media_dir) for v in media[kind]]
  except (ValueError, TypeError, AttributeError, OSError) as e:
    row["error"] = f"row {row['id']}: {e}"
    return row
  row["turns"], row["prompt"] = turns, _user_text(turns)
  return row


def read_json(path: str | os.PathLike, media_dir: str | None = None) -> list[dict]:
  """Normalized rows of a JSON-lines file (blank lines are ignored) or of a
  JSON file holding one array of rows."""
  base = os.path.dirname(os.path.abspath(path))
  with open(path) as f:
    text = f.read()
  if text.lstrip().startswith("["):
    raws = json.loads(text)
  else:
    raws = [json.loads(line) for line in text.splitlines() if line.strip()]
  return [normalize_row(r, i, base, media_dir) for i, r in enumerate(raws)]


def read_parquet(path: str | os.PathLike, media_dir: str | None = None) -> list[dict]:
  """Normalized rows of a Parquet file (HF datasets' and veRL's layouts)."""
  import pyarrow.parquet as pq  # Only Parquet datasets pay for the import.

  base = os.path.dirname(os.path.abspath(path))
  table = pq.read_table(path)
  return [normalize_row(r, i, base, media_dir) for i, r in enumerate(table.to_pylist())]


def read_rows(path: str | os.PathLike, media_dir: str | None = None) -> list[dict]:
  """Normalized rows of a .jsonl, .json or .parquet dataset file; media
  given as bytes are written to `media_dir`."""
  name = os.fspath(path)
  if name.endswith(".parquet"):
    return read_parquet(name, media_dir)
  if name.endswith((".jsonl", ".json")):
    return read_json(name, media_dir)
  raise ValueError(f"unknown dataset format (want .jsonl or .parquet): {name}")


class RowSource:
  """A Grain random-access source over normalized rows (len + getitem)."""

  def __init__(self, rows: Sequence[dict]):
    self._rows = list(rows)

  @classmethod
  def from_file(cls, path: str | os.PathLike) -> RowSource:
    return cls(read_rows(path))

  def __len__(self) -> int:
    return len(self._rows)

  def __getitem__(self, index: int) -> dict:
    return self._rows[index]
