"""Sparse weight deltas (models/hf_delta.py): a published folder also holds the
bf16 elements that changed since the previous version, exactly; a real
server at that version reads them instead of the folder and serves what the
folder gives, and the folder itself loads as before (SGLang reads only it).
"""

import os

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from test_publish_faults import http, random_model, served

from fluxjax.models import config, hf_delta, hf_export, hf_load, sharded, vlm
from fluxjax.rollout import launcher, publish
from fluxjax.sharding import mesh as mesh_lib
from helpers import server_env

BF16 = ml_dtypes.bfloat16


def nudged(model, share: float, seed: int = 0):
  """`model` with about `share` of every parameter's elements moved by more
  than a bf16 step (the rest as they were)."""
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(seed)

  def nudge(x):
    x = np.asarray(x)
    moved = rng.random(x.shape) < share
    return np.where(moved, x * 1.5 + 0.01, x).astype(x.dtype)

  return nnx.merge(graphdef, jax.tree.map(nudge, state))


def test_entries_hold_the_changed_elements_exactly_or_the_whole_tensor():
  old = np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16)
  new = old.copy()
  new[1, 2] = BF16(-7.5)
  got = hf_delta.entries("w", new, old)
  assert sorted(got) == ["w::index", "w::value"]
  np.testing.assert_array_equal(got["w::index"], [6])
  assert got["w::index"].dtype == np.int32 and got["w::value"].dtype == BF16
  assert float(got["w::value"][0]) == -7.5
  assert hf_delta.entries("w", old.copy(), old) == {}
  # The bytes decide: -0.0 differs from 0.0.
  zero = np.zeros(8, BF16)
  negative = zero.copy()
  negative[3] = -negative[3]
  got = hf_delta.entries("z", negative, zero)
  assert list(got["z::index"]) == [3] and np.signbit(got["z::value"][0])
  many = old.copy()
  many[:2] += BF16(1)  # 8 of 12 changed: the indices would cost more than the tensor
  marker = hf_delta.entries("w", many, old)  # read from the folder instead
  assert list(marker) == ["w::folder"] and marker["w::folder"].size == 0
  with pytest.raises(hf_delta.DeltaFormatError, match="the base holds"):
    hf_delta.entries("w", old.astype(np.float32), old)


def test_a_delta_built_from_runs_of_rows_is_the_whole_tensors_or_marks_the_folder():
  rng = np.random.default_rng(0)
  old = rng.standard_normal((10, 6)).astype(BF16)
  new = old.copy()
  new[[1, 4, 9], [0, 5, 2]] += BF16(1)
  whole = hf_delta.entries("w", new, old)
  delta = hf_delta.TensorDelta("w", new.shape, old.shape)
  for start in (0, 3, 6, 9):
    delta.add(start, new[start : start + 3], old[start : start + 3])
  got = delta.entries()
  assert sorted(got) == sorted(whole) == ["w::index", "w::value"]
  for key in whole:
    np.testing.assert_array_equal(
      got[key].view(np.uint16 if key.endswith("value") else np.int32),
      whole[key].view(np.uint16 if key.endswith("value") else np.int32),
    )
  # 3 entries of 4 + 2 bytes: past 12 bytes the tensor is read from the folder.
  bounded = hf_delta.TensorDelta("w", new.shape, old.shape, max_bytes=12)
  for start in (0, 5):
    bounded.add(start, new[start : start + 5], old[start : start + 5])
  assert list(bounded.entries()) == ["w::folder"]
  with pytest.raises(hf_delta.DeltaFormatError, match=r"the base holds \[11, 6\]"):
    hf_delta.TensorDelta("w", (10, 6), (11, 6))


def _files(folder: str) -> dict[str, bytes]:
  out = {}
  for parent, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(parent, name)
      with open(path, "rb") as f:
        out[os.path.relpath(path, folder)] = f.read()
  return out


