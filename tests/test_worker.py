"""The leader's op stream without processes: what LeaderWorker sends and serve runs.

A recording channel stands in for the coordination service (the real one
runs between two processes in test_launch.py and test_multiprocess.py).
"""

import pytest

from fluxjax.rl import worker as worker_lib


class _Channel:
  """Ops in a list: `send` appends, `recv` pops from the front."""

  def __init__(self, ops=()):
    self.ops = list(ops)
    self.forgotten = -1

  def send(self, name, *args):
    self.ops.append((name, args))
    return len(self.ops) - 1

  def recv(self):
    return self.ops.pop(0)

  def forget_through(self, n):
    self.forgotten = n


class _Worker:
  """Records the ops it runs, in order."""

  def __init__(self):
    self.ran = []

  def __getattr__(self, name):
    if name not in worker_lib.OPS:
      raise AttributeError(name)
    return lambda *args: self.ran.append((name, args)) or {"op": name}


def test_the_leader_sends_each_op_before_running_it():
  channel, inner = _Channel(), _Worker()
  leader = worker_lib.LeaderWorker(inner, channel)
  leader.restore(None)
  leader.sft_begin(patch_source=object())  # the leader's own pixels are not sent
  leader.sft_train(["s1"])
  leader.add(("a", "b"))
  assert leader.apply() == {"op": "apply"}
  leader.save(1, {"version": 1}, {"grain": {}}, False)
  leader.stop()
  names = [name for name, _ in channel.ops]
  assert names == ["restore", "sft_begin", "sft_train", "add", "apply", "save", "stop"]
  assert channel.ops[1] == ("sft_begin", ())
  assert channel.ops[3] == ("add", (["a", "b"],))  # a list: what a follower unpickles
  assert [name for name, _ in inner.ran] == names[:-1]
  # The update is a collective every follower joined: ops up to it are read.
  assert channel.forgotten == 4


def test_a_follower_runs_the_ops_in_order_until_stop():
  inner = _Worker()
  ops = [("add", (["s"],)), ("apply", ()), ("stage", ()), ("stop", ()), ("add", (["late"],))]
  assert worker_lib.serve(inner, _Channel(ops)) == 3
  assert inner.ran == [("add", (["s"],)), ("apply", ()), ("stage", ())]


def test_a_follower_stops_with_the_leaders_error_or_an_unknown_op():
  with pytest.raises(worker_lib.LeaderFailed, match="out of memory"):
    worker_lib.serve(_Worker(), _Channel([("abort", ("out of memory",))]))
  with pytest.raises(ValueError, match="unknown op 'close'"):
    worker_lib.serve(_Worker(), _Channel([("close", ())]))
