"""A failed or killed weight publish leaves the previous version loadable, and
a server never loads half a publish.

  * write error, in process: the third shard file of `Fleet.publish` finds
    the disk full (ENOSPC) after its header, leaving a partial file; in a
    child process: the filesystem refuses the third shard (RLIMIT_FSIZE, so
    the writer's own write gets EFBIG). The publish reports the failure, tells no server
    anything and leaves no temporary folder;
  * kill: a child writer is SIGKILLed from inside the write, once after its
    third shard and once between moving the old folder of a republished
    version aside and renaming the new one in. The next write clears the
    leftovers and moves the old folder back;
  * a real server process told to load a damaged folder answers
    `{"success": false}`, serves on with its previous weights and version,
    and loads the next good folder.
"""

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from functools import partial

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from fluxjax.models import config, hf_export, hf_load, vlm
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.rollout import launcher, publish
from helpers import server_env

SHARD_BYTES = 400_000  # the tiny model in float32 spans several shards
PROMPT = [5, 17, 99, 4, 250, 31, 8, 72]
GREEDY = {"temperature": 0, "max_new_tokens": 6}


def random_model(seed: int) -> vlm.Qwen25VL:
  """Random tiny weights without create_model's many small init compilations."""
  graphdef, state = nnx.split(vlm.abstract_model(config.preset("tiny")))
  rng = np.random.default_rng(seed)
  state = jax.tree.map(lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state)
  return nnx.merge(graphdef, state)


def assert_holds(path: str, model: vlm.Qwen25VL) -> None:
  """The folder loads, and holds exactly `model`'s parameters."""
  loaded = hf_load.load_hf_checkpoint(path)
  expected = nnx.to_flat_state(nnx.state(model, nnx.Param))
  got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.Param)))
  for key, var in expected:
    np.testing.assert_array_equal(np.asarray(got[key].get_value()), var.get_value())


def shards(folder: str) -> list[str]:
  return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def http(url, path, body=None):
  """(status, parsed body) with urllib: the raw wire."""
  data = None if body is None else json.dumps(body).encode()
  req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      return r.status, json.loads(r.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def served(url) -> tuple[str, list, list]:
  """(weight version, greedy output ids, their logprobs) the server gives now."""
  status, out = http(
    url, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True}
  )
  assert status == 200, out
  logprobs = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
  return http(url, "/get_weight_version")[1]["weight_version"], out["output_ids"], logprobs


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
  """Two good versions, several shards each: {seed: folder}."""
  root = tmp_path_factory.mktemp("versions")
  return {
    seed: hf_export.save_hf_checkpoint(
      random_model(seed), str(root / f"m{seed}"), dtype="float32", max_shard_bytes=SHARD_BYTES
    )
    for seed in (1, 2)
  }


@pytest.fixture(scope="module")
def url(folders, tmp_path_factory):
  cmd = ["python", "-m", "fluxjax.rollout.server", "--model-path", folders[1]]
  cmd += ["--weight-version", "1", "--num-slots", "2", "--context-length", "64"]
  logs = str(tmp_path_factory.mktemp("logs"))
  launched = launcher.launch_servers(cmd, 1, env=server_env(), timeout_s=120, log_dir=logs)
  yield launched.urls[0]
  launched.stop()


def load(url, folder, version) -> tuple[int, dict]:
  return http(url, "/update_weights_from_disk", {"model_path": folder, "weight_version": version})


