"""Reward registry on crafted strings; the async RewardScheduler's timeouts and recovery.

The scheduler's workers are spawned processes: the reward functions below are
module-level so that they unpickle there (this module imports nothing heavy,
keeping worker start-up fast).
"""

import logging
import math
import multiprocessing
import os
import signal
import time

import pytest

from fluxjax.rl import reward_fns, reward_pool

# --- reward functions run inside the workers -------------------------------


def sleep_then_correct(response, answer):
  """Sleeps `response` seconds, then answers correctly (reward 1)."""
  time.sleep(float(response))
  return 1.0


def sleep_then_wrong(response, answer):
  time.sleep(float(response))
  return 0.0


def hang(response, answer):
  time.sleep(60)
  return 1.0


def crash(response, answer):
  raise RuntimeError("reward bug")


def die(response, answer):
  os._exit(3)  # a segfaulting sandbox, as far as the parent can tell


def not_a_number(response, answer):
  return float(response)  # "nan", "inf", "-inf"


def not_a_float(response, answer):
  return None


# --- the registry ------------------------------------------------------------


@pytest.mark.parametrize(
  "response,want",
  [
    ("<answer>7</answer>", "7"),
    ("<think>3 + 4</think><answer> 7 </answer>", "7"),
    ("<answer>5</answer> on reflection <answer>7</answer>", "7"),  # the last tag wins
    ("The answer is 7.", "7."),
    ("Answer: red", "red"),
    ("7", "7"),
  ],
)
def test_extract_answer(response, want):
  assert reward_fns.extract_answer(response) == want


@pytest.mark.parametrize(
  "response,answer,want",
  [
    ("<answer>red</answer>", "red", 1.0),
    ("<answer>Red.</answer>", "red", 1.0),  # case and punctuation ignored
    ("The answer is blue.", "blue", 1.0),
    ("Answer: circle", "circle", 1.0),
    ("It is green", "green", 1.0),  # a bare answer's last word
    ("<answer>red</answer>", "blue", 0.0),
    ("Answer: 12", "13", 0.0),
  ],
)
def test_exact(response, answer, want):
  assert reward_fns.get("exact")(response, answer) == want


@pytest.mark.parametrize(
  "response,answer,want",
  [
    ("<answer>42</answer>", "42", 1.0),
    ("<answer>42.0</answer>", "42", 1.0),
    ("The answer is 1,000.", "1000", 1.0),
    ("Answer: -3", "-3", 1.0),
    ("3 * 4 = 12", "12", 1.0),  # bare: the last number
    ("<answer>41</answer>", "42", 0.0),
    ("<answer>forty-two</answer>", "42", 0.0),
    ("<answer>0.1000001</answer>", "0.1", 1.0),  # |diff| 1e-7 <= 1e-6 + 1e-6 * 0.1
    ("<answer>0.10001</answer>", "0.1", 0.0),  # |diff| 1e-5 > 1.1e-6
  ],
)
def test_numeric(response, answer, want):
  assert reward_fns.get("numeric")(response, answer) == want


def test_numeric_tolerance_override():
  assert reward_fns.numeric_answer("<answer>10.4</answer>", "10", abs_tol=0.5) == 1.0
  assert reward_fns.numeric_answer("<answer>10.6</answer>", "10", abs_tol=0.5) == 0.0


@pytest.mark.parametrize(
  "response,want",
  [
    ("<answer>7</answer>", 1.0),
    ("<think>I look at the image carefully.</think><answer>3</answer>", 1.0),
    ("<think>I watch the video frame by frame.</think> <answer>red</answer>\n", 1.0),
    ("The answer is 7.", 0.0),  # not the asked-for tags
    ("<answer></answer>", 0.0),  # empty answer
    ("<answer>7</answer> and more text", 0.0),  # trailing text
    ("<think>a</think><think>b</think><answer>7</answer>", 0.0),
  ],
)
def test_format(response, want):
  assert reward_fns.get("format")(response, "7") == want


def test_accuracy_dispatch_and_combined():
  assert reward_fns.get("accuracy")("<answer>12.0</answer>", "12") == 1.0  # numeric reference
  assert reward_fns.get("accuracy")("<answer>yellow</answer>", "yellow") == 1.0
  combined = reward_fns.get("accuracy_with_format")
  assert combined("<answer>12</answer>", "12") == pytest.approx(1.0)  # 0.9 + 0.1
  assert combined("The answer is 12.", "12") == pytest.approx(0.9)  # 0.9 + 0
  assert combined("<answer>11</answer>", "12") == pytest.approx(0.1)  # 0 + 0.1
  with pytest.raises(KeyError):
    reward_fns.get("no-such-reward")


def test_controls_reverse_or_remove_the_signal():
  reversed_ = reward_fns.get("accuracy_reversed")
  assert reversed_("<answer>12</answer>", "12") == 0.0
  assert reversed_("<answer>11</answer>", "12") == 1.0
  const = reward_fns.get("constant")
  assert const("<answer>12</answer>", "12") == const("junk", "12") == 0.0


