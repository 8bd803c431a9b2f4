"""Strategies behind one registry keyed by `sharding.strategy`.

A strategy decides three things: the sequence-parallel factorization of the
mesh, the plan for a batch (from lengths only), and the attention function the
text decoder runs with. Everything else (FSDP, the packed batch, the step) is
shared, so switching strategies by config changes nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import ml_collections

from fluxjax.models.config import ModelConfig
from fluxjax.sharding import mesh as mesh_lib
from fluxjax.sharding import plan as plan_lib
from fluxjax.sharding import planners
from fluxjax.parallel import sync as sync_lib
from fluxjax.parallel import train_step, ulysses
from fluxjax.sharding.plan import Plan


@dataclasses.dataclass(frozen=True)
class Strategy:
  name: str
  sp: int                     # Ulysses degree (1 = none); flex_ulysses: p_max
  capacity: int               # tokens per device per microbatch (the largest bucket)
  model_cfg: ModelConfig
  buckets: tuple[int, ...] = ()  # static capacities; () = powers of two up to capacity
  sync: str = "layer"            # "layer" (FSDP per layer) | "minibatch" (ODC)
  balance_vision: bool = False   # spread images/frames over devices by patch count

  def sp_axes(self) -> tuple[tuple[str, int], ...]:
    if self.name == "flex_ulysses":
      return ulysses.binary_axes(self.sp)
    return ((mesh_lib.SP, self.sp),)

  def plan(self, lengths: Sequence[int], num_devices: int) -> Plan:
    """The strategy's plan, with capacities and microbatch count bucketed."""
    buckets = self.buckets or plan_lib.default_buckets(self.capacity)
    shape = self.model_cfg.cost_shape()
    if self.name == "packed_dp" and self.sync == "minibatch":
      plan = planners.plan_packed_dp_lb_mini(lengths, num_devices, self.capacity, shape)
    elif self.name == "packed_dp":
      plan = planners.plan_packed_dp(lengths, num_devices, self.capacity, shape)
    elif self.name == "ulysses":
      plan = planners.plan_ulysses(lengths, num_devices, self.sp, self.capacity, shape)
    else:
      plan = planners.plan_flex_ulysses(lengths, num_devices, self.sp, self.capacity, buckets)
    return plan_lib.bucketed(plan, buckets)

  def attention_fn(self, mesh: jax.sharding.Mesh, plan: Plan | None = None,
                   inside_shard_map: bool = False) -> Callable | None:
    """The text attention for this strategy; None = the row-local default.

    flex_ulysses needs the plan: its buffer sections are part of the shapes.
    `inside_shard_map`: for code already running per device (minibatch sync).
    """
    backend = self.model_cfg.attention_backend
    if self.name == "flex_ulysses":
      if plan is None:
        raise ValueError("flex_ulysses attention depends on the plan's levels")
      names = tuple(name for name, _ in self.sp_axes())
      return ulysses.make_flex_attention_fn(mesh, plan.level_layout(), names,
                                            mesh_lib.batch_axes(mesh), backend, inside_shard_map)
    if self.sp == 1:
      return None
    return ulysses.make_attention_fn(mesh, (mesh_lib.SP,), mesh_lib.batch_axes(mesh), backend,
                                     inside_shard_map)

  def accumulate_fn(self, mesh: jax.sharding.Mesh, plan: Plan, graphdef, param_shardings,
                    loss_fn) -> Callable:
    """(params, batch, total=None) -> (loss, grads, sums) under this strategy's sync mode.

    `total` normalizes the loss (default: the batch's token weight, see
    train_step.accumulate).
    """
    if self.sync == "minibatch":
      independent = all(r.degree == 1 for rows in plan.microbatches for r in rows)
      return sync_lib.make_accumulate(
          graphdef, mesh, param_shardings, loss_fn,
          self.attention_fn(mesh, plan, inside_shard_map=True), independent_rows=independent,
          # Degree-1 rows keep each image on its tokens' device unless balanced.
          local_vision=independent and not self.balance_vision,
          merge_unit=self.model_cfg.vision.merge_unit)
    attention_fn = self.attention_fn(mesh, plan)
    return lambda params, batch, total=None: train_step.accumulate(
        graphdef, params, batch, loss_fn, attention_fn, param_shardings, total)

  def logprobs_fn(self, mesh: jax.sharding.Mesh, plan: Plan, graphdef) -> Callable:
    """(params, batch) -> per-token logprobs [M, D, C]: a forward pass (the reference's).

    Always the layer-sync program: a forward has no gradient barrier for
    minibatch sync to relax, and every plan's batch is valid under it.
    """
    attention_fn = self.attention_fn(mesh, plan)
    return lambda params, batch: train_step.token_logprobs(graphdef, params, batch,
                                                           attention_fn)


def _buckets(cfg) -> tuple[int, ...]:
  buckets = tuple(sorted(cfg.get("capacity_buckets") or ()))
  if buckets and buckets[-1] != cfg.capacity:
    raise ValueError(f"the largest of sharding.capacity_buckets {buckets} must equal "
                     f"sharding.capacity {cfg.capacity}")
  return buckets


def _sync(cfg) -> str:
  mode = cfg.get("sync", "layer")
  if mode not in ("layer", "minibatch"):
    raise ValueError(f"sharding.sync must be 'layer' or 'minibatch', got {mode!r}")
  return mode


def _make(name: str, degree: int, cfg, model_cfg) -> Strategy:
  """The fields every strategy reads the same way from the sharding section."""
  return Strategy(name, degree, cfg.capacity, model_cfg, _buckets(cfg), _sync(cfg),
                  bool(cfg.get("balance_vision", False)))


def _packed_dp(cfg, model_cfg):
  if cfg.get("sp", 1) not in (1, None):
    raise ValueError(f"packed_dp has no sequence parallelism; got sharding.sp={cfg.sp}")
  return _make("packed_dp", 1, cfg, model_cfg)


def _ulysses(cfg, model_cfg):
  t = model_cfg.text
  ulysses.check_degree(cfg.sp, t.num_heads, t.num_kv_heads)
  return _make("ulysses", cfg.sp, cfg, model_cfg)


def _flex_ulysses(cfg, model_cfg):
  t = model_cfg.text
  p_max = cfg.get("p_max", 8)
  ulysses.check_degree(p_max, t.num_heads, t.num_kv_heads)
  return _make("flex_ulysses", p_max, cfg, model_cfg)


STRATEGIES: dict[str, Callable[[ml_collections.ConfigDict, ModelConfig], Strategy]] = {
    "packed_dp": _packed_dp,
    "ulysses": _ulysses,
    "flex_ulysses": _flex_ulysses,
}


def get_strategy(cfg: ml_collections.ConfigDict, model_cfg: ModelConfig) -> Strategy:
  """The strategy named by `cfg.strategy` (a `sharding` config section)."""
  if cfg.strategy not in STRATEGIES:
    raise ValueError(f"unknown sharding.strategy {cfg.strategy!r}; choose one of "
                     f"{sorted(STRATEGIES)}")
  return STRATEGIES[cfg.strategy](cfg, model_cfg)
