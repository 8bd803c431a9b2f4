"""Sparse weight deltas: a published version as the elements that changed.

A published folder `v<n>` may carry, in `delta/`, its tensors as changes from an earlier
version `v<b>`: per tensor, the flat indices (HF layout) and exact new values of the
elements whose bytes differ, so applying them to `v<b>` gives `v<n>` bit for bit. Past
`DENSE_SHARE` of its elements changed, or past the writer's bound (`TensorDelta`'s
`max_bytes`), a tensor is marked to be read from the folder. `TensorDelta` builds the
entries, `FileWriter` (a tensor's entries at a time) and `write_manifest` write them,
`base_version` and `apply` read them. Why, who reads them and the files' layout:
docs/fleet.md, "Weight deltas".
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Sequence

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

DELTA_DIR = "delta"
MANIFEST = "delta.json"
FORMAT = "sparse-v1"
# Past this share of changed elements a tensor is stored whole (an int32
# index and a bf16 value cost 3 times one bf16 element).
DENSE_SHARE = 1 / 3
_SEP = "::"
# safetensors' names of the dtypes a delta file holds.
_CODES = {
  np.dtype(np.uint8): "U8",
  np.dtype(np.int32): "I32",
  np.dtype(np.int64): "I64",
  np.dtype(np.float16): "F16",
  np.dtype(np.float32): "F32",
  np.dtype(ml_dtypes.bfloat16): "BF16",
}


class DeltaFormatError(ValueError):
  """A delta folder that cannot be applied (missing, damaged, of another format)."""


def entries(name: str, new: np.ndarray, old: np.ndarray) -> dict[str, np.ndarray]:
  """One tensor's delta entries: its changed elements, the whole tensor, or none."""
  delta = TensorDelta(name, new.shape, old.shape)
  delta.add(0, new, old)
  return delta.entries()


