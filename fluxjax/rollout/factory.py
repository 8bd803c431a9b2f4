"""The rollout backend a run config's `rollout` section names.

`rollout.backend` names a registered backend (`BACKENDS`): each checks its
section before any model is built and then builds its `RolloutBackend`, with
the servers it launched. How its weights reach a fleet, `rollout.weight_sync`,
names a registered transport (`publish.WEIGHT_TRANSPORTS`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from fluxjax import settings as settings_lib
from fluxjax.models import media, vlm
from fluxjax.models.processor import VisionProcessorConfig
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import embedded, fleet, launcher, protocol, publish, router, weight_protocol
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout.backend import RolloutBackend

# `rollout.launch = OWN_SERVER`: our server, serving the run's model (`server_command`).
OWN_SERVER = ("fluxjax.rollout.server",)


def check_config(rollout) -> None:
  """Raises ValueError for a rollout section that cannot start, before any
  model is built (a 7B run should not load its weights to learn this)."""
  backend_kind(rollout.backend).check(rollout)
  if rollout.router_url and rollout.router_launch:
    raise ValueError("give rollout.router_url (a running router) or router_launch, not both")
  server_gpu_groups(rollout)
  publish.weight_transport(rollout.weight_sync)
  if rollout.weight_group_backend not in weight_protocol.WEIGHT_GROUP_BACKENDS:
    raise ValueError(
      f"rollout.weight_group_backend={rollout.weight_group_backend!r}: set "
      f"--config.rollout.weight_group_backend to one of {weight_protocol.WEIGHT_GROUP_BACKENDS}"
    )
  engine_lib.check_decode_steps(
    rollout.num_continuous_decode_steps, "--config.rollout.num_continuous_decode_steps"
  )


def server_gpu_groups(rollout) -> list[str] | None:
  """Each launched server's CUDA_VISIBLE_DEVICES from rollout.server_gpus
  ("4,5,6,7" over 2 servers: "4,5" and "6,7"), or None (inherit).

  Raises:
    ValueError: GPUs that do not split evenly among rollout.num_servers, or
      servers given GPUs but not launched.
  """
  gpus = [g.strip() for g in rollout.server_gpus.split(",") if g.strip()]
  if not gpus:
    return None
  n = rollout.num_servers
  if rollout.urls or rollout.router_url or not rollout.launch:
    raise ValueError("rollout.server_gpus places launched servers: set rollout.launch too")
  if len(gpus) % n:
    raise ValueError(
      f"rollout.server_gpus={rollout.server_gpus!r}: {len(gpus)} GPUs do not split evenly "
      f"among rollout.num_servers={n}"
    )
  k = len(gpus) // n
  return [",".join(gpus[i * k : (i + 1) * k]) for i in range(n)]


def server_command(settings: settings_lib.Settings) -> list[str]:
  """`python -m fluxjax.rollout.server` serving a run config's model.

  The same checkpoint (`model.hf_path`, else random weights of the preset),
  tokenizer, compute dtype, decode attention, seed, slots, context and vision preprocessing
  limits as the run (the trainer and the server must preprocess media
  alike: the prompt's pad counts come from it; pass settings whose limits
  `loop.validate` resolved); `launch_servers` adds --host and --port. For
  `rollout.launch` when no SGLang is at hand.
  """
  model = settings.model
  cmd = ["python", "-m", "fluxjax.rollout.server"]
  if model.hf_path:
    cmd += ["--model-path", os.path.abspath(model.hf_path)]
  if model.tokenizer_path:
    cmd += ["--tokenizer-path", os.path.abspath(model.tokenizer_path)]
  cmd += ["--preset", model.preset, "--dtype", model.dtype]
  cmd += ["--decode-attention", model.decode_attention]
  cmd += ["--seed", str(settings.seed), "--num-slots", str(settings.rollout.num_slots)]
  cmd += ["--context-length", str(settings.rollout.context_length)]
  steps = settings.rollout.num_continuous_decode_steps
  cmd += ["--num-continuous-decode-steps", str(steps)]
  for flag, value in _preprocessing_flags(settings.data.vision).items():
    cmd += [flag, value]
  return cmd


def _preprocessing_flags(vision: settings_lib.Vision) -> dict[str, str]:
  """The run's vision preprocessing limits as `fluxjax.rollout.server` flags."""
  return {protocol.server_flag(k): str(v) for k, v in dataclasses.asdict(vision).items()}


