"""Rollout and trainer on disjoint cores, for the benches that compare lag modes.

`pin_and_launch(trainer_cores, rollout_cores, config)` pins this process (the
trainer) to `trainer_cores` with sched_setaffinity, which must happen before
JAX starts its thread pools, and starts one `fluxjax.rollout.server` process
(SGLang's protocol) under `taskset -c rollout_cores`, configured like the
run's embedded engine would be. A run then drives it as a fleet of one:
`use_server(config, urls)`. Weights reach it through disk every step (pause
-> update_weights_from_disk -> continue), as they reach an SGLang fleet.
"""

from __future__ import annotations

import os


def _cores(spec: str) -> set[int]:
  return {int(x) for x in spec.split(",") if x}


def pin_and_launch(trainer_cores: str, rollout_cores: str, config):
  """Pins this process and starts the rollout server; returns (servers, command)."""
  from fluxjax.rl import loop
  from fluxjax.rollout import factory, launcher

  os.sched_setaffinity(0, _cores(trainer_cores))
  # The run's settings as it resolves them (the checkpoint's vision limits).
  settings = loop.validate(config).settings
  cmd = ["taskset", "-c", rollout_cores, *factory.server_command(settings)]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return launcher.launch_servers(cmd, 1, env=env, timeout_s=600), " ".join(cmd)


def use_server(config, urls) -> None:
  """Points a run's rollout at the launched server (a fleet of one)."""
  if urls:
    config.rollout.backend, config.rollout.urls = "sglang", tuple(urls)
