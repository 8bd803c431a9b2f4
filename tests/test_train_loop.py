"""The GRPO loop end to end on the tiny preset: runs, checkpoints, resumes."""

import json
import os

import pytest

from fluxjax.rl import coordinator, loop, metrics
from fluxjax.rollout import factory
from fluxjax.settings import Settings
from helpers import server_env, tiny_run_config

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


@pytest.mark.slow
def test_adaptive_lag_with_recycling_through_the_router_trains_each_prompt_once(
  tmp_path, monkeypatch
):
  """The Flux controller through the coordinator, with tail batching's
  partial rollouts, on two server processes behind the real SGLang router,
  all launched from the config (rollout.launch, rollout.router_launch):
  generation goes through the router and each weight update pauses both
  servers mid-round. Every step full, no prompt twice, the lag within its
  bounds, the sync interval's barrier taken, tokens at most max_lag stale,
  and no decode work discarded."""
  c = tiny_run_config(6)
  c.eval.every = 0
  c.data.synth_train = 64
  c.rl.prompts_per_step, c.rl.responses_per_prompt = 3, 2
  c.rollout.tail_batching.eta = 1.5
  lag = c.coordinator.lag
  lag.mode, lag.sync_interval = "adaptive", 3
  c.rollout.backend, c.rollout.num_servers = "sglang", 2
  c.rollout.num_slots = 4
  c.rollout.launch = tuple(factory.server_command(Settings.of(c)))
  c.rollout.router_launch = ("python", "-m", "sglang_router.launch_router", "--log-level", "warn")
  # The servers inherit this environment: one plain CPU device each.
  for key, value in server_env().items():
    monkeypatch.setenv(key, value)
  last = loop.run(c, str(tmp_path))
  assert last["policy/version"] == 6.0
  assert last["fleet/routed"] == 1.0 and last["fleet/servers"] == 2.0
  assert last["fleet/servers_down"] == 0.0
  recs = [r for r in metrics.read_metrics(str(tmp_path)) if r["step"] >= 1]
  assert all(lag.min_lag <= r["async/allowed_lag"] <= lag.max_lag for r in recs)
  assert all(lag.min_async_ratio <= r["async/async_ratio"] <= lag.max_async_ratio for r in recs)
  assert any(r["async/sync_barrier"] == 1.0 for r in recs)  # sync_interval 3 in 6 steps
  assert all(r["async/version_gap_max"] <= lag.max_lag for r in recs)
  assert all(0.0 <= r["async/staleness"] <= 1.0 for r in recs)
  steps = loop.read_trained(str(tmp_path))
  trained = [i for r in steps for i in r["ids"]]
  assert [len(r["ids"]) for r in steps] == [3] * 6 and len(trained) == len(set(trained))
  # Recycling discards no decode work: a response ends at a vision pad id
  # a random policy samples, so every continuation is a valid prompt.
  assert last["rollout/restarted_total"] == 0.0
  assert last["rollout/tokens_discarded_total"] == 0.0
  # The run's summary: held-out accuracy at the RL start and, with eval.every
  # 0, still at the last step; the 6 steps' samples.
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["start"]["step"] == 0 and summary["end"]["step"] == 6
  assert summary["end"]["accuracy"] == last["eval/accuracy"]
  assert 0.0 <= summary["start"]["accuracy"] <= 1.0
  assert (summary["rl_steps"], summary["samples"]) == (6, 18) and summary["samples_per_s"] > 0


def test_sampling_seeds_are_derived_per_response():
  """A request's seed depends only on (run seed, sample position, response
  index): the same response gets the same seed in any run, and the responses
  of a group, the samples of a stream and two runs' seeds all differ."""
  seed = coordinator.sampling_seed
  assert seed(0, 7, 3) == seed(0, 7, 3)
  seeds = {seed(run, uid, j) for run in range(2) for uid in range(64) for j in range(8)}
  assert len(seeds) == 2 * 64 * 8
  assert all(0 <= s < 2**31 for s in seeds)
