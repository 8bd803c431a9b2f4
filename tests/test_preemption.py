"""SIGTERM (a scheduler's preemption) mid-run: the step in progress finishes and
is checkpointed, the run exits with 128 + SIGTERM, and the same command
resumes it with each prompt trained once and to the state an uninterrupted
run reaches, bit for bit (fluxjax/rl/preemption.py)."""

import json
import os
import signal

import multiprocess_runs as runs
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import loop, preemption
from fluxjax.rl import metrics as metrics_lib
from helpers import (
  assert_each_prompt_trained_once,
  assert_every_drawn_prompt_accounted_for,
  tiny_run_config,
)


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_in_progress_and_the_run_resumes(tmp_path, monkeypatch):
  config = tiny_run_config(4)
  config.eval.every = 0  # the RL start and the last step only
  config.data.synth_train = 16  # one epoch: no prompt comes twice in 4 steps
  config.checkpoint.every = 100  # only the preemption and the last step save
  config.rollout.tail_batching.eta = 1.0  # a step's prompts follow the loader's order
  step = coordinator_lib.Coordinator.step

  def step_then_sigterm(self):
    result = step(self)
    if self.steps == 2:  # the signal lands while step 2's records are written
      os.kill(os.getpid(), signal.SIGTERM)
    return result

  monkeypatch.setattr(coordinator_lib.Coordinator, "step", step_then_sigterm)
  with pytest.raises(preemption.Preempted) as stopped:
    loop.run(config, str(tmp_path))
  assert stopped.value.step == 2 and stopped.value.code == 128 + signal.SIGTERM
  assert ocp.utils.checkpoint_steps(str(tmp_path / "checkpoints")) == [2]
  assert_each_prompt_trained_once(tmp_path, 2, config.rl.prompts_per_step)
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is restored
  # Stopped at once: no held-out evaluation after step 0, and the summary
  # says why the run ended early.
  evaluated = [r["step"] for r in metrics_lib.read_metrics(str(tmp_path)) if "eval/accuracy" in r]
  assert evaluated == [0]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["preempted"] and "2 RL steps of 4 (preempted" in summary["text"][0]

  monkeypatch.setattr(coordinator_lib.Coordinator, "step", step)
  last = loop.run(config, str(tmp_path))
  assert last["policy/version"] == 4.0
  assert_each_prompt_trained_once(tmp_path, 4, config.rl.prompts_per_step)
  assert_every_drawn_prompt_accounted_for(tmp_path, config.rl.prompts_per_step)
  # Resumed exactly: the train state (parameters and optimizer) equals an
  # uninterrupted run's bit for bit.
  plain = tmp_path / "uninterrupted"
  loop.run(config, str(plain))
  resumed, uninterrupted = runs.params(tmp_path, 4), runs.params(plain, 4)
  assert resumed.keys() == uninterrupted.keys()
  differ = [k for k in resumed if not np.array_equal(resumed[k], uninterrupted[k])]
  assert not differ, differ[:5]


def test_a_follower_only_logs_sigterm_and_outside_the_main_thread_nothing_changes(caplog):
  with preemption.Preemption(leader=False) as p:
    os.kill(os.getpid(), signal.SIGTERM)
    assert p.requested  # the process is still here
  assert "the leader checkpoints and stops this process" in caplog.text
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