def test_a_failed_write_publishes_nothing_and_the_fleet_keeps_its_version(
  url, tmp_path, monkeypatch
):
  monkeypatch.setattr(
    hf_export,
    "save_hf_checkpoint",
    partial(hf_export.save_hf_checkpoint, max_shard_bytes=SHARD_BYTES),
  )
  first, second = random_model(1), random_model(2)
  root = str(tmp_path)
  written = []

  class ThirdFileFindsTheDiskFull(hf_export.ShardWriter):
    def __init__(self, path, shapes, dtype):
      super().__init__(path, shapes, dtype)
      written.append(path)

    def write(self, name, tensor, start=0):
      if len(written) == 3:  # after its header: a partial file, as a full disk leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)
      super().write(name, tensor, start)

  async def go():
    fleet = fleet_lib.Fleet(
      [url], health_interval_s=3600, weights_root=root, weights_dtype="float32"
    )
    async with fleet:
      good = await fleet.publish(first, 1)
      before = served(url)
      monkeypatch.setattr(hf_export, "ShardWriter", ThirdFileFindsTheDiskFull)
      failed = await fleet.publish(second, 2)
      kept = served(url), fleet.published, sorted(os.listdir(root))
      monkeypatch.undo()
      again = await fleet.publish(second, 2)
      return good, before, failed, kept, again, served(url)

  good, before, failed, (after, published, listing), again, now = asyncio.run(go())
  assert not good.failed and before[0] == "1"
  assert len(written) == 3  # the third shard failed, and nothing was written after it
  assert failed.path is None and set(failed.seconds) == {"write"}  # no server was told anything
  assert len(failed.failed) == 1 and "No space left on device" in failed.failed[0]
  assert after == before and published == ("1", os.path.join(root, "v1"))
  assert listing == ["v1"]  # no v2, no temporary folder
  assert_holds(os.path.join(root, "v1"), first)
  assert not again.failed and now[0] == "2" and now[2] != before[2]


def damage_missing_shard(folder: str) -> None:
  os.remove(os.path.join(folder, shards(folder)[1]))


