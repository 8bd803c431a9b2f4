"""Multi-controller runs: 2 processes x 2 CPU devices against 1 process x 4.

The main job runs as `python -m fluxjax.launch --processes=2 --cpu_devices=2
-- <train args>` (subprocesses, gloo collectives between them) and as the
same launcher's one process holding all 4 devices. Both runs are seeded, in
sync mode without tail batching, train under flex_ulysses with its largest
degree across all 4 devices (sharding.sp=4: across both processes of the
2-process run, as the GPU variants run), and place the embedded engine on
process 0's 2 devices (rollout.embedded_devices=2), so rollout runs the same
programs in both; they must then sample the same responses and train the
same updates, up to the summation order of collectives across processes. A
resumed run repeats exactly what the killed one would have done, so the
2-process run is killed (its leader, the process holding the run's
decisions, as a one-process run's only process does) and restarted on the
way, and must still match. Its checkpoint then resumes in this process, on
the 8 devices the test session has.
"""

import json
import logging
import math
import os
import re

import multiprocess_runs as runs
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fluxjax.parallel import train_step
from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import loop, metrics
from helpers import (
  assert_each_prompt_trained_once,
)


def _here(workdir, **overrides) -> None:
  """The run in this process, on its 8 devices."""
  loop.run(runs.config(**overrides), str(workdir))


def _train_metrics(workdir) -> dict[int, dict]:
  return {r["step"]: r for r in metrics.read_metrics(str(workdir)) if "train/loss" in r}


