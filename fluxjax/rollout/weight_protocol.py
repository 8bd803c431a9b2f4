"""The weight-update part of SGLang's native HTTP API that RL rollout uses.

docs/fleet.md, "Weight sync: disk or distributed". The generate side is in protocol.py;
bodies and errors follow json_body.py.

  POST /update_weights_from_disk  `parse_update_weights`
  POST /update_weight_version     `parse_update_weight_version`
  POST /init_weights_update_group, /update_weights_from_distributed,
       /destroy_weights_update_group  InitWeightsGroup, DistributedUpdate
                                   (the tensors follow over torch.distributed)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fluxjax.rollout.json_body import ProtocolError, is_json_int, json_flag

WEIGHT_GROUP_BACKENDS = ("gloo", "nccl")
# The group fluxjax's trainer makes (a server may hold others).
WEIGHT_GROUP_NAME = "fluxjax_weights"
# dtype names of a distributed update (torch's, without the `torch.` prefix).
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
# What the trainer publishes in, on disk and on the wire.
PUBLISHED_DTYPE = "bfloat16"
# load_format values of a disk update (null: auto).
DISK_LOAD_FORMATS = ("auto", "safetensors", None)


def parse_update_weights(body: dict) -> tuple[str, str | None, bool]:
  """(model_path, weight_version, abort_all_requests) of an
  /update_weights_from_disk body; flush_cache is accepted (a no-op here).

  The body: {model_path, load_format, flush_cache, abort_all_requests, weight_version}.
  """
  path = body.get("model_path")
  if not isinstance(path, str):
    raise ProtocolError("model_path (a checkpoint folder) is required")
  if body.get("load_format") not in DISK_LOAD_FORMATS:
    raise ProtocolError(f"load_format {body['load_format']!r} is not supported")
  version = body.get("weight_version")
  if version is not None and not isinstance(version, str):
    raise ProtocolError(f"weight_version must be a string, got {version!r}")
  json_flag(body.get("flush_cache"), "flush_cache")
  return path, version, json_flag(body.get("abort_all_requests"), "abort_all_requests")


@dataclasses.dataclass(frozen=True)
class InitWeightsGroup:
  """An /init_weights_update_group body: the trainer is rank 0; this server's
  ranks (its GPUs, tp x pp) start at `rank_offset` (publish.rank_layout)."""

  master_address: str
  master_port: int
  rank_offset: int
  world_size: int
  group_name: str
  backend: str

  def to_body(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class DistributedUpdate:
  """An /update_weights_from_distributed body: the tensors rank 0 then
  broadcasts, in order (names, dtypes, shapes only)."""

  names: tuple[str, ...]
  dtypes: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  group_name: str
  weight_version: str | None = None
  flush_cache: bool = True
  abort_all_requests: bool = False

  def to_body(self) -> dict[str, Any]:
    body = dataclasses.asdict(self)
    body["names"], body["dtypes"] = list(self.names), list(self.dtypes)
    body["shapes"] = [list(s) for s in self.shapes]
    body["load_format"] = None
    return body


def _name(body: dict, key: str) -> str:
  value = body.get(key)
  if not isinstance(value, str) or not value:
    raise ProtocolError(f"{key} (a non-empty string) is required, got {value!r}")
  return value


def parse_init_weights_group(body: dict) -> InitWeightsGroup:
  port: Any = body.get("master_port")
  offset: Any = body.get("rank_offset")
  size: Any = body.get("world_size")
  if not is_json_int(port) or not 0 < port < 65536:
    raise ProtocolError(f"master_port must be a port number, got {port!r}")
  if not is_json_int(size) or size < 2:
    raise ProtocolError(f"world_size must be an int >= 2 (the trainer and a server), got {size!r}")
  if not is_json_int(offset) or not 0 < offset < size:
    raise ProtocolError(f"rank_offset must be in [1, world_size), got {offset!r}")
  backend = body.get("backend", "nccl")
  if backend not in WEIGHT_GROUP_BACKENDS:
    raise ProtocolError(f"backend must be one of {WEIGHT_GROUP_BACKENDS}, got {backend!r}")
  return InitWeightsGroup(
    _name(body, "master_address"), port, offset, size, _name(body, "group_name"), backend
  )


def parse_distributed_update(body: dict) -> DistributedUpdate:
  names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
  if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
    raise ProtocolError("names must be a list of tensor names")
  if not isinstance(dtypes, list) or len(dtypes) != len(names):
    raise ProtocolError(f"dtypes must be a list of {len(names)} dtype names")
  if any(d not in WEIGHT_DTYPES for d in dtypes):
    raise ProtocolError(f"dtypes must be among {WEIGHT_DTYPES}, got {sorted(set(dtypes))}")
  if not isinstance(shapes, list) or len(shapes) != len(names):
    raise ProtocolError(f"shapes must be a list of {len(names)} shapes")
  if not all(isinstance(s, list) and all(is_json_int(d) and d >= 0 for d in s) for s in shapes):
    raise ProtocolError("each shape must be a list of non-negative ints")
  if body.get("load_format") is not None:
    raise ProtocolError(f"load_format {body['load_format']!r} is not supported (only null)")
  version = body.get("weight_version")
  if version is not None and not isinstance(version, str):
    raise ProtocolError(f"weight_version must be a string, got {version!r}")
  return DistributedUpdate(
    tuple(names),
    tuple(dtypes),
    tuple(tuple(s) for s in shapes),
    _name(body, "group_name"),
    version,
    json_flag(body.get("flush_cache", True), "flush_cache"),
    json_flag(body.get("abort_all_requests"), "abort_all_requests"),
  )


def parse_group_name(body: dict) -> str:
  """The group of a /destroy_weights_update_group body."""
  return _name(body, "group_name")


def parse_update_weight_version(body: dict) -> tuple[str, bool]:
  """(new_version, abort_all_requests) of an /update_weight_version body."""
  version = body.get("new_version")
  if not isinstance(version, str):
    raise ProtocolError(f"new_version (a string) is required, got {version!r}")
  return version, json_flag(body.get("abort_all_requests"), "abort_all_requests")
