"""Strategies behind one registry keyed by `sharding.strategy`.

A `Strategy` decides three things: the sequence-parallel factorization of the mesh, the
plan for a batch (from lengths only), and the attention function the text decoder runs
with. Everything else (FSDP, the packed batch, the step) is shared, so a strategy swap is
the one flag `--config.sharding.strategy` on any mesh. `sharding.sp` has one meaning for
all of them, the largest sequence-parallel degree (`resolve_sp`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from collections.abc import Callable, Sequence
from typing import ClassVar

import jax

from fluxjax import settings as settings_lib
from fluxjax.models.config import ModelConfig
from fluxjax.parallel import sync as sync_lib
from fluxjax.parallel import train_step, ulysses
from fluxjax.planning import balance, planners
from fluxjax.planning import plan as plan_lib
from fluxjax.planning.plan import Plan
from fluxjax.sharding import mesh as mesh_lib

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Strategy:
  """A sharding strategy: the mesh's sequence-parallel axes, the plan of a
  batch, and the text attention; FSDP, the packed batch and the step are
  shared. Subclasses set `name`, write `_plan` (host numpy, lengths only)
  and override `sp_axes` or `attention_fn` where they differ; `register`
  makes `--config.sharding.strategy=NAME` find them."""

  name: ClassVar[str] = ""
  uses_sp: ClassVar[bool] = True  # False: every sequence stays whole on one device
  sp: int  # largest degree: ulysses' fixed one, flex_ulysses' p_max; 1 = none
  capacity: int  # tokens per device per microbatch (the largest bucket)
  model_cfg: ModelConfig
  buckets: tuple[int, ...] = ()  # static capacities; () = powers of two up to capacity
  sync: str = "layer"  # "layer" (FSDP per layer) | "minibatch" (ODC)
  balance_vision: bool = False  # spread images/frames over devices by patch count

  def sp_axes(self) -> tuple[tuple[str, int], ...]:
    return ((mesh_lib.SP, self.sp),)

  def plan(self, lengths: Sequence[int], num_devices: int) -> Plan:
    """The strategy's plan, with capacities and microbatch count bucketed."""
    buckets = self.buckets or plan_lib.default_buckets(self.capacity)
    return plan_lib.bucketed(self._plan(lengths, num_devices, buckets), buckets)

  def _plan(self, lengths: Sequence[int], num_devices: int, buckets: tuple[int, ...]) -> Plan:
    raise NotImplementedError(f"strategy {self.name!r} has no planner")

  def attention_fn(
    self, mesh: jax.sharding.Mesh, plan: Plan | None = None, inside_shard_map: bool = False
  ) -> Callable | None:
    """The text attention for this strategy; None = the row-local default.

    `inside_shard_map`: for code already running per device (minibatch sync).
    """
    if self.sp == 1:
      return None
    return ulysses.make_attention_fn(
      mesh,
      (mesh_lib.SP,),
      mesh_lib.batch_axes(mesh),
      self.model_cfg.attention_backend,
      inside_shard_map,
    )

  def accumulate_fn(
    self,
    mesh: jax.sharding.Mesh,
    plan: Plan,
    graphdef,
    param_shardings,
    loss_fn,
    *,
    temperature: float = 1.0,
  ) -> Callable:
    """(params, batch, total=None) -> (loss, grads, sums) under this strategy's sync mode.

    `total` normalizes the loss (default: the batch's token weight, see
    train_step.accumulate); the policy's logprobs are of softmax(logits /
    temperature), the sampling temperature in RL.
    """
    if self.sync == "minibatch":
      independent = all(r.degree == 1 for rows in plan.microbatches for r in rows)
      return sync_lib.make_accumulate(
        graphdef,
        mesh,
        param_shardings,
        loss_fn,
        self.attention_fn(mesh, plan, inside_shard_map=True),
        independent_rows=independent,
        # Degree-1 rows keep each image on its tokens' device unless balanced.
        local_vision=independent and not self.balance_vision,
        merge_unit=self.model_cfg.vision.merge_unit,
        temperature=temperature,
      )
    attention_fn = self.attention_fn(mesh, plan)
    return lambda params, batch, total=None: train_step.accumulate(
      graphdef,
      params,
      batch,
      loss_fn,
      attention_fn,
      param_shardings,
      total,
      temperature=temperature,
    )

  def logprobs_fn(
    self, mesh: jax.sharding.Mesh, plan: Plan, graphdef, *, temperature: float = 1.0
  ) -> Callable:
    """(params, batch) -> per-token logprobs [M, D, C]: a forward pass (the reference's).

    Always the layer-sync program: a forward has no gradient barrier for
    minibatch sync to relax, and every plan's batch is valid under it.
    """
    attention_fn = self.attention_fn(mesh, plan)
    return lambda params, batch: train_step.token_logprobs(
      graphdef, params, batch, attention_fn, temperature=temperature
    )


