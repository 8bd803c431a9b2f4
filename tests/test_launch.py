"""fluxjax.launch and the jax.distributed set-up: cluster detection, each
process's environment and flags, supervision of real processes, and one real
2-process jax.distributed run through the launcher's command line."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import launch_child
import ml_collections
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from fluxjax import launch
from fluxjax.models import config, hf_delta, hf_export, hf_load, sharded
from fluxjax.sharding import mesh as mesh_lib
from helpers import process_alive, run_launcher

TESTS = pathlib.Path(__file__).resolve().parent
ROOT = TESTS.parent
PID_LINE = re.compile(r"^fluxjax\.launch: process (\d+) pid (\d+)$", re.MULTILINE)
WORKER_LINE = re.compile(r"^launch_child: worker pid (\d+)$", re.MULTILINE)


def _distributed(**fields) -> ml_collections.ConfigDict:
  cfg = {
    "coordinator_address": "",
    "num_processes": -1,
    "process_id": -1,
    "local_device_ids": "",
    "auto": True,
  }
  return ml_collections.ConfigDict({**cfg, **fields})


# --- detection ---------------------------------------------------------------------


@pytest.mark.parametrize(
  "environ, job",
  [
    ({}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "n1"}, None),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2"}, None),  # the batch script, not an srun step
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),
    ({"TPU_WORKER_HOSTNAMES": "t0"}, None),
    ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, "tpu"),
    ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "FLUXJAX_DISTRIBUTED": "1"}, "FLUXJAX_DISTRIBUTED"),
  ],
)
def test_cluster_job_counts_only_multi_process_jobs(environ, job):
  assert mesh_lib.cluster_job(environ) == job


def test_distributed_arguments():
  slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]"}
  detect = {
    "coordinator_address": None,
    "num_processes": None,
    "process_id": None,
    "local_device_ids": None,
  }
  assert mesh_lib.distributed_arguments(None, slurm) is None
  assert mesh_lib.distributed_arguments(_distributed(), {}) is None
  assert mesh_lib.distributed_arguments(_distributed(), {"KUBERNETES_SERVICE_HOST": "x"}) is None
  assert mesh_lib.distributed_arguments(_distributed(), slurm) == detect
  assert mesh_lib.distributed_arguments(_distributed(auto=False), slurm) is None
  # JAX reads JAX_COORDINATOR_ADDRESS itself; it alone makes the run multi-process.
  assert mesh_lib.distributed_arguments(
    _distributed(auto=False), {"JAX_COORDINATOR_ADDRESS": "h:1"}
  )
  explicit = _distributed(
    coordinator_address="h:1234", num_processes=4, process_id=3, local_device_ids="6,7"
  )
  assert mesh_lib.distributed_arguments(explicit, {}) == {
    "coordinator_address": "h:1234",
    "num_processes": 4,
    "process_id": 3,
    "local_device_ids": [6, 7],
  }


def test_a_single_process_run_leaves_jax_distributed_alone():
  mesh_lib.maybe_initialize_distributed(_distributed(), {"KUBERNETES_SERVICE_HOST": "x"})
  assert not jax.distributed.is_initialized()


# --- each process's environment and command line ----------------------------------


def test_child_env_replaces_the_cpu_device_count():
  environ = {
    "XLA_FLAGS": "--xla_foo=1 --xla_force_host_platform_device_count=8 --xla_bar",
    "JAX_NUM_CPU_DEVICES": "8",
    "KEEP": "me",
  }
  env = launch.child_env(environ, process_id=1, cpu_devices=2, gpus_per_process=0)
  assert env["XLA_FLAGS"] == "--xla_foo=1 --xla_bar --xla_force_host_platform_device_count=2"
  assert env["JAX_PLATFORMS"] == "cpu"
  assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
  assert env["NPROC"] == "24" and env["KEEP"] == "me"
  assert "JAX_NUM_CPU_DEVICES" not in env
  assert "JAX_LOCAL_DEVICE_IDS" not in env
  assert launch.child_env({"NPROC": "4"}, 0, 2, 0)["NPROC"] == "4"


def test_child_env_leaves_the_platform_alone_by_default():
  environ = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "CUDA_VISIBLE_DEVICES": "4"}
  assert launch.child_env(environ, 1, cpu_devices=0, gpus_per_process=0) == environ


def test_child_env_gives_each_process_its_gpus():
  environ = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5"}
  ids = [launch.child_env(environ, i, 0, 3)["JAX_LOCAL_DEVICE_IDS"] for i in range(2)]
  assert ids == ["0,1,2", "3,4,5"]
  assert launch.child_env(environ, 1, 0, 3)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5"


def test_child_args():
  assert launch.child_args("fluxjax.train", ["--config=c.py", "--workdir=w"], "h:9", 2, 1) == [
    sys.executable,
    "-m",
    "fluxjax.train",
    "--config=c.py",
    "--workdir=w",
    "--config.distributed.coordinator_address=h:9",
    "--config.distributed.num_processes=2",
    "--config.distributed.process_id=1",
  ]


def test_the_launcher_owns_the_distributed_flags(capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(["--processes=2", "--", "--config.distributed.process_id=0"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert "--config.distributed.process_id=0" in err and "the launcher sets" in err


@pytest.mark.parametrize(
  "argv",
  [
    [],
    ["--processes=0"],
    ["--processes=2", "--cpu_devices=-1"],
    ["--processes=1", "--num_nodes=2"],  # no coordinator address
    ["--processes=1", "--num_nodes=2", "--node_rank=2", "--coordinator_address=h:1"],
    ["--processes=1", "--coordinator_address=h:1", "--port=5"],
    ["--processes=1", "--num_nodes=2", "--coordinator_address=h"],  # no port
  ],
)
def test_bad_options_exit_2(argv, capsys):
  with pytest.raises(SystemExit) as exit_info:
    launch.main(argv)
  assert exit_info.value.code == 2
  assert "usage:" in capsys.readouterr().err


def test_exit_status():
  assert launch.exit_status(0) == 0
  assert launch.exit_status(3) == 3
  assert launch.exit_status(-signal.SIGKILL) == 137
  assert launch.exit_status(-signal.SIGTERM) == 143


# --- supervision of real processes --------------------------------------------------


def _gone_soon(pid: int, timeout_s: float = 5.0) -> bool:
  deadline = time.monotonic() + timeout_s
  while process_alive(pid):
    if time.monotonic() > deadline:
      return False
    time.sleep(0.05)
  return True


def _pids(stderr: str) -> dict[int, int]:
  return {int(i): int(pid) for i, pid in PID_LINE.findall(stderr)}


@pytest.fixture
def child_module(monkeypatch):
  """Lets `--module launch_child` resolve in the launched processes."""
  path = os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")])
  monkeypatch.setenv("PYTHONPATH", path.rstrip(os.pathsep))


def _launch(actions: list[str], grace_s: float = 5.0) -> tuple[int, float]:
  start = time.monotonic()
  rc = launch.main(
    [f"--processes={len(actions)}", f"--grace_s={grace_s}", "--module=launch_child", "--"] + actions
  )
  return rc, time.monotonic() - start


def test_all_processes_succeed(child_module, capfd):
  rc, _ = _launch(["ok", "ok", "ok"])
  assert rc == 0
  assert sorted(_pids(capfd.readouterr().err)) == [0, 1, 2]


def test_a_failure_stops_the_others_and_gives_its_code(child_module, capfd):
  rc, seconds = _launch(["sleep", "exit:3"])
  err = capfd.readouterr().err
  assert rc == 3
  assert seconds < 20, seconds  # not the sleeper's 60 s
  assert "process 1 (pid" in err and "exited with code 3; stopping the other 1 process" in err
  assert not process_alive(_pids(err)[0])


def test_a_process_killed_by_a_signal_gives_128_plus_the_signal(child_module, capfd):
  rc, seconds = _launch(["sleep", "sigkill"])
  err = capfd.readouterr().err
  assert rc == 137
  assert seconds < 20, seconds
  assert "was killed by SIGKILL (9)" in err
  assert not process_alive(_pids(err)[0])


def test_a_failed_process_leaves_no_workers_behind(child_module, capfd):
  rc, _ = _launch(["sleep", "orphan:5"])
  err = capfd.readouterr().err
  assert rc == 5
  worker = int(WORKER_LINE.search(err).group(1))
  assert _gone_soon(worker), f"the failed process's worker {worker} still runs"
  assert not process_alive(_pids(err)[0])


def _read_until(stream, pattern: re.Pattern, count: int, timeout_s: float) -> str:
  """Lines of `stream` until `pattern` has matched `count` times."""
  text = ""
  deadline = time.monotonic() + timeout_s
  while len(pattern.findall(text)) < count:
    assert time.monotonic() < deadline, text
    line = stream.readline()
    assert line, text  # the launcher ended early
    text += line
  return text


@contextlib.contextmanager
def _launcher(actions: list[str]):
  """`python -m fluxjax.launch` of launch_child with `actions`, its stderr piped."""
  launcher = subprocess.Popen(
    [sys.executable, "-m", "fluxjax.launch", f"--processes={len(actions)}"]
    + ["--module=launch_child", "--", *actions],
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    yield launcher
  finally:
    launcher.kill()
    launcher.wait()
    launcher.stderr.close()


def test_sigterm_to_the_launcher_stops_every_process(child_module):
  with _launcher(["sleep", "sleep"]) as launcher:
    pids = _pids(_read_until(launcher.stderr, PID_LINE, 2, timeout_s=30))
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    assert not any(process_alive(pid) for pid in pids.values())


def test_sigterm_reaches_the_processes_before_their_workers(child_module):
  """A preempted process finishes its step with the workers it started (its
  rollout servers) still up, then stops them; nothing is left after."""
  with _launcher(["preempt", "sleep"]) as launcher:
    text = _read_until(launcher.stderr, PID_LINE, 2, timeout_s=30)
    if not WORKER_LINE.search(text):  # the child may print it before the launcher's lines
      text += _read_until(launcher.stderr, WORKER_LINE, 1, timeout_s=30)
    pids, worker = _pids(text), int(WORKER_LINE.search(text).group(1))
    launcher.send_signal(signal.SIGTERM)
    assert launcher.wait(timeout=30) == 128 + signal.SIGTERM
    assert "worker up through the step: True" in launcher.stderr.read()
    assert not any(process_alive(pid) for pid in [*pids.values(), worker])


# --- a real jax.distributed run ----------------------------------------------------


def test_two_processes_run_one_jax_distributed_program(child_module):
  """2 processes x 2 CPU devices: one global 4-device mesh. conftest.py's 8-device
  XLA_FLAGS reach the launcher; --cpu_devices=2 must win over them."""
  out = run_launcher(
    [sys.executable, "-m", "fluxjax.launch", "--processes=2", "--cpu_devices=2"]
    + ["--module=launch_child", "--", "jax", "jax"],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    timeout=180,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  lines = out.stdout.splitlines()
  assert f"sum={float(sum(range(16)))}" in lines, out.stdout
  assert "hybrid=0;1" in lines, out.stdout  # mesh.data = hosts: a replica per process
  # The leader's op channel (40 chunks for the big op) and the gather to the leader.
  assert "ops=small:2,big:1" in lines, out.stdout
  assert "gathered=" + ",".join(map(str, range(16))) in lines, out.stdout
  # Process 1's 8 float32s of x and 16 of w, sent to process 0 alone.
  assert "received=96" in lines, out.stdout
  assert sorted(_pids(out.stderr)) == [0, 1]


def test_two_nodes_of_one_process_each_run_one_jax_distributed_program(child_module):
  """torchrun's convention: a launcher per node, --num_nodes, --node_rank and
  node 0's --coordinator_address; node 1's process is process 1 of 2."""
  address = f"127.0.0.1:{launch.free_port()}"
  nodes = [
    subprocess.Popen(
      [sys.executable, "-m", "fluxjax.launch", "--processes=1", "--cpu_devices=2"]
      + ["--num_nodes=2", f"--node_rank={rank}", f"--coordinator_address={address}"]
      + ["--module=launch_child", "--", "jax", "jax"],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for rank in (1, 0)
  ]
  try:
    outs = [node.communicate(timeout=180) for node in nodes]
  finally:
    for node in nodes:
      if node.poll() is None:
        node.send_signal(signal.SIGTERM)
        node.communicate(timeout=60)
  assert [node.returncode for node in nodes] == [0, 0], [err[-2000:] for _, err in outs]
  lines = "".join(out for out, _ in outs).splitlines()
  assert f"sum={float(sum(range(16)))}" in lines, lines
  assert "gathered=" + ",".join(map(str, range(16))) in lines, lines
  assert [sorted(_pids(err)) for _, err in outs] == [[1], [0]]


def _changed(model):
  """launch_child's v5: one element of every parameter moved by 1."""
  state = jax.tree.map(lambda x: x.at[(0,) * x.ndim].add(1.0), nnx.state(model))
  return nnx.merge(nnx.graphdef(model), state)


