"""GRPO from the committed base learns to reason where it pays, and only with the right sign.

Two main jobs (`python -m fluxjax.train --config=configs/vlm.py`, the default:
RL from the committed base, one CPU device each) run side by side on
`colour_list`, whose medium and hard items the base answers right mostly when
it works them out in a `<think>` chain first and otherwise guesses. One is
rewarded with `accuracy`, the other with `accuracy_reversed` (1 - accuracy).
GRPO's advantages are (r - mean) / std within a group, so the second run's
advantages are exactly the first's with the sign flipped. Accuracy is sampled
at the training temperature on held-out prompts (rl/evaluation.py). The first
run must gain and the second must lose, each by more than the 95% interval
of the difference, and the share of responses that reason must rise in the
first and fall in the second; a sign or weighting error anywhere between the
reward and the update (advantages, loss, importance weights, the KL term, the
stream update, publishing) fails one of them.

The first run is also the README's user (test_smoke.py runs the real-shape
variants): the CLI on one plain CPU device, the base loaded through
model.hf_path, the embedded engine, evaluations at the start and the end,
the summary.
"""

import json
import math
import subprocess

import pytest

from fluxjax import config_args
from fluxjax.rl import metrics
from helpers import ROOT, server_env, train_command

# At the job's lr 3e-4 both moves clear their intervals more than three times
# over at 10 steps (the commit that set 10 has the figures).
RL_STEPS = {"accuracy": 10, "accuracy_reversed": 10}


def command(workdir, reward: str) -> list[str]:
  steps = RL_STEPS[reward]
  overrides = {
    # Lists of colours in a picture, read out in a chain or guessed: one
    # task, so that every prompt of a step trains it.
    "data.mix": "colour_list",
    "data.synth_eval": 128,
    "eval.prompts": 128,
    "eval.greedy": False,
    "eval.every": steps,  # the RL start and the end
    "total_steps": steps,
    "checkpoint.every": 1000,
    "rl.reward.fn": reward,
    "rl.reward.num_workers": 1,
    # Every launched response trains: the run does not depend on thread timing.
    "rollout.tail_batching.eta": 1.0,
  }
  return train_command(workdir, overrides, variant="tiny_base")


def _start(workdir, reward: str, log_path):
  log = open(log_path, "w")
  proc = subprocess.Popen(
    command(workdir, reward), cwd=ROOT, env=server_env(), stdout=log, stderr=subprocess.STDOUT
  )
  return proc, log


@pytest.mark.slow
def test_grpo_raises_held_out_accuracy_and_a_flipped_sign_lowers_it(tmp_path):
  logs = {name: tmp_path / f"{name}.log" for name in RL_STEPS}
  runs = {}
  try:
    for reward in RL_STEPS:
      runs[reward] = _start(tmp_path / reward, reward, logs[reward])
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
  _assert_the_cli_run(tmp_path / "accuracy", logs["accuracy"].read_text(), RL_STEPS["accuracy"])
  start = evals["accuracy"][0]
  assert evals["accuracy_reversed"][0]["eval/accuracy"] == start["eval/accuracy"]  # one base
  end = evals["accuracy"][RL_STEPS["accuracy"]]
  flipped_end = evals["accuracy_reversed"][RL_STEPS["accuracy_reversed"]]
  assert start["eval/accuracy"] <= 0.65, start  # headroom left for GRPO

  def ci(a, b):  # the 95% half-interval of a difference of two evaluations
    return math.hypot(a["eval/accuracy_ci95"], b["eval/accuracy_ci95"])

  gain = end["eval/accuracy"] - start["eval/accuracy"]
  loss = start["eval/accuracy"] - flipped_end["eval/accuracy"]
  assert gain > ci(start, end), (start, end)
  assert loss > ci(start, flipped_end), (start, flipped_end)
  # Reasoning pays on this task: rewarded, it spreads; punished, it goes.
  share = "eval/reasoning_share"
  assert end[share] > start[share] + 0.2, (start[share], end[share])
  assert flipped_end[share] < start[share] - 0.1, (start[share], flipped_end[share])


def _assert_the_cli_run(workdir, out: str, steps: int) -> None:
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["last_step"] == steps
  assert summary["start"]["step"] == 0 and summary["end"]["step"] == steps
  assert summary["warm_up"] is None, "the main job starts from the base, with no warm-up"
  config = json.loads((workdir / "config.json").read_text())
  assert config["model"]["hf_path"] == config_args.TINY_BASE
  assert "run summary" in out and "python -m fluxjax.plot" in out
  # The config is validated once per start (its rules log what they limit).
  assert out.count("prompts are limited to") <= 1, out[-4000:]
  assert summary["faults"] == {}, summary["faults"]
  records = [r for r in metrics.read_metrics(str(workdir)) if "train/loss" in r]
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  assert all(math.isfinite(r["train/loss"]) and r["train/sequences"] > 0 for r in records)