def test_large_tensors_go_to_disk_in_runs_of_rows_and_write_the_same_folder(
  tmp_path, monkeypatch, devices
):
  """Past hf_export.ROW_RUN_BYTES a 2-D tensor (the embedding, a kernel) is sliced,
  cast, gathered and written a run of rows at a time, from FSDP-sharded
  parameters: the folder and its delta are the bytes of the whole-tensor
  write, and no run is larger than the bound."""
  del devices
  mesh = mesh_lib.make_mesh()
  first = sharded.create_sharded_model(config.preset("tiny"), mesh, seed=0, log_table=False)
  graphdef, state = nnx.split(first)
  moved = nnx.state(nudged(first, share=0.01))
  second = nnx.merge(
    graphdef, jax.tree.map(lambda a, b: jax.device_put(a, b.sharding), moved, state)
  )
  versions = ((1, first), (2, second))
  whole = [
    publish.write_checkpoint(m, str(tmp_path / "whole"), v, deltas=True) for v, m in versions
  ]

  pieces = []
  rows = hf_export.hf_tensor_rows

  def spy(*args, **kwargs):
    for name, start, x in rows(*args, **kwargs):
      pieces.append((name, start, x.ndim, x.nbytes))
      yield name, start, x

  monkeypatch.setattr(hf_export, "hf_tensor_rows", spy)
  monkeypatch.setattr(hf_export, "ROW_RUN_BYTES", 4096)
  runs = [publish.write_checkpoint(m, str(tmp_path / "runs"), v, deltas=True) for v, m in versions]
  for a, b in zip(whole, runs):
    folder = lambda path: {k: v for k, v in _files(path).items() if not k.startswith("delta")}
    assert folder(a) == folder(b)
  # The delta applies to v1 as the whole-tensor one does; a tensor whose
  # entries pass the bound is read from the folder instead.
  assert hf_delta.base_version(runs[1]) == "1"
  v1, v2 = hf_load.TensorIndex(runs[0]), hf_load.TensorIndex(runs[1])
  applied = dict(hf_delta.apply(runs[1], v1.read, v2.read))
  whole_applied = dict(hf_delta.apply(whole[1], v1.read, v2.read))
  assert set(applied) == set(whole_applied)
  for name in v2.where:
    got = applied.get(name, v1.read(name))
    np.testing.assert_array_equal(got.view(np.uint16), v2.read(name).view(np.uint16))
  with safe_open(os.path.join(runs[1], "delta", "model.safetensors"), "numpy") as f:
    marked = {k.partition("::")[0] for k in f.keys() if k.endswith("::folder")}  # noqa: SIM118
  assert "model.embed_tokens.weight" in marked  # its 1% changed pass 4096 bytes of entries
  split = {name for name, start, _, _ in pieces if start > 0}
  assert {"model.embed_tokens.weight", "lm_head.weight"} <= split
  assert any(
    name.endswith("mlp.down_proj.weight") for name in split
  )  # a kernel: HF rows = our columns
  assert all(n <= 4096 for name, _, _, n in pieces if name in split)
  # Past the bound only the patch embedding comes whole (its 5-D layout is no
  # slice of ours; 1.5 MB at 7B).
  assert {name for name, _, _, n in pieces if n > 4096} - split == {
    "visual.patch_embed.proj.weight"
  }


def test_runs_of_rows_put_together_are_the_whole_tensors(devices):
  """What a broadcast from several processes sends (`hf_export.whole_tensors` of
  runs of rows, here of at most 4 KiB from FSDP-sharded parameters): the
  whole-tensor export's bytes, in its order; `hf_row_count` counts the runs."""
  del devices
  model = sharded.create_sharded_model(
    config.preset("tiny"), mesh_lib.make_mesh(), seed=0, log_table=False
  )
  runs = list(hf_export.hf_tensor_rows(model, "bfloat16", run_bytes=4096))
  assert (
    len(runs)
    == hf_export.hf_row_count(model, "bfloat16", run_bytes=4096)
    > len(hf_load.hf_layout(model.cfg))
  )
  whole = list(hf_export.hf_tensors(model, "bfloat16"))
  put_together = list(hf_export.whole_tensors(iter(runs), model.cfg))
  assert len(put_together) == len(whole)
  for (name, want), got in zip(whole, put_together, strict=True):
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=name)


def test_a_folder_carries_its_changes_from_the_previous_version(tmp_path):
  root = str(tmp_path)
  first = random_model(1)
  second = nudged(first, share=0.01)
  v1 = publish.write_checkpoint(first, root, 1, deltas=True)
  v2 = publish.write_checkpoint(second, root, 2, deltas=True)
  assert not os.path.exists(os.path.join(v1, hf_delta.DELTA_DIR))  # nothing before v1
  assert hf_delta.base_version(v2) == "1"
  # The folder alone is the model (strict: the delta is not among its tensors).
  loaded = hf_load.load_hf_checkpoint(v2)
  for (_, a), (_, b) in zip(
    nnx.to_flat_state(nnx.state(loaded, nnx.Param)),
    nnx.to_flat_state(nnx.state(second, nnx.Param)),
  ):
    np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()).astype(BF16))
  # Applied to v1's tensors, the delta gives v2's, bit for bit.
  before, after = hf_load.TensorIndex(v1), hf_load.TensorIndex(v2)
  # The delta writer's positioned reads give the memory-mapped bytes.
  unmapped = hf_load.TensorIndex(v1, mapped=False)
  for name in before.where:
    np.testing.assert_array_equal(unmapped.read(name), before.read(name), err_msg=name)
    assert unmapped.read(name).dtype == before.read(name).dtype
  changed = dict(hf_delta.apply(v2, before.read, after.read))
  assert changed and set(changed) <= set(after.where)
  for name in after.where:
    want = after.read(name)
    got = changed.get(name, before.read(name))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=name)
  delta_bytes = sum(
    os.path.getsize(os.path.join(v2, hf_delta.DELTA_DIR, f))
    for f in os.listdir(os.path.join(v2, hf_delta.DELTA_DIR))
  )
  folder_bytes = sum(os.path.getsize(os.path.join(v2, f)) for f in os.listdir(v2) if "safe" in f)
  assert delta_bytes < folder_bytes / 10, (delta_bytes, folder_bytes)
  # Most elements changed: every tensor is marked to be read from the folder,
  # so the delta adds no copy of it.
  v3 = publish.write_checkpoint(nudged(second, share=0.6), root, 3, deltas=True)
  third = hf_load.TensorIndex(v3)
  changed = dict(hf_delta.apply(v3, after.read, third.read))
  assert set(changed) == set(third.where)
  for name in third.where:
    np.testing.assert_array_equal(changed[name].view(np.uint16), third.read(name).view(np.uint16))
  delta = os.path.join(v3, hf_delta.DELTA_DIR)
  assert sum(os.path.getsize(os.path.join(delta, f)) for f in os.listdir(delta)) < 100_000


