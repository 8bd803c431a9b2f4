"""Models created already sharded: each parameter materializes on its devices only.

The abstract model gives shapes and logical axes; `fluxjax.sharding.rules`
maps those to mesh axes; a jitted init with out_shardings then draws each
shard where it lives, so no host or device ever holds a whole copy.
"""

from __future__ import annotations

import functools
import logging

import jax
from flax import nnx

from fluxjax.models import vlm
from fluxjax.models.config import ModelConfig
from fluxjax.sharding import rules as rules_lib
from fluxjax.sharding.rules import Rules

log = logging.getLogger(__name__)


def create_sharded_model(
  cfg: ModelConfig,
  mesh: jax.sharding.Mesh,
  rules: Rules | None = None,
  *,
  seed: int = 0,
  max_replicated_bytes: int = 1 << 20,
  log_table: bool = True,
) -> vlm.Qwen25VL:
  """Random-init model whose parameters are created already sharded.

  Logs the parameter table and refuses layouts that would replicate a
  parameter over `max_replicated_bytes` on every device.
  """
  rules = rules_lib.fsdp_rules(mesh) if rules is None else rules
  graphdef, _ = _checked_layout(cfg, mesh, rules, max_replicated_bytes, log_table)
  init = sharded_init(cfg, rules, mesh)
  with jax.set_mesh(mesh):
    state = init(jax.random.key(seed))
  return nnx.merge(graphdef, state)


def _checked_layout(
  cfg: ModelConfig,
  mesh: jax.sharding.Mesh,
  rules: Rules,
  max_replicated_bytes: int,
  log_table: bool,
) -> tuple[nnx.GraphDef, nnx.State]:
  """(graphdef, shardings) of the model's parameters, logged and checked."""
  graphdef, abstract_state = nnx.split(vlm.abstract_model(cfg))
  shardings = rules_lib.state_shardings(abstract_state, rules, mesh)
  table = rules_lib.parameter_table(abstract_state, shardings)
  if log_table:
    log.debug("parameters:\n%s", rules_lib.format_table(table))
    log.info("parameters: %s", rules_lib.format_total(table))
  rules_lib.check_sharded(table, max_replicated_bytes)
  return graphdef, shardings


def sharded_init(cfg: ModelConfig, rules: Rules, mesh: jax.sharding.Mesh):
  """`init(seed_key) -> state`, jitted once per (config, rules, mesh).

  The seed is an argument, not a constant of the program, and the jitted
  function is kept: every model of one config and layout (a reference model,
  a resumed loop, a notebook re-running a cell) reuses one compiled program.
  Compiling it costs ~10 s on CPU whatever the model's size: each parameter's
  random draw is its own threefry kernel.
  """
  return _sharded_init(cfg, tuple((name, tuple(mesh_axes)) for name, mesh_axes in rules), mesh)


@functools.lru_cache(maxsize=8)
def _sharded_init(cfg: ModelConfig, rules: Rules, mesh: jax.sharding.Mesh):
  _, abstract_state = nnx.split(vlm.abstract_model(cfg))

  def init(seed_key):
    return nnx.state(vlm.create_model(cfg, seed_key))

  return jax.jit(init, out_shardings=rules_lib.state_shardings(abstract_state, rules, mesh))


def model_shardings(
  cfg: ModelConfig,
  mesh: jax.sharding.Mesh,
  rules: Rules | None = None,
  *,
  max_replicated_bytes: int = 1 << 20,
  log_table: bool = True,
) -> dict[tuple, jax.sharding.Sharding]:
  """{state path: sharding} for `hf_load.load_hf_checkpoint(shardings=...)`.

  The same table, log line and replication check as `create_sharded_model`:
  a checkpoint loads into the layout a random init would have.
  """
  rules = rules_lib.fsdp_rules(mesh) if rules is None else rules
  _, shardings = _checked_layout(cfg, mesh, rules, max_replicated_bytes, log_table)
  return dict(nnx.to_flat_state(shardings))
