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
  fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
  return fields[0], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_throttled_process_runs_its_duty_and_runs_freely_after():
  busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
  try:
    time.sleep(0.2)
    _, before = _stat(busy.pid)
    start = time.monotonic()
    throttle = cores.Throttle([busy.pid], 0.25)
    time.sleep(2.0)
    achieved = throttle.stop()
    elapsed = time.monotonic() - start
    _, used = _stat(busy.pid)
    used -= before
    time.sleep(0.1)
    state, _ = _stat(busy.pid)
  finally:
    busy.kill()
    busy.wait()
  # Its duty (a late wake-up of the signalling thread is made up by a longer
  # stop), and achieved() is what the process could use: no more CPU than that.
  assert 0.2 < achieved < 0.3
  assert used <= achieved * elapsed + 2 / os.sysconf("SC_CLK_TCK")
  # At most its duty of the 2 s (a loaded core may give it less), against
  # the full 2 s unthrottled.
  assert used < 0.35 * 2.0
  assert state in "RS", f"left stopped (state {state})"


@pytest.mark.parametrize("duty", [0.0, 1.0])
def test_a_throttle_that_would_stop_or_not_slow_is_refused(duty):
  with pytest.raises(ValueError, match="duty"):
    cores.Throttle([os.getpid()], duty)
