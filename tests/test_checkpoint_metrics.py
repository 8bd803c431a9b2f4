"""Checkpoint round trips (sharded state, RNG, JSON state), metrics and plots."""

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fluxjax import plot
from fluxjax.models import config as config_lib
from fluxjax.models import sharded
from fluxjax.parallel import train_step
from fluxjax.rl import checkpoint, metrics
from fluxjax.sharding import mesh as mesh_lib
from helpers import adamw_config

OPT = adamw_config()


def _state(mesh, seed):
  model = sharded.create_sharded_model(config_lib.preset("tiny"), mesh, seed=seed, log_table=False)
  tx = train_step.make_optimizer(OPT)
  return train_step.create_train_state(model, tx, mesh)


def test_periodic_saves_every_k_steps_or_none(tmp_path):
  every_3 = checkpoint.Checkpointer(str(tmp_path / "a"), save_every=3)
  assert [k for k in range(1, 10) if every_3.should_save(k)] == [3, 6, 9]
  # 0: no periodic save (the loop still saves the last step).
  assert not any(
    checkpoint.Checkpointer(str(tmp_path / "b"), save_every=0).should_save(k) for k in range(10)
  )
  with pytest.raises(ValueError, match=r"checkpoint\.every must be >= 0"):
    checkpoint.Checkpointer(str(tmp_path / "c"), save_every=-1)


