"""bench/cores.py's Throttle: a slower rollout device made from a CPU core."""

import os
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import cores


def _stat(pid: int) -> tuple[str, float]:
  """(state, CPU seconds used) of a process, from /proc."""
  state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
  return state, cores.cpu_seconds(pid)


def test_a_throttled_process_runs_its_duty_and_runs_freely_after():
  busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    time.sleep(0.2)
    start = time.monotonic()
    _, before = _stat(busy.pid)
    throttle = cores.Throttle([busy.pid], 0.25)
    throttled = time.monotonic()
    time.sleep(2.0)
    released = time.monotonic()
    achieved = throttle.stop()
    _, used = _stat(busy.pid)
    read = time.monotonic()
    elapsed, used = read - start, used - before
    # Outside the throttle the process ran freely: from the first reading to
    # the throttle's start, and from its release to the second reading (which
    # a loaded machine can delay by tens of milliseconds).
    unthrottled = (throttled - start) + (read - released)
    time.sleep(0.1)
    state, _ = _stat(busy.pid)
  finally:
    busy.kill()
    busy.wait()
  # Its duty (a late wake-up of the signalling thread, or a stop that lands
  # late, is made up by a longer stop), and no more CPU than the duty's share
  # of the time, up to one cycle's run and the kernel's tick.
  assert 0.2 < achieved < 0.3
  one_cycle = 0.25 * 0.02
  assert used <= 0.25 * elapsed + unthrottled + one_cycle + 2 / os.sysconf("SC_CLK_TCK")
  # At most its duty of the 2 s (a loaded core may give it less), against
  # the full 2 s unthrottled.
  assert used < 0.35 * 2.0
  assert state in "RS", f"left stopped (state {state})"


@pytest.mark.parametrize("duty", [0.0, 1.0])
def test_a_throttle_that_would_stop_or_not_slow_is_refused(duty):
  with pytest.raises(ValueError, match="duty"):
    cores.Throttle([os.getpid()], duty)
