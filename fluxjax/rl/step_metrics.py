"""What a GRPO step reports.

`step_metrics` is a pure function of what the coordinator measured in a step
(`StepFacts`), the run's settings and its model config: the step's timing,
async, publish, round and loss (train/*) metrics, the run's totals, and the
metrics of the batch it trained (`batch_metrics`). Each metric, what it means and
what a healthy run shows: docs/metrics.md, "The health metrics, one by one".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from fluxjax import settings as settings_lib
from fluxjax.models import flops as flops_lib
from fluxjax.models.config import ModelConfig
from fluxjax.rl import advantages as adv_lib
from fluxjax.rl import reward_fns, trajectories
from fluxjax.rl.round_driver import RoundStats


@dataclasses.dataclass(frozen=True)
class StepFacts:
  """What the coordinator measured in one step.

  Attributes:
    groups: the trained groups.
    rounds: the rollout rounds that ended while the step waited.
    update: the update's own metrics, host floats (logged as train/*).
    lr: the learning rate of its first optimizer update.
    memory: `device_memory_metrics()` after the update.
    version: the policy version after the step's publish.
    wait_s, update_s, step_s, publish_s: seconds waiting for rollouts (the
      update's streamed parts are added meanwhile), applying the update after
      them, in the whole step, publishing.
    publish_wait: what `Publisher.settle_reads` measured before the update.
    filtered, requeued: groups DAPO dropped; groups staler than the lag
      bound, generated again.
    staleness: `async_control.combine_staleness` of the batch.
    trained_gap: `async_control.version_gap` of its tokens (mean, max).
    control: what admission reported after observing the staleness.
    totals: the run's counted events so far (`Coordinator.fault_counts`).
  """

  groups: Sequence[trajectories.Group]
  rounds: Sequence[RoundStats]
  update: Mapping[str, float]
  lr: float
  memory: Mapping[str, float]
  version: int
  wait_s: float
  update_s: float
  step_s: float
  publish_s: float
  publish_wait: Mapping[str, float]
  filtered: int
  requeued: int
  staleness: Mapping[str, float]
  trained_gap: Mapping[str, float]
  control: Mapping[str, float]
  totals: Mapping[str, float]


def step_metrics(
  facts: StepFacts, settings: settings_lib.Settings, cfg: ModelConfig
) -> dict[str, float]:
  """Every metric a step logs, by name."""
  tokens = sum(len(c.output_ids) for g in facts.groups for c in g.completions)
  updates = facts.update.get("updates", 1.0)
  return {
    **batch_metrics(facts.groups, settings),
    "optim/lr": facts.lr,
    **facts.memory,
    "rollout/wait_seconds": facts.wait_s,
    "perf/update_seconds": facts.update_s,
    "rollout/rounds": float(len(facts.rounds)),
    "rollout/filtered_groups": float(facts.filtered),
    "async/stale_requeued": float(facts.requeued),
    "perf/step_seconds": facts.step_s,
    **throughput_metrics(facts.groups, cfg, facts.step_s, updates),
    "perf/tokens_per_s": tokens / max(facts.step_s, 1e-9),
    "publish/seconds": facts.publish_s,
    **facts.publish_wait,
    "policy/version": float(facts.version),
    **{f"async/{k}": v for k, v in facts.staleness.items()},
    "async/trained_gap": facts.trained_gap["mean"],
    "async/trained_gap_max": facts.trained_gap["max"],
    **{f"async/{k}": v for k, v in facts.control.items()},
    **{f"train/{k}": v for k, v in facts.update.items()},
    **round_metrics(facts.rounds),
    **facts.totals,
  }


def batch_metrics(
  groups: Sequence[trajectories.Group], settings: settings_lib.Settings
) -> dict[str, float]:
  """Every rollout/* and reward/* batch metric (docs/metrics.md), not optim/lr or memory."""
  rl = settings.rl
  rewards = [r for g in groups for r in g.rewards]
  completions = [c for g in groups for c in g.completions]
  lengths = [len(c.output_ids) for c in completions]
  advantages = adv_lib.group_advantages(
    np.asarray(rewards),
    np.repeat(np.arange(len(groups)), [len(g.rewards) for g in groups]),
    std_normalize=rl.adv_std_normalize,
    eps=rl.adv_eps,
  )
  prompts = [len(g.prompt.tokens_T) for g in groups]
  return {
    "rollout/reward_mean": float(np.mean(rewards)),
    "rollout/accuracy": float(np.mean([r >= rl.reward.correct_threshold for r in rewards])),
    **reward_term_metrics([t for g in groups for t in g.reward_terms]),
    **_stats("rollout/advantage_", advantages),
    **response_length_metrics(lengths),
    "rollout/response_clip_ratio": float(np.mean([n >= rl.max_new_tokens for n in lengths])),
    "rollout/reasoning_share": float(np.mean([reward_fns.reasons(c.text) for c in completions])),
    "rollout/prompt_len_mean": float(np.mean(prompts)),
    "rollout/prompt_len_max": float(np.max(prompts)),
  }


def _stats(prefix: str, values) -> dict[str, float]:
  v = np.asarray(values, np.float64)
  return {
    f"{prefix}mean": float(v.mean()),
    f"{prefix}std": float(v.std()),
    f"{prefix}min": float(v.min()),
    f"{prefix}max": float(v.max()),
  }


def response_length_metrics(lengths: Sequence[int]) -> dict[str, float]:
  """The step's response lengths in tokens: mean, median, 99th percentile, max."""
  p50, p99 = np.percentile(lengths, [50, 99])
  return {
    "rollout/response_len_mean": float(np.mean(lengths)),
    "rollout/response_len_p50": float(p50),
    "rollout/response_len_p99": float(p99),
    "rollout/response_len_max": float(np.max(lengths)),
  }


def reward_term_metrics(terms: Sequence[Mapping[str, float]]) -> dict[str, float]:
  """reward/<name>/{mean,std,min,max} of each reward function over the responses
  whose call succeeded (rl/reward_spec.py)."""
  out = {}
  for name in sorted({n for t in terms for n in t}):
    out.update(_stats(f"reward/{name}/", [t[name] for t in terms if name in t]))
  return out


def throughput_metrics(
  groups: Sequence[trajectories.Group], cfg: ModelConfig, seconds: float, updates: float
) -> dict[str, float]:
  """perf/model_tflops_per_s and, on devices with a known peak, perf/mfu."""
  lengths = [len(g.prompt) + len(c.output_ids) for g in groups for c in g.completions]
  grids = [m.grid_thw for g in groups for _ in g.completions for m in g.prompt.media]
  model_flops = updates * (flops_lib.text_flops(cfg, lengths) + flops_lib.vision_flops(cfg, grids))
  rate = model_flops / max(seconds, 1e-9)
  out = {"perf/model_tflops_per_s": rate / 1e12}
  devices = jax.devices()
  peak = flops_lib.datasheet_peak(devices[0].device_kind)
  if peak:
    out["perf/mfu"] = rate / (peak * len(devices))
  return out


def round_metrics(rounds: Sequence[RoundStats]) -> dict[str, float]:
  """The step's rollout rounds: mean wall time, long rounds, the counted
  stats summed, the mean share of idle engine slots."""
  if not rounds:
    return {}
  out = {
    "rollout/round_seconds": float(np.mean([r.wall_s for r in rounds])),
    "rollout/long_rounds": float(sum(r.kind == "long" for r in rounds)),
  }
  for key in RoundStats.COUNTED:
    out[f"rollout/{key}"] = float(sum(r.counts()[key] for r in rounds))
  idle = [r.slot_idle_fraction for r in rounds if r.slot_idle_fraction is not None]
  if idle:
    out["rollout/slot_idle_fraction"] = float(np.mean(idle))
  return out


def device_memory_metrics() -> dict[str, float]:
  """perf/device_memory_{in_use,peak}_gb of the first local device; {} where
  the backend reports no memory statistics (XLA:CPU)."""
  try:
    stats = jax.local_devices()[0].memory_stats()
  except Exception:  # some backends raise instead of returning None
    return {}
  if not stats:
    return {}
  return {
    "perf/device_memory_in_use_gb": stats.get("bytes_in_use", 0) / 2**30,
    "perf/device_memory_peak_gb": stats.get("peak_bytes_in_use", 0) / 2**30,
  }
