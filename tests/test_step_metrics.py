"""A step's batch metrics against direct computation."""

import dataclasses

import numpy as np
import pytest

from fluxjax import config_args
from fluxjax.models import config as model_config
from fluxjax.models import flops
from fluxjax.models.inputs import SequenceInputs
from fluxjax.rl import advantages, step_metrics, trajectories
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
  config = config_args.load_config()
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
