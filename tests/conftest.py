"""Test setup: a fake 8-device CPU mesh.

XLA reads these flags once, when the backend starts, so they must be set before
anything imports jax (pytest loads conftest.py first).
"""

import os
import pathlib
import subprocess
import tempfile

# LLVM's -O1 for XLA:CPU, and no MLIR fusion emitters: compiling is most of
# the suite's time, and both compile faster at no cost in run time
# (docs/testing.md, the fake 8-device mesh, has the figures).
# Subprocesses the tests start inherit both.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false"
  + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# XLA:CPU sizes its Eigen pool to max(CPUs, devices), i.e. 8 threads for the
# 8 fake devices on a 2-core machine. A program with two independent
# collectives can then leave the last device's part without a thread while
# the others wait in the rendezvous (XLA aborts after 40 s). tsl reads NPROC
# as the CPU count: more threads than devices leave room.
os.environ.setdefault("NPROC", "24")
# Parity tests compare fp32 numbers; keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# No executable reuse across tests (persistent cache): with it, XLA:CPU's
# multi-device ExecuteLaunch can crash while the rollout engine's thread and
# the trainer dispatch at once (docs/testing.md).
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
# glibc's malloc hands XLA:CPU's large temporaries back to the kernel and
# maps them anew each step; one arena that keeps them spares millions of page
# faults (docs/testing.md, allocator settings). glibc reads these at process
# start: they reach the xdist workers and every subprocess, not this process.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 30))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(4 << 30))
os.environ.setdefault("MALLOC_ARENA_MAX", "1")

import hypothesis
import jax
import pytest


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected the fake 8-device mesh, got {devs}"
  return devs


@pytest.fixture(scope="session")
def mesh_for(devices):
  """strategy -> the fake 8-device mesh with the strategy's sequence axes
  (`mesh.make_mesh`'s default data and fsdp), one per set of axes."""
  from fluxjax.sharding import mesh as mesh_lib  # pylint: disable=import-outside-toplevel

  del devices  # asserts the fake mesh
  meshes = {}

  def get(strategy):
    axes = tuple(strategy.sp_axes())
    if axes not in meshes:
      meshes[axes] = mesh_lib.make_mesh(sp_axes=axes)
    return meshes[axes]

  return get


@pytest.fixture(scope="session")
def tiny_model():
  """The tiny preset at seed 0, unsharded, built once per test process.

  Shared: a test that changes weights works on its own copy
  (`vlm.create_model` with another seed, or `nnx.clone`).
  """
  from fluxjax.models import config, vlm  # pylint: disable=import-outside-toplevel

  return vlm.create_model(config.preset("tiny"), seed=0)


# --- nothing written into the repository tree ----------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Written by Python and pip themselves, not by tests.
_BUILD_OUTPUTS = ("__pycache__/", ".egg-info/")

# Hypothesis keeps examples and caches under ./.hypothesis unless told otherwise;
# this folder goes when the session's interpreter exits.
_HYPOTHESIS_HOME = tempfile.TemporaryDirectory(prefix="fluxjax-hypothesis-")
hypothesis.configuration.set_hypothesis_home_dir(_HYPOTHESIS_HOME.name)
hypothesis.settings.register_profile("fluxjax", database=None)
hypothesis.settings.load_profile("fluxjax")


def _untracked() -> set[str] | None:
  """Untracked and ignored paths of the checkout, or None outside a git checkout."""
  try:
    out = subprocess.run(
      ["git", "status", "--porcelain", "--ignored", "--untracked-files=all"],
      cwd=ROOT,
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  except (OSError, subprocess.CalledProcessError):
    return None
  paths = {line[3:] for line in out.splitlines() if line[:2] in ("??", "!!")}
  return {p for p in paths if not any(part in p for part in _BUILD_OUTPUTS)}


def _is_xdist_worker(session) -> bool:
  """Under pytest-xdist the controller checks the tree around all workers."""
  return hasattr(session.config, "workerinput")


def pytest_sessionstart(session):
  if not _is_xdist_worker(session):
    session.config.stash[_TREE] = _untracked()


def pytest_sessionfinish(session, exitstatus):
  if _is_xdist_worker(session):
    return
  before = session.config.stash.get(_TREE, None)
  after = _untracked()
  if before is None or after is None:
    return
  new = sorted(after - before)
  if new:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
      reporter.write_line(f"tests wrote into the repository tree: {new[:10]}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


_TREE = pytest.StashKey[set[str] | None]()


# --- the two workers end together ------------------------------------------------------

# xdist hands each worker a whole module at a time, in collection order
# (`--no-loadscope-reorder` in pyproject.toml; its default orders modules by
# test count). The modules that take the longest go first, by their worker
# time in a full run, so the last module a worker takes is a short one
# (docs/testing.md has the times).
_LONGEST_FIRST = (
  "test_fleet_multiprocess.py",
  "test_multiprocess.py",
  "test_grpo_learning.py",
  "test_strategies.py",
  "test_stream_trainer.py",
  "test_fleet_sync.py",
  "test_notebook.py",
  "test_smoke.py",
  "test_faults.py",
  "test_strategy_swap.py",
  "test_preemption.py",
  "test_rollout_engine.py",
  "test_sft.py",
  "test_mesh_rules.py",
  "test_launch.py",
  "test_weight_deltas.py",
)


def pytest_collection_modifyitems(config, items):
  rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
