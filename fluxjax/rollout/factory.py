"""The rollout backend a run config's `rollout` section names.

backend = "embedded"  the JAX engine in this process (rollout/embedded.py),
                      serving the trainer's model;
backend = "sglang"    a `Fleet` of servers speaking SGLang's native API:
                      `urls` of running servers, or `launch` (a command
                      such as ["python", "-m", "sglang.launch_server",
                      "--model-path", M], given --port) started
                      `num_servers` times. With `router_url` (a running
                      SGLang router) or `router_launch` (a router command,
                      given --worker-urls and --port), a `RoutedFleet`:
                      generation through the router, weight updates to
                      each worker.
"""

from __future__ import annotations

from fluxjax.models import media, vlm
from fluxjax.models.processor import VisionProcessorConfig
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import embedded, fleet, router
from fluxjax.rollout.backend import RolloutBackend

BACKENDS = ("embedded", "sglang")


def check_config(cfg) -> None:
  """Raises ValueError for a rollout section that cannot start, before any
  model is built (a 7B run should not load its weights to learn this)."""
  backend = cfg.get("backend", "embedded")
  if backend not in BACKENDS:
    raise ValueError(f"rollout.backend must be embedded or sglang, got {backend!r}")
  if backend == "sglang" and not (cfg.get("urls") or cfg.get("launch") or cfg.get("router_url")):
    raise ValueError(
      "rollout.backend=sglang needs rollout.urls (running servers), "
      "rollout.launch (a command that starts one, given --port) or "
      "rollout.router_url (a running SGLang router)"
    )
  if cfg.get("router_url") and cfg.get("router_launch"):
    raise ValueError("give rollout.router_url (a running router) or router_launch, not both")


def server_command(config) -> list[str]:
  """`python -m fluxjax.rollout.server` serving a run config's model.

  The same preset, seed, slots, context and vision pixel limits as the run
  (the trainer and the server must preprocess media alike: the prompt's pad
  counts come from it); `launch_servers` adds --host and --port. For
  `rollout.launch` when no SGLang is at hand.
  """
  v = config.data.vision
  cmd = ["python", "-m", "fluxjax.rollout.server"]
  cmd += ["--preset", str(config.model.preset), "--seed", str(config.seed)]
  cmd += ["--num-slots", str(config.rollout.num_slots)]
  cmd += ["--context-length", str(config.rollout.context_length)]
  for key in ("image_min_pixels", "image_max_pixels", "video_min_pixels", "video_max_pixels"):
    cmd += [f"--{key.replace('_', '-')}", str(v[key])]
  return cmd


def make_backend(
  cfg,
  *,
  model: vlm.Qwen25VL | None = None,
  tokenizer: Tokenizer | None = None,
  seed: int = 0,
  proc_cfg: VisionProcessorConfig | None = None,
  limits: media.MediaLimits = media.DEFAULT_LIMITS,
  weights_root: str | None = None,
) -> tuple[RolloutBackend, fleet.LaunchedServers | None]:
  """Builds the backend of a `rollout` config section.

  Args:
    cfg: the `rollout` section (backend, num_slots, context_length, urls,
      launch, num_servers, launch_timeout_s, health_interval_s, router_url,
      router_launch).
    model, tokenizer: what the embedded backend serves (the trainer's).
    seed: the embedded engine's sampling seed.
    proc_cfg: the embedded engine's vision processing; must equal the
      trainer's (the prompt's pad-token counts come from it).
    limits: the embedded engine's media size budgets (the loader's).
    weights_root: where a fleet's published versions are written.

  Returns:
    (backend, launched): the backend, and the servers this call started
    (to stop after the backend closes), or None.
  """
  check_config(cfg)
  if cfg.get("backend", "embedded") == "embedded":
    if model is None or tokenizer is None:
      raise ValueError("the embedded backend needs the model and tokenizer")
    return embedded.EmbeddedRollout(
      model,
      tokenizer,
      num_slots=cfg.get("num_slots", 8),
      context_length=cfg.get("context_length", 512),
      seed=seed,
      proc_cfg=proc_cfg,
      limits=limits,
    ), None
  health_s = float(cfg.get("health_interval_s", 2.0))
  router_url = cfg.get("router_url") or ""
  if router_url:
    return router.RoutedFleet(
      router_url, health_interval_s=health_s, weights_root=weights_root
    ), None
  urls = list(cfg.get("urls") or [])
  launched = None
  if not urls:
    launched = fleet.launch_servers(
      list(cfg.get("launch")),
      int(cfg.get("num_servers", 1)),
      timeout_s=float(cfg.get("launch_timeout_s", 600)),
    )
    urls = launched.urls
  if not cfg.get("router_launch"):
    return fleet.Fleet(urls, health_interval_s=health_s, weights_root=weights_root), launched
  try:
    routed = router.launch_router(list(cfg.get("router_launch")), urls)
  except BaseException:
    if launched is not None:
      launched.stop()
    raise
  if launched is None:
    launched = fleet.LaunchedServers([], [], [])
  launched.router = routed
  return router.RoutedFleet(
    routed.urls[0], health_interval_s=health_s, weights_root=weights_root
  ), launched