class TensorDelta:
  """One tensor's delta entries, built from runs of its rows given in order.

  Past DENSE_SHARE of the tensor's elements changed, or past `max_bytes` of
  entries (an index and a value each), it is marked to be read from the
  folder and its entries are dropped: the builder never holds more than
  that, however large the tensor.

  Raises:
    DeltaFormatError: the base's tensor has another shape or dtype.
  """

  def __init__(
    self,
    name: str,
    shape: tuple[int, ...],
    base_shape: tuple[int, ...],
    max_bytes: float = float("inf"),
  ):
    if tuple(shape) != tuple(base_shape):
      raise DeltaFormatError(
        f"{name}: the base holds {list(base_shape)}, the new version {list(shape)}"
      )
    self.name = name
    self._size = int(np.prod(shape))
    self._index_dtype = np.int32 if self._size < 2**31 else np.int64
    self._max_bytes = max_bytes
    self._index: list[np.ndarray] = []
    self._value: list[np.ndarray] = []
    self._value_dtype = np.dtype(np.uint8)  # the new version's, from the first run
    self._count = 0
    self._dense = False

  def add(self, start_row: int, new: np.ndarray, old: np.ndarray) -> None:
    """The changes in rows [start_row, start_row + len(new)) of the tensor."""
    if new.shape != old.shape or new.dtype != old.dtype:
      raise DeltaFormatError(
        f"{self.name} rows from {start_row}: the base holds {old.dtype} {list(old.shape)}, "
        f"the new version {new.dtype} {list(new.shape)}"
      )
    if self._dense:
      return
    self._value_dtype = new.dtype
    bits = np.dtype(f"u{new.dtype.itemsize}")
    flat = np.ascontiguousarray(new).reshape(-1)
    changed = np.flatnonzero(flat.view(bits) != np.ascontiguousarray(old).reshape(-1).view(bits))
    self._count += changed.size
    entry_bytes = np.dtype(self._index_dtype).itemsize + new.dtype.itemsize
    if self._count > DENSE_SHARE * self._size or self._count * entry_bytes > self._max_bytes:
      self._dense, self._index, self._value = True, [], []
      return
    offset = start_row * (flat.size // max(len(new), 1)) if new.ndim else 0
    self._index.append((changed + offset).astype(self._index_dtype))
    self._value.append(flat[changed])

  def parts(self) -> list[tuple[str, np.dtype, list[np.ndarray]]]:
    """Its entries as (key, dtype, the pieces that make it up, in order)."""
    if self._dense:
      return [(f"{self.name}{_SEP}folder", np.dtype(np.uint8), [])]
    if self._count == 0:
      return []
    return [
      (f"{self.name}{_SEP}index", np.dtype(self._index_dtype), self._index),
      (f"{self.name}{_SEP}value", self._value_dtype, self._value),
    ]

  def entries(self) -> dict[str, np.ndarray]:
    """Its entries: the changed elements, the whole tensor (from the folder), or none."""
    return {
      key: np.concatenate(pieces) if pieces else np.zeros(0, dtype)
      for key, dtype, pieces in self.parts()
    }


class FileWriter:
  """One file's delta entries, folder/delta/file_name, written a tensor's at
  a time (`add`), so the builder holds one tensor's entries at most, not the
  file's: the safetensors header's room is kept at the start for every
  entry the file's tensors may have, and `close` fills it in.

  Args:
    folder: the version's folder.
    file_name: the folder's file these are the deltas of.
    names: the HF names of that file's tensors.
    value_dtype: the tensors' dtype.
  """

  def __init__(self, folder: str, file_name: str, names: Sequence[str], value_dtype):
    os.makedirs(os.path.join(folder, DELTA_DIR), exist_ok=True)
    self.path = os.path.join(folder, DELTA_DIR, file_name)
    self._header: dict = {"__metadata__": {"format": FORMAT}}
    self._offset = 0
    self._room = _header_room(names, np.dtype(value_dtype))
    self._file = open(self.path, "wb")  # closed by `close` or `abort`
    self._file.seek(8 + self._room)

  def add(self, delta: TensorDelta) -> None:
    """Writes one tensor's entries (none when it did not change)."""
    for key, dtype, pieces in delta.parts():
      start = self._offset
      for piece in pieces:
        self._file.write(np.ascontiguousarray(piece, dtype).view(np.uint8).data)
        self._offset += piece.size * dtype.itemsize
      count = (self._offset - start) // dtype.itemsize
      self._header[key] = {
        "dtype": _CODES[dtype],
        "shape": [count],
        "data_offsets": [start, self._offset],
      }

  def close(self) -> None:
    """Writes the header into its room and closes the file."""
    raw = json.dumps(self._header, separators=(",", ":")).encode()
    if len(raw) > self._room:
      raise ValueError(f"{self.path}: a header of {len(raw)} bytes past its {self._room}")
    self._file.seek(0)
    self._file.write(struct.pack("<Q", self._room) + raw + b" " * (self._room - len(raw)))
    self._file.close()

  def abort(self) -> None:
    self._file.close()


def _header_room(names: Sequence[str], value_dtype: np.dtype) -> int:
  """The most bytes a delta file's header can take for tensors `names`: each with
  an index and a value entry, every offset at the most digits (a multiple of
  8, so the data starts aligned)."""
  most = 2**64 - 1
  header: dict = {"__metadata__": {"format": FORMAT}}
  for name in names:
    for key, code in (("index", "I64"), ("value", _CODES[value_dtype])):
      header[f"{name}{_SEP}{key}"] = {"dtype": code, "shape": [most], "data_offsets": [most, most]}
  size = len(json.dumps(header, separators=(",", ":")).encode())
  return size + -size % 8


def write_manifest(folder: str, base_version: str) -> None:
  with open(os.path.join(folder, DELTA_DIR, MANIFEST), "w") as f:
    json.dump({"format": FORMAT, "base_version": str(base_version)}, f)


def base_version(folder: str) -> str | None:
  """The version the folder's delta applies to; None without a usable delta."""
  try:
    with open(os.path.join(folder, DELTA_DIR, MANIFEST)) as f:
      manifest = json.load(f)
  except (OSError, ValueError):
    return None
  if manifest.get("format") != FORMAT:
    return None
  return str(manifest.get("base_version"))


def apply(
  folder: str, current: Callable[[str], np.ndarray], whole: Callable[[str], np.ndarray]
) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, new tensor) for every tensor the folder's delta changes, one at
  a time: `current(name)` (the base's tensor as the caller holds it) with
  the changed elements set, or `whole(name)` (the folder's tensor).

  Raises:
    DeltaFormatError: a delta file unreadable, or an entry without its pair.
  """
  delta = os.path.join(folder, DELTA_DIR)
  for file_name in sorted(os.listdir(delta)):
    if file_name == MANIFEST:
      continue
    try:
      with safe_open(os.path.join(delta, file_name), framework="numpy") as f:
        keys = list(f.keys())
        names = dict.fromkeys(k.rpartition(_SEP)[0] for k in keys)
        for name in names:
          if f"{name}{_SEP}folder" in keys:
            yield name, whole(name)
            continue
          if f"{name}{_SEP}index" not in keys or f"{name}{_SEP}value" not in keys:
            raise DeltaFormatError(f"{file_name}: {name} has no index or no value")
          tensor = np.array(current(name))
          try:
            tensor.reshape(-1)[f.get_tensor(f"{name}{_SEP}index")] = f.get_tensor(
              f"{name}{_SEP}value"
            )
          except (IndexError, ValueError) as e:
            raise DeltaFormatError(f"{file_name}: {name}: {e}") from e
          yield name, tensor
    except SafetensorError as e:
      raise DeltaFormatError(f"{os.path.join(delta, file_name)}: {e}") from e
