"""Test setup: a fake 8-device CPU mesh.

XLA reads these flags once, when the backend starts, so they must be set before
anything imports jax (pytest loads conftest.py first).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# Parity tests compare fp32 numbers; keep XLA's CPU matmuls at full precision.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")

import jax  # noqa: E402  (must follow the environment set-up above)
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def devices():
  devs = jax.devices()
  assert len(devs) == 8, f"expected the fake 8-device mesh, got {devs}"
  return devs