def test_the_delta_builder_holds_a_tensor_s_entries_not_its_file_s(tmp_path):
  """A file's deltas go to disk a tensor at a time: a 48-layer tiny model with
  a quarter of every tensor changed has 11 MB of entries in its one file,
  yet the write's traced memory (numpy and Python) peaks below a third of
  that (2.4 MB: a tensor's work, 128 KB in bf16 at most, and the headers of
  the base and the new file, which grow with the tensor count); holding the
  file's entries would take all 11 MB. The delta applies bit for bit."""
  import dataclasses
  import tracemalloc

  tiny = config.preset("tiny")
  cfg = dataclasses.replace(tiny, text=dataclasses.replace(tiny.text, num_layers=48))
  graphdef, state = nnx.split(vlm.abstract_model(cfg))
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state)
  first = nnx.merge(graphdef, state)
  v1 = publish.write_checkpoint(first, str(tmp_path), 1)
  second = nudged(first, share=0.25)
  tracemalloc.start()
  try:
    v2 = publish.write_checkpoint(second, str(tmp_path), 2, deltas=True)
    peak = tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()
  entries = os.path.getsize(os.path.join(v2, hf_delta.DELTA_DIR, "model.safetensors"))
  assert entries > 10e6
  assert peak < entries / 3, (peak, entries)
  before, after = hf_load.TensorIndex(v1), hf_load.TensorIndex(v2)
  changed = dict(hf_delta.apply(v2, before.read, after.read))
  assert set(changed) == set(after.where)
  for name in after.where:
    np.testing.assert_array_equal(changed[name].view(np.uint16), after.read(name).view(np.uint16))


def test_an_unreadable_base_leaves_the_folder_without_a_delta(tmp_path):
  root = str(tmp_path)
  v1 = publish.write_checkpoint(random_model(1), root, 1)
  for f in os.listdir(v1):
    if f.endswith(".safetensors"):
      with open(os.path.join(v1, f), "r+b") as out:
        out.truncate(64)
  v2 = publish.write_checkpoint(random_model(2), root, 2, deltas=True)
  assert not os.path.exists(os.path.join(v2, hf_delta.DELTA_DIR))
  hf_load.load_hf_checkpoint(v2)


@pytest.fixture
def server(tmp_path):
  """A server serving v1 of a root whose v2 carries a delta from it."""
  root = str(tmp_path / "weights")
  first = random_model(1)
  v1 = publish.write_checkpoint(first, root, 1, dtype="bfloat16", deltas=True)
  v2 = publish.write_checkpoint(nudged(first, 0.01), root, 2, dtype="bfloat16", deltas=True)
  cmd = ["python", "-m", "fluxjax.rollout.server", "--model-path", v1]
  cmd += ["--weight-version", "1", "--num-slots", "2", "--context-length", "64"]
  logs = str(tmp_path / "logs")
  launched = launcher.launch_servers(cmd, 1, env=server_env(), timeout_s=120, log_dir=logs)
  yield launched.urls[0], v1, v2
  launched.stop()


def test_a_server_at_the_base_version_reads_the_delta_and_serves_the_folder(server):
  url, v1, v2 = server
  applied = lambda: http(url, "/get_server_info")[1]["weight_deltas_applied"]
  status, out = http(url, "/update_weights_from_disk", {"model_path": v2, "weight_version": "2"})
  assert status == 200 and out["success"], out
  assert applied() == 1
  by_delta = served(url)
  assert by_delta[0] == "2"
  # Back to v1 under another version name: v2's delta no longer applies,
  # so v2 is read from the folder.
  status, out = http(url, "/update_weights_from_disk", {"model_path": v1, "weight_version": "1b"})
  assert status == 200 and out["success"], out
  assert served(url)[2] != by_delta[2]
  status, out = http(url, "/update_weights_from_disk", {"model_path": v2, "weight_version": "2"})
  assert status == 200 and out["success"], out
  assert applied() == 1
  assert served(url) == by_delta  # same tokens, same logprobs


def test_a_damaged_delta_falls_back_to_the_folder(server):
  url, _, v2 = server
  delta = os.path.join(v2, hf_delta.DELTA_DIR)
  for f in os.listdir(delta):
    if f != hf_delta.MANIFEST:
      with open(os.path.join(delta, f), "r+b") as out:
        out.truncate(16)
  status, out = http(url, "/update_weights_from_disk", {"model_path": v2, "weight_version": "2"})
  assert status == 200 and out["success"], out
  assert http(url, "/get_server_info")[1]["weight_deltas_applied"] == 0
  assert served(url)[0] == "2"
