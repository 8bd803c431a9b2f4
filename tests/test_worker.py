"""The leader's op stream without processes: what a leading PolicyWorker sends and serve runs.

A recording channel stands in for the coordination service (the real one
runs between two processes in test_launch.py and test_multiprocess.py).
"""

import inspect
import types

import numpy as np
import pytest

from fluxjax.rl import worker as worker_lib


class _Channel:
  """Ops in a list: `send` appends (and logs), `recv` pops from the front."""

  def __init__(self, ops=(), log=None):
    self.ops = list(ops)
    self.log = [] if log is None else log
    self.forgotten = -1

  def send(self, name, *args):
    self.ops.append((name, args))
    self.log.append(("send", name))
    return len(self.ops) - 1

  def recv(self):
    return self.ops.pop(0)

  def forget_through(self, n):
    self.forgotten = n


class _Recorder:
  """Each method call logged as ("run", op), answering `answer`."""

  def __init__(self, log, **answers):
    self.log, self.answers = log, answers

  def __getattr__(self, name):
    op = {"train": "sft_train", "finish": "sft_finish"}.get(name, name)
    return lambda *args, **kwargs: self.log.append(("run", op)) or self.answers.get(name)


def _worker(log, backend="embedded"):
  """A PolicyWorker without a model: a recording trainer, checkpointer and warm-up."""
  worker = object.__new__(worker_lib.PolicyWorker)
  worker.settings = types.SimpleNamespace(rollout=types.SimpleNamespace(backend=backend))
  worker._channel, worker._last_sent = None, -1
  worker._trainer = _Recorder(log, apply={"loss": np.float32(0.5)})
  worker._trainer.state = types.SimpleNamespace(params={"w": np.zeros(2)})
  worker.ckpt, worker.rng = _Recorder(log, save=True), None
  worker._sft, worker._sft_ckpt = _Recorder(log, train={"sft/loss": 1.0}), None
  worker._patch_source, worker._read, worker._owns_media = _Recorder([]), [], False
  worker._publishing = None
  return worker


def test_a_leading_worker_sends_each_op_before_running_it():
  log = []
  channel, worker = _Channel(log=log), _worker(log, backend="sglang")
  worker.add(["a"])  # not leading yet: nothing is sent
  assert log == [("run", "add")]
  log.clear()
  worker.lead(channel)
  worker.restore(None)
  worker.sft_train(["s1"])
  worker.add(["a", "b"])
  assert worker.apply() == {"loss": np.float32(0.5)}
  assert worker.save(1, {"version": 1}, {"grain": {}}, force=True)
  assert worker.stage(7)["w"] is worker._trainer.state.params["w"]  # a fleet's: no copy
  worker.sft_finish()
  worker.announce_gathers(2)
  worker.stop()
  sent = ["restore", "sft_train", "add", "apply", "save", "publish_part", "sft_finish"]
  ran = [name for name in sent if name not in ("restore", "publish_part")]
  assert [name for kind, name in log if kind == "run"] == ran
  assert [name for kind, name in log if kind == "send"] == [*sent, "publish_gather", "stop"]
  # Each op is sent before it runs.
  assert all(log.index(("send", name)) < log.index(("run", name)) for name in ran)
  assert channel.ops[2] == ("add", (["a", "b"],))
  # Keyword and default arguments travel in the worker's positional order.
  assert channel.ops[4] == ("save", (1, {"version": 1}, {"grain": {}}, True))
  assert channel.ops[5] == ("publish_part", (7,))  # a fleet's followers publish their part
  assert channel.ops[6] == ("sft_finish", (False,))
  assert channel.ops[7] == ("publish_gather", (2,))
  # The update is a collective every follower joined: ops up to it are read.
  assert channel.forgotten == 3


def _placeholders(name):
  """A placeholder for each argument `PolicyWorker.<name>` requires."""
  params = list(inspect.signature(getattr(worker_lib.PolicyWorker, name)).parameters.values())
  return [f"<{p.name}>" for p in params[1:] if p.default is inspect.Parameter.empty]


# PolicyWorker's methods that are not ops: each process calls them itself, or
# (lead, stop, abort, announce_gathers) they are the leader's.
LOCAL = {"load_params", "should_save", "latest_step", "close"}
LOCAL |= {"lead", "stop", "abort", "announce_gathers"}


def test_the_op_table_is_every_op_the_leader_sends_and_serve_runs():
  """Every PolicyWorker method is an op or local; every op a leader can send
  is in the table (`stage` with a fleet sends `publish_part`; the leader's
  `announce_gathers`, `publish_gather`), and a follower runs each as its
  worker's method of that name, with the arguments sent."""
  methods = {
    name
    for name, fn in vars(worker_lib.PolicyWorker).items()
    if inspect.isfunction(fn) and not name.startswith("_")
  }
  assert set(worker_lib.OPS) == methods - LOCAL
  assert all(spec.name == name for name, spec in worker_lib.OPS.items())
  sent = []
  for backend in ("embedded", "sglang"):
    worker, channel = _worker([], backend), _Channel()
    worker.lead(channel)
    for name, spec in sorted(worker_lib.OPS.items()):
      args = [3] if name == "stage" else _placeholders(name)
      sent_name, sent_args = spec.message(worker, *args)
      channel.send(sent_name, *sent_args)
    worker.announce_gathers(1)
    follower = _Follower()
    assert worker_lib.serve(follower, _Channel([*channel.ops, ("stop", ())])) == len(channel.ops)
    assert follower.ran == channel.ops
    sent += [name for name, _ in channel.ops]
  assert set(sent) == set(worker_lib.OPS)


class _Follower:
  """Records the ops it runs, in order."""

  def __init__(self):
    self.ran = []

  def __getattr__(self, name):
    if name not in worker_lib.OPS:
      raise AttributeError(name)
    return lambda *args: self.ran.append((name, args))


def test_a_follower_runs_the_ops_in_order_until_stop():
  follower = _Follower()
  ops = [("add", (["s"],)), ("apply", ()), ("stage", ()), ("stop", ()), ("add", (["late"],))]
  assert worker_lib.serve(follower, _Channel(ops)) == 3
  assert follower.ran == [("add", (["s"],)), ("apply", ()), ("stage", ())]


def test_a_follower_stops_with_the_leaders_error_or_an_unknown_op():
  with pytest.raises(worker_lib.LeaderFailed, match="out of memory"):
    worker_lib.serve(_Follower(), _Channel([("abort", ("out of memory",))]))
  with pytest.raises(ValueError, match="unknown op 'close'"):
    worker_lib.serve(_Follower(), _Channel([("close", ())]))
