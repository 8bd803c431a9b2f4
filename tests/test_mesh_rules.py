"""Mesh from config, the logical-axis rules, the parameter table, and CLI switching."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config as config_lib
from fluxjax.models import sharded, vlm
from fluxjax.sharding import axes, rules
from fluxjax.sharding import mesh as mesh_lib
from helpers import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_mesh_shape_resolution_and_errors(devices):
  assert mesh_lib.mesh_shape(8, 1, -1, (("sp", 4),)) == {"data": 1, "fsdp": 2, "sp": 4}
  assert mesh_lib.mesh_shape(8, 2, -1, (("sp", 1),)) == {"data": 2, "fsdp": 4, "sp": 1}
  with pytest.raises(ValueError, match="do not divide"):
    mesh_lib.mesh_shape(8, 1, -1, (("sp", 3),))
  with pytest.raises(ValueError, match="at most one"):
    mesh_lib.mesh_shape(8, -1, -1, (("sp", 1),))
  with pytest.raises(ValueError, match="!= 8 devices"):
    mesh_lib.mesh_shape(8, 1, 2, (("sp", 2),))
  mesh = mesh_lib.make_mesh(data=2, sp_axes=(("sp", 2),))
  assert mesh.axis_names == ("data", "fsdp", "sp")
  assert mesh_lib.param_axes(mesh) == ("fsdp", "sp")
  assert mesh_lib.batch_axes(mesh) == ("data", "fsdp", "sp")


def test_rules_shard_every_large_7b_parameter(devices):
  """On 8 devices every 7B parameter over 1 MiB is sharded, each 8 ways."""
  mesh = mesh_lib.make_mesh(sp_axes=(("sp", 2),))
  state = nnx.state(vlm.abstract_model(config_lib.preset("7b")), nnx.Param)
  table = rules.parameter_table(state, rules.state_shardings(state, rules.fsdp_rules(mesh), mesh))
  rules.check_sharded(table, 1 << 20)
  large = [r for r in table if r["bytes"] > 1 << 20]
  assert large and all(r["bytes_per_device"] * 8 == r["bytes"] for r in large)
  assert "total per device" in rules.format_table(table)


def test_replicated_large_parameter_is_refused(devices):
  mesh = mesh_lib.make_mesh(sp_axes=(("sp", 1),))
  state = nnx.state(vlm.abstract_model(config_lib.preset("7b")), nnx.Param)
  only_vision = [(axes.VIS_EMBED, ("fsdp", "sp"))]  # text weights get no rule
  table = rules.parameter_table(state, rules.state_shardings(state, only_vision, mesh))
  with pytest.raises(ValueError, match=r"would be replicated on every device: .*model\."):
    rules.check_sharded(table, 1 << 20)


def test_checkpoint_layout_gets_the_same_check(devices):
  """A checkpoint load (model_shardings) is refused like a random init would be."""
  mesh = mesh_lib.make_mesh(sp_axes=(("sp", 1),))
  cfg = config_lib.preset("7b")
  layout = sharded.model_shardings(cfg, mesh, log_table=False)
  assert len(layout) == len(nnx.to_flat_state(nnx.state(vlm.abstract_model(cfg))))
  only_vision = [(axes.VIS_EMBED, ("fsdp", "sp"))]
  with pytest.raises(ValueError, match="would be replicated on every device"):
    sharded.model_shardings(cfg, mesh, only_vision, log_table=False)


def test_partition_spec_skips_indivisible_dims(devices):
  mesh = mesh_lib.make_mesh(sp_axes=(("sp", 1),))
  r = rules.fsdp_rules(mesh)
  # 12 does not divide by 8: fall through to the next eligible axis.
  spec = rules.partition_spec((axes.EMBED, axes.MLP), (12, 16), r, mesh)
  assert spec == jax.sharding.PartitionSpec(None, "fsdp")
  assert rules.partition_spec((axes.EMBED,), (12,), r, mesh) == jax.sharding.PartitionSpec(None)


def test_sharded_init_places_shards_without_a_whole_copy(devices, tiny_model):
  mesh = mesh_lib.make_mesh(sp_axes=(("sp", 2),))
  model = sharded.create_sharded_model(config_lib.preset("tiny"), mesh, seed=0, log_table=False)
  reference = tiny_model
  want = dict(nnx.to_flat_state(nnx.state(reference, nnx.Param)))
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    value = var.get_value()
    # Same random init; jitted and eager sampling may differ in the last ulp.
    np.testing.assert_allclose(
      np.asarray(value), np.asarray(want[key].get_value()), rtol=1e-6, atol=1e-9
    )
    if value.size >= 1024:
      assert not value.sharding.is_fully_replicated, key
      assert all(s.data.size * 8 == value.size for s in value.addressable_shards), key


def test_sharded_init_compiles_once_for_every_seed(devices):
  mesh = mesh_lib.make_mesh()
  cfg = config_lib.preset("tiny")
  a = sharded.create_sharded_model(cfg, mesh, seed=3, log_table=False)
  b = sharded.create_sharded_model(cfg, mesh, seed=4, log_table=False)
  init = sharded.sharded_init(cfg, rules.fsdp_rules(mesh), mesh)
  assert init._cache_size() == 1  # one program, the seed is its argument
  embed_a, embed_b = (np.asarray(m.model.embed_tokens[...]) for m in (a, b))
  assert not np.allclose(embed_a, embed_b)


def _train(*overrides):
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices=8), JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-m", "fluxjax.train", "--config=configs/vlm.py:tiny", *overrides],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def test_cli_switches_strategy_by_config(tmp_path):
  # total_steps=0: build everything (data, sharded model, engine), evaluate, stop.
  out = _train(
    "--config.sharding.strategy=ulysses",
    "--config.sharding.sp=4",
    "--config.total_steps=0",
    "--config.data.synth_train=4",
    "--config.data.synth_eval=2",
    "--config.eval.prompts=2",
    f"--workdir={tmp_path}",
  )
  assert "strategy ulysses (sp=4) on mesh {'data': 1, 'fsdp': 2, 'sp': 4}" in out.stderr
  assert "total per device" in out.stderr  # the parameter table's total was logged
  assert out.returncode == 0, out.stderr[-3000:]
  assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "config.json").exists()
  # The whole table goes to the run's log file only.
  assert "MiB/device" in (tmp_path / "train.log").read_text()
  assert "MiB/device" not in out.stderr
  bad = _train("--config.sharding.strategy=ring", f"--workdir={tmp_path / 'bad'}")
  assert bad.returncode == 1
  assert "bad configuration: unknown sharding.strategy 'ring'" in bad.stderr
  assert not (tmp_path / "bad").exists()  # refused before anything is written
  odd = _train(
    "--config.sharding.strategy=ulysses", "--config.sharding.sp=16", f"--workdir={tmp_path / 'odd'}"
  )
  assert "does not divide the 8 query heads" in odd.stderr


class _Device:
  """What `data_axis` reads of a device: its process and its memory limit."""

  def __init__(self, process_index: int, limit: int | None):
    self.process_index, self._limit = process_index, limit

  def memory_stats(self):
    return None if self._limit is None else {"bytes_limit": self._limit}


def _hosts(hosts: int, per_host: int, limit: int | None) -> list[_Device]:
  return [_Device(h, limit) for h in range(hosts) for _ in range(per_host)]


@pytest.mark.parametrize(
  "devices,params,want",
  [
    (_hosts(1, 8, 80 << 30), 8.3e9, 1),  # one host: nothing to choose
    (_hosts(2, 8, 80 << 30), 8.3e9, 2),  # 7B: 16.6 GB of state per device fits
    (_hosts(16, 8, 80 << 30), 8.3e9, 16),
    (_hosts(2, 8, 80 << 30), 33.5e9, 1),  # 32B: 67 GB per device does not
    (_hosts(2, 8, None), 8.3e9, 1),  # CPUs report no limit
  ],
)
def test_auto_data_axis_is_a_replica_per_host_when_the_state_fits(devices, params, want):
  assert mesh_lib.data_axis(mesh_lib.AUTO, int(params), remat=True, devices=devices) == want
  assert mesh_lib.data_axis(4, int(params), remat=True, devices=devices) == 4  # given: kept


def test_a_hybrid_mesh_moves_fewer_bytes_between_hosts():
  for hosts in (2, 4, 16):
    hybrid = mesh_lib.inter_host_bytes(10**9, hosts, hybrid=True, remat=False)
    fsdp = mesh_lib.inter_host_bytes(10**9, hosts, hybrid=False, remat=False)
    assert hybrid == pytest.approx(2 / 3 * fsdp)
    assert mesh_lib.inter_host_bytes(10**9, hosts, hybrid=False, remat=True) > fsdp
  assert mesh_lib.inter_host_bytes(10**9, 1, hybrid=False, remat=True) == 0


def test_unresolved_auto_data_names_its_resolver(devices):
  with pytest.raises(ValueError, match=r"resolved by loop\.validate"):
    mesh_lib.make_mesh(mesh_lib.AUTO, -1, devices=devices)
