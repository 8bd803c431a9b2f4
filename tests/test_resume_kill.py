"""A run killed with SIGKILL mid-step resumes and trains each prompt exactly once.

`python -m fluxjax.train` runs in a subprocess (checkpoint every step, written
asynchronously by Orbax); once step 2 is logged it is killed with SIGKILL,
wherever it is. The same command then auto-resumes from the last complete
checkpoint, drops the log records of the steps it redoes, and finishes. With
tail batching off and sync lag the prompts of each step follow the loader's
order, so the trained set must equal the first steps * P samples of the
seeded loader, each exactly once, and the loss curve has one point per step.
"""

import json
import math
import signal
import subprocess
import time

import pytest

from fluxjax.data import pipeline, readers
from fluxjax.models import processor
from fluxjax.rl import loop, metrics
from helpers import ROOT, train_command

STEPS, P = 4, 2


def _command(workdir):
  overrides = {
    "total_steps": STEPS,
    "eval.every": 0,
    "checkpoint.every": 1,
    "sft.enabled": False,
    "data.synth_train": 16,
    "data.synth_eval": 2,
    "eval.prompts": 2,
    "rl.prompts_per_step": P,
    "rl.responses_per_prompt": 2,
    "rl.max_new_tokens": 6,
    "rl.reward.num_workers": 1,
    "rollout.num_slots": 4,
    "rollout.tail_batching.eta": 1.0,
    "coordinator.lag.mode": "sync",
  }
  return train_command(workdir, overrides)


@pytest.mark.slow
def test_sigkill_mid_step_resumes_each_prompt_once(tmp_path):
  workdir = tmp_path / "run"
  log = open(tmp_path / "first.log", "w")
  proc = subprocess.Popen(_command(workdir), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  deadline = time.time() + 600
  try:
    while time.time() < deadline and proc.poll() is None:
      if (workdir / metrics.JSONL).exists() and any(
        r["step"] >= 2 for r in metrics.read_metrics(str(workdir))
      ):
        break
      time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be killed"
    proc.send_signal(signal.SIGKILL)
  finally:
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  before = {r["step"]: r for r in metrics.read_metrics(str(workdir))}

  second = subprocess.run(_command(workdir), cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  assert "resumed from step" in second.stderr

  records = loop.read_trained(str(workdir))
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  trained = [i for r in records for i in r["ids"]]
  assert len(trained) == STEPS * P and len(set(trained)) == STEPS * P

  rows = readers.read_rows(str(workdir / "data" / "train" / "manifest.jsonl"))
  config = json.load(open(workdir / "config.json"))
  loader = pipeline.ShadowLoader(
    rows,
    P,
    processor.VisionProcessorConfig(**config["data"]["vision"]),
    num_workers=0,
    seed=config["seed"],
  )
  expected = [sorted(s.id for s in loader.next_batch()) for _ in range(STEPS)]
  loader.close()
  # Within a step groups arrive in finish order; the step's set is the batch's.
  assert [sorted(r["ids"]) for r in records] == expected

  # The loss curve: one record per step, finite; steps kept from the first
  # run are unchanged.
  lines = [json.loads(x) for x in open(workdir / metrics.JSONL) if x.strip()]
  steps = [r["step"] for r in lines if "train/loss" in r]
  assert steps == list(range(1, STEPS + 1))
  assert all(math.isfinite(r["train/loss"]) for r in lines if "train/loss" in r)
  after = {r["step"]: r for r in lines}
  kept = [s for s in before if s in after and after[s]["time"] == before[s]["time"]]
  assert kept and max(kept) >= 1, "the resumed run kept none of the first run's steps"