def launch_command(settings: settings_lib.Settings) -> list[str]:
  """The server command `rollout.launch` names: `server_command` for
  `OWN_SERVER`; a command of its own that runs `fluxjax.rollout.server`
  gets the run's vision preprocessing limits it does not set itself (the
  trainer and the server must preprocess media alike); any other command
  as given."""
  launch = list(settings.rollout.launch)
  if tuple(launch) == OWN_SERVER:
    return server_command(settings)
  if OWN_SERVER[0] not in launch:
    return launch
  given = {arg.split("=", 1)[0] for arg in launch if arg.startswith("--")}
  for flag, value in _preprocessing_flags(settings.data.vision).items():
    if flag not in given:
      launch += [flag, value]
  return launch


@dataclasses.dataclass(frozen=True)
class BackendInputs:
  """What a backend is built from besides its `rollout` section.

  Attributes:
    launch: the fleet's server command when it has no urls (`launch_command`
      of the run config); None = `rollout.launch` as given.
    model, tokenizer: what the embedded backend serves (the trainer's).
    seed: the embedded engine's sampling seed.
    proc_cfg: the trainer's vision processing: the embedded engine's, and
      what a fleet's servers must report (the prompt's pad-token counts
      come from it).
    limits: the embedded engine's media size budgets (the loader's).
    weights_root: where a fleet's published versions are written.
    served_model: the trainer's model, which a fleet's servers must serve.
    log_dir: where launched servers and a launched router write their
      output (server<i>.log, router0.log).
  """

  launch: list[str] | None = None
  model: vlm.Qwen25VL | None = None
  tokenizer: Tokenizer | None = None
  seed: int = 0
  proc_cfg: VisionProcessorConfig | None = None
  limits: media.MediaLimits = media.DEFAULT_LIMITS
  weights_root: str | None = None
  served_model: fleet.ServedModel | None = None
  log_dir: str | None = None


# A built backend and the servers its build launched (to stop after it closes), or None.
Built = tuple[RolloutBackend, launcher.LaunchedServers | None]
Build = Callable[[settings_lib.Rollout, BackendInputs], Built]
Check = Callable[[settings_lib.Rollout], None]


def _no_check(rollout: settings_lib.Rollout) -> None:
  del rollout


@dataclasses.dataclass(frozen=True)
class BackendKind:
  """A registered `rollout.backend`.

  Attributes:
    name: its `rollout.backend` value.
    build: (the `rollout` section, inputs) -> `Built`.
    check: raises ValueError for a section it cannot start from.
    in_process: rollout runs in the trainer's leader process, on its own
      copy of the trainer's weights (`BackendInputs.model`), on the leader's
      devices; otherwise on servers the weights are published to.
  """

  name: str
  build: Build
  check: Check = _no_check
  in_process: bool = False


# The backends `rollout.backend` names, by name (`register_backend`).
BACKENDS: dict[str, BackendKind] = {}


def register_backend(
  name: str, check: Check = _no_check, in_process: bool = False
) -> Callable[[Build], Build]:
  """Function decorator: makes the build function the backend
  `rollout.backend=name` picks, its section first vetted by `check`
  (`BackendKind` says what `in_process` means)."""

  def register(build: Build) -> Build:
    if not name or name in BACKENDS:
      raise ValueError(f"a rollout backend needs a name of its own, got {name!r}")
    BACKENDS[name] = BackendKind(name, build, check, in_process)
    return build

  return register


def backend_kind(name: str) -> BackendKind:
  """The registered backend `name`."""
  if name not in BACKENDS:
    raise ValueError(f"unknown rollout.backend {name!r}; choose one of {sorted(BACKENDS)}")
  return BACKENDS[name]


def in_process(rollout: settings_lib.Rollout) -> bool:
  """Whether the section's backend runs in the trainer's process (`BackendKind`)."""
  return backend_kind(rollout.backend).in_process