def test_checkpoint_round_trip_reshards(tmp_path, devices, caplog):
  mesh = mesh_lib.make_mesh(sp_axes=(("sp", 2),))
  _, state, _ = _state(mesh, seed=0)
  # Make the optimizer state non-trivial so the round trip means something.
  state = dataclasses_replace_step(state, 7)
  rng = jax.random.key(123)
  ckpt = checkpoint.Checkpointer(str(tmp_path), save_every=1)
  coord = {"long_queue": [3, 9], "version": 7}
  data = {"iter": {"next_index": 42}}
  with caplog.at_level(logging.WARNING):
    assert ckpt.save(7, state, rng, coord, data)
    ckpt.wait()
  # A save logs no warning (a run saves often, and its log is read for faults).
  assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert ckpt.latest_step() == 7
  # Restore onto a different mesh layout: the target's shardings win.
  other = mesh_lib.make_mesh(sp_axes=(("sp", 4),))
  _, fresh, _ = _state(other, seed=1)
  step, restored, rng2, coord2, data2 = checkpoint.Checkpointer(str(tmp_path)).restore(
    checkpoint.abstract_like(fresh)
  )
  assert step == 7 and coord2 == coord and data2 == data
  assert jnp.array_equal(jax.random.key_data(rng2), jax.random.key_data(rng))
  for a, b, f in zip(jax.tree.leaves(restored), jax.tree.leaves(state), jax.tree.leaves(fresh)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding == f.sharding
  # A step it does not keep: the error lists those it does.
  with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 5 .*keeps steps 7$"):
    checkpoint.Checkpointer(str(tmp_path)).restore(checkpoint.abstract_like(fresh), 5)
  ckpt.close()


def dataclasses_replace_step(state, step):
  import dataclasses

  return dataclasses.replace(state, step=jnp.asarray(step, jnp.int32))


def test_key_data_written_as_an_orbax_array_item_restores(tmp_path):
  """A checkpoint whose PRNG key data is an Orbax array item (`ArraySave`)
  resumes with that key."""
  key, state = jax.random.key(5), {"w": np.arange(4, dtype=np.float32)}
  manager = ocp.CheckpointManager(str(tmp_path / "checkpoints"), item_names=checkpoint.ITEMS)
  manager.save(
    3,
    args=ocp.args.Composite(
      state=ocp.args.StandardSave(state),
      rng=ocp.args.ArraySave(np.asarray(jax.random.key_data(key))),
      coordinator=ocp.args.JsonSave({"version": 3}),
      data=ocp.args.JsonSave({}),
    ),
  )
  manager.wait_until_finished()
  manager.close()
  step, restored, rng, coordinator, _ = checkpoint.Checkpointer(str(tmp_path)).restore(
    checkpoint.abstract_like(state)
  )
  assert step == 3 and coordinator == {"version": 3}
  np.testing.assert_array_equal(restored["w"], state["w"])
  np.testing.assert_array_equal(jax.random.key_data(rng), jax.random.key_data(key))


def test_no_checkpoint_is_a_clear_error(tmp_path):
  with pytest.raises(FileNotFoundError, match="no checkpoint"):
    checkpoint.Checkpointer(str(tmp_path)).restore({})


def test_metrics_jsonl_resume_dedup_and_plots(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    for step in range(1, 6):
      w.write(
        step,
        {
          "rollout/reward_mean": step / 10,
          "eval/accuracy": step / 20,
          "perf/tokens_per_s": 100.0 + step,
          "train/loss": float("nan"),
        },
      )
  # A resumed run redoes step 5 and goes on: the later record wins.
  with metrics.MetricWriter(str(tmp_path)) as w:
    w.write(5, {"rollout/reward_mean": 0.9})
    w.write(6, {"rollout/reward_mean": 1.0})
  recs = metrics.read_metrics(str(tmp_path))
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
  assert recs[4]["rollout/reward_mean"] == 0.9 and recs[0]["train/loss"] == "nan"
  assert os.path.isdir(tmp_path / "tb") and os.listdir(tmp_path / "tb")
  written = plot.plot(str(tmp_path))
  names = sorted(os.path.basename(p) for p in written)
  assert names == ["accuracy.png", "reward.png", "summary.png", "throughput.png"]
  for p in written:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  line = metrics.Progress(10).line(3, {"rollout/reward_mean": 0.5, "eval/accuracy": 0.25})
  assert "step 3/10" in line and "reward 0.5" in line and "ETA" in line


def test_accuracy_plots_carry_the_interval_greedy_pass_at_k_and_difficulties(tmp_path):
  with metrics.MetricWriter(str(tmp_path)) as w:
    for step in (-10, 0, 5, 10):
      w.write(
        step,
        {
          "eval/accuracy": 0.3 + step / 100,
          "eval/accuracy_ci95": 0.05,
          "eval/accuracy_greedy": 0.35 + step / 100,
          "eval/pass@4": 0.6,
          "eval/accuracy/easy": 0.5,
          "eval/accuracy/hard": 0.1,
        },
      )
  records = metrics.read_metrics(str(tmp_path))
  panels = {p.name: p for p in plot.PANELS}
  accuracy = plot._curves(records, panels["accuracy"])
  assert [c[0] for c in accuracy] == ["eval/accuracy", "eval/accuracy_greedy", "eval/pass@4"]
  assert accuracy[0][3] == [0.05] * 4 and accuracy[1][3] is None  # the band, main curve only
  by_level = plot._curves(records, panels["accuracy_by_difficulty"])
  assert [c[0] for c in by_level] == ["eval/accuracy/easy", "eval/accuracy/hard"]
  names = sorted(os.path.basename(p) for p in plot.plot(str(tmp_path)))
  assert names == ["accuracy.png", "accuracy_by_difficulty.png", "summary.png"]


def test_plot_overlays_runs_with_health_panels_and_has_help(tmp_path, capsys):
  for name, lr in (("a", 1e-4), ("b", 3e-4)):
    with metrics.MetricWriter(str(tmp_path / name)) as w:
      for step in range(1, 4):
        w.write(step, {"train/loss": 0.1 * step, "train/entropy": 1.0 / step, "optim/lr": lr})
  runs = [str(tmp_path / "a"), str(tmp_path / "b")]
  records = [metrics.read_metrics(r) for r in runs]
  panels = {p.name: p for p in plot.PANELS}
  assert [c[0] for c in plot._curves(records[0], panels["lr"])] == ["optim/lr"]
  plot.main([*runs, "--out", str(tmp_path / "cmp")])
  names = sorted(os.path.basename(p) for p in capsys.readouterr().out.split())
  assert names == ["entropy.png", "loss.png", "lr.png", "summary.png"]
  with pytest.raises(SystemExit) as done:
    plot.main(["--help"])
  assert done.value.code == 0 and "RUN [RUN ...]" in capsys.readouterr().out
  with pytest.raises(SystemExit, match=r"no metrics\.jsonl"):
    plot.main([str(tmp_path)])
