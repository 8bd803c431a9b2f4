"""Rules across the sections of a run's settings, checked before anything is built.

A rule that one section cannot check alone (the response budget against the
context and against the longest sequence the trainer can place, the lag
bounds, the batch against the mesh) is written here once; each error names the flag to
change. Rules of one section stay with the code that reads it
(strategies.resolve_sp, mesh.mesh_shape, factory.check_config,
async_control.check_lag), and `check` runs those too.
"""

from __future__ import annotations

import logging

from fluxjax import settings as settings_lib
from fluxjax.models.config import ModelConfig
from fluxjax.parallel.strategies import Strategy
from fluxjax.rl import async_control
from fluxjax.rollout import factory

log = logging.getLogger(__name__)


def longest_sequence(strategy: Strategy) -> int:
  """Tokens of the longest sequence the trainer can place: `capacity` per
  device over at most `sp` devices (1 for packed_dp)."""
  return strategy.capacity * strategy.sp


def prompt_budget(settings: settings_lib.Settings, strategy: Strategy) -> int:
  """Tokens a prompt may take: the shorter of the rollout context and the
  trainer's longest sequence, less the response budget. Longer prompts are
  skipped (counted) before rollout."""
  longest = min(settings.rollout.context_length, longest_sequence(strategy))
  return longest - settings.rl.max_new_tokens


def check(
  settings: settings_lib.Settings, model_cfg: ModelConfig, strategy: Strategy, num_devices: int
) -> None:
  """Raises ValueError for the first broken rule; warns of idle devices."""
  _check_lengths(settings, model_cfg, strategy)
  _check_group(settings)
  _check_lag(settings)
  _check_faults(settings)
  _warn_idle_devices(settings, strategy, num_devices)


def _check_lengths(
  settings: settings_lib.Settings, model_cfg: ModelConfig, strategy: Strategy
) -> None:
  context, new = settings.rollout.context_length, settings.rl.max_new_tokens
  longest = longest_sequence(strategy)
  if new < 1:
    raise ValueError(f"rl.max_new_tokens={new}: set --config.rl.max_new_tokens to at least 1")
  if context <= new:
    raise ValueError(
      f"rollout.context_length={context} leaves no tokens for a prompt beside "
      f"rl.max_new_tokens={new} (every prompt would be skipped as too long); raise "
      "--config.rollout.context_length (a fleet's: the servers' --context-length) "
      "or lower --config.rl.max_new_tokens"
    )
  trainer = (
    f"the trainer's longest sequence, {longest} tokens (sharding.capacity="
    f"{strategy.capacity} per device over at most {strategy.sp} device(s) for {strategy.name})"
  )
  if longest <= new:
    raise ValueError(
      f"{trainer} leaves no tokens for a prompt beside rl.max_new_tokens={new}; "
      f"set --config.sharding.capacity to more than {new // strategy.sp} or lower "
      "--config.rl.max_new_tokens"
    )
  if longest < context:
    log.info("prompts are limited to %d tokens by %s", prompt_budget(settings, strategy), trainer)
  positions = model_cfg.text.max_position_embeddings
  if factory.in_process(settings.rollout) and context > positions:
    raise ValueError(
      f"rollout.context_length={context} exceeds the model's {positions} positions; "
      f"set --config.rollout.context_length to at most {positions}"
    )


def _check_group(settings: settings_lib.Settings) -> None:
  rl = settings.rl
  if rl.prompts_per_step < 1:
    raise ValueError(f"rl.prompts_per_step={rl.prompts_per_step}: set it to at least 1")
  if rl.responses_per_prompt < 2:
    raise ValueError(
      f"rl.responses_per_prompt={rl.responses_per_prompt}: a GRPO advantage is "
      "relative to the prompt's group, and a group of one has none; set "
      "--config.rl.responses_per_prompt to at least 2"
    )
  eta = settings.rollout.tail_batching.eta
  if eta < 1:
    raise ValueError(
      f"rollout.tail_batching.eta={eta}: a round launches eta x the prompts it "
      "keeps; set --config.rollout.tail_batching.eta to 1.0 (off) or more"
    )


def _check_lag(settings: settings_lib.Settings) -> None:
  """The lag section's own rules (async_control), whatever the mode."""
  lag = settings.coordinator.lag
  try:
    async_control.AdmissionController.from_config(lag, settings.rl.prompts_per_step)
  except ValueError as e:
    raise ValueError(f"{e}; set the --config.coordinator.lag.* flags it names") from None


def _check_faults(settings: settings_lib.Settings) -> None:
  for name, limit in settings.faults.limits().items():
    if limit < 0:
      raise ValueError(
        f"faults.{name}={limit!r}: a count of failures; set --config.faults.{name} "
        "to 0 or more (fluxjax/faults.py; configs/vlm.py says what each counts)"
      )


def _warn_idle_devices(
  settings: settings_lib.Settings, strategy: Strategy, num_devices: int
) -> None:
  sequences = settings.rl.prompts_per_step * settings.rl.responses_per_prompt
  rows = num_devices // strategy.sp
  if sequences < rows:
    log.warning(
      "%d sequences per step (rl.prompts_per_step x rl.responses_per_prompt) "
      "cannot occupy %d devices, %s splitting a sequence over at most %d: some "
      "devices idle every step; raise --config.rl.prompts_per_step",
      sequences,
      num_devices,
      strategy.name,
      strategy.sp,
    )
