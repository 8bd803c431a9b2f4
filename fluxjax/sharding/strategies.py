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
from fluxjax.sharding import ulysses
from fluxjax.sharding.plan import Plan


@dataclasses.dataclass(frozen=True)
class Strategy:
  name: str
  sp: int                     # Ulysses degree (1 = none)
  capacity: int               # tokens per device per microbatch (the largest bucket)
  model_cfg: ModelConfig
  buckets: tuple[int, ...] = ()  # static capacities; () = powers of two up to capacity

  def sp_axes(self) -> tuple[tuple[str, int], ...]:
    return ((mesh_lib.SP, self.sp),)

  def plan(self, lengths: Sequence[int], num_devices: int) -> Plan:
    """The strategy's plan, with capacity and microbatch count bucketed."""
    if self.name == "packed_dp":
      plan = planners.plan_packed_dp(lengths, num_devices, self.capacity)
    else:
      plan = planners.plan_ulysses(lengths, num_devices, self.sp, self.capacity)
    return plan_lib.bucketed(plan, self.buckets or plan_lib.default_buckets(self.capacity))

  def attention_fn(self, mesh: jax.sharding.Mesh) -> Callable | None:
    """None: the decoder's default (row-local) attention is already correct."""
    if self.sp == 1:
      return None
    return ulysses.make_attention_fn(mesh, (mesh_lib.SP,), mesh_lib.batch_axes(mesh),
                                     self.model_cfg.attention_backend)


def _buckets(cfg) -> tuple[int, ...]:
  buckets = tuple(sorted(cfg.get("capacity_buckets") or ()))
  if buckets and buckets[-1] != cfg.capacity:
    raise ValueError(f"the largest of sharding.capacity_buckets {buckets} must equal "
                     f"sharding.capacity {cfg.capacity}")
  return buckets


def _packed_dp(cfg, model_cfg):
  if cfg.get("sp", 1) not in (1, None):
    raise ValueError(f"packed_dp has no sequence parallelism; got sharding.sp={cfg.sp}")
  return Strategy("packed_dp", 1, cfg.capacity, model_cfg, _buckets(cfg))


def _ulysses(cfg, model_cfg):
  t = model_cfg.text
  ulysses.check_degree(cfg.sp, t.num_heads, t.num_kv_heads)
  return Strategy("ulysses", cfg.sp, cfg.capacity, model_cfg, _buckets(cfg))


STRATEGIES: dict[str, Callable[[ml_collections.ConfigDict, ModelConfig], Strategy]] = {
    "packed_dp": _packed_dp,
    "ulysses": _ulysses,
}


def get_strategy(cfg: ml_collections.ConfigDict, model_cfg: ModelConfig) -> Strategy:
  """The strategy named by `cfg.strategy` (a `sharding` config section)."""
  if cfg.strategy not in STRATEGIES:
    raise ValueError(f"unknown sharding.strategy {cfg.strategy!r}; choose one of "
                     f"{sorted(STRATEGIES)}")
  return STRATEGIES[cfg.strategy](cfg, model_cfg)
