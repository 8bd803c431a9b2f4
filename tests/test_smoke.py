"""The `smoke` modifier of configs/vlm.py: every variant's settings, the run's sizes cut.

Fast: each variant's smoke config differs from the variant only in the size
fields the modifier names, validates on the 8-device test mesh, and a fleet
variant launches fluxjax's own server with the run's model and limits. Slow:
`python -m fluxjax.train --config=configs/vlm.py:VARIANT,smoke` end to end
for the variants of `END_TO_END`, as a user runs it on one CPU device, ending with its
summary, through the `python -m fluxjax.rollout.server` process they launch.
"""

import json
import math
import os
import subprocess
import sys

import pytest

from fluxjax import config_args
from fluxjax.models import config as model_config
from fluxjax.rl import config_rules, loop, metrics
from fluxjax.rollout import factory, server
from fluxjax.settings import Settings
from helpers import server_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("tiny", "tiny_base", "qwen25_vl_3b", "qwen25_vl_7b", "qwen25_vl_32b")
# What the modifier may change: the run's sizes (configs/vlm.py `_smoke`).
SIZES = {
  "model.preset",
  "total_steps",
  "optim.total_steps",
  "rl.prompts_per_step",
  "data.synth_train",
  "data.synth_eval",
  "eval.prompts",
  "eval.samples_per_prompt",
  "sft.steps",
  "sft.eval_every",
  "sharding.capacity",
  "rollout.launch",
  "data.vision.image_min_pixels",
  "data.vision.image_max_pixels",
  "data.vision.video_min_pixels",
  "data.vision.video_max_pixels",
  "data.vision.video_max_frames",
}


def _flat(d, prefix=""):
  out = {}
  for key, value in d.items():
    name = f"{prefix}{key}"
    if hasattr(value, "items"):
      out.update(_flat(value, name + "."))
    else:
      out[name] = value
  return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_smoke_keeps_every_setting_but_the_sizes(variant, devices):
  full = _flat(config_args.load_config(arg=variant).to_dict())
  smoke_cfg = config_args.load_config(arg=f"{variant},smoke")
  smoke = _flat(smoke_cfg.to_dict())
  assert full.keys() == smoke.keys()
  changed = {k for k in full if full[k] != smoke[k]}
  assert changed <= SIZES, changed - SIZES
  assert smoke_cfg.total_steps == 2
  cfg, strategy, _, settings, _ = loop.validate(smoke_cfg)
  # The model keeps the variant's heads (the sequence-parallel degrees follow).
  want = model_config.preset(config_args.load_config(arg=variant).model.preset).text
  assert (cfg.text.num_heads, cfg.text.num_kv_heads) == (want.num_heads, want.num_kv_heads)
  assert config_rules.prompt_budget(settings, strategy) > 0
  if smoke_cfg.rollout.backend == "sglang":
    assert tuple(smoke_cfg.rollout.launch) == factory.OWN_SERVER
    cmd = factory.launch_command(settings)
    args = server.parse_args(cmd[3:])
    assert args.preset == smoke_cfg.model.preset and args.dtype == smoke_cfg.model.dtype
    assert args.context_length == smoke_cfg.rollout.context_length
    assert args.num_continuous_decode_steps == smoke_cfg.rollout.num_continuous_decode_steps
    assert {k: getattr(args, k) for k in server.VISION_LIMITS} == smoke_cfg.data.vision.to_dict()


# End to end: 3B, the cheapest real-shape run (80 s) and the only preset
# with tied embeddings (its publishes and its server load them). Its head
# layout (2 KV heads under a sequence-parallel degree of 8, replicated) is
# also the tiny preset's under flex_ulysses in test_strategy_swap; 7B and 32B
# (KV heads equal to the degree: 4 and 8) are covered by test_config's
# auto-sp table, their runs (88 s, 105 s) left out to keep the suite within
# its time. The tiny variant's CLI run is test_grpo_learning's first run (the
# main job as the README runs it, with its warm-up).
END_TO_END = ("qwen25_vl_3b",)


@pytest.mark.slow
@pytest.mark.parametrize("variant", END_TO_END)
def test_the_smoke_run_from_the_command_line(variant, tmp_path):
  """The README's user: the CLI on one plain CPU device, 2 RL steps on the
  variant's own rollout path, evaluation at the start and the end, the summary."""
  workdir = tmp_path / "run"
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "fluxjax.train",
      f"--config=configs/vlm.py:{variant},smoke",
      f"--workdir={workdir}",
    ],
    cwd=ROOT,
    env=server_env(),
    capture_output=True,
    text=True,
    timeout=900,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["last_step"] == 2
  assert summary["start"]["step"] == 0 and summary["end"]["step"] == 2
  assert "run summary" in out.stderr and "python -m fluxjax.plot" in out.stderr
  # The config is validated once per start (its rules log what they limit).
  assert out.stderr.count("prompts are limited to") <= 1, out.stderr[-4000:]
  # Random weights sample vision pad ids; a response ends at one
  # (Tokenizer.response_stop_ids), so nothing is refused or discarded.
  assert summary["faults"] == {}, summary["faults"]
  steps = [r for r in metrics.read_metrics(str(workdir)) if "train/loss" in r]
  assert [r["step"] for r in steps] == [1, 2]
  assert all(math.isfinite(r["train/loss"]) and r["train/sequences"] > 0 for r in steps)
  # Served by the launched server, weights published.
  assert all(r["fleet/servers"] == 1 and r["fleet/servers_down"] == 0 for r in steps)
  assert steps[-1]["policy/version"] == 2


def test_a_launch_command_of_ones_own_gets_the_runs_preprocessing():
  """`rollout.launch` naming fluxjax's server with options of its own: the
  vision limits it leaves out are the run's (the trainer and the server must
  count a prompt's pad tokens alike); another server's command is left as is."""
  cfg = config_args.load_config(arg="qwen25_vl_3b,smoke")
  own = ("python", "-m", "fluxjax.rollout.server", "--preset", cfg.model.preset)
  cfg.rollout.launch = (*own, "--video-max-frames=4")
  args = server.parse_args(factory.launch_command(Settings.of(cfg))[3:])
  want = {**cfg.data.vision.to_dict(), "video_max_frames": 4}
  assert {k: getattr(args, k) for k in server.VISION_LIMITS} == want
  cfg.rollout.launch = ("python", "-m", "sglang.launch_server", "--model-path", "/m")
  assert factory.launch_command(Settings.of(cfg)) == list(cfg.rollout.launch)
