"""The GRPO loop end to end on the tiny preset: runs, checkpoints, resumes."""

import importlib.util
import json
import os

import pytest

from fluxjax import metrics
from fluxjax.rl import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config(total_steps):
  spec = importlib.util.spec_from_file_location("vlm_config", os.path.join(ROOT, "configs", "vlm.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  c.total_steps, c.eval_every = total_steps, 2
  c.data.synth_train, c.data.synth_eval, c.data.eval_prompts = 8, 2, 2
  c.rl.prompts_per_step, c.rl.responses_per_prompt, c.rl.max_new_tokens = 2, 2, 6
  c.rl.reward.num_workers = 1
  c.rollout.num_slots = 4
  c.checkpoint.every = 1
  return c


def test_loop_runs_checkpoints_and_resumes(tmp_path):
  last = loop.run(_config(2), str(tmp_path))
  assert last["policy/version"] == 2.0
  # The engine's behaviour logprobs are the trainer's: importance weights are 1.
  recs = metrics.read_metrics(str(tmp_path))
  assert [r["step"] for r in recs] == [0, 1, 2]
  assert recs[2]["train/is_weight"] == pytest.approx(1.0, abs=1e-4)
  assert "eval/accuracy" in recs[0] and "eval/accuracy" in recs[2]
  assert sorted(os.listdir(tmp_path / "checkpoints"))[-1] == "2"
  # Resume: the run continues at step 3 with the next policy version and data.
  last = loop.run(_config(3), str(tmp_path))
  assert last["policy/version"] == 3.0
  recs = metrics.read_metrics(str(tmp_path))
  assert [r["step"] for r in recs] == [0, 1, 2, 3]
  # The loader's counters come back with its state: 2 batches of 2, then 1 more.
  assert recs[2]["data/emitted"] == 4 and recs[3]["data/emitted"] == 6
  with open(tmp_path / "config.json") as f:
    assert json.load(f)["total_steps"] == 3
