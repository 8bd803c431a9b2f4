"""A step's metrics against direct computation."""

import dataclasses

import numpy as np
import pytest

from fluxjax import config_args
from fluxjax.models import config as model_config
from fluxjax.models import flops
from fluxjax.models.inputs import SequenceInputs
from fluxjax.rl import advantages, round_driver, step_metrics, trajectories
from fluxjax.settings import Settings
from helpers import completion


def _group(key, rewards, lengths, prompt_len, terms=None):
  prompt = SequenceInputs(
    np.zeros(prompt_len, np.int32), np.zeros((3, prompt_len), np.int32), media=(), mrope_delta=0
  )
  texts = [
    "<think> x</think><answer>1</answer>" if n > 5 else "<answer>1</answer>" for n in lengths
  ]
  done = [
    dataclasses.replace(completion(list(range(n)), [-1.0] * n), text=t)
    for n, t in zip(lengths, texts, strict=True)
  ]
  return trajectories.Group(key, prompt, done, list(rewards), "1", terms or [])


def test_batch_metrics_of_two_groups():
  config = config_args.load_config(arg="tiny")
  config.rl.max_new_tokens = 8
  settings = Settings.of(config)
  groups = [
    _group("a", [1.0, 0.0, 1.0, 0.0], [3, 8, 6, 2], 20, [{"acc": 1.0}, {"acc": 0.0}, {}, {}]),
    _group("b", [0.5, 0.5, 1.0, 0.0], [8, 8, 4, 7], 30),
  ]
  m = step_metrics.batch_metrics(groups, settings)
  adv = advantages.group_advantages(
    np.array([1, 0, 1, 0, 0.5, 0.5, 1, 0]), np.array([0] * 4 + [1] * 4)
  )
  assert m["rollout/advantage_mean"] == pytest.approx(adv.mean(), abs=1e-6)
  assert m["rollout/advantage_max"] == pytest.approx(adv.max())
  assert m["rollout/advantage_std"] == pytest.approx(adv.std(), rel=1e-5)
  assert m["rollout/response_clip_ratio"] == 3 / 8  # three reached max_new_tokens
  assert m["rollout/reasoning_share"] == 5 / 8  # longer than 5 tokens reason here
  assert (m["rollout/prompt_len_mean"], m["rollout/prompt_len_max"]) == (25.0, 30.0)
  assert m["rollout/accuracy"] == 3 / 8 and m["rollout/reward_mean"] == 0.5
  # A function's statistics cover the calls that returned it.
  assert (m["reward/acc/mean"], m["reward/acc/min"], m["reward/acc/max"]) == (0.5, 0.0, 1.0)
  assert step_metrics.device_memory_metrics() == {}  # XLA:CPU reports none


def test_throughput_counts_each_trained_sequence_with_its_prompt():
  cfg = model_config.preset("tiny")
  groups = [_group("a", [1.0, 0.0], [3, 5], 20), _group("b", [0.5, 0.5], [4, 4], 30)]
  m = step_metrics.throughput_metrics(groups, cfg, seconds=2.0, updates=2.0)
  want = 2.0 * flops.text_flops(cfg, [23, 25, 34, 34]) / 2.0 / 1e12
  assert m["perf/model_tflops_per_s"] == pytest.approx(want)
  assert "perf/mfu" not in m  # a CPU has no datasheet peak


def _round(kind: str, wall_s: float, aborted: int, idle: float | None = None):
  return round_driver.RoundStats(
    kind, wall_s, 4, 8, aborted, 0, 1, 2, 0, 0, 40, 50, 5, 6, 7, 12, slot_idle_fraction=idle
  )


def test_round_metrics_sum_the_counted_statistics():
  m = step_metrics.round_metrics([_round("short", 1.0, 3, 0.5), _round("long", 3.0, 1)])
  assert m["rollout/round_seconds"] == 2.0 and m["rollout/long_rounds"] == 1.0
  assert m["rollout/aborted"] == 4.0 and m["rollout/tokens_discarded"] == 14.0
  assert m["rollout/slot_idle_fraction"] == 0.5  # of the rounds that report it
  assert step_metrics.round_metrics([]) == {}


def test_a_step_reports_every_fact_under_its_name():
  settings = Settings.of(config_args.load_config(arg="tiny"))
  groups = [_group("a", [1.0, 0.0], [3, 5], 20)]
  facts = step_metrics.StepFacts(
    groups=groups,
    rounds=[_round("short", 1.0, 3)],
    update={"loss": 0.5, "updates": 1.0},
    lr=1e-3,
    memory={},
    version=4,
    wait_s=1.0,
    update_s=0.75,
    step_s=2.0,
    publish_s=0.5,
    publish_wait={"publish/update_wait_seconds": 0.25},
    filtered=1,
    requeued=2,
    staleness={"staleness": 0.1},
    trained_gap={"mean": 0.5, "max": 1.0},
    control={"allowed_lag": 1.0},
    totals={"faults/nonfinite_steps_total": 0.0},
  )
  m = step_metrics.step_metrics(facts, settings, model_config.preset("tiny"))
  assert m["train/loss"] == 0.5 and m["optim/lr"] == 1e-3 and m["policy/version"] == 4.0
  assert m["rollout/wait_seconds"] == 1.0 and m["perf/step_seconds"] == 2.0
  assert m["perf/update_seconds"] == 0.75
  assert m["perf/tokens_per_s"] == 4.0  # 8 response tokens in 2 s
  assert m["rollout/rounds"] == 1.0 and m["rollout/aborted"] == 3.0
  assert m["rollout/filtered_groups"] == 1.0 and m["async/stale_requeued"] == 2.0
  assert m["async/staleness"] == 0.1 and m["async/allowed_lag"] == 1.0
  assert m["async/trained_gap"] == 0.5 and m["async/trained_gap_max"] == 1.0
  assert m["publish/seconds"] == 0.5 and m["publish/update_wait_seconds"] == 0.25
  assert m["faults/nonfinite_steps_total"] == 0.0 and "rollout/reward_mean" in m
