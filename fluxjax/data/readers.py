"""Readers of RL dataset rows (JSONL or Parquet) into one normalized form.

A row is a dict with `id`, `prompt` (text), `answer`, `images` and `videos`
(absolute paths). Both the synth manifest and the usual RL dataset layouts are
accepted: `prompt` may be a string or chat messages; the answer may sit in
`answer`, `ground_truth`, `solution` or `reward_model.ground_truth`; media may
be a string, a list of strings, or dicts with a `path`. Relative media paths
resolve against the dataset file's directory. Only paths are read: pixels are
the preprocessor workers' business. The row's other fields that are JSON
values, with the contents of veRL's `extra_info`, are kept as `extra` for
rewards that ask for them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

_ANSWER_KEYS = ("answer", "ground_truth", "solution")
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


def _text_of(prompt: Any) -> str:
  """Prompt text from a string or HF-style chat messages (user turns)."""
  if isinstance(prompt, str):
    return prompt
  if isinstance(prompt, Sequence):
    parts = []
    for message in prompt:
      content = message.get("content", "") if isinstance(message, dict) else ""
      if isinstance(content, str):
        parts.append(content)
      else:
        parts.extend(
          p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    return "\n".join(p for p in parts if p)
  raise ValueError(f"prompt must be text or messages, got {type(prompt)}")


def _paths(value: Any, base_dir: str) -> list[str]:
  if value is None:
    return []
  if isinstance(value, (str, dict)):
    value = [value]
  out = []
  for v in value:
    path = v.get("path") if isinstance(v, dict) else v
    if not isinstance(path, str):
      raise ValueError(f"media entry must be a path or {{'path': ...}}, got {v!r}")
    out.append(path if os.path.isabs(path) else os.path.join(base_dir, path))
  return out


def normalize_row(raw: dict, index: int, base_dir: str) -> dict:
  """One raw dataset row -> {id, prompt, answer, images, videos, source, task,
  difficulty, solution, extra}.

  Args:
    raw: the row as stored.
    index: its position in the file (the id when the row has none).
    base_dir: directory that relative media paths start from.

  Returns:
    The normalized row.
  """
  answer = next((raw[k] for k in _ANSWER_KEYS if raw.get(k) is not None), None)
  if answer is None and isinstance(raw.get("reward_model"), dict):
    answer = raw["reward_model"].get("ground_truth")
  return {
    "id": str(raw.get("id", index)),
    "prompt": _text_of(raw.get("prompt", raw.get("question", ""))),
    "answer": None if answer is None else str(answer),
    "images": _paths(raw.get("images", raw.get("image")), base_dir),
    "videos": _paths(raw.get("videos", raw.get("video")), base_dir),
    "source": str(raw.get("source", raw.get("data_source", ""))),
    "task": str(raw.get("task", "")),  # the reward function's hint
    "difficulty": str(raw.get("difficulty", "")),  # evaluation breaks accuracy down by it
    # The reference reasoning before the answer (the SFT warm-up's <think> span).
    "solution": str(raw.get("solution") or ""),
    "extra": _extra(raw),
  }


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  """Normalized rows of a JSON-lines file (blank lines are ignored)."""
  base = os.path.dirname(os.path.abspath(path))
  rows: list[dict] = []
  with open(path) as f:
    for line in f:
      if line.strip():
        rows.append(normalize_row(json.loads(line), len(rows), base))
  return rows


def read_parquet(path: str | os.PathLike) -> list[dict]:
  """Normalized rows of a Parquet file."""
  import pyarrow.parquet as pq  # Only Parquet datasets pay for the import.

  base = os.path.dirname(os.path.abspath(path))
  table = pq.read_table(path)
  return [normalize_row(r, i, base) for i, r in enumerate(table.to_pylist())]


def read_rows(path: str | os.PathLike) -> list[dict]:
  """Normalized rows of a .jsonl/.json-lines or .parquet dataset file."""
  name = os.fspath(path)
  if name.endswith(".parquet"):
    return read_parquet(name)
  if name.endswith((".jsonl", ".json")):
    return read_jsonl(name)
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