# The strategies `sharding.strategy` names, by name (`register`); a strategy of
# your own is a module with a registered subclass, named "module:Class".
STRATEGIES: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
  """Class decorator: makes `cls` the strategy `sharding.strategy=cls.name` picks."""
  if not cls.name or cls.name in STRATEGIES:
    raise ValueError(f"a strategy needs a name of its own, got {cls.name!r}")
  STRATEGIES[cls.name] = cls
  return cls


@register
class PackedDP(Strategy):
  """veRL-like: sequences packed whole into each device's rows (sp ignored);
  with minibatch sync, LB-Mini's balance over each device's microbatches."""

  name = "packed_dp"
  uses_sp = False

  def _plan(self, lengths, num_devices, buckets):
    shape = self.model_cfg.cost_shape()
    if self.sync == "minibatch":
      return planners.plan_packed_dp_lb_mini(lengths, num_devices, self.capacity, shape)
    return planners.plan_packed_dp(lengths, num_devices, self.capacity, shape)


@register
class Ulysses(Strategy):
  """Every sequence split over exactly sp devices (all-to-all attention)."""

  name = "ulysses"

  def _plan(self, lengths, num_devices, buckets):
    shape = self.model_cfg.cost_shape()
    return planners.plan_ulysses(lengths, num_devices, self.sp, self.capacity, shape)


@register
class FlexUlysses(Strategy):
  """FlexRL: each sequence split only as far as its length needs, up to sp,
  over nested binary axes; the attention depends on the plan's levels."""

  name = "flex_ulysses"

  def sp_axes(self) -> tuple[tuple[str, int], ...]:
    return ulysses.binary_axes(self.sp)

  def _plan(self, lengths, num_devices, buckets):
    return planners.plan_flex_ulysses(lengths, num_devices, self.sp, self.capacity, buckets)

  def attention_fn(
    self, mesh: jax.sharding.Mesh, plan: Plan | None = None, inside_shard_map: bool = False
  ) -> Callable | None:
    if plan is None:
      raise ValueError("flex_ulysses attention depends on the plan's levels")
    names = tuple(name for name, _ in self.sp_axes())
    return ulysses.make_flex_attention_fn(
      mesh,
      plan.level_layout(),
      names,
      mesh_lib.batch_axes(mesh),
      self.model_cfg.attention_backend,
      inside_shard_map,
    )


def strategy_class(name: str) -> type[Strategy]:
  """The registered strategy `name`, or "module:Class" (imported, then registered)."""
  if ":" in name:
    module, _, attr = name.partition(":")
    cls = getattr(importlib.import_module(module), attr, None)
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
      raise ValueError(f"sharding.strategy={name!r} is not a Strategy subclass")
    return cls
  if name not in STRATEGIES:
    raise ValueError(
      f"unknown sharding.strategy {name!r}; choose one of {sorted(STRATEGIES)} "
      "or give module:Class of your own Strategy"
    )
  return STRATEGIES[name]


def _buckets(sharding) -> tuple[int, ...]:
  buckets = tuple(sorted(sharding.capacity_buckets))
  if buckets and buckets[-1] != sharding.capacity:
    raise ValueError(
      f"the largest of sharding.capacity_buckets {buckets} must equal "
      f"sharding.capacity {sharding.capacity}"
    )
  return buckets


def _sync(sharding) -> str:
  mode = sharding.sync
  if mode not in ("layer", "minibatch"):
    raise ValueError(f"sharding.sync must be 'layer' or 'minibatch', got {mode!r}")
  return mode


AUTO = 0  # sharding.sp = 0: the largest degree that fits


def _make(cls: type[Strategy], degree: int, sharding, model_cfg) -> Strategy:
  """The fields every strategy reads the same way from the sharding section."""
  return cls(
    degree,
    sharding.capacity,
    model_cfg,
    _buckets(sharding),
    _sync(sharding),
    sharding.balance_vision,
  )


def sp_choices(model_cfg: ModelConfig, room: int) -> tuple[int, ...]:
  """Degrees the model's heads allow that divide `room` devices, ascending."""
  t = model_cfg.text
  powers = (1 << k for k in range(room.bit_length()))
  return tuple(
    p for p in powers if not room % p and not ulysses.degree_problem(p, t.num_heads, t.num_kv_heads)
  )