def test_random_reward_is_a_fair_coin_blind_to_correctness():
  coin = reward_fns.get("random")
  right = [coin("<answer>12</answer>", "12") for _ in range(2000)]
  wrong = [coin("<answer>11</answer>", "12") for _ in range(2000)]
  assert set(right) | set(wrong) == {0.0, 1.0}
  # Binomial(2000, 0.5): standard deviation 0.011 of the mean; 0.05 is 4.5 sigma.
  assert abs(sum(right) / 2000 - 0.5) < 0.05 and abs(sum(wrong) / 2000 - 0.5) < 0.05


# --- the scheduler -----------------------------------------------------------


def _reward_children():
  return [p for p in multiprocessing.active_children() if p.name == "fluxjax-reward"]


@pytest.fixture
def make_scheduler():
  made = []

  def make(**kw):
    kw.setdefault("num_workers", 2)
    made.append(reward_pool.RewardScheduler(**kw))
    return made[-1]

  yield make
  for s in made:
    s.shutdown()
  assert not _reward_children(), "reward workers leaked"


def test_results_arrive_asynchronously(make_scheduler):
  rs = make_scheduler(fn="accuracy", t_min=0.5, t_max=5.0)
  slow = rs.submit("0.5", "1", fn=sleep_then_correct, tag="slow")
  fast = [rs.submit(f"<answer>{i}</answer>", "3", tag=i) for i in range(5)]
  results = rs.gather(fast, timeout=10)
  # The fast ones complete while the slow one is still running.
  assert not slow.done()
  assert [r.reward for r in results] == [0, 0, 0, 1, 0]
  assert [r.tag for r in results] == list(range(5)) and all(r.status == "ok" for r in results)
  assert slow.result(timeout=10).reward == 1.0
  polled = rs.poll()
  assert sorted(str(r.tag) for r in polled) == sorted(["slow", *map(str, range(5))])
  assert rs.poll() == []
  m = rs.metrics()
  assert (m["reward/submitted"], m["reward/completed"], m["reward/ok"]) == (6, 6, 6)
  assert m["reward/correct"] == 2


def test_hang_is_cut_at_the_timeout_and_pool_recovers(make_scheduler):
  rs = make_scheduler(t_min=0.2, t_max=1.0)
  start = time.monotonic()
  # No correct call yet, so T = t_max = 1 s.
  result = rs.submit("", "", fn=hang).result(timeout=20)
  waited = time.monotonic() - start
  assert (result.reward, result.status, result.timeout) == (0.0, "timeout", 1.0)
  assert 1.0 <= waited < 5.0
  m = rs.metrics()
  assert m["reward/timeout"] == 1 and m["reward/worker_restarts"] == 1
  # Both workers (one of them the replacement) keep serving.
  again = rs.gather([rs.submit("<answer>4</answer>", "4") for _ in range(4)], timeout=20)
  assert all(r.status == "ok" and r.reward == pytest.approx(1.0) for r in again)


def test_crash_gives_zero_and_counted_error(make_scheduler):
  rs = make_scheduler(t_min=0.2, t_max=5.0)
  raised = rs.submit("", "", fn=crash).result(timeout=20)
  assert (raised.reward, raised.status) == (0.0, "error")
  assert "reward bug" in raised.error
  died = rs.submit("", "", fn=die).result(timeout=20)
  assert (died.reward, died.status) == (0.0, "error")
  assert "worker died" in died.error
  m = rs.metrics()
  assert m["reward/error"] == 2 and m["reward/worker_restarts"] == 1  # raising keeps the worker
  assert rs.submit("<answer>red</answer>", "red").result(timeout=20).status == "ok"


def test_a_reward_that_is_not_a_finite_number_is_a_counted_logged_error(make_scheduler, caplog):
  caplog.set_level(logging.WARNING, logger="fluxjax.rl.reward_pool")
  rs = make_scheduler(t_min=0.2, t_max=5.0)
  bad = [
    rs.submit(text, "", fn=not_a_number, key=f"sample-{text}") for text in ("nan", "inf", "-inf")
  ]
  bad.append(rs.submit("", "", fn=not_a_float, key="sample-none"))
  bad.append(rs.submit("", "", fn=crash, key="sample-crash"))
  results = rs.gather(bad, timeout=20)
  assert [(r.reward, r.status) for r in results] == [(0.0, "error")] * 5
  assert [r.error.strip().splitlines()[-1] for r in results[:3]] == [
    f"ValueError: reward not_a_number returned a non-finite value {v}"
    for v in ("nan", "inf", "-inf")
  ]
  assert "TypeError" in results[3].error
  m = rs.metrics()
  assert m["reward/error"] == 5 and m["reward/ok"] == 0 and m["reward/worker_restarts"] == 0
  logged = [r.getMessage() for r in caplog.records if r.name == "fluxjax.rl.reward_pool"]
  for key, why in [
    ("sample-nan", "non-finite value nan"),
    ("sample-inf", "non-finite value inf"),
    ("sample-none", "TypeError"),
    ("sample-crash", "RuntimeError: reward bug"),
  ]:
    assert any(f"'{key}'" in msg and why in msg for msg in logged), (key, logged)
  # The pool keeps serving.
  assert rs.submit("<answer>red</answer>", "red").result(timeout=20).status == "ok"