def damage_truncated_shard(folder: str) -> None:
  file = os.path.join(folder, shards(folder)[-1])
  with open(file, "r+b") as f:
    f.truncate(os.path.getsize(file) // 2)


def damage_transposed_tensor(folder: str) -> None:
  """One tensor stored [in, out] instead of [out, in]: the same size, so a
  load that only reshapes takes it."""
  file = os.path.join(folder, shards(folder)[0])
  with safe_open(file, framework="numpy") as f:
    tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
  name = next(k for k, v in tensors.items() if v.ndim == 2 and v.shape[0] != v.shape[1])
  tensors[name] = np.ascontiguousarray(tensors[name].T)
  save_file(tensors, file, metadata={"format": "pt"})


def damage_half_written(folder: str) -> None:
  """What a killed writer leaves: the first shards, no index."""
  os.remove(os.path.join(folder, "model.safetensors.index.json"))
  for f in shards(folder)[2:]:
    os.remove(os.path.join(folder, f))


@pytest.mark.parametrize(
  "damage,message",
  [
    (damage_missing_shard, "which is missing"),
    (damage_truncated_shard, "model-"),
    (damage_transposed_tensor, "has shape"),
    (damage_half_written, "tensors missing"),
    (None, "No such file"),
  ],
  ids=["missing_shard", "truncated_shard", "transposed_tensor", "half_written", "no_folder"],
)
def test_a_server_never_loads_half_a_publish(url, folders, tmp_path, damage, message):
  status, out = load(url, folders[1], "1")
  assert status == 200 and out["success"], out
  before = served(url)
  bad = str(tmp_path / "bad")
  if damage is None:
    bad = "/no/such/folder"
  else:
    shutil.copytree(folders[2], bad)
    damage(bad)
  status, out = load(url, bad, "2")
  assert status == 400 and out["success"] is False and message in out["message"], out
  assert served(url) == before  # same version, same tokens, same logprobs
  status, out = load(url, folders[2], "2")
  assert status == 200 and out["success"], out
  now = served(url)
  assert now[0] == "2" and now[2] != before[2]


CHILD = """
import os, resource, signal, sys, threading
from functools import partial
sys.path.insert(0, sys.argv[3])
from test_publish_faults import SHARD_BYTES, random_model
from fluxjax.models import hf_export
from fluxjax.rollout import publish

scenario, root = sys.argv[1], sys.argv[2]
hf_export.save_hf_checkpoint = partial(hf_export.save_hf_checkpoint, max_shard_bytes=SHARD_BYTES)
Writer, replace = hf_export.ShardWriter, os.replace
model = random_model(2)
opened = []

class ThirdFileRefused(Writer):  # no file may grow past 1 KiB while the third is written
  def __init__(self, path, shapes, dtype):
    opened.append(path)
    self.limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if len(opened) == 3:
      resource.setrlimit(resource.RLIMIT_FSIZE, (1024, self.limit[1]))
    super().__init__(path, shapes, dtype)

  def close(self):
    super().close()
    resource.setrlimit(resource.RLIMIT_FSIZE, self.limit)

class ThirdFileThenWait(Writer):
  def close(self):
    super().close()
    opened.append(self.path)
    if len(opened) == 3:
      print("stopped", flush=True)
      threading.Event().wait()

def aside_then_wait(src, dst):
  replace(src, dst)
  if dst.endswith(".old"):
    print("stopped", flush=True)
    threading.Event().wait()

if scenario == "mid_write":
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  hf_export.ShardWriter = ThirdFileRefused
  try:
    publish.write_checkpoint(model, root, 2, dtype="float32")
    print("written", flush=True)
  except OSError as e:
    print("error", e.errno, sorted(os.listdir(root)), flush=True)
  opened.clear()
  hf_export.ShardWriter = ThirdFileThenWait
  publish.write_checkpoint(model, root, 2, dtype="float32")
else:  # v1 written again, stopped between its two renames
  os.replace = aside_then_wait
  publish.write_checkpoint(model, root, 1, dtype="float32")
"""


def start_child(script, scenario: str, root, log) -> subprocess.Popen:
  return subprocess.Popen(
    [sys.executable, str(script), scenario, str(root), os.path.dirname(__file__)],
    stdout=subprocess.PIPE,
    stderr=log,
    text=True,
  )


def lines_until_stopped(child: subprocess.Popen) -> list[str]:
  """The child's lines up to "stopped" (all of them if it ends before)."""
  assert child.stdout is not None
  lines = []
  for line in child.stdout:
    lines.append(line.strip())
    if lines[-1] == "stopped":
      break
  return lines


def test_a_writer_killed_mid_publish_leaves_the_previous_version(tmp_path, monkeypatch):
  """Both kills run at once in two children; each writes its own root."""
  monkeypatch.setattr(
    hf_export,
    "save_hf_checkpoint",
    partial(hf_export.save_hf_checkpoint, max_shard_bytes=SHARD_BYTES),
  )
  first, second = random_model(1), random_model(2)
  script = tmp_path / "child.py"
  script.write_text(CHILD)
  roots = {s: tmp_path / s for s in ("mid_write", "swap")}
  for root in roots.values():
    publish.write_checkpoint(first, str(root), 1, dtype="float32")
  logs = {s: open(tmp_path / f"{s}.log", "wb") for s in roots}
  children = {s: start_child(script, s, roots[s], logs[s]) for s in roots}
  watchdog = threading.Timer(120, lambda: [c.kill() for c in children.values()])
  watchdog.start()
  try:
    lines = {s: lines_until_stopped(c) for s, c in children.items()}
    for s in roots:
      assert lines[s][-1:] == ["stopped"], (lines[s], (tmp_path / f"{s}.log").read_text()[-3000:])
    # Where each kill lands: a temporary folder with three shards and no
    # config; v1 moved aside, its replacement complete but not renamed in.
    mid_write = sorted(os.listdir(roots["mid_write"]))
    assert len(mid_write) == 2 and mid_write[1] == "v1" and mid_write[0].startswith(".tmp-v2-")
    assert len(shards(str(roots["mid_write"] / mid_write[0]))) == 3
    assert not os.path.exists(roots["mid_write"] / mid_write[0] / "config.json")
    swap = sorted(os.listdir(roots["swap"]))
    assert len(swap) == 2 and swap[1] == swap[0] + ".old" and swap[0].startswith(".tmp-v1-")
  finally:
    watchdog.cancel()
    for c in children.values():
      c.send_signal(signal.SIGKILL)
      c.wait()
    for log in logs.values():
      log.close()
  assert all(c.returncode == -signal.SIGKILL for c in children.values())
  # The refused write, before the kill: EFBIG, and nothing left but v1.
  assert lines["mid_write"][0] == "error 27 ['v1']", lines["mid_write"]

  for root in roots.values():
    publish.write_checkpoint(second, str(root), 2, dtype="float32")
    assert sorted(os.listdir(root)) == ["v1", "v2"]
    assert_holds(str(root / "v1"), first)
    assert_holds(str(root / "v2"), second)
