"""HF safetensors out: a model's tensors in the published layout, and folders of them.

`hf_tensors` / `hf_tensor_rows` gather a model's tensors one layer tensor (or
run of rows) at a time, each to the process that sends or writes it.
`save_hf_checkpoint` writes a folder under a hidden temporary name and renames
it into place once every file is closed, so a reader never sees half a checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from fluxjax.models import config as config_lib
from fluxjax.models import hf_delta, hf_load, vlm
from fluxjax.models.hf_load import Array
from fluxjax.sharding import gather

log = logging.getLogger(__name__)

# A folder being written is `.tmp-<name>-<random>`; the folder it replaces is
# moved aside to that name + `.old` for the instant of the swap.
_TEMP_PREFIX = ".tmp-"
_ASIDE_SUFFIX = ".old"


def _on_one_device(x: Array) -> Array:
  """`x` moved to one of its devices when this process holds all of it.

  The layout change that follows then runs on that device alone, with no
  collective: a deferred broadcast (rollout/publish.py) reads the trainer's
  arrays from another thread while the training step runs, and collectives
  launched from two threads may meet in different orders on different GPUs.
  (A model that spans processes goes through `gather.gather_to` instead.)"""
  if not isinstance(x, jax.Array) or not x.is_fully_addressable or len(x.sharding.device_set) == 1:
    return x
  return jax.device_put(x, x.addressable_shards[0].device)


# A published tensor past this many bytes goes to disk in runs of rows of at
# most this size (`hf_tensor_rows`), so a process's part of a disk publish
# holds one run of it: the 7B embedding alone is 1.09 GB in bf16, 2.3 decoder
# layers, and a decoder layer's largest tensor 136 MB.
ROW_RUN_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class _Tensor:
  """One published tensor: its HF name, our layer tensor's shape, its kind
  and leaf path, and where it lies (the leaf's value and its layer; None:
  the leaf whole). Nothing runs until `get` or a gather."""

  name: str
  shape: tuple[int, ...]
  kind: str
  leaf_path: str
  value: Array
  layer: int | None

  def get(self) -> Array:
    # The layer axis is never sharded: indexing it is no collective.
    return self.value if self.layer is None else self.value[self.layer]

  def box(self, axis: int = 0, lo: int = 0, hi: int | None = None) -> gather.Bounds:
    """Its place in the leaf, entries [lo, hi) of our axis `axis` (all by default)."""
    dims = [(0, n) for n in self.shape]
    if dims:
      dims[axis] = (lo, dims[axis][1] if hi is None else hi)
    layer = () if self.layer is None else ((self.layer, self.layer + 1),)
    return (*layer, *dims)


def _layer_tensors(model: vlm.Qwen25VL) -> Iterator[_Tensor]:
  """Every published tensor, in order."""
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    leaf_path = ".".join(map(str, key))
    stack, template, kind = hf_load.leaf_rule(leaf_path)
    value = var.get_value()
    for i in range(value.shape[0]) if stack else [None]:
      shape = tuple(value.shape if i is None else value.shape[1:])
      yield _Tensor(template.format(i) if stack else template, shape, kind, leaf_path, value, i)


def _export(x: Array, np_dtype, layout) -> np.ndarray:
  """`layout(x)` in `np_dtype` on this host: cast and laid out on one device
  first. Contiguous: safetensors writes the buffer as laid out, ignoring strides."""
  return np.ascontiguousarray(hf_load.to_host(layout(_on_one_device(x.astype(np_dtype)))))


def hf_tensors(model: vlm.Qwen25VL, dtype: str = "bfloat16"):
  """Yields (HF name, numpy tensor) one layer tensor at a time, in `dtype`
  (of a model that spans processes, on process 0; None elsewhere)."""
  for name, _, tensor in hf_tensor_rows(model, dtype, run_bytes=math.inf):
    yield name, tensor


@dataclasses.dataclass(frozen=True)
class _Runs:
  """How a published tensor goes in runs of rows: its `rows` HF rows are
  entries of our axis `axis` (an embedding's rows, one row each; a kernel's
  first output axis, `inner` rows each: HF [out, in] = ours [in..., out...]
  flattened and transposed, as `hf_load.ours_to_hf`), `per_run` rows a run
  (whole entries: a multiple of `inner`)."""

  rows: int
  axis: int
  inner: int
  per_run: int


def _row_runs(shape, kind: str, leaf_path: str, itemsize: int, run_bytes: float) -> _Runs | None:
  """How the published tensor of our `shape` goes in runs of rows when it
  is past `run_bytes` and its rows are a slice of ours; else None, whole
  (also vectors and the patch embedding's 5-D layout)."""
  if kind != "kernel":
    if len(shape) != 2:
      return None
    rows, axis, inner = shape[0], 0, 1
  elif leaf_path == "visual.patch_embed.kernel":
    return None
  else:
    axis = 2 if leaf_path.endswith(hf_load.TWO_INPUT_AXES) else 1
    rows, inner = math.prod(shape[axis:]), math.prod(shape[axis + 1 :])
  size = math.prod(shape) * itemsize
  if size <= run_bytes:
    return None
  per_run = inner * max(1, int(run_bytes // (inner * (size // rows))))
  return _Runs(rows, axis, inner, per_run)


def _transposed(x: Array) -> Array:
  return x.T


def _as_is(x: Array) -> Array:
  return x


def _slice_rows(x: Array, n_in: int, start: int, stop: int) -> Array:
  if not n_in:
    return x[start:stop]
  return x.reshape(math.prod(x.shape[:n_in]), -1)[:, start:stop]


def _hf_rows(x: np.ndarray, n_in: int) -> np.ndarray:
  """A kernel's run in our layout [in..., entries, ...] -> its HF rows."""
  return x.reshape(math.prod(x.shape[:n_in]), -1).T


def hf_tensor_rows(
  model: vlm.Qwen25VL,
  dtype: str = "bfloat16",
  run_bytes: float | None = None,
  consumer: Callable[[str], int] | None = None,
):
  """Yields (HF name, first row, rows) in `dtype`: `hf_tensors`' tensors, one
  past `run_bytes` (default ROW_RUN_BYTES) whose rows are a slice of ours in
  runs of at most that size (of whole entries of our axis, `_Runs`; the
  others whole, from row 0); `hf_row_count` items in all. Each run is sliced
  before it is cast and brought to a host.

  A model that spans processes: each tensor (or run) is cast where its
  parts lie and goes to the process `consumer(name)` names (default 0) and
  to no other (`gather.gather_to`), which lays it out and yields it; the
  others yield None as the rows, having taken part.
  """
  run_bytes = ROW_RUN_BYTES if run_bytes is None else run_bytes
  np_dtype = hf_load.NUMPY_DTYPES[dtype]
  itemsize = np.dtype(np_dtype).itemsize
  spans = spans_processes(model)
  for t in _layer_tensors(model):
    runs = _row_runs(t.shape, t.kind, t.leaf_path, itemsize, run_bytes)
    if spans:
      to = 0 if consumer is None else consumer(t.name)
      yield from _gathered_rows(t, runs, np_dtype, model.cfg, to)
    else:
      yield from _local_rows(t, runs, np_dtype, model.cfg)


def _hf_layout(t: _Tensor, cfg: config_lib.ModelConfig):
  return functools.partial(hf_load.ours_to_hf, kind=t.kind, path=t.leaf_path, cfg=cfg)


def _local_rows(t: _Tensor, runs: _Runs | None, np_dtype, cfg: config_lib.ModelConfig):
  """`hf_tensor_rows`' items of a tensor this process holds whole."""
  if runs is None:
    yield t.name, 0, _export(t.get(), np_dtype, _hf_layout(t, cfg))
    return
  layout = _transposed if t.kind == "kernel" else _as_is
  x = t.get()
  for start in range(0, runs.rows, runs.per_run):
    yield (
      t.name,
      start,
      _export(_slice_rows(x, runs.axis, start, start + runs.per_run), np_dtype, layout),
    )


def _gathered_rows(t: _Tensor, runs: _Runs | None, np_dtype, cfg: config_lib.ModelConfig, to: int):
  """`hf_tensor_rows`' items of a tensor that spans processes: it whole, or
  its runs, cast where they lie, on process `to` (None elsewhere)."""
  assert isinstance(t.value, jax.Array), f"{t.name}: a model that spans processes holds jax.Arrays"
  if runs is None:
    host = gather.gather_to(t.value, to, t.box(), np_dtype)
    yield t.name, 0, _laid_out(host, t, _hf_layout(t, cfg))
    return
  layout = functools.partial(_hf_rows, n_in=runs.axis) if t.kind == "kernel" else _as_is
  for start in range(0, runs.rows, runs.per_run):
    stop = min(runs.rows, start + runs.per_run)
    box = t.box(runs.axis, start // runs.inner, stop // runs.inner)
    yield t.name, start, _laid_out(gather.gather_to(t.value, to, box, np_dtype), t, layout)


def _laid_out(host: np.ndarray | None, t: _Tensor, layout) -> np.ndarray | None:
  """A gathered box of `t`'s leaf in the published layout (None: not here)."""
  if host is None:
    return None
  if t.layer is not None:
    host = host.reshape(host.shape[1:])  # the one layer
  return np.ascontiguousarray(layout(host))


def whole_tensors(items, cfg: config_lib.ModelConfig) -> Iterator[np.ndarray]:
  """The published tensors whole, in `hf_load.hf_layout` order, from
  `hf_tensor_rows`' items on the process that consumes them: one that came
  whole passes through, one in runs of rows is copied into a buffer of its
  shape as they come."""
  shapes = dict(hf_load.hf_layout(cfg))
  buffer = None
  for name, start, rows in items:
    shape = shapes[name]
    if start == 0 and tuple(rows.shape) == tuple(shape):
      yield rows
      continue
    if start == 0:
      buffer = np.empty(shape, rows.dtype)
    assert buffer is not None, f"{name}: rows from {start} came before row 0"
    buffer[start : start + rows.shape[0]] = rows
    if start + rows.shape[0] == shape[0]:
      yield buffer
      buffer = None


def hf_row_count(
  model: vlm.Qwen25VL, dtype: str = "bfloat16", run_bytes: float | None = None
) -> int:
  """How many items `hf_tensor_rows` yields, from the shapes alone."""
  run_bytes = ROW_RUN_BYTES if run_bytes is None else run_bytes
  itemsize = np.dtype(hf_load.NUMPY_DTYPES[dtype]).itemsize
  count = 0
  for t in _layer_tensors(model):
    runs = _row_runs(t.shape, t.kind, t.leaf_path, itemsize, run_bytes)
    count += 1 if runs is None else -(-runs.rows // runs.per_run)
  return count


@dataclasses.dataclass(frozen=True)
class ShardFile:
  """One safetensors file of a folder `save_hf_checkpoint` writes: its name,
  its tensors in the order `hf_tensors` yields them, and the process that
  writes it."""

  name: str
  tensors: tuple[str, ...]
  writer: int


def _shard_name(i: int, count: int) -> str:
  return "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def tensor_bytes(cfg: config_lib.ModelConfig, dtype: str) -> list[tuple[str, int]]:
  """(HF name, bytes in `dtype`) of each published tensor, in `hf_tensors` order."""
  itemsize = np.dtype(hf_load.NUMPY_DTYPES[dtype]).itemsize
  return [(name, math.prod(shape) * itemsize) for name, shape in hf_load.hf_layout(cfg)]


def byte_runs(nbytes: Sequence[int], max_bytes: int) -> list[range]:
  """Consecutive runs of items of at most `max_bytes` together (an item
  larger than that alone): the files of a folder, the buckets of a broadcast."""
  runs: list[range] = []
  start = size = 0
  for i, n in enumerate(nbytes):
    if i > start and size + n > max_bytes:
      runs.append(range(start, i))
      start, size = i, 0
    size += n
  if len(nbytes) > start:
    runs.append(range(start, len(nbytes)))
  return runs


def write_plan(
  cfg: config_lib.ModelConfig, dtype: str, max_shard_bytes: int, writers: int = 1
) -> list[ShardFile]:
  """The files of a written folder, the same on every process (from the layout alone).

  The published tensors, in `hf_tensors` order, are cut into `writers` runs
  of about equal bytes (process k writes run k), and each run into files of
  at most `max_shard_bytes` (a larger tensor has a file of its own).
  """
  sizes = tensor_bytes(cfg, dtype)
  total = max(1, sum(n for _, n in sizes))
  offsets = itertools.accumulate((n for _, n in sizes), initial=0)
  owner = [min(writers - 1, start * writers // total) for start, _ in zip(offsets, sizes)]
  runs: list[tuple[int, list[str]]] = []
  for writer, members in itertools.groupby(range(len(sizes)), key=owner.__getitem__):
    mine = list(members)
    for run in byte_runs([sizes[i][1] for i in mine], max_shard_bytes):
      runs.append((writer, [sizes[mine[j]][0] for j in run]))
  return [
    ShardFile(_shard_name(i, len(runs)), tuple(names), writer)
    for i, (writer, names) in enumerate(runs)
  ]


def spans_processes(model: vlm.Qwen25VL) -> bool:
  """Whether other processes hold parts of `model` (its exports are collectives)."""
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  return any(isinstance(x, jax.Array) and not x.is_fully_addressable for x in leaves)


def _failed_writers(own: _OwnFiles, writers: int) -> tuple[list[int], bool]:
  """The processes whose files failed, and whether any process's deltas did
  (a collective when several write)."""
  flags = np.array([own.failure is not None, own.delta_failure is not None], np.int32)
  if writers > 1:
    from jax.experimental import multihost_utils

    flags = np.asarray(multihost_utils.process_allgather(flags))
  flags = flags.reshape(-1, 2)
  return [int(i) for i in np.flatnonzero(flags[:, 0])], bool(flags[:, 1].any())


def save_hf_checkpoint(
  model: vlm.Qwen25VL,
  path: str,
  *,
  dtype: str = "bfloat16",
  max_shard_bytes: int = 4 << 30,
  extra_files: Mapping[str, str | bytes] | None = None,
  delta_from: tuple[str, str] | None = None,
) -> str:
  """Writes the published layout: config.json, model(-0000k-of-0000n).safetensors.

  The folder is written next to `path` under a hidden temporary name
  (`.tmp-<name>-<random>`, or `.tmp-<name>-shared` when several processes
  write) and renamed into place, so a reader (a rollout server loading new
  weights) never sees a half-written folder. A write that fails (a full
  disk) removes the temporary folder and raises OSError; `path` is then as it
  was. A writer killed mid-write leaves the temporary folder, which
  `remove_interrupted_writes` clears.

  A model sharded across processes needs every process to call this, in the
  same order, and each process writes its own run of the files
  (`write_plan`) into the folder, which must be on a filesystem they share:
  each tensor (or run of rows) goes in `dtype` to the process that writes
  its file and to no other (`hf_tensor_rows`). Process 0 then writes the
  index and config.json and renames the folder into place. Files and their
  deltas are streamed a tensor at a time (`ShardWriter`,
  `hf_delta.FileWriter`), so no process holds more than one layer tensor,
  or run of rows, of the export. A model held by
  one process (a rollout engine's copy) is written by that process alone.
  A failed file write does not stop the others at once: every process goes
  on gathering, the failure is shared at the end, and process 0 removes the
  folder and raises, as does the process that failed.

  Args:
    model: the model to export.
    path: destination folder (replaced if it exists).
    dtype: tensor dtype on disk.
    max_shard_bytes: split into several files with an index past this size.
    extra_files: {file name: source path or bytes} copied in as well
      (tokenizer.json, preprocessor_config.json, ...).
    delta_from: (folder, version) of an earlier version written the same
      way: the folder also gets its changes from it (hf_delta). A delta that
      cannot be made (the base unreadable) is left out, and the folder is
      written without one.

  Returns:
    The destination path.

  Raises:
    OSError: the folder could not be written (process 0, and a process
      whose own files failed).
  """
  writer = FolderWriter(model, path, dtype, max_shard_bytes, extra_files, delta_from)
  try:
    for name, start, rows in hf_tensor_rows(model, dtype, consumer=writer.writer_of):
      writer.write(name, start, rows)
  except BaseException:
    writer.abort()
    raise
  return writer.finish()


class FolderWriter:
  """One process's part in writing a folder as `save_hf_checkpoint` does,
  fed `hf_tensor_rows`' items in order: `write` each (every process sees
  every item: its own are written, the others skipped), then `finish`.

  The writes may run on another thread than the gathers that make the
  items (a deferred publish, rollout/tensor_feed.py); `finish`, a
  collective when several processes write, runs where the gathers do.
  """

  def __init__(
    self,
    model: vlm.Qwen25VL,
    path: str,
    dtype: str = "bfloat16",
    max_shard_bytes: int = 4 << 30,
    extra_files: Mapping[str, str | bytes] | None = None,
    delta_from: tuple[str, str] | None = None,
  ):
    if dtype not in hf_load.NUMPY_DTYPES:
      raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(hf_load.NUMPY_DTYPES)}")
    self._cfg, self._path, self._dtype = model.cfg, path, dtype
    self._extra_files, self._delta_from = extra_files, delta_from
    self._writers = jax.process_count() if spans_processes(model) else 1
    self._me = jax.process_index() if self._writers > 1 else 0
    self._leader = self._me == 0  # the process that finishes the folder
    self._plan = write_plan(model.cfg, dtype, max_shard_bytes, self._writers)
    self._tmp = _temp_folder(path, shared=self._writers > 1, create=self._leader)
    self._shapes = dict(hf_load.hf_layout(model.cfg))
    self._file_of = {name: f for f in self._plan for name in f.tensors}
    self.own = _OwnFiles()
    self._file: ShardWriter | None = None
    self._base: hf_load.TensorIndex | None = None
    self._delta_file: hf_delta.FileWriter | None = None
    self._tensor_delta: hf_delta.TensorDelta | None = None

  def writer_of(self, name: str) -> int:
    """The process that writes tensor `name` (its file's), the one its rows go to."""
    return self._file_of[name].writer

  def write(self, name: str, start: int, rows: np.ndarray | None) -> None:
    """Writes `rows` of tensor `name` from row `start` when its file is this
    process's, with its delta from the base version (rows of another
    process's file, None here, are skipped). After a failure it writes
    nothing more (or no more deltas)."""
    file = self._file_of[name]
    if file.writer != self._me or self.own.failure is not None:
      return
    assert rows is not None, f"{name}: rows of this process's file did not come here"
    try:
      if self._file is None:
        os.makedirs(self._tmp, exist_ok=True)  # made by process 0 before the first gather
        shapes = [(n, self._shapes[n]) for n in file.tensors]
        self._file = ShardWriter(os.path.join(self._tmp, file.name), shapes, self._dtype)
      self._file.write(name, rows, start)
    except OSError as e:
      self.own.failure = e
      self._close_files()
      return
    if self._delta_from is not None and self.own.delta_failure is None:
      self._write_delta(name, start, rows, file)
    if self._file.done:
      self._file = None

  def _write_delta(self, name: str, start: int, rows: np.ndarray, file: ShardFile) -> None:
    """Adds `rows`' changes to the tensor's delta; a finished tensor's go to
    its file's delta file at once, so a process holds one tensor's at most
    (`hf_delta.TensorDelta`'s bound, ROW_RUN_BYTES)."""
    assert self._delta_from is not None and self._file is not None
    try:
      self._base = self._base or hf_load.TensorIndex(self._delta_from[0], mapped=False)
      shape = self._shapes[name]
      if self._delta_file is None:
        self._delta_file = hf_delta.FileWriter(self._tmp, file.name, file.tensors, rows.dtype)
      if start == 0:
        base_shape = self._base.shape_and_dtype(name)[0]
        self._tensor_delta = hf_delta.TensorDelta(name, shape, base_shape, ROW_RUN_BYTES)
      assert self._tensor_delta is not None
      self._tensor_delta.add(start, rows, self._base.read(name, (start, start + rows.shape[0])))
      if start + rows.shape[0] == shape[0]:
        self._delta_file.add(self._tensor_delta)
        self._tensor_delta = None
      if self._file.done:
        self._delta_file.close()
        self._delta_file = None
    except (OSError, ValueError, KeyError) as e:
      log.warning("no delta from %s: %s", self._delta_from[0], e)
      self.own.delta_failure = e
      self._close_delta()

  def _close_files(self) -> None:
    """Closes the files being written, unfinished."""
    if self._file is not None:
      self._file.close()
    self._close_delta()

  def _close_delta(self) -> None:
    if self._delta_file is not None:
      self._delta_file.abort()
      self._delta_file = None
    self._tensor_delta = None

  def finish(self) -> str:
    """Shares every process's failures (a collective when several write);
    process 0 then finishes the folder and renames it into place. Returns
    its path.

    Raises:
      OSError: the folder could not be written (process 0, and a process
        whose own files failed); the temporary folder is removed.
    """
    try:
      failed, no_delta = _failed_writers(self.own, self._writers)
      if self.own.failure is not None:
        raise self.own.failure
      if failed and self._leader:
        raise OSError(
          f"{self._path}: processes {failed} could not write their files (their logs say why)"
        )
      if self._leader:
        if self._delta_from is not None and not no_delta:
          hf_delta.write_manifest(self._tmp, self._delta_from[1])
        else:
          shutil.rmtree(os.path.join(self._tmp, hf_delta.DELTA_DIR), ignore_errors=True)
        _finish_folder(self._tmp, self._path, self._cfg, self._plan, self._dtype, self._extra_files)
    except BaseException:
      self.abort()
      raise
    return self._path

  def abort(self) -> None:
    """Ends the write unfinished: process 0 removes the temporary folder."""
    self._close_files()
    if self._leader:
      shutil.rmtree(self._tmp, ignore_errors=True)


def _finish_folder(
  tmp: str,
  path: str,
  cfg: config_lib.ModelConfig,
  plan: list[ShardFile],
  dtype: str,
  extra_files: Mapping[str, str | bytes] | None,
) -> None:
  """The index, config.json and extra files into `tmp`, then `tmp` renamed to `path`."""
  _write_index(tmp, plan, sum(n for _, n in tensor_bytes(cfg, dtype)))
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(config_lib.to_hf_dict(cfg, torch_dtype=dtype), f, indent=2)
  for name, src in (extra_files or {}).items():
    dst = os.path.join(tmp, name)
    if isinstance(src, bytes):
      with open(dst, "wb") as out:
        out.write(src)
    else:
      shutil.copyfile(src, dst)
  _publish(tmp, path)


def _temp_folder(path: str, *, shared: bool, create: bool) -> str:
  """Where `save_hf_checkpoint` writes `path` before renaming it into place."""
  parent = os.path.dirname(os.path.abspath(path))
  prefix = _TEMP_PREFIX + os.path.basename(os.path.normpath(path)) + "-"
  if not shared:
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=prefix, dir=parent)
  tmp = os.path.join(parent, prefix + "shared")
  if create:  # the folder's one writer run: a leftover is an interrupted write
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
  return tmp


class ShardWriter:
  """One safetensors file written tensor by tensor, in the order of `shapes`:
  the header first (every tensor's offsets follow from the shapes), then
  each tensor's bytes as it comes, whole or in runs of rows, so a writer
  holds nothing but what it is given. The file is closed after the last
  tensor's last row."""

  def __init__(self, path: str, shapes: list[tuple[str, tuple[int, ...]]], dtype: str):
    self.path = path
    self._dtype = np.dtype(hf_load.NUMPY_DTYPES[dtype])
    self._pending = list(shapes)
    self._rows = 0  # rows of the next pending tensor written so far
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
      end = offset + math.prod(shape) * self._dtype.itemsize
      header[name] = {"dtype": hf_load.SAFETENSORS_DTYPES[dtype], "shape": list(shape)}
      header[name]["data_offsets"] = [offset, end]
      offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    self._file = open(path, "wb")  # closed after the last tensor
    self._file.write(struct.pack("<Q", len(raw)) + raw)

  @property
  def done(self) -> bool:
    return not self._pending

  def write(self, name: str, tensor: np.ndarray, start: int = 0) -> None:
    """Writes `tensor`: the next pending one, or its rows from `start` on."""
    want, shape = self._pending[0]
    fits = (
      name == want
      and tensor.dtype == self._dtype
      and tensor.ndim == len(shape)
      and tuple(tensor.shape[1:]) == shape[1:]
      and start == self._rows
      and start + (tensor.shape[0] if shape else 1) <= (shape[0] if shape else 1)
    )
    if not fits:
      raise ValueError(
        f"{self.path}: got {name} {list(tensor.shape)} {tensor.dtype} at row {start}, "
        f"the file's next is {want} {list(shape)} {self._dtype} from row {self._rows}"
      )
    self._file.write(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8).data)
    self._rows += tensor.shape[0] if shape else 1
    if self._rows == (shape[0] if shape else 1):
      self._pending.pop(0)
      self._rows = 0
      if not self._pending:
        self.close()

  def close(self) -> None:
    self._file.close()


@dataclasses.dataclass
class _OwnFiles:
  """What one process's part of a folder write came to."""

  failure: OSError | None = None  # its files: the version fails
  delta_failure: Exception | None = None  # its deltas: the version has none


def _write_index(folder: str, plan: list[ShardFile], total_bytes: int) -> None:
  """The index of a folder of several files (HF's total_size: the tensors' bytes)."""
  if len(plan) == 1:
    return
  weight_map = {name: f.name for f in plan for name in f.tensors}
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, f, indent=2)


def _publish(tmp: str, path: str) -> None:
  """Renames tmp into path; an existing folder is moved aside, then removed.

  A kill between the two renames leaves `path` missing and the old folder
  aside under tmp + `.old`; `remove_interrupted_writes` moves it back.
  """
  if os.path.exists(path):
    old = tmp + _ASIDE_SUFFIX
    os.replace(path, old)
    try:
      os.replace(tmp, path)
    except OSError:
      os.replace(old, path)
      raise
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.replace(tmp, path)


def remove_interrupted_writes(parent: str) -> list[str]:
  """Clears what `save_hf_checkpoint` calls killed mid-write left in `parent`.

  Their temporary folders are removed; a folder a killed writer had moved
  aside to replace it is moved back when its name is free (the kill fell
  between the two renames of `_publish`), otherwise removed. Call it only
  where no other writer is at work in `parent` (it cannot tell a live
  writer's temporary folder from a dead one's).

  Returns:
    The names of the entries removed or moved back.
  """
  if not os.path.isdir(parent):
    return []
  cleared = []
  for entry in sorted(os.listdir(parent)):
    full = os.path.join(parent, entry)
    if not entry.startswith(_TEMP_PREFIX) or not os.path.isdir(full):
      continue
    if entry.endswith(_ASIDE_SUFFIX):
      # `.tmp-<name>-<random>.old`; mkdtemp's random part has no "-".
      name = entry[len(_TEMP_PREFIX) : -len(_ASIDE_SUFFIX)].rpartition("-")[0]
      if name and not os.path.exists(os.path.join(parent, name)):
        os.replace(full, os.path.join(parent, name))
        log.warning("moved %s back to %s (its replacement was interrupted)", entry, name)
        cleared.append(entry)
        continue
    shutil.rmtree(full, ignore_errors=True)
    log.info("removed %s, left by an interrupted checkpoint write", full)
    cleared.append(entry)
  return cleared