def test_adaptive_timeout(make_scheduler):
  """T = min(max(t_min, 1.5 x the slowest correct call), t_max) per key. Every
  sleep keeps a margin that holds at 3x slowdown of the machine: the
  thresholds follow the measured times, never the nominal sleeps."""
  rs = make_scheduler(t_min=0.2, t_max=6.0, anchor_factor=1.5)
  # Before any correct call: T = t_max.
  assert rs.timeout_for("a") == 6.0
  a, b = rs.gather(
    [
      rs.submit("0.6", "", fn=sleep_then_correct, key="a"),
      rs.submit("4.2", "", fn=sleep_then_correct, key="b"),
    ],
    timeout=60,
  )
  c = rs.submit("0", "", fn=sleep_then_correct, key="c").result(timeout=60)
  assert (a.timeout, b.timeout, c.timeout) == (6.0, 6.0, 6.0)
  assert a.status == b.status == "ok"
  # key a: anchor ~0.6 s -> T = 1.5 x the measured time (between the bounds).
  t_a = rs.timeout_for("a")
  assert t_a == pytest.approx(1.5 * a.elapsed) and 0.9 <= t_a < 6.0
  # key b: 1.5 x 4.2 = 6.3 -> clamped to t_max.
  assert rs.timeout_for("b") == 6.0
  # key c: 1.5 x ~0 -> clamped to t_min.
  assert rs.timeout_for("c") == 0.2
  # A faster correct call and a slow wrong one leave the anchor where it is ...
  quick, wrong = rs.gather(
    [
      rs.submit("0.01", "", fn=sleep_then_correct, key="a"),
      rs.submit(f"{0.5 * t_a:.3f}", "", fn=sleep_then_wrong, key="a"),
    ],
    timeout=60,
  )
  assert quick.timeout == t_a and wrong.status == "ok" and rs.timeout_for("a") == t_a
  # ... a call slower than T is cut at T with reward 0, while a slower correct
  # call within T (0.8 T: 0.27 x 1.5 of headroom) raises the anchor.
  cut, slower = rs.gather(
    [
      rs.submit(f"{3 * t_a:.3f}", "", fn=sleep_then_correct, key="a"),
      rs.submit(f"{0.8 * t_a:.3f}", "", fn=sleep_then_correct, key="a"),
    ],
    timeout=60,
  )
  assert (cut.status, cut.reward, cut.timeout) == ("timeout", 0.0, t_a)
  assert slower.status == "ok" and slower.timeout == t_a
  assert rs.timeout_for("a") == pytest.approx(min(1.5 * slower.elapsed, 6.0))
  assert rs.timeout_for("a") > t_a
  assert rs.metrics()["reward/timeout"] == 1


def test_production_defaults_and_shutdown():
  from fluxjax import config_args

  cfg = config_args.load_config(arg="tiny").rl.reward
  assert (cfg.t_min, cfg.t_max, cfg.anchor_factor) == (2.0, 30.0, 1.5)
  cfg.num_workers = 1
  with reward_pool.RewardScheduler.from_config(cfg) as rs:
    assert rs.timeout_for() == 30.0
    assert rs.submit("<answer>7</answer>", "7").result(timeout=20).reward == pytest.approx(1.0)
    assert rs.timeout_for() == 2.0  # 1.5 * (microseconds) -> t_min
    pending = rs.submit("", "", fn=hang)
  # Shutting down resolves what was still running and kills the workers.
  assert pending.result(timeout=1).status == "cancelled"
  assert not _reward_children()
  with pytest.raises(RuntimeError):
    rs.submit("x", "x")
  assert math.isnan(reward_pool.RewardResult(0, "ok", 0, math.nan).timeout)


def test_a_group_wide_stop_signal_leaves_the_workers_to_their_parent(make_scheduler):
  """SIGTERM and SIGINT sent to the process group (a preemption, a Ctrl-C) do not
  kill the reward workers: no call fails and nothing is restarted."""
  rs = make_scheduler(num_workers=1)
  assert rs.submit("<answer>4</answer>", "4").result(timeout=20).status == "ok"  # ready
  (child,) = _reward_children()
  for sig in (signal.SIGTERM, signal.SIGINT):
    os.kill(child.pid, sig)
  after = rs.gather([rs.submit("<answer>4</answer>", "4") for _ in range(3)], timeout=20)
  assert all(r.status == "ok" for r in after) and child.is_alive()
  assert rs.metrics()["reward/worker_restarts"] == 0