def resolve_sp(
  sharding: settings_lib.Sharding,
  model_cfg: ModelConfig,
  num_devices: int,
  mesh: settings_lib.Mesh | None = None,
  max_auto: int | None = None,
  longest: int = 0,
) -> int:
  """The sequence-parallel degree `sharding.sp` asks for on this mesh.

  `sharding.sp` has one meaning for all strategies, and auto (sp = 0) one rule:
  docs/design.md, section 5. The heads' constraint is `ulysses.degree_problem`; auto
  stays within one host, so the all-to-alls stay on the host's fast interconnect, unless
  the longest sequence needs more (`_auto_sp`).

  Args:
    sharding: the `sharding` section; sp = 0 is auto.
    model_cfg: the model (its query and kv heads bound the degree).
    num_devices: devices of the whole mesh.
    mesh: the `mesh` section (data, fsdp); None = the default data 1, fsdp -1.
    max_auto: one host's devices, the largest degree auto picks unless
      `longest` needs more; None = no cap.
    longest: tokens of the longest sequence the run trains; 0 = unknown.

  Raises:
    ValueError naming the flag to change and the values that fit.
  """
  data, fsdp = (mesh.data, mesh.fsdp) if mesh is not None else (1, -1)
  room = mesh_lib.sp_room(num_devices, data, fsdp)
  fits = sp_choices(model_cfg, room)
  sp = sharding.sp
  if sp == AUTO:
    return _auto_sp(fits, max_auto, longest, sharding.capacity, model_cfg)
  if sp in fits:
    return sp
  auto = _auto_sp(fits, max_auto, longest, sharding.capacity, model_cfg, quiet=True)
  t = model_cfg.text
  reason = (
    ulysses.degree_problem(sp, t.num_heads, t.num_kv_heads)
    or f"the {room} devices left after mesh.data={data}, mesh.fsdp={fsdp} do not divide by {sp}"
  )
  hint = "" if fsdp == -1 else ", or --config.mesh.fsdp=-1 to leave sp the devices it needs"
  raise ValueError(
    f"sharding.sp={sp} does not fit {sharding.strategy}: {reason}; set "
    f"--config.sharding.sp to one of {list(fits)}, or 0 (auto: {auto} here)"
    f"{hint}"
  )


def _auto_sp(
  fits: Sequence[int],
  host: int | None,
  longest: int,
  capacity: int,
  model_cfg: ModelConfig,
  quiet: bool = False,
) -> int:
  """Auto sp: the largest degree within one host of `host` devices, unless the
  longest sequence needs more devices' memory; then the smallest degree
  across hosts that holds it (none holds it: the largest). Logs the choice
  when a degree across hosts fits, with the all-to-all bytes between hosts."""
  within = max(p for p in fits if host is None or p <= max(host, 1))
  beyond = [p for p in fits if p > within]
  if not beyond:
    return within
  needs_more = longest > within * capacity
  chosen = (
    next((p for p in beyond if p * capacity >= longest), beyond[-1]) if needs_more else within
  )
  if quiet:
    return chosen
  other = chosen if needs_more else beyond[0]
  # One device's all-to-all bytes per forward at `other`, the part sent to
  # devices on other hosts (other - host of its other - 1 peers).
  sent = balance.ulysses_all_to_all_bytes(capacity, other, model_cfg.cost_shape())
  between = sent * (other - min(host or other, other)) / (other - 1) / 1e6
  need = -(-longest // capacity)
  if needs_more:
    why = f"the longest sequence ({longest} tokens) needs {need} devices, more than {within}"
  elif longest:
    why = f"{within} devices hold the longest sequence ({longest} tokens)"
  else:
    why = "the longest sequence is not known"
  log.info(
    "sharding.sp auto: %d, %s: %s at sharding.capacity %d; sp=%d %s %.1f MB per device per "
    "forward between hosts",
    chosen,
    "across hosts" if needs_more else "within one host",
    why,
    capacity,
    other,
    "sends" if needs_more else "would send",
    between,
  )
  return chosen


def get_strategy(
  sharding: settings_lib.Sharding,
  model_cfg: ModelConfig,
  mesh: settings_lib.Mesh | None = None,
  num_devices: int | None = None,
  longest: int = 0,
) -> Strategy:
  """The strategy named by `sharding.strategy` (a `sharding` config section).

  Args:
    sharding: the `sharding` section.
    model_cfg: the model config.
    mesh: the `mesh` section; auto sp leaves room for mesh.data and
      mesh.fsdp. None = the default mesh (data 1, fsdp -1).
    num_devices: devices of the mesh; None = jax.device_count(). Auto sp
      stays within jax.local_device_count() unless `longest` needs more.
    longest: tokens of the longest sequence the run trains; 0 = unknown.
  """
  cls = strategy_class(sharding.strategy)
  if hasattr(sharding, "p_max"):  # a programmatic section (Settings.of refuses it too)
    raise ValueError(
      "sharding.p_max is not a setting: flex_ulysses' largest degree is "
      "sharding.sp (e.g. --config.sharding.sp=8; 0 = auto)"
    )
  num_devices = jax.device_count() if num_devices is None else num_devices
  degree = (
    resolve_sp(sharding, model_cfg, num_devices, mesh, jax.local_device_count(), longest)
    if cls.uses_sp
    else 1
  )
  return _make(cls, degree, sharding, model_cfg)
