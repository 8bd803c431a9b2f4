"""GRPO raises held-out accuracy on the image task, and only with the right sign.

Two main jobs (`python -m fluxjax.train` on the colour task, one CPU device
each) start from the same post-SFT policy: the first runs the warm-up, which
checkpoints the RL start as step 0, and the second resumes from a copy of that
checkpoint (so it must not warm up again). One is rewarded with `accuracy`,
the other with `accuracy_reversed` (1 - accuracy). GRPO's advantages are
(r - mean) / std within a group, so the second run's advantages are exactly
the first's with the sign flipped. Accuracy is sampled at the training
temperature on held-out prompts (rl/evaluation.py). The first run must gain
and the second must lose, each by more than the 95% interval of the
difference; a sign or weighting error anywhere between the reward and the
update (advantages, loss, importance weights, the stream update, publishing)
fails one of them.

The first run is also the README's user (test_smoke.py runs the real-shape
variants): the CLI on one plain CPU device, the SFT warm-up on the embedded
engine, evaluations at the start and the end, the summary.
"""

import json
import math
import shutil
import subprocess
import time

import pytest

from fluxjax.rl import metrics
from helpers import ROOT, server_env, train_command

# 0.34 -> 0.48 (+-0.06) in 20 steps; the reversed reward reaches 0.98 train
# reward within 5 steps, so its run stops there.
RL_STEPS = {"accuracy": 20, "accuracy_reversed": 5}


def command(workdir, reward: str) -> list[str]:
  steps = RL_STEPS[reward]
  overrides = {
    # The colour of the shape in a 112 px picture: one task of the default
    # mix, alone so that every prompt of a step trains it. 50 warm-up steps
    # teach the answer format and leave the task half learnt.
    "data.mix": "colour",
    "sft.steps": 50,
    "data.synth_eval": 128,
    "eval.prompts": 128,
    "eval.greedy": False,
    "eval.every": steps,  # the RL start and the end
    "sft.eval_every": 0,
    "total_steps": steps,
    "checkpoint.every": 1000,
    "rl.reward.fn": reward,
    "rl.reward.num_workers": 1,
    # Every launched response trains: the run does not depend on thread timing.
    "rollout.tail_batching.eta": 1.0,
  }
  return train_command(workdir, overrides)


def _start(workdir, reward: str, log_path):
  log = open(log_path, "w")
  proc = subprocess.Popen(
    command(workdir, reward), cwd=ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT
  )
  return proc, log


def _wait_for_checkpoint(workdir, proc, log_path, timeout=600):
  """Waits until checkpoint 0 (the RL start) is complete: renamed into place."""
  done = workdir / "checkpoints" / "0"
  deadline = time.time() + timeout
  while not done.exists():
    assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
    time.sleep(0.5)
  return done


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy_and_a_flipped_sign_lowers_it(tmp_path):
  first, flipped = tmp_path / "accuracy", tmp_path / "accuracy_reversed"
  logs = {name: tmp_path / f"{name}.log" for name in RL_STEPS}
  runs = {"accuracy": _start(first, "accuracy", logs["accuracy"])}
  try:
    start_ckpt = _wait_for_checkpoint(first, runs["accuracy"][0], logs["accuracy"])
    shutil.copytree(start_ckpt, flipped / "checkpoints" / "0")
    runs["accuracy_reversed"] = _start(flipped, "accuracy_reversed", logs["accuracy_reversed"])
    evals = {}
    for reward, (proc, _) in runs.items():
      assert proc.wait(timeout=900) == 0, logs[reward].read_text()[-3000:]
      workdir = tmp_path / reward
      evals[reward] = {
        r["step"]: r for r in metrics.read_metrics(str(workdir)) if "eval/accuracy" in r
      }
  finally:  # a failed run must not leave the other one running
    for proc, log in runs.values():
      proc.kill()
      proc.wait()
      log.close()
  _assert_the_cli_run(first, logs["accuracy"].read_text(), RL_STEPS["accuracy"])
  # The second run started from the first one's RL start, without a warm-up.
  flipped_log = logs["accuracy_reversed"].read_text()
  assert "resumed from step 0" in flipped_log and "SFT warm-up" not in flipped_log
  start = evals["accuracy"][0]
  end = evals["accuracy"][RL_STEPS["accuracy"]]
  flipped_end = evals["accuracy_reversed"][RL_STEPS["accuracy_reversed"]]
  assert start["eval/accuracy"] <= 0.55, start  # headroom left for GRPO

  def ci(a, b):  # the 95% half-interval of a difference of two evaluations
    return math.hypot(a["eval/accuracy_ci95"], b["eval/accuracy_ci95"])

  gain = end["eval/accuracy"] - start["eval/accuracy"]
  loss = start["eval/accuracy"] - flipped_end["eval/accuracy"]
  assert gain > ci(start, end), (start, end)
  assert loss > ci(start, flipped_end), (start, flipped_end)


def _assert_the_cli_run(workdir, out: str, steps: int) -> None:
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["last_step"] == steps
  assert summary["start"]["step"] == 0 and summary["end"]["step"] == steps
  assert summary["warm_up"] is not None, "the main job warms up with SFT before RL"
  assert "run summary" in out and "python -m fluxjax.plot" in out
  # The config is validated once per start (its rules log what they limit).
  assert out.count("prompts are limited to") <= 1, out[-4000:]
  assert summary["faults"] == {}, summary["faults"]
  records = [r for r in metrics.read_metrics(str(workdir)) if "train/loss" in r]
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  assert all(math.isfinite(r["train/loss"]) and r["train/sequences"] > 0 for r in records)