def test_two_processes_publish_a_sharded_model_each_writing_its_own_files(child_module, tmp_path):
  """A fleet publish from a model sharded over 2 processes x 2 devices: no
  process gathers it whole. Each writes its run of the folder's files
  (launch_child `publish`, tensors past 4 KiB in runs of rows), and the
  deltas of its files; one process's full
  disk fails the whole version and leaves nothing behind, also deferred (the
  gathers fed from process 0's main thread to a writer thread on each); the
  distributed transport's gathers, runs of rows too, bring process 0 every
  bf16 tensor whole."""
  root = tmp_path / "weights"
  out = run_launcher(
    [sys.executable, "-m", "fluxjax.launch", "--processes=2", "--cpu_devices=2"]
    + ["--module=launch_child", "--", f"publish:{root}", f"publish:{root}"],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  # The same parameters on this session's 8 devices (the seeded init does not
  # depend on the layout).
  mesh = mesh_lib.make_mesh(1, -1)
  model = sharded.create_sharded_model(config.preset("tiny"), mesh, seed=0, log_table=False)
  plan = hf_export.write_plan(model.cfg, "bfloat16", 4 << 30, writers=2)
  assert {f.writer for f in plan} == {0, 1}  # each process has files to write
  assert sorted(os.listdir(root)) == ["v3", "v5"]  # v4, v6 refused whole, no temporary folder
  written = sorted(f for f in os.listdir(root / "v3") if f.endswith(".safetensors"))
  assert written == sorted(f.name for f in plan)
  # v5's delta from v3: a file per file of the folder (each process its own),
  # and applied to v3 it gives v5 bit for bit.
  assert hf_delta.base_version(str(root / "v5")) == "3"
  deltas = sorted(os.listdir(root / "v5" / hf_delta.DELTA_DIR))
  assert deltas == sorted([hf_delta.MANIFEST, *written])
  v3, v5 = hf_load.TensorIndex(str(root / "v3")), hf_load.TensorIndex(str(root / "v5"))
  changed = dict(hf_delta.apply(str(root / "v5"), v3.read, v5.read))
  assert changed
  for name in v5.where:
    got = changed.get(name, v3.read(name))
    np.testing.assert_array_equal(got.view(np.uint16), v5.read(name).view(np.uint16))
  loaded = nnx.to_flat_state(nnx.state(hf_load.load_hf_checkpoint(str(root / "v3")), nnx.Param))
  expected = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  for key, var in loaded:
    want = np.asarray(jax.device_get(expected[key].get_value())).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(var.get_value()), want.astype(np.float32))
  lines = out.stdout.splitlines()
  refused = [line for line in lines if line.startswith("refused=")]
  assert len(refused) == 2, lines
  assert all("processes [1] could not write their files" in r for r in refused), lines
  assert f"deferred={root / 'v5'}" in lines, lines
  # The deferred v5 holds the changed model's bf16 values.
  for name, tensor in hf_export.hf_tensors(_changed(model), "bfloat16"):
    np.testing.assert_array_equal(v5.read(name).view(np.uint16), tensor.view(np.uint16))
  digests = [line for line in lines if "digest=" in line]
  assert digests == [f"digest={launch_child.bf16_digest(model)}"], digests
  _assert_each_gathered_its_own(model, plan, lines)


def _assert_each_gathered_its_own(model, plan, lines: list[str]) -> None:
  """What each process's gathers brought it (launch_child prints it): for
  v3, the bytes of its own files, each gather at most a run of 4 KiB or a
  tensor not cut into runs; for the broadcast, the model to process 0 and
  nothing to process 1."""
  writer = {name: f.writer for f in plan for name in f.tensors}
  items = list(hf_export.hf_tensor_rows(model, "bfloat16", run_bytes=4096))
  counts = dict(line.split("=") for line in lines if line.startswith(("written", "broadcast")))
  for k in (0, 1):
    mine = [rows.nbytes for name, _, rows in items if writer[name] == k]
    assert counts[f"written{k}"] == f"{sum(mine)},{max(mine)}", (k, counts)
  total = sum(n for _, n in hf_export.tensor_bytes(model.cfg, "bfloat16"))
  assert counts["broadcast0"] == f"{total},{max(r.nbytes for _, _, r in items)}", counts
  assert counts["broadcast1"] == "0,0", counts
