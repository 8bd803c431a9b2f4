"""The typed seams between the RL side and its parts, checked cheaply.

the rollout backend protocol (both backends implement it; the loop thread
    that holds one open);
the per-layout step cache both trainers use (one compile per layout);
no attribute probing or forwarding in rl/ and rollout/, and no caller
    outside the coordinator assigning its attributes.
"""

import ast
import asyncio
import pathlib
import threading

import numpy as np
import pytest

from fluxjax.models import inputs
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import layout_steps
from fluxjax.rollout import backend as backend_lib
from fluxjax.rollout import fleet as fleet_lib
from helpers import TINY as CFG
from helpers import make_strategy

ROOT = pathlib.Path(__file__).resolve().parents[1]


# --- the rollout backend protocol -----------------------------------------------------


def test_both_backends_implement_the_protocol():
  from fluxjax.rollout import embedded  # JAX model code; instances: test_rollout_engine.py

  assert issubclass(embedded.EmbeddedRollout, backend_lib.RolloutBackend)
  fleet = fleet_lib.Fleet(["http://127.0.0.1:1"], weights_root="/tmp/w")
  assert isinstance(fleet, backend_lib.RolloutBackend)
  assert isinstance(fleet, backend_lib.Sampler)
  assert fleet.slot_stats() is None
  assert fleet.metrics() == {"fleet/retries": 0.0, "fleet/servers_down": 0.0, "fleet/servers": 1.0}
  assert fleet.weights_root == "/tmp/w"


def test_a_backend_without_slot_stats_is_not_one():
  """The protocol has teeth: a sampler missing a method does not pass."""

  class GenerateOnly:
    async def generate(self, request, group=None):
      raise NotImplementedError

    async def abort(self, rid):
      pass

  assert not isinstance(GenerateOnly(), backend_lib.Sampler)
  assert not isinstance(GenerateOnly(), backend_lib.RolloutBackend)


class _RecordingBackend:
  """Records on which thread its lifetime calls ran."""

  def __init__(self, fail_close=False):
    self.calls: list[tuple[str, str]] = []
    self.fail_close = fail_close

  async def start(self):
    self.calls.append(("start", threading.current_thread().name))

  async def close(self):
    self.calls.append(("close", threading.current_thread().name))
    if self.fail_close:
      raise ConnectionError("session already gone")

  async def __aenter__(self):
    await self.start()
    return self

  async def __aexit__(self, *exc):
    await self.close()

  async def generate(self, request, group=None):
    raise NotImplementedError

  async def abort(self, rid):
    pass

  async def publish(self, model, version):
    raise NotImplementedError

  def metrics(self):
    return {}

  def slot_stats(self):
    return None


def test_loop_thread_holds_a_backend_open_on_its_loop():
  backend = _RecordingBackend()
  assert isinstance(backend, backend_lib.RolloutBackend)
  with backend_lib.LoopThread("rollout-test") as thread:
    with thread.running(backend) as running:
      assert running is backend and backend.calls == [("start", "rollout-test")]
      assert thread.call(asyncio.sleep(0, result=7)) == 7
    assert backend.calls[-1] == ("close", "rollout-test")
    # Closed when the block fails too; a failing close is logged, not raised
    # over the block's own error.
    failing = _RecordingBackend(fail_close=True)
    with pytest.raises(KeyError), thread.running(failing):
      raise KeyError("the run failed")
    assert [c for c, _ in failing.calls] == ["start", "close"]
  assert not thread.alive


# --- one compiled step per layout -----------------------------------------------------


def _seqs(lengths, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for n in lengths:
    seq = inputs.sequence_from_tokens(rng.integers(0, 400, n).tolist(), [], CFG)
    ones = np.ones(n, np.float32)
    out.append(
      batch_lib.TrainSequence(
        inputs=seq, loss_mask_T=ones, advantages_T=ones, old_logprobs_T=np.zeros(n, np.float32)
      )
    )
  return out


def test_layout_steps_compile_once_per_layout(devices, mesh_for):
  del devices
  strategy = make_strategy("packed_dp", capacity=128)
  mesh = mesh_for(strategy)
  compiled = []

  def compile_step(plan, batch):
    compiled.append(layout_steps.layout_key(plan))
    return object()  # stands for a jitted step

  steps = layout_steps.LayoutSteps(CFG, mesh, strategy, compile_step, patch_buckets=(128,))
  small = [_seqs([20, 30, 25]), _seqs([31, 18], seed=1)]  # one microbatch of 8 rows
  large = _seqs([120] * 12, seed=2)  # more rows than devices
  first = steps.place(small[0])
  again = steps.place(small[1])
  other = steps.place(large)
  assert layout_steps.layout_key(first.plan) == layout_steps.layout_key(again.plan)
  assert layout_steps.layout_key(first.plan) != layout_steps.layout_key(other.plan)
  assert again.step is first.step and other.step is not first.step
  assert len(compiled) == steps.num_layouts == 2
  # The batch is placed on the mesh, one row per device.
  assert first.batch.targets.sharding.mesh == mesh
  assert first.host.targets.shape[1] == mesh.size
  plan, host = steps.prepare(small[0])
  assert layout_steps.layout_key(plan) == compiled[0] and host.targets.shape[1] == mesh.size


# --- no probing, no outside assignment ------------------------------------------------


def _sources(*folders):
  for folder in folders:
    yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_attribute_probes_or_forwarding_in_rl_and_rollout():
  found = []
  for path in _sources("fluxjax/rl", "fluxjax/rollout"):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
      ):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno} hasattr")
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in (
        "__getattr__",
        "__getattribute__",
      ):
        found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
  assert not found, found


def _assigned_attributes(node: ast.AST):
  targets = []
  if isinstance(node, ast.Assign):
    targets = node.targets
  elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
    targets = [node.target]
  stack = list(targets)
  while stack:
    t = stack.pop()
    if isinstance(t, (ast.Tuple, ast.List)):
      stack.extend(t.elts)
    elif isinstance(t, ast.Attribute):
      yield t


def _base_name(node: ast.AST) -> str | None:
  while isinstance(node, ast.Attribute):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def test_nothing_outside_the_coordinator_assigns_its_attributes():
  found = []
  for path in _sources("fluxjax", "tests", "bench"):
    if path == ROOT / "fluxjax" / "rl" / "coordinator.py":
      continue
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      for target in _assigned_attributes(node):
        if _base_name(target) in ("coord", "coordinator"):
          found.append(f"{path.relative_to(ROOT)}:{target.lineno}")
  assert not found, found
