"""Test setup: a fake 8-device CPU mesh.

XLA reads these flags once, when the backend starts, so they must be set before
anything imports jax (pytest loads conftest.py first).
"""

import atexit
import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# XLA:CPU sizes its Eigen pool to max(CPUs, devices): 8 threads for 8 fake
# devices on this 2-core machine. A device that runs two independent
# collectives of one program at once holds two of them, and the last device's
# part can find no thread: every other thread waits in a rendezvous for it,
# which XLA aborts after 40 s (seen in ~1 of 6 runs of test_stream_trainer.py:
# all-gather and all-to-all of one `add`, devices 0-1 in both, device 7 in
# neither). More threads than devices leave room; tsl reads NPROC for the CPU
# count.
os.environ.setdefault("NPROC", "24")
# Parity tests compare fp32 numbers; keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# One persistent compilation cache for the whole session, passed through the
# environment so the subprocesses (rollout servers, the SIGKILLed and resumed
# runs) share it: the loop tests compile the same tiny-model programs (engine
# prefill/decode, train step, eval) again and again, which took ~40% of their
# time on a 2-core machine. Fresh per session unless the developer names one,
# so a run never depends on what an earlier run left.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix="fluxjax-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402  (must follow the environment set-up above)
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected the fake 8-device mesh, got {devs}"
  return devs
