"""The GRPO loop end to end on the tiny preset: runs, checkpoints, resumes."""

import os

import numpy as np
import pytest

from fluxjax.rl import loop, losses, metrics, requests
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
  seed = requests.sampling_seed
  assert seed(0, 7, 3) == seed(0, 7, 3)
  seeds = {seed(run, uid, j) for run in range(2) for uid in range(64) for j in range(8)}
  assert len(seeds) == 2 * 64 * 8
  assert all(0 <= s < 2**31 for s in seeds)


def test_response_records_account_for_every_trained_response(tmp_path, devices):
  """With `coordinator.response_records`, trained.jsonl gives each trained
  response its record: R per trained prompt, in the step's order; the loss
  weights of a step add up to 1 (token-mean) and weigh the per-response token
  means back into the step's own metric."""
  del devices
  c = tiny_run_config(3)
  c.coordinator.response_records = True
  c.coordinator.lag.mode, c.coordinator.lag.fixed_lag = "fixed", 1
  loop.run(c, str(tmp_path))
  steps = {r["step"]: r for r in metrics.read_metrics(str(tmp_path))}
  trained = loop.read_trained(str(tmp_path))
  assert [t["step"] for t in trained] == [1, 2, 3]
  R = c.rl.responses_per_prompt
  for t in trained:
    responses = t["responses"]
    assert [r["sample_id"] for r in responses] == [i for i in t["ids"] for _ in range(R)]
    assert [r["response"] for r in responses] == list(range(R)) * len(t["ids"])
    assert sum(r["loss_weight"] for r in responses) == pytest.approx(1.0, rel=1e-5)
    m = steps[t["step"]]
    for key in ("is_weight", "behaviour_kl", "entropy"):
      weighed = sum(r["loss_weight"] * r["token_means"][key] for r in responses)
      assert weighed == pytest.approx(m[f"train/{key}"], rel=1e-4), key
    # The raw-weight histogram's bins share out every trained token.
    bins = [name for name, _, _ in losses.is_weight_bins()]
    assert sum(m[f"train/{name}"] for name in bins) == pytest.approx(1.0, rel=1e-5)
    for r in responses:
      assert 1 <= r["length"] <= c.rl.max_new_tokens
      assert 0.0 <= r["token_means"]["is_truncated"] <= 1.0
      assert 0.0 <= r["gap_mean"] <= r["gap_max"] and r["versions"] >= 1
    # The step's version gap is over its tokens: each response's, length-weighted.
    lengths = np.array([r["length"] for r in responses])
    gaps = np.array([r["gap_mean"] for r in responses])
    assert (gaps * lengths).sum() / lengths.sum() == pytest.approx(m["async/trained_gap"])
  assert all(r["gap_max"] == 0 for r in trained[0]["responses"])  # all sampled by version 0
