"""HF safetensors in and out, in the published Qwen2.5-VL layout.

Published checkpoints (and SGLang) use `visual.*`, `model.*`, `lm_head.*`;
transformers 5 names the same tensors `model.visual.*` and
`model.language_model.*` in memory. We read both and always write the
published layout, sharded into several files with an index when large.

Loading builds each parameter with `jax.make_array_from_callback`: a device
shard is filled from the safetensors files one layer tensor at a time, so no
host ever holds the whole model (nor, for stacked layers, a whole stack).

Both directions guard against half a checkpoint. A folder is written under a
hidden temporary name and renamed into place once every file is closed, and a
failed write removes its temporary folder. A load first checks the whole
folder against the model (every file present and complete, every tensor
present with its exact shape and a float dtype) and raises
`CheckpointFormatError` before reading any weight, so a rollout server told to
load a damaged folder keeps the weights it serves.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import glob
import itertools
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from fluxjax.models import config as config_lib
from fluxjax.models import hf_delta, vlm

log = logging.getLogger(__name__)

# A tensor on the host or on a device: the layout changes run on either.
Array = np.ndarray | jax.Array

# Stacked module prefixes: ours -> HF (layer index inserted after the prefix).
_STACKS = {"model.layers": "model.layers", "visual.blocks": "visual.blocks"}
# Our leaf names that differ from HF's (after the layer prefix is handled).
_RENAMES = {
  "model.embed_tokens": "model.embed_tokens.weight",
  "lm_head": "lm_head.weight",
  "visual.patch_embed.kernel": "visual.patch_embed.proj.weight",
  "visual.merger.fc1.kernel": "visual.merger.mlp.0.weight",
  "visual.merger.fc1.bias": "visual.merger.mlp.0.bias",
  "visual.merger.fc2.kernel": "visual.merger.mlp.2.weight",
  "visual.merger.fc2.bias": "visual.merger.mlp.2.bias",
}
# Kernels whose input side spans two of our axes ([heads, head_dim, out]).
_TWO_INPUT_AXES = ("self_attn.o_proj.kernel", "attn.proj.kernel")
# transformers 5 in-memory prefixes -> published prefixes.
_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# safetensors dtype names a parameter may be stored in.
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
# A folder being written is `.tmp-<name>-<random>`; the folder it replaces is
# moved aside to that name + `.old` for the instant of the swap.
_TEMP_PREFIX = ".tmp-"
_ASIDE_SUFFIX = ".old"


class CheckpointFormatError(ValueError):
  """A checkpoint folder that does not hold the model whole: a file missing or
  truncated, a tensor missing, misshapen, of a non-float dtype, or unused."""


def canonical_hf_name(name: str) -> str:
  for alias, canonical in _ALIASES:
    if name.startswith(alias):
      return canonical + name[len(alias) :]
  return name


def _leaf_rule(path: str):
  """(stack prefix or None, HF name template, kind) for one of our leaves.

  Stacked leaves get a `{}` in the template for the layer index.
  """
  kind = "kernel" if path.endswith(".kernel") or path == "lm_head" else "same"
  stack = next((s for s in _STACKS if path.startswith(s + ".")), None)
  if stack is not None:
    rest = path[len(stack) + 1 :]
    if kind == "kernel":
      rest = rest.removesuffix(".kernel") + ".weight"
    return stack, f"{_STACKS[stack]}.{{}}.{rest}", kind
  if path in _RENAMES:
    return None, _RENAMES[path], kind
  if kind == "kernel":
    return None, path.removesuffix(".kernel") + ".weight", kind
  return None, path, kind


def _hf_to_ours(w: Array, kind: str, shape: tuple[int, ...]) -> Array:
  """HF tensor -> our layout. HF kernels are [out, in...]; ours [in..., out...]."""
  if kind == "kernel":
    w = w.reshape(w.shape[0], -1).T
  if int(np.prod(w.shape)) != int(np.prod(shape)):
    raise ValueError(f"checkpoint tensor of shape {w.shape} cannot fill parameter {shape}")
  return w.reshape(shape)


def _ours_to_hf(x: Array, kind: str, path: str, cfg: config_lib.ModelConfig) -> Array:
  if kind != "kernel":
    return x.reshape(-1) if path.endswith(".bias") else x
  if path == "visual.patch_embed.kernel":
    v = cfg.vision
    return x.T.reshape(
      v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size
    )
  n_in = 2 if path.endswith(_TWO_INPUT_AXES) else 1
  return x.reshape(int(np.prod(x.shape[:n_in])), -1).T


def _hf_shape(
  shape: tuple[int, ...], kind: str, path: str, cfg: config_lib.ModelConfig
) -> tuple[int, ...]:
  """The published shape of one (layer) parameter of ours: what `_ours_to_hf` makes of it."""
  if kind != "kernel":
    return (int(np.prod(shape)),) if path.endswith(".bias") else shape
  if path == "visual.patch_embed.kernel":
    v = cfg.vision
    return (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
  n_in = 2 if path.endswith(_TWO_INPUT_AXES) else 1
  return (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))


class TensorIndex:
  """Name -> file over one or several safetensors files, read lazily.

  Opening checks each file's header and that its data covers the header's
  tensors (safetensors does), so a missing or truncated file fails here.
  `mapped=False` reads each tensor with one positioned read instead of
  through safetensors' memory map, whose touched pages stay resident while
  the index is open: for reading a folder once, a tensor at a time, in
  bounded memory (the delta writer's pass over the previous version).
  """

  def __init__(self, folder: str, mapped: bool = True):
    self._folder = folder
    self._mapped = mapped
    self._headers: dict[str, tuple[int, dict]] = {}
    index_file = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index_file):
      with open(index_file) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(folder, "*.safetensors")))
      if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
      weight_map = None
    self._handles = {}
    for file in files:
      full = os.path.join(folder, file)
      if not os.path.isfile(full):
        raise CheckpointFormatError(f"{folder}: the index lists {file}, which is missing")
      try:
        self._handles[file] = safe_open(full, framework="numpy")
      except SafetensorError as e:
        raise CheckpointFormatError(f"{full}: {e}") from e
    self.where: dict[str, tuple[str, str]] = {}  # name -> (file, name in the file)
    for file, handle in self._handles.items():
      for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
        if weight_map is not None and weight_map.get(name) != file:
          continue
        self.where[canonical_hf_name(name)] = (file, name)

  def shape_and_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
    """(shape, safetensors dtype name) from the header, without reading the data."""
    file, raw = self.where[name]
    tensor = self._handles[file].get_slice(raw)
    return tuple(tensor.get_shape()), tensor.get_dtype()

  def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor `name`, or its rows [start, stop) (its leading axis)."""
    if name not in self.where:
      raise KeyError(f"checkpoint has no tensor {name!r}")
    file, raw = self.where[name]
    if not self._mapped:
      return _read_unmapped(os.path.join(self._folder, file), raw, self._headers, rows)
    try:
      if rows is None:
        return self._handles[file].get_tensor(raw)
      return self._handles[file].get_slice(raw)[rows[0] : rows[1]]
    except SafetensorError as e:
      raise CheckpointFormatError(f"{file}: tensor {raw}: {e}") from e


_NUMPY_OF_SAFETENSORS = {v: np.dtype(_DTYPES[k]) for k, v in _SAFETENSORS_DTYPES.items()}


def _read_unmapped(
  path: str, name: str, headers: dict, rows: tuple[int, int] | None = None
) -> np.ndarray:
  """One tensor of a safetensors file, or its rows [start, stop), by a
  positioned read of their bytes (`headers`: path -> (data offset, header),
  filled on first use)."""
  with open(path, "rb") as f:
    if path not in headers:
      (size,) = struct.unpack("<Q", f.read(8))
      headers[path] = 8 + size, json.loads(f.read(size))
    data_start, header = headers[path]
    entry = header[name]
    start, end = entry["data_offsets"]
    dtype = _NUMPY_OF_SAFETENSORS.get(entry["dtype"])
    if dtype is None:
      raise CheckpointFormatError(f"{path}: tensor {name} is {entry['dtype']}, not a float")
    shape = list(entry["shape"])
    if rows is not None:
      first, stop = rows[0], min(rows[1], shape[0])
      row_bytes = (end - start) // max(shape[0], 1)
      start, end = start + first * row_bytes, start + stop * row_bytes
      shape[0] = stop - first
    data = os.pread(f.fileno(), end - start, data_start + start)
  if len(data) != end - start:
    raise CheckpointFormatError(f"{path}: tensor {name} is cut short")
  return np.frombuffer(data, dtype).reshape(shape)


def _check_whole(
  tensors: TensorIndex, expected: Mapping[str, tuple[int, ...]], allowed: set[str], strict: bool
) -> None:
  """Raises CheckpointFormatError unless every expected tensor is there with
  its exact shape and a float dtype; tensors in neither `expected` nor
  `allowed` fail when `strict` (else they are logged)."""
  missing = sorted(set(expected) - set(tensors.where))
  if missing:
    raise CheckpointFormatError(f"{len(missing)} tensors missing, e.g. {missing[:5]}")
  for name, shape in expected.items():
    got, dtype = tensors.shape_and_dtype(name)
    if got != shape:
      raise CheckpointFormatError(f"tensor {name} has shape {list(got)}, the model {list(shape)}")
    if dtype not in _FLOAT_DTYPES:
      raise CheckpointFormatError(f"tensor {name} has dtype {dtype}, not a float")
  unused = sorted(set(tensors.where) - set(expected) - allowed)
  if unused:
    msg = f"{len(unused)} checkpoint tensors unused by the model, e.g. {unused[:5]}"
    if strict:
      raise CheckpointFormatError(msg)
    log.warning(msg)


def load_hf_checkpoint(
  path: str,
  cfg: config_lib.ModelConfig | None = None,
  *,
  shardings: Mapping[tuple, jax.sharding.Sharding] | None = None,
  strict: bool = True,
) -> vlm.Qwen25VL:
  """Loads a Qwen2.5-VL HF checkpoint folder into our model.

  The folder is checked whole before any weight is read: every file the
  index lists present, every file's data covering its header, every tensor
  the model needs present with its exact published shape (a transposed or
  reshaped tensor of the right size is refused) and a float dtype. No
  completion marker is needed for that, and folders written by others load.
  What the check cannot see is damage inside a tensor's bytes (safetensors
  has no checksums).

  Args:
    path: folder with config.json and model*.safetensors (+ index if sharded).
    cfg: the model config; read from config.json when None.
    shardings: optional {state path tuple: Sharding} for each parameter (from
      the sharding rules); default puts everything on the first device.
    strict: fail on checkpoint tensors the model does not use.

  Returns:
    The model, parameters placed as requested.

  Raises:
    CheckpointFormatError: the folder does not hold this model whole.
    FileNotFoundError: no config.json or no safetensors file.
  """
  cfg = cfg or config_lib.load_hf_config(path)
  tensors = TensorIndex(path)
  abstract = vlm.abstract_model(cfg)
  graphdef, abstract_state = nnx.split(abstract)
  dtype = jnp.dtype(cfg.param_dtype)
  default_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  expected: dict[str, tuple[int, ...]] = {}
  plan = []
  for key, var in nnx.to_flat_state(abstract_state):
    leaf_path = ".".join(map(str, key))
    shape = tuple(var.get_value().shape)
    stack, template, kind = _leaf_rule(leaf_path)
    if leaf_path == "lm_head" and cfg.text.tie_word_embeddings:
      raise ValueError("tied config but model has an lm_head")
    layer_shape = shape[1:] if stack else shape
    names = [template.format(i) for i in range(shape[0])] if stack else [template]
    hf_shape = _hf_shape(layer_shape, kind, leaf_path, cfg)
    expected.update((name, hf_shape) for name in names)
    plan.append((key, var, shape, stack, names, kind, layer_shape))
  # Some exports keep the tied lm_head copy; it is the embedding.
  allowed = {"lm_head.weight"} if cfg.text.tie_word_embeddings else set()
  _check_whole(tensors, expected, allowed, strict)
  flat = []
  for key, var, shape, stack, names, kind, layer_shape in plan:
    cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()

    def layer_tensor(name, kind=kind, layer_shape=layer_shape, cache=cache):
      if name not in cache:
        cache[name] = _hf_to_ours(tensors.read(name), kind, layer_shape).astype(dtype)
        if len(cache) > 2:
          cache.popitem(last=False)
      return cache[name]

    def fill(index, names=names, stack=stack, layer_tensor=layer_tensor):
      if not stack:
        return layer_tensor(names[0])[index]
      layers = range(*index[0].indices(len(names)))
      return np.stack([layer_tensor(names[i])[index[1:]] for i in layers])

    sharding = (shardings or {}).get(key, default_sharding)
    value = jax.make_array_from_callback(shape, sharding, fill)
    flat.append((key, var.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


def _param_leaves(cfg: config_lib.ModelConfig):
  """(state key, leaf path, stack or None, HF name template, kind, shape) of
  every parameter, in the order `hf_tensors` yields them."""
  abstract = nnx.state(vlm.abstract_model(cfg), nnx.Param)
  for key, var in nnx.to_flat_state(abstract):
    leaf_path = ".".join(map(str, key))
    stack, template, kind = _leaf_rule(leaf_path)
    yield key, leaf_path, stack, template, kind, tuple(var.get_value().shape)


def _hf_targets(cfg: config_lib.ModelConfig):
  """(HF name, state key, layer index or None, kind, our layer shape, published
  shape) of every tensor `hf_tensors` yields, in its order."""
  for key, leaf_path, stack, template, kind, shape in _param_leaves(cfg):
    layer_shape = shape[1:] if stack else shape
    hf_shape = _hf_shape(layer_shape, kind, leaf_path, cfg)
    for i in range(shape[0]) if stack else [None]:
      yield template.format(i) if stack else template, key, i, kind, layer_shape, hf_shape


def hf_layout(cfg: config_lib.ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
  """(HF name, published shape) of every tensor `hf_tensors` yields, in its order."""
  return [(name, hf_shape) for name, *_, hf_shape in _hf_targets(cfg)]


def with_hf_tensors(state: nnx.State, cfg: config_lib.ModelConfig, named) -> nnx.State:
  """`state` (a model's) with the parameters the (HF name, tensor) pairs give
  replaced, each placed like the array it replaces; the others are kept.

  The tensors are read as they come (a receiver's stream) into a host buffer
  per parameter; layers of a stacked parameter that did not come are copied
  from the one it replaces.

  Raises:
    CheckpointFormatError: a name the model does not have, or a tensor of
      another shape than the published one.
  """
  targets = {name: rest for name, *rest in _hf_targets(cfg)}
  current = dict(nnx.to_flat_state(state))
  host: dict[tuple, tuple[np.ndarray, set]] = {}
  for raw, w in named:
    name = canonical_hf_name(raw)
    if name not in targets:
      raise CheckpointFormatError(f"tensor {raw} is not a parameter of the served model")
    key, i, kind, layer_shape, hf_shape = targets[name]
    if tuple(w.shape) != hf_shape:
      raise CheckpointFormatError(
        f"tensor {raw} has shape {list(w.shape)}, the model {list(hf_shape)}"
      )
    old = current[key].get_value()
    buffer, filled = host.setdefault(key, (np.empty(old.shape, old.dtype), set()))
    value = _hf_to_ours(np.asarray(w), kind, layer_shape)
    if i is None:
      buffer[...] = value
    else:
      buffer[i] = value
    filled.add(i)
  flat = []
  for key, var in current.items():
    if key in host:
      buffer, filled = host.pop(key)
      old = var.get_value()
      missing = [] if None in filled else sorted(set(range(old.shape[0])) - filled)
      if missing:
        buffer[missing] = np.asarray(jax.device_get(old))[missing]
      var = var.replace(jax.device_put(buffer, old.sharding))
    flat.append((key, var))
  return nnx.from_flat_state(flat)


def hf_tensor_reader(state: nnx.State, cfg: config_lib.ModelConfig):
  """`read(name)`: one published tensor of a model's `state`, in its
  parameter dtype, on the host (the layout is worked out once)."""
  targets = {name: (key, i, kind) for name, key, i, kind, _, _ in _hf_targets(cfg)}
  flat = dict(nnx.to_flat_state(state))

  def read(name: str) -> np.ndarray:
    if name not in targets:
      raise KeyError(f"the model has no tensor {name!r}")
    key, i, kind = targets[name]
    value = flat[key].get_value()
    x = value if i is None else value[i]
    return np.ascontiguousarray(_to_host(_ours_to_hf(x, kind, ".".join(map(str, key)), cfg)))

  return read


def _to_host(x: Array) -> np.ndarray:
  """The whole array on this host; a collective when other processes hold shards of it."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _on_one_device(x: Array) -> Array:
  """`x` moved to one of its devices when this process holds all of it.

  The layout change that follows then runs on that device alone, with no
  collective: a deferred broadcast (rollout/publish.py) reads the trainer's
  arrays from another thread while the training step runs, and collectives
  launched from two threads may meet in different orders on different GPUs.
  Arrays that span processes stay where they are (their reads are the
  trainer's own, in order)."""
  if not isinstance(x, jax.Array) or not x.is_fully_addressable or len(x.sharding.device_set) == 1:
    return x
  return jax.device_put(x, x.addressable_shards[0].device)


# A published tensor past this many bytes goes to disk in runs of rows of at
# most this size (`hf_tensor_rows`), so a process's part of a disk publish
# holds one run of it: the 7B embedding alone is 1.09 GB in bf16, 2.3 decoder
# layers, and a decoder layer's largest tensor 136 MB.
ROW_RUN_BYTES = 64 << 20


def _layer_tensors(model: vlm.Qwen25VL):
  """(HF name, our layer tensor's shape, a function returning it, kind, leaf
  path) of every published tensor, in order; nothing runs until it is called."""
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    leaf_path = ".".join(map(str, key))
    stack, template, kind = _leaf_rule(leaf_path)
    value = var.get_value()
    for i in range(value.shape[0]) if stack else [None]:
      # The layer axis is never sharded: indexing it is no collective.
      get = functools.partial(_layer, value, i)
      shape = value.shape if i is None else value.shape[1:]
      yield template.format(i) if stack else template, shape, get, kind, leaf_path


def _layer(value: Array, i: int | None) -> Array:
  return value if i is None else value[i]


def _export(x: Array, np_dtype, layout) -> np.ndarray:
  """`layout(x)` in `np_dtype` on this host: cast and laid out on one device
  first. Contiguous: safetensors writes the buffer as laid out, ignoring strides."""
  return np.ascontiguousarray(_to_host(layout(_on_one_device(x.astype(np_dtype)))))


def hf_tensors(model: vlm.Qwen25VL, dtype: str = "bfloat16"):
  """Yields (HF name, numpy tensor) one layer tensor at a time, in `dtype`."""
  for name, _, tensor in hf_tensor_rows(model, dtype, run_bytes=math.inf):
    yield name, tensor


def _row_runs(shape, kind: str, leaf_path: str, itemsize: int, run_bytes: float):
  """(rows, input axes, rows per run) when the published tensor of our
  `shape` goes in runs of rows: past `run_bytes`, with its rows a slice of
  ours (an embedding table's rows, 0 input axes; a kernel's output columns:
  HF [out, in] = ours [in..., out...] flattened and transposed, as
  `_ours_to_hf`); else None, whole (also vectors and the patch embedding's
  5-D layout)."""
  if kind != "kernel":
    if len(shape) != 2:
      return None
    rows, n_in = shape[0], 0
  elif leaf_path == "visual.patch_embed.kernel":
    return None
  else:
    n_in = 2 if leaf_path.endswith(_TWO_INPUT_AXES) else 1
    rows = math.prod(shape[n_in:])
  size = math.prod(shape) * itemsize
  if size <= run_bytes:
    return None
  return rows, n_in, max(1, int(run_bytes // (size // rows)))


def _transposed(x: Array) -> Array:
  return x.T


def _as_is(x: Array) -> Array:
  return x


def _slice_rows(x: Array, n_in: int, start: int, stop: int) -> Array:
  if not n_in:
    return x[start:stop]
  return x.reshape(math.prod(x.shape[:n_in]), -1)[:, start:stop]


def hf_tensor_rows(model: vlm.Qwen25VL, dtype: str = "bfloat16", run_bytes: float | None = None):
  """Yields (HF name, first row, rows) in `dtype`: `hf_tensors`' tensors, one
  past `run_bytes` (default ROW_RUN_BYTES) whose rows are a slice of ours in
  runs of at most that size, each sliced before it is cast or gathered (the
  others whole, from row 0); `hf_row_count` items in all."""
  run_bytes = ROW_RUN_BYTES if run_bytes is None else run_bytes
  np_dtype = _DTYPES[dtype]
  itemsize = np.dtype(np_dtype).itemsize
  for name, shape, get, kind, leaf_path in _layer_tensors(model):
    runs = _row_runs(shape, kind, leaf_path, itemsize, run_bytes)
    if runs is None:
      whole = functools.partial(_ours_to_hf, kind=kind, path=leaf_path, cfg=model.cfg)
      yield name, 0, _export(get(), np_dtype, whole)
      continue
    rows, n_in, per_run = runs
    layout = _transposed if kind == "kernel" else _as_is
    x = get()
    for start in range(0, rows, per_run):
      yield name, start, _export(_slice_rows(x, n_in, start, start + per_run), np_dtype, layout)


def whole_tensors(items, cfg: config_lib.ModelConfig) -> Iterator[np.ndarray]:
  """The published tensors whole, in `hf_layout` order, from
  `hf_tensor_rows`' items: one that came whole passes through, one in runs
  of rows is copied into a buffer of its shape as they come."""
  shapes = dict(hf_layout(cfg))
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
  itemsize = np.dtype(_DTYPES[dtype]).itemsize
  count = 0
  for _, shape, _, kind, leaf_path in _layer_tensors(model):
    runs = _row_runs(shape, kind, leaf_path, itemsize, run_bytes)
    count += 1 if runs is None else -(-runs[0] // runs[2])
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
  itemsize = np.dtype(_DTYPES[dtype]).itemsize
  return [(name, math.prod(shape) * itemsize) for name, shape in hf_layout(cfg)]


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
  same order (each tensor is gathered in `dtype` by a collective, one layer
  tensor at a time), and each process writes its own run of the files
  (`write_plan`) into the folder, which must be on a filesystem they share;
  process 0 then writes the index and config.json and renames the folder
  into place. Files are streamed a tensor at a time (`ShardWriter`), so no
  process holds more than one layer tensor of the export. A model held by
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
    for name, start, rows in hf_tensor_rows(model, dtype):
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
    if dtype not in _DTYPES:
      raise ValueError(f"unsupported dtype {dtype!r}; choose from {sorted(_DTYPES)}")
    self._cfg, self._path, self._dtype = model.cfg, path, dtype
    self._extra_files, self._delta_from = extra_files, delta_from
    self._writers = jax.process_count() if spans_processes(model) else 1
    self._me = jax.process_index() if self._writers > 1 else 0
    self._leader = self._me == 0  # the process that finishes the folder
    self._plan = write_plan(model.cfg, dtype, max_shard_bytes, self._writers)
    self._tmp = _temp_folder(path, shared=self._writers > 1, create=self._leader)
    self._shapes = dict(hf_layout(model.cfg))
    self._file_of = {name: f for f in self._plan for name in f.tensors}
    self.own = _OwnFiles()
    self._file: ShardWriter | None = None
    self._base: TensorIndex | None = None
    self._delta: dict[str, np.ndarray] = {}
    self._tensor_delta: hf_delta.TensorDelta | None = None

  def write(self, name: str, start: int, rows: np.ndarray) -> None:
    """Writes `rows` of tensor `name` from row `start` when its file is this
    process's, with its delta from the base version. After a failure it
    writes nothing more (or no more deltas)."""
    file = self._file_of[name]
    if file.writer != self._me or self.own.failure is not None:
      return
    try:
      if self._file is None:
        os.makedirs(self._tmp, exist_ok=True)  # made by process 0 before the first gather
        shapes = [(n, self._shapes[n]) for n in file.tensors]
        self._file = ShardWriter(os.path.join(self._tmp, file.name), shapes, self._dtype)
      self._file.write(name, rows, start)
    except OSError as e:
      self.own.failure = e
      if self._file is not None:
        self._file.close()
      return
    if self._delta_from is not None and self.own.delta_failure is None:
      self._write_delta(name, start, rows, file.name)
    if self._file.done:
      self._file, self._delta = None, {}

  def _write_delta(self, name: str, start: int, rows: np.ndarray, file_name: str) -> None:
    assert self._delta_from is not None and self._file is not None
    try:
      self._base = self._base or TensorIndex(self._delta_from[0], mapped=False)
      shape = self._shapes[name]
      if start == 0:
        base_shape = self._base.shape_and_dtype(name)[0]
        self._tensor_delta = hf_delta.TensorDelta(name, shape, base_shape, ROW_RUN_BYTES)
      assert self._tensor_delta is not None
      self._tensor_delta.add(start, rows, self._base.read(name, (start, start + rows.shape[0])))
      if start + rows.shape[0] == shape[0]:
        self._delta.update(self._tensor_delta.entries())
      if self._file.done:
        hf_delta.write_file(self._tmp, file_name, self._delta)
    except (OSError, ValueError, KeyError) as e:
      log.warning("no delta from %s: %s", self._delta_from[0], e)
      self.own.delta_failure = e

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
    if self._file is not None:
      self._file.close()
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
    self._dtype = np.dtype(_DTYPES[dtype])
    self._pending = list(shapes)
    self._rows = 0  # rows of the next pending tensor written so far
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
      end = offset + math.prod(shape) * self._dtype.itemsize
      header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape)}
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