@pytest.mark.slow
def test_two_processes_killed_and_resumed_match_one_and_resume_in_one(
  tmp_path, caplog, monkeypatch
):
  """The main job with the SFT warm-up and a KL reference, as 1 process x 4
  devices and as 2 x 2, the latter's leader killed mid-step and the job
  restarted: the same prompts, losses and parameters (within 1e-5), and
  bit for bit the parameters of the same 2-process run never killed; then
  the 2-process checkpoint resumes in this process on 8 devices, until NaN
  updates stop it."""
  one, two, whole = tmp_path / "one", tmp_path / "two", tmp_path / "whole"
  runs.run(runs.one(one, total_steps=3), tmp_path / "one.log")
  runs.run(runs.two(whole, total_steps=3), tmp_path / "whole.log")
  runs.kill_once_a_checkpoint_is_complete(
    runs.two(two, total_steps=3), tmp_path / "killed.log", victim=0
  )
  before = {r["step"]: r for r in metrics.read_metrics(str(two))}
  out = runs.run(runs.two(two, total_steps=3), tmp_path / "two.log")
  assert "resumed from step" in out
  assert len(re.findall(r"fluxjax\.launch: process \d pid \d+", out)) == 2
  assert f"strategy flex_ulysses (sp={runs.SP})" in out

  # Each prompt trained once, the same ones in both runs.
  a = assert_each_prompt_trained_once(one, 3, runs.P)
  b = assert_each_prompt_trained_once(two, 3, runs.P)
  assert [sorted(r["ids"]) for r in a] == [sorted(r["ids"]) for r in b]
  # Metrics are the leader's: one record per step, not one per process; the
  # resumed run dropped the records of the steps it redid and kept the others.
  for workdir in (one, two):
    lines = [json.loads(x) for x in open(workdir / metrics.JSONL) if x.strip()]
    assert [r["step"] for r in lines if "train/loss" in r] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) for r in lines if "train/loss" in r)
  after = {r["step"]: r for r in metrics.read_metrics(str(two))}
  kept = [s for s in before if s in after and after[s]["time"] == before[s]["time"]]
  assert kept and max(kept) >= 1, "the resumed run kept none of the first run's steps"
  ma, mb = _train_metrics(one), _train_metrics(two)
  for k in (1, 2, 3):
    for key in ("train/loss", "train/grad_norm", "train/kl", "rollout/reward_mean"):
      np.testing.assert_allclose(mb[k][key], ma[k][key], rtol=1e-5, atol=1e-5, err_msg=key)
  # A gradient, not the loss: at ratio 1 the policy term of the loss is the
  # mean advantage, about 0 in a step with signal, so the loss is about the KL.
  assert any(m["train/grad_norm"] > 1e-3 for m in ma.values()), "no step had a signal"
  # Every process logged to its own file.
  assert (two / "train.log").exists() and (two / "train.p1.log").exists()
  # The parameters after step 3, each checkpoint restored in this one process.
  pa, pb = runs.params(one, 3), runs.params(two, 3)
  assert pa.keys() == pb.keys()
  for key in pa:
    np.testing.assert_allclose(pb[key], pa[key], rtol=1e-5, atol=1e-5, err_msg=key)
  # The kill and the resume changed nothing: the run never killed, on the
  # same 2 processes, trained the same prompts to the same bits.
  c = assert_each_prompt_trained_once(whole, 3, runs.P)
  assert [sorted(r["ids"]) for r in b] == [sorted(r["ids"]) for r in c]
  pw = runs.params(whole, 3)
  assert pw.keys() == pb.keys()
  for key in pw:
    np.testing.assert_array_equal(pb[key], pw[key], err_msg=key)

  # The warm-up: held-out accuracy before it (step -3), every 2 of its steps
  # (a published snapshot) and after it (step 0, where GRPO starts); its loss
  # at steps -2..0. Its two publishes and the first RL update: version 3.
  for workdir in (one, two):
    recs = {r["step"]: r for r in metrics.read_metrics(str(workdir))}
    assert sorted(recs) == [-3, -2, -1, 0, 1, 2, 3]
    assert all("eval/accuracy" in recs[k] for k in (-3, -1, 0)) and "eval/accuracy" not in recs[-2]
    assert all(np.isfinite(recs[k]["sft/loss"]) for k in (-2, -1, 0))
    assert recs[1]["policy/version"] == 3.0
    # The KL reference is the policy as RL began (saved once, by the leader):
    # zero KL at the first step, up to two programs' rounding, then positive.
    assert os.path.exists(workdir / "reference" / "config.json")
    assert 0.0 <= recs[1]["train/kl"] < 1e-9 and recs[2]["train/kl"] > 1e-6
    # The engine's behaviour logprobs are the trainer's: importance weights 1.
    assert recs[2]["train/is_weight"] == pytest.approx(1.0, abs=1e-4)

  # The 2-process checkpoint resumes in this process (8 devices) and goes on:
  # no second warm-up, the reference read back from the work directory (KL to
  # the restored policy would be ~0 at this first step). From step 5 every
  # batch carries a NaN advantage: step 5 applies no update and publishes
  # nothing (counted, its prompts logged), step 6 is the second in a row and
  # stops the run; the checkpoints hold the last good policy.
  good = coordinator_lib.Coordinator.sequences

  def poisoned(self, groups):
    seqs = good(self, groups)
    if self.steps >= 4:
      seqs[0].advantages_T = np.full_like(seqs[0].advantages_T, np.nan)
    return seqs

  monkeypatch.setattr(coordinator_lib.Coordinator, "sequences", poisoned)
  with (
    caplog.at_level(logging.INFO, logger="fluxjax"),
    pytest.raises(train_step.NonFiniteError, match="2 updates in a row"),
  ):
    _here(two, total_steps=6, **{"faults.nonfinite_steps": 2})
  assert "resumed from step 3" in caplog.text
  assert_each_prompt_trained_once(two, 5, runs.P)  # the refused step's prompts are consumed
  recs = {r["step"]: r for r in metrics.read_metrics(str(two))}
  assert sorted(recs) == [-3, -2, -1, 0, 1, 2, 3, 4, 5]
  assert recs[4]["train/kl"] > 1e-6 and recs[4]["policy/version"] == 6.0
  assert recs[4]["train/nonfinite"] == 0.0 and recs[5]["train/nonfinite"] == 1.0
  assert recs[5]["policy/version"] == 6.0 and recs[5]["faults/nonfinite_steps_total"] == 1.0
  step5 = loop.read_trained(str(two))[-1]
  assert step5["step"] == 5 and all(i in caplog.text for i in step5["ids"])
  assert re.search(r"update 5 skipped: loss nan", caplog.text)
  assert max(ocp.utils.checkpoint_steps(str(two / "checkpoints"))) == 5
  p4, p5 = runs.params(two, 4), runs.params(two, 5)
  assert all(np.array_equal(p5[k], p4[k]) for k in p4)
