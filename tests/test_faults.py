"""Faults inside the GRPO loop: the run completes and the metrics count each event.

* a reward function that hangs: the call times out, scores 0, is counted
  (`reward/timeout`), its worker is replaced;
* a corrupt image in the dataset: a counted skip of the loader
  (`data/skipped/corrupt`), the batch is still full;
* a prompt longer than the rollout context: a counted skip of the producer
  (`data/skipped/prompt_too_long`), never sent to the engine;
* a rollout server killed mid-round (real server processes on loopback): the
  fleet marks it down and retries on the other (`fleet/servers_down`,
  `fleet/retries` or `faults/failed_rounds_total`).
"""

import asyncio
import json
import os
import signal

import pytest

from fluxjax.data import readers, synth
from fluxjax.rl import loop, metrics
from fluxjax.rollout import client as client_lib
from fluxjax.rollout import factory, launcher
from fluxjax.settings import Settings
from helpers import server_env, tiny_run_config


def _dataset(tmp_path, n=24):
  """A small `shapes` dataset plus one corrupt image and one over-long prompt."""
  manifest = synth.generate(str(tmp_path / "data"), "shapes", n, seed=3)
  rows = readers.read_rows(manifest)
  image_row = next(r for r in rows if r.get("images"))
  bad = tmp_path / "corrupt.jpg"
  bad.write_bytes(b"\xff\xd8\xff\xe0 this is no jpeg" * 10)
  extra = [
    dict(image_row, id="corrupt-image", images=[str(bad)]),
    dict(image_row, id="too-long", images=[], prompt="Count every word of this. " + "word " * 400),
  ]
  path = tmp_path / "train.jsonl"
  with open(path, "w") as f:
    for row in rows[:4] + extra + rows[4:]:
      f.write(json.dumps(row) + "\n")
  return str(path), manifest


@pytest.mark.slow
def test_hanging_reward_corrupt_image_and_long_prompt_are_counted(tmp_path, monkeypatch):
  train, eval_manifest = _dataset(tmp_path)
  monkeypatch.setenv("FLUXJAX_HANG_FLAG", str(tmp_path / "hung"))
  c = tiny_run_config(3)
  c.data.train, c.data.eval, c.eval.prompts = train, eval_manifest, 2
  c.rl.reward.fn = "fault_rewards:hang_once"
  c.rl.reward.t_min, c.rl.reward.t_max = 1.0, 3.0  # no correct call yet: T = t_max
  c.rl.reward.num_workers = 2
  c.rl.prompts_per_step = 4
  c.rollout.context_length = 128  # the 400-word prompt does not fit
  last = loop.run(c, str(tmp_path / "run"))
  assert last["policy/version"] == 3.0
  assert os.path.exists(tmp_path / "hung")
  assert last["reward/timeout"] >= 1 and last["reward/worker_restarts"] >= 1
  assert last["data/skipped/corrupt"] >= 1
  assert last["data/skipped/prompt_too_long"] >= 1
  trained = [i for r in loop.read_trained(str(tmp_path / "run")) for i in r["ids"]]
  # Every step full, none twice (the data holds more than one pass needs).
  assert len(trained) == 12 and len(set(trained)) == 12
  assert not {"corrupt-image", "too-long"} & set(trained)


@pytest.mark.slow
def test_server_killed_mid_round(tmp_path, monkeypatch):
  c = tiny_run_config(3)
  c.data.synth_train = 32  # more than the run reads: ids repeat only across epochs
  c.rl.prompts_per_step, c.rl.responses_per_prompt = 3, 2
  # Long responses: a kill while the server is busy meets requests in flight,
  # not the gap between a round's last answer and the next weight update.
  c.rl.max_new_tokens = 48
  c.coordinator.lag.mode = "fixed"  # rounds keep running while the trainer steps
  c.rollout.num_slots = 4
  cmd = factory.server_command(Settings.of(c))
  logs = str(tmp_path / "logs")
  servers = launcher.launch_servers(cmd, 2, env=server_env(), timeout_s=300, log_dir=logs)
  try:
    c.rollout.backend, c.rollout.urls = "sglang", tuple(servers.urls)
    # No health probe during the run: the fleet must learn of the death from
    # the requests it sends there (in flight or new), which it retries elsewhere.
    c.rollout.health_interval_s = 600.0
    workdir = tmp_path / "run"

    def kill_mid_request_after_first_step(client, request):
      # After step 1, the first request sent to server 0 finds it stopped
      # (SIGSTOP: it can answer nothing), then killed 20 ms later while the
      # request is in flight, so the death is met by a request in flight, not
      # by the next weight update. (A kill alone, 20 ms after the send, could
      # land after a response that stopped early had come back.)
      done = os.path.exists(workdir / metrics.JSONL) and any(
        r["step"] >= 1 for r in metrics.read_metrics(str(workdir))
      )
      if client.url == servers.urls[0] and done and servers.procs[0].poll() is None:
        servers.procs[0].send_signal(signal.SIGSTOP)
        asyncio.get_running_loop().call_later(0.02, servers.procs[0].kill)
      return generate(client, request)

    generate = client_lib.SGLangClient.generate
    monkeypatch.setattr(client_lib.SGLangClient, "generate", kill_mid_request_after_first_step)
    last = loop.run(c, str(workdir))
  finally:
    servers.stop()
  assert servers.procs[0].poll() is not None, "the server was never killed"
  assert last["policy/version"] == 3.0
  assert last["fleet/servers_down"] == 1.0
  assert last["fleet/retries"] + last["faults/failed_rounds_total"] >= 1
  trained = [i for r in loop.read_trained(str(workdir)) for i in r["ids"]]
  assert len(trained) == 9 and len(set(trained)) == 9
