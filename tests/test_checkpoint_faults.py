"""A failed or killed Orbax save leaves the previous checkpoint whole and loadable.

Two ways a save of step N+1 dies after step N was saved:
  * a write error: in process, the write of one array of step N+1 raises
    ENOSPC where Orbax awaits its tensorstore write (after another array of
    the step is already written); in a child process, the filesystem itself
    refuses the write (RLIMIT_FSIZE, so tensorstore's own file write gets
    EFBIG);
  * a kill: the child is SIGKILLed from inside Orbax's array writer, after
    one array of step N+1 is written and before the step is committed.
Either way the error reaches the caller, `latest_step` stays N, step N
restores exactly, and the next save of N+1 succeeds over the leftovers.
"""

import errno
import os
import signal
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from orbax.checkpoint._src.serialization import serialization

from fluxjax.rl import checkpoint

TMP_SUFFIX = ".orbax-checkpoint-tmp"


def host_state(seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    "w": rng.standard_normal((64, 32)).astype(np.float32),
    "b": rng.standard_normal(32).astype(np.float32),
    "step": np.asarray(seed, np.int32),
  }


def run_state(seed: int, mesh=None) -> tuple[dict, jax.Array, dict, dict]:
  """(state, rng, coordinator JSON, data JSON) of a run at step `seed`."""
  state = host_state(seed)
  if mesh is None:
    arrays = {k: jnp.asarray(v) for k, v in state.items()}
  else:
    spec = {"w": P("x"), "b": P(), "step": P()}
    arrays = {k: jax.device_put(v, NamedSharding(mesh, spec[k])) for k, v in state.items()}
  return arrays, jax.random.key(seed), {"version": seed}, {"next_index": 10 * seed}


def assert_restores(ckpt: checkpoint.Checkpointer, like: dict, seed: int) -> None:
  step, state, rng, coordinator, data = ckpt.restore(checkpoint.abstract_like(like))
  assert step == seed
  for name, value in host_state(seed).items():
    np.testing.assert_array_equal(np.asarray(state[name]), value)
  assert np.array_equal(jax.random.key_data(rng), jax.random.key_data(jax.random.key(seed)))
  assert coordinator == {"version": seed} and data == {"next_index": 10 * seed}


def leftovers(workdir) -> list[str]:
  """The steps whose temporary (uncommitted) folders are in the checkpoint directory."""
  entries = os.listdir(os.path.join(workdir, "checkpoints"))
  return [e.split(TMP_SUFFIX)[0] for e in entries if TMP_SUFFIX in e]


# When one array write fails, Orbax closes its event loop with the step's
# other tensorstore writes in flight; their completion callbacks then find the
# loop closed and Python reports that as an unraisable RuntimeError.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("surfaces_at", ["wait", "save", "close"])
def test_a_failed_write_surfaces_and_the_previous_checkpoint_stays(
  tmp_path, devices, monkeypatch, surfaces_at
):
  mesh = jax.make_mesh((8,), ("x",))
  ckpt = checkpoint.Checkpointer(str(tmp_path))
  assert ckpt.save(1, *run_state(1, mesh))
  ckpt.wait()

  write = serialization.async_serialize_from_host
  writes = []

  async def second_write_fails(*args, **kwargs):
    writes.append(1)
    if len(writes) == 2:
      raise OSError(errno.ENOSPC, "No space left on device (injected)")
    return await write(*args, **kwargs)

  monkeypatch.setattr(serialization, "async_serialize_from_host", second_write_fails)
  assert ckpt.save(2, *run_state(2, mesh))
  assert ckpt.latest_step() == 1  # queued, not committed
  with pytest.raises(checkpoint.CheckpointWriteError, match="checkpoint step 2 was not saved") as e:
    if surfaces_at == "wait":
      ckpt.wait()
    elif surfaces_at == "save":
      ckpt.save(3, *run_state(3, mesh))
    else:
      ckpt.close()
  assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.ENOSPC
  assert "latest complete checkpoint" in str(e.value) and str(e.value).endswith("is step 1")
  assert len(writes) >= 2 and leftovers(tmp_path) == ["2"]  # it failed midway
  assert ckpt.latest_step() == 1
  like = run_state(1, mesh)[0]
  assert_restores(ckpt, like, 1)
  if surfaces_at != "close":
    ckpt.close()  # reported once: closing after it is quiet

  monkeypatch.undo()
  again = checkpoint.Checkpointer(str(tmp_path))
  assert again.latest_step() == 1
  assert again.save(2, *run_state(2, mesh))
  again.wait()
  assert again.latest_step() == 2 and leftovers(tmp_path) == []
  assert_restores(again, like, 2)
  again.close()


CHILD = """
import resource, signal, sys, threading
from orbax.checkpoint._src.serialization import serialization
sys.path.insert(0, sys.argv[2])
from test_checkpoint_faults import run_state
from fluxjax.rl import checkpoint

ckpt = checkpoint.Checkpointer(sys.argv[1])
ckpt.save(1, *run_state(1))
ckpt.wait()

# The filesystem refuses step 2: no file may grow past 1 KiB.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
ckpt.save(2, *run_state(2))
try:
  ckpt.wait()
  print("saved", flush=True)
except checkpoint.CheckpointWriteError as e:
  print("error", str(e).replace(chr(10), " "), flush=True)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

# Step 2 again, stopped inside the array writer once one array is written.
write = serialization.async_serialize_from_host
async def write_then_wait(*args, **kwargs):
  await write(*args, **kwargs)
  print("mid-save", flush=True)
  threading.Event().wait()
serialization.async_serialize_from_host = write_then_wait
ckpt.save(2, *run_state(2))
threading.Event().wait()
"""


def test_a_refused_write_then_a_kill_mid_save_leave_the_previous_checkpoint(tmp_path):
  script = tmp_path / "child.py"
  script.write_text(CHILD)
  workdir = tmp_path / "run"
  with open(tmp_path / "child.log", "wb") as log:
    child = subprocess.Popen(
      [sys.executable, str(script), str(workdir), os.path.dirname(__file__)],
      stdout=subprocess.PIPE,
      stderr=log,
      text=True,
    )
  watchdog = threading.Timer(120, child.kill)  # a child stuck before it reports
  watchdog.start()
  lines = []
  assert child.stdout is not None
  for line in child.stdout:
    lines.append(line.strip())
    if line.strip() == "mid-save":
      break
  watchdog.cancel()
  try:
    assert lines and lines[-1] == "mid-save", (lines, (tmp_path / "child.log").read_text()[-3000:])
    # The kill lands while step 2 is half written: its temporary folder holds data.
    assert leftovers(workdir) == ["2"]
    assert not os.path.exists(workdir / "checkpoints" / "2")
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  assert child.returncode == -signal.SIGKILL
  error = lines[0]
  assert error.startswith("error checkpoint step 2 was not saved") and "File too large" in error
  assert error.endswith("is step 1"), error

  ckpt = checkpoint.Checkpointer(str(workdir))
  assert ckpt.latest_step() == 1
  like = run_state(1)[0]
  assert_restores(ckpt, like, 1)
  assert ckpt.save(2, *run_state(2))
  ckpt.wait()
  assert ckpt.latest_step() == 2 and leftovers(workdir) == []
  assert_restores(ckpt, like, 2)
  ckpt.close()
