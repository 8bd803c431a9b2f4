"""HF safetensors in: the published Qwen2.5-VL layout, and loading it.

Published checkpoints (and SGLang) use `visual.*`, `model.*`, `lm_head.*`;
transformers 5 names the same tensors `model.visual.*` and
`model.language_model.*` in memory. We read both; `hf_export` writes the
published layout. A load checks the whole folder against the model before it
reads any weight (`load_hf_checkpoint`), then fills each device shard one
layer tensor at a time.
"""

from __future__ import annotations

import collections
import glob
import json
import logging
import os
import struct
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open

from fluxjax.models import config as config_lib
from fluxjax.models import vlm

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
TWO_INPUT_AXES = ("self_attn.o_proj.kernel", "attn.proj.kernel")
# transformers 5 in-memory prefixes -> published prefixes.
_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))
# The dtypes a checkpoint is written in: numpy's and safetensors' names for each.
NUMPY_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
# safetensors dtype names a parameter may be stored in.
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


class CheckpointFormatError(ValueError):
  """A checkpoint folder that does not hold the model whole: a file missing or
  truncated, a tensor missing, misshapen, of a non-float dtype, or unused."""


def canonical_hf_name(name: str) -> str:
  for alias, canonical in _ALIASES:
    if name.startswith(alias):
      return canonical + name[len(alias) :]
  return name


def leaf_rule(path: str):
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


def ours_to_hf(x: Array, kind: str, path: str, cfg: config_lib.ModelConfig) -> Array:
  """Our (layer) parameter at leaf `path` -> its published layout; `_hf_to_ours` undone."""
  if kind != "kernel":
    return x.reshape(-1) if path.endswith(".bias") else x
  if path == "visual.patch_embed.kernel":
    v = cfg.vision
    return x.T.reshape(
      v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size
    )
  n_in = 2 if path.endswith(TWO_INPUT_AXES) else 1
  return x.reshape(int(np.prod(x.shape[:n_in])), -1).T


def _hf_shape(
  shape: tuple[int, ...], kind: str, path: str, cfg: config_lib.ModelConfig
) -> tuple[int, ...]:
  """The published shape of one (layer) parameter of ours: what `ours_to_hf` makes of it."""
  if kind != "kernel":
    return (int(np.prod(shape)),) if path.endswith(".bias") else shape
  if path == "visual.patch_embed.kernel":
    v = cfg.vision
    return (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
  n_in = 2 if path.endswith(TWO_INPUT_AXES) else 1
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


_NUMPY_OF_SAFETENSORS = {v: np.dtype(NUMPY_DTYPES[k]) for k, v in SAFETENSORS_DTYPES.items()}


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
    stack, template, kind = leaf_rule(leaf_path)
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
  every parameter, in the order `hf_export.hf_tensors` yields them."""
  abstract = nnx.state(vlm.abstract_model(cfg), nnx.Param)
  for key, var in nnx.to_flat_state(abstract):
    leaf_path = ".".join(map(str, key))
    stack, template, kind = leaf_rule(leaf_path)
    yield key, leaf_path, stack, template, kind, tuple(var.get_value().shape)


def _hf_targets(cfg: config_lib.ModelConfig):
  """(HF name, state key, layer index or None, kind, our layer shape, published
  shape) of every tensor `hf_export.hf_tensors` yields, in its order."""
  for key, leaf_path, stack, template, kind, shape in _param_leaves(cfg):
    layer_shape = shape[1:] if stack else shape
    hf_shape = _hf_shape(layer_shape, kind, leaf_path, cfg)
    for i in range(shape[0]) if stack else [None]:
      yield template.format(i) if stack else template, key, i, kind, layer_shape, hf_shape


def hf_layout(cfg: config_lib.ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
  """(HF name, published shape) of every tensor `hf_export.hf_tensors` yields, in its order."""
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
    return np.ascontiguousarray(to_host(ours_to_hf(x, kind, ".".join(map(str, key)), cfg)))

  return read


def to_host(x: Array) -> np.ndarray:
  """The whole array on this host; a collective when other processes hold shards of it."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))
