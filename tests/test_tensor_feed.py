"""TensorFeed: tensors gathered on one thread (announced first, as a trainer
spanning processes announces its gathers to the others) and taken by a
broadcast on another, at most `capacity` waiting between them."""

import threading
import time

import numpy as np
import pytest

from fluxjax.rollout import tensor_feed


class _Gathers:
  """`count` tensors whose gathers are logged with what was announced and
  what waited for the broadcast when each ran."""

  def __init__(self, count: int):
    self.count, self.announced, self.feed = count, 0, None
    self.log: list[tuple[int, int, int]] = []  # (index, announced, waiting)

  def announce(self, n: int) -> None:
    assert n > 0
    self.announced += n

  def __iter__(self):
    for i in range(self.count):
      self.log.append((i, self.announced, self.feed.waiting if self.feed else 0))
      yield np.full((3,), i, np.int32)


def _take(feed, out, delay=0.0):
  for x in feed:
    out.append(int(x[0]))
    time.sleep(delay)


@pytest.mark.parametrize("capacity", [1, 3])
def test_every_tensor_arrives_in_order_announced_first_and_bounded(capacity):
  gathers, out = _Gathers(20), []
  feed = gathers.feed = tensor_feed.TensorFeed(iter(gathers), gathers.count, capacity)
  taker = threading.Thread(target=_take, args=(feed, out, 0.002))
  taker.start()
  for _ in range(30):  # the step's waiting loop
    feed.pump(gathers.announce)
    time.sleep(0.001)
  feed.finish(gathers.announce)
  taker.join(10)
  assert out == list(range(20)) and feed.remaining == 0
  assert gathers.announced == 20
  for i, announced, waiting in gathers.log:
    assert announced > i  # the others were told before this gather ran
    assert waiting < capacity  # at most `capacity` waiting, this one included


def test_pump_never_waits_for_the_broadcast():
  """Nothing taken: a pump fills the room there is, and the next finds none."""
  gathers = _Gathers(5)
  feed = tensor_feed.TensorFeed(iter(gathers), gathers.count, capacity=2)
  assert feed.pump(gathers.announce) == 2
  assert feed.pump(gathers.announce) == 0  # nothing taken: no room
  assert feed.remaining == 3 and gathers.announced == 2


def test_a_broadcast_that_stops_taking_leaves_finish_to_gather_and_drop_the_rest():
  """A failed broadcast closes the feed: every gather still runs (the other
  processes run theirs), none waits for room."""
  gathers, out = _Gathers(10), []
  feed = tensor_feed.TensorFeed(iter(gathers), gathers.count)
  feed.pump(gathers.announce)
  out.append(int(next(feed)[0]))
  feed.close()
  done = threading.Event()
  threading.Thread(target=lambda: (feed.finish(gathers.announce), done.set())).start()
  assert done.wait(5), "finish waited for a broadcast that takes no more"
  assert out == [0] and len(gathers.log) == 10 and gathers.announced == 10


def test_an_abandoned_feed_ends_the_broadcast_without_gathering():
  gathers = _Gathers(10)
  feed = tensor_feed.TensorFeed(iter(gathers), gathers.count)
  errors: list[BaseException] = []

  def take():
    try:
      list(feed)
    except tensor_feed.Abandoned as e:
      errors.append(e)

  taker = threading.Thread(target=take)
  taker.start()
  feed.pump(gathers.announce)
  feed.abandon()
  taker.join(5)
  assert not taker.is_alive() and errors
  assert len(gathers.log) == 1 and feed.remaining == 0


def test_take_runs_the_announced_gathers_and_after_last_follows_the_last():
  """Another process's side: `take(n)` as the announcements arrive; what it
  runs after the last gather runs once, on the gathering thread, before
  `take` returns."""
  gathers, out, finished = _Gathers(7), [], []
  feed = gathers.feed = tensor_feed.TensorFeed(
    iter(gathers), gathers.count, 2, after_last=lambda: finished.append(len(gathers.log))
  )
  taker = threading.Thread(target=_take, args=(feed, out, 0.001))
  taker.start()
  feed.take(3)
  assert not finished and feed.remaining == 4
  with pytest.raises(ValueError, match="5 gathers asked for, 4 left"):
    feed.take(5)
  feed.take(4)
  taker.join(5)
  assert finished == [7] and out == list(range(7))
  assert all(waiting < 2 for _, _, waiting in gathers.log)


def test_an_unconsumed_feed_drops_each_item_once_gathered():
  gathers = _Gathers(5)
  feed = tensor_feed.TensorFeed(iter(gathers), gathers.count, consumed=False)
  feed.take(5)  # nothing takes them: no wait for room
  assert len(gathers.log) == 5 and feed.waiting == 0
