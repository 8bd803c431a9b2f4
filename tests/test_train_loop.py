"""The GRPO loop end to end on the tiny preset: runs, checkpoints, resumes."""

import os

import pytest

from fluxjax.rl import coordinator, loop
from helpers import tiny_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_validate_refuses_what_the_loop_cannot_do():
  c = tiny_run_config(1)
  c.rl.reward.fn = "no_such_module:score"
  with pytest.raises(ValueError, match="cannot load reward"):
    loop.validate(c)
  # A fleet without servers is refused before any model is built.
  c = tiny_run_config(1)
  c.rollout.backend = "sglang"
  with pytest.raises(ValueError, match=r"needs rollout\.urls"):
    loop.validate(c)
  c.rollout.urls = ("http://127.0.0.1:1",)
  loop.validate(c)


def test_sampling_seeds_are_derived_per_response():
  """A request's seed depends only on (run seed, sample position, response
  index): the same response gets the same seed in any run, and the responses
  of a group, the samples of a stream and two runs' seeds all differ."""
  seed = coordinator.sampling_seed
  assert seed(0, 7, 3) == seed(0, 7, 3)
  seeds = {seed(run, uid, j) for run in range(2) for uid in range(64) for j in range(8)}
  assert len(seeds) == 2 * 64 * 8
  assert all(0 <= s < 2**31 for s in seeds)
