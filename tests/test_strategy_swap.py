"""The tiny default run trains one GRPO step under each other strategy, chosen
only by `sharding.strategy` (sp stays at its default 0 = auto)."""

import math

import pytest

from fluxjax import config_args
from fluxjax.parallel import strategies
from fluxjax.rl import loop


def _config():
  """The default tiny run, cut to one step of 2 prompts x 2 short responses."""
  c = config_args.load_config(arg="tiny")
  c.total_steps, c.eval.every = 1, 0
  c.data.synth_train, c.data.synth_eval, c.eval.prompts = 4, 1, 1
  c.eval.samples_per_prompt, c.eval.greedy = 1, False
  c.rl.prompts_per_step, c.rl.responses_per_prompt, c.rl.max_new_tokens = 2, 2, 4
  c.rl.reward.num_workers = 1
  c.rollout.num_slots, c.rollout.context_length = 4, 256
  c.sft.enabled = False
  return c


@pytest.mark.slow
# packed_dp, the default, plans every step of the other loop tests
# (test_train_loop.py, test_multiprocess.py, test_grpo_learning.py).
@pytest.mark.parametrize("name", [s for s in strategies.STRATEGIES if s != "packed_dp"])
def test_one_step_under_each_strategy(name, tmp_path, monkeypatch, devices):
  planned = []
  plan = strategies.Strategy.plan

  def spy(self, lengths, num_devices):
    planned.append((self.name, self.sp))
    return plan(self, lengths, num_devices)

  monkeypatch.setattr(strategies.Strategy, "plan", spy)
  c = _config()
  c.sharding.strategy = name
  last = loop.run(c, str(tmp_path))
  assert last["policy/version"] == 1.0
  # Every batch the step trained was planned by the strategy asked for, at
  # the auto degree on 8 devices (tiny: 8 query heads, 2 kv heads).
  assert planned and set(planned) == {(name, 8)}
  losses = {k: v for k, v in last.items() if k.startswith("train/") and "loss" in k}
  assert "train/loss" in losses and "train/pg_loss" in losses
  assert all(math.isfinite(v) for v in losses.values()), losses