def make_backend(rollout: settings_lib.Rollout, inputs: BackendInputs | None = None) -> Built:
  """Builds the backend of a `rollout` config section from `inputs`.

  Returns:
    (backend, launched): the backend, and the servers this call started
    (to stop after the backend closes), or None.
  """
  check_config(rollout)
  return backend_kind(rollout.backend).build(rollout, inputs or BackendInputs())


@register_backend("embedded", in_process=True)
def _embedded(rollout: settings_lib.Rollout, inputs: BackendInputs) -> Built:
  """The JAX engine in this process (rollout/embedded.py), serving the trainer's model."""
  if inputs.model is None or inputs.tokenizer is None:
    raise ValueError("the embedded backend needs the model and tokenizer")
  return embedded.EmbeddedRollout(
    inputs.model,
    inputs.tokenizer,
    num_slots=rollout.num_slots,
    context_length=rollout.context_length,
    num_continuous_decode_steps=rollout.num_continuous_decode_steps,
    seed=inputs.seed,
    proc_cfg=inputs.proc_cfg,
    limits=inputs.limits,
  ), None


def _check_fleet(rollout: settings_lib.Rollout) -> None:
  if not (rollout.urls or rollout.launch or rollout.router_url):
    raise ValueError(
      "rollout.backend=sglang needs rollout.urls (running servers), "
      "rollout.launch (a command that starts one, given --port; "
      f"{OWN_SERVER!r} starts fluxjax's own) or rollout.router_url (a running SGLang router)"
    )


@register_backend("sglang", check=_check_fleet)
def _fleet(rollout: settings_lib.Rollout, inputs: BackendInputs) -> Built:
  """A `Fleet` of servers speaking SGLang's native API: `urls` of running
  servers, or `launch` (a command such as ["python", "-m",
  "sglang.launch_server", "--model-path", M], given --port; `OWN_SERVER` is
  `python -m fluxjax.rollout.server` serving the run's model) started
  `num_servers` times. With `router_url` (a running SGLang router) or
  `router_launch` (a router command, given --worker-urls and --port), a
  `RoutedFleet`: generation through the router, weight updates to each worker.
  """
  health_s, launch_s = rollout.health_interval_s, rollout.launch_timeout_s
  proc_cfg = inputs.proc_cfg
  sync: dict[str, Any] = dict(
    weights_root=inputs.weights_root,
    weight_sync=rollout.weight_sync,
    weight_deltas=rollout.weight_deltas,
    defer_updates=rollout.defer_updates,
    weight_group_backend=rollout.weight_group_backend,
    weight_group_address=rollout.weight_group_address,
    weight_group_timeout_s=rollout.weight_group_timeout_s,
    weight_bucket_bytes=int(rollout.weight_bucket_mb * 2**20),
    vision_limits=dataclasses.asdict(proc_cfg) if proc_cfg is not None else None,
    served_model=inputs.served_model,
  )
  if rollout.router_url:
    return router.RoutedFleet(
      rollout.router_url, workers_timeout_s=launch_s, health_interval_s=health_s, **sync
    ), None
  urls = list(rollout.urls)
  launched = None
  if not urls:
    launched = launcher.launch_servers(
      list(rollout.launch) if inputs.launch is None else inputs.launch,
      rollout.num_servers,
      timeout_s=launch_s,
      log_dir=inputs.log_dir,
      gpu_groups=server_gpu_groups(rollout),
    )
    urls = launched.urls
  if not rollout.router_launch:
    return fleet.Fleet(urls, health_interval_s=health_s, **sync), launched
  try:
    routed = router.launch_router(
      list(rollout.router_launch), urls, timeout_s=launch_s, log_dir=inputs.log_dir
    )
  except BaseException:
    if launched is not None:
      launched.stop()
    raise
  if launched is None:
    launched = launcher.LaunchedServers([], [], [])
  launched.router = routed
  return router.RoutedFleet(
    routed.urls[0], workers_timeout_s=launch_s, health_interval_s=health_s, **sync
  ), launched
