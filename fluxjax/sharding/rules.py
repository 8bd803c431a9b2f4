"""The one table from logical axis names to mesh axes.

Rules are an ordered list of (logical axis, mesh axes). For each parameter the
rules are tried in order: a rule applies to the first dimension carrying its
logical name whose size divides by the product of its mesh axes, provided those
mesh axes are still unused for that parameter. FSDP is the default table: each
parameter shards its first eligible dimension over every non-`data` axis.
Gradients and optimizer state take the same specs as their parameters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from fluxjax.sharding import axes
from fluxjax.sharding import mesh as mesh_lib

P = jax.sharding.PartitionSpec
Rules = Sequence[tuple[str, tuple[str, ...]]]

# Wider dimensions first: they divide by large meshes and give even shards.
_FSDP_PRIORITY = (
  axes.EMBED,
  axes.VIS_EMBED,
  axes.MERGED,
  axes.MLP,
  axes.VIS_MLP,
  axes.VOCAB,
  axes.PATCH,
  axes.Q_HEADS,
  axes.KV_HEADS,
  axes.VIS_HEADS,
  axes.HEAD_DIM,
)


def fsdp_rules(mesh: jax.sharding.Mesh) -> list[tuple[str, tuple[str, ...]]]:
  """Weights: FSDP over every non-data axis. Activations: batch over all axes."""
  group = mesh_lib.param_axes(mesh)
  rules = [(name, group) for name in _FSDP_PRIORITY]
  rules.append((axes.ACT_BATCH, mesh_lib.batch_axes(mesh)))
  return rules


def partition_spec(
  logical: Sequence[str | None], shape: Sequence[int], rules: Rules, mesh: jax.sharding.Mesh
) -> P:
  """Resolves one array's logical axes to a PartitionSpec (see module docstring)."""
  spec: list = [None] * len(shape)
  used: set[str] = set()
  for name, mesh_axes in rules:
    mesh_axes = tuple(a for a in mesh_axes if mesh.shape[a] > 1)
    if not mesh_axes or used & set(mesh_axes):
      continue
    size = math.prod(mesh.shape[a] for a in mesh_axes)
    for i, (logical_i, dim) in enumerate(zip(logical, shape)):
      if logical_i == name and spec[i] is None and dim % size == 0:
        spec[i] = mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]
        used.update(mesh_axes)
        break
  return P(*spec)


# The rollout engine's KV cache [layers, slots, kv heads, capacity, head dim]:
# slots over the batch axes where they divide (no reduction is split), else
# the heads, else the head dim over the parameter axes.
KV_CACHE_AXES = (axes.LAYERS, axes.ACT_BATCH, axes.KV_HEADS, None, axes.HEAD_DIM)


def kv_cache_sharding(shape: Sequence[int], mesh: jax.sharding.Mesh) -> jax.sharding.NamedSharding:
  """Where the engine's cache lives, fixed up front so its programs compile once.

  Left to propagation, the first prefill (an unplaced cache) returns the cache
  sharded as XLA chose and the second call compiles again for that layout.
  """
  group = mesh_lib.param_axes(mesh)
  table = [
    (axes.ACT_BATCH, mesh_lib.batch_axes(mesh)),
    (axes.KV_HEADS, group),
    (axes.HEAD_DIM, group),
  ]
  return jax.sharding.NamedSharding(mesh, partition_spec(KV_CACHE_AXES, shape, table, mesh))


def state_shardings(state: nnx.State, rules: Rules, mesh: jax.sharding.Mesh) -> nnx.State:
  """NamedSharding for every leaf of an (abstract) NNX state, from its metadata."""

  def one(var):
    value = var.get_value()
    names = var.get_metadata().get("out_sharding") or (None,) * len(value.shape)
    return jax.sharding.NamedSharding(mesh, partition_spec(names, value.shape, rules, mesh))

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def parameter_table(state: nnx.State, shardings: nnx.State) -> list[dict]:
  """One row per parameter: name, shape, spec, bytes per device."""
  rows = []
  flat_s = dict(nnx.to_flat_state(shardings))
  for key, var in nnx.to_flat_state(state):
    value = var.get_value()
    sharding = flat_s[key]
    shard_shape = sharding.shard_shape(value.shape)
    rows.append(
      {
        "name": ".".join(map(str, key)),
        "shape": tuple(value.shape),
        "spec": str(sharding.spec),
        "bytes_per_device": int(np.prod(shard_shape)) * np.dtype(value.dtype).itemsize,
        "bytes": int(np.prod(value.shape)) * np.dtype(value.dtype).itemsize,
        "replicated": sharding.is_fully_replicated and sharding.num_devices > 1,
      }
    )
  return rows


def check_sharded(table: list[dict], max_replicated_bytes: int) -> None:
  """Refuses a layout that leaves a large parameter whole on every device."""
  bad = [r for r in table if r["replicated"] and r["bytes"] > max_replicated_bytes]
  if bad:
    names = ", ".join(f"{r['name']} {r['shape']}" for r in bad[:5])
    raise ValueError(
      f"{len(bad)} parameters over {max_replicated_bytes} bytes would be "
      f"replicated on every device: {names}. Add a rule for their logical "
      f"axes or pick mesh sizes that divide them."
    )


def format_table(table: list[dict]) -> str:
  width = max(len(r["name"]) for r in table)
  lines = [f"{'parameter':<{width}}  {'shape':<22} {'spec':<28} {'MiB/device':>10}"]
  for r in table:
    lines.append(
      f"{r['name']:<{width}}  {r['shape']!s:<22} {r['spec']:<28} "
      f"{r['bytes_per_device'] / 2**20:>10.3f}"
    )
  lines.append(format_total(table))
  return "\n".join(lines)


def format_total(table: list[dict]) -> str:
  """The table's last line: parameter bytes per device and unsharded."""
  total = sum(r["bytes_per_device"] for r in table)
  return (
    f"total per device: {total / 2**20:.2f} MiB "
    f"(unsharded {sum(r['bytes'] for r in table) / 2**20:.2f} MiB)"
  )
