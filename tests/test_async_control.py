"""Adaptive async: staleness metric, PID bounds/convergence/anti-windup, admission."""

import json

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from fluxjax.rl import async_control as ac


def test_version_tags_and_gap():
  tags = ac.tag_tokens(3, 5)
  tags = ac.tag_tokens(2, 7, tags)  # resumed after a weight update
  assert tags.tolist() == [5, 5, 5, 7, 7]
  assert ac.version_gap(tags, 8) == {"mean": pytest.approx(2.2), "max": 3.0}
  assert ac.version_gap(tags, 8, mask_T=[0, 0, 0, 1, 1])["max"] == 1.0
  assert ac.parse_version("12") == 12 and ac.parse_version("default") == 0


def test_staleness_zero_on_policy_and_grows_with_drift():
  rng = np.random.default_rng(0)
  b = -rng.uniform(0.5, 3.0, 1000)
  fresh = ac.staleness(b, b, np.full(1000, 4), 4)
  assert fresh["staleness"] == 0.0 and fresh["kl"] == 0.0 and fresh["iw_var"] == 0.0
  prev = 0.0
  for drift, gap in ((0.05, 1), (0.2, 2), (0.5, 4)):
    s = ac.staleness(b, b + rng.normal(0, drift, 1000), np.full(1000, 4 - gap), 4)
    assert s["kl"] > 0 and s["iw_var"] > 0 and 0 < s["staleness"] < 1
    assert s["staleness"] > prev
    prev = s["staleness"]
  # k3 matches the exact KL of a known pair: behaviour N(0,1) vs current N(mu,1).
  x = rng.normal(0, 1, 200_000)
  mu = 0.3
  est = ac.staleness(-(x**2) / 2, -((x - mu) ** 2) / 2, np.zeros_like(x), 0)["kl"]
  assert est == pytest.approx(mu**2 / 2, rel=0.05)
  # Masked and non-finite tokens are ignored.
  s = ac.staleness([-1.0, np.nan, -1.0], [-1.0, -1.0, -9.0], [0, 0, 0], 0, mask_T=[1, 1, 0])
  assert s["staleness"] == 0.0


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
  meas=st.lists(st.floats(-10, 10) | st.sampled_from([np.nan, np.inf, -np.inf]), max_size=60),
  lo=st.integers(0, 3),
  span=st.integers(0, 6),
  target=st.floats(0, 1),
  kp=st.floats(0, 10),
  ki=st.floats(0, 5),
  kd=st.floats(0, 5),
)
def test_pid_output_stays_in_bounds(meas, lo, span, target, kp, ki, kd):
  pid = ac.PIDController(target, lo, lo + span, kp=kp, ki=ki, kd=kd)
  for m in meas:
    out = pid.update(m)
    assert lo <= out <= lo + span
  assert np.isfinite(pid.integral)


def simulate(pid, gain, steps, tau=3.0, noise=0.0, seed=0):
  """First-order staleness process: s relaxes toward gain * lag with time constant tau."""
  rng = np.random.default_rng(seed)
  s, trace = 0.0, []
  for _ in range(steps):
    lag = pid.update(s + noise * rng.normal())
    s += (gain * lag - s) / tau
    trace.append((s, lag))
  return np.array(trace)


@pytest.mark.parametrize("gain,target", [(0.05, 0.15), (0.1, 0.3), (0.04, 0.2)])
def test_pid_converges_on_first_order_process(gain, target):
  pid = ac.PIDController(target, 0, 8, kp=2.0, ki=0.5)
  trace = simulate(pid, gain, 300, noise=0.005)
  s, lag = trace[:, 0], trace[:, 1]
  assert (lag >= 0).all() and (lag <= 8).all()
  assert abs(s[-50:].mean() - target) < 0.01
  assert abs(lag[-50:].mean() - target / gain) < 0.3


def test_pid_anti_windup():
  # Target unreachable (gain too small): the lag pins at max_lag...
  pid = ac.PIDController(0.5, 0, 4, kp=2.0, ki=0.5)
  for _ in range(500):
    assert pid.update(0.0) <= 4
  assert pid.output == 4
  integral_pinned = pid.integral
  # ... without winding up: the integral stopped growing once saturated.
  assert integral_pinned < 4 / 0.5 + 1
  # Staleness jumps above target: the lag leaves the bound at once.
  assert pid.update(0.9) < 4
  # Without anti-windup the integral would be 250 and the lag stuck for ~300 steps.


def test_modes():
  sync = ac.AdmissionController(8, "sync")
  assert sync.allowed_lag == 0 and sync.capacity(0) == 8
  sync.on_started(8)
  assert sync.capacity(0) == 0 and sync.capacity(1) == 8  # next batch after the update
  sync.observe(0.9)
  assert sync.allowed_lag == 0

  fixed = ac.AdmissionController(4, "fixed", fixed_lag=2)
  assert fixed.allowed_lag == 2 and fixed.capacity(0) == 12
  fixed.on_started(12)
  fixed.observe(0.0)
  assert fixed.allowed_lag == 2 and fixed.capacity(0) == 0 and fixed.capacity(1) == 4
  fixed.on_cancelled(3)  # aborted rollouts to re-run give their admission back
  assert fixed.capacity(0) == 3

  ad = ac.AdmissionController(4, "adaptive", min_lag=1, max_lag=3, target_staleness=0.2)
  assert ad.allowed_lag == 1
  for _ in range(20):
    ad.observe(0.0)  # fresh data: allow more lag
  assert ad.allowed_lag == 3 and ad.capacity(0) == 16
  ad.on_started(16)
  for _ in range(20):
    ad.observe(1.0)  # too stale: throttle; finished samples are untouched
  assert ad.allowed_lag == 1 and ad.capacity(0) == 0 and ad.capacity(2) == 0
  assert ad.capacity(3) == 4

  with pytest.raises(ValueError):
    ac.AdmissionController(4, "async")


def test_state_round_trip():
  a = ac.AdmissionController(4, "adaptive", max_lag=5)
  a.on_started(7)
  for s in (0.0, 0.05, 0.3):
    a.observe(s)
  state = json.loads(json.dumps(a.get_state()))
  b = ac.AdmissionController(4, "adaptive", max_lag=5)
  b.set_state(state)
  assert b.get_state() == a.get_state()
  assert a.observe(0.1) == b.observe(0.1) and a.pid.output == b.pid.output
