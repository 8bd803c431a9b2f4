"""Weight publishing: trainer parameters -> versioned HF folder -> every server.

Remote servers (ours or SGLang) get the refit sequence slime and AReaL use:
  write   HF-layout safetensors to <root>/v<version>, atomically (a temp folder
          renamed into place by hf_io.save_hf_checkpoint), so a server never
          reads a half-written checkpoint;
  pause   POST /pause_generation (mode "abort": in-flight requests return
          their partial output with finish_reason abort, which the
          coordinator continues; requests sent while paused wait in the
          server, as SGLang holds them);
  flush   POST /flush_cache (retried until idle);
  update  POST /update_weights_from_disk {model_path, weight_version};
  resume  POST /continue_generation, on every server that was paused.
Each phase is timed across the fleet (the slowest server counts);
`Fleet.update_weights` runs the sequence.

In-process engines skip the disk: `publish_in_process` swaps the arrays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Mapping, Sequence

from fluxjax.models import hf_io, vlm
from fluxjax.models import tokenizer as tokenizer_lib


@dataclasses.dataclass
class PublishReport:
  version: str
  path: str | None
  seconds: dict[str, float]
  failed: list[str]


def write_checkpoint(
  model: vlm.Qwen25VL,
  root: str,
  version: int | str,
  *,
  dtype: str = "bfloat16",
  extra_files: Mapping[str, str | bytes] | None = None,
) -> str:
  """Writes <root>/v<version> atomically and returns its path."""
  extra = {"tokenizer.json": tokenizer_lib.ASSET_PATH} if extra_files is None else extra_files
  path = os.path.join(root, f"v{version}")
  return hf_io.save_hf_checkpoint(model, path, dtype=dtype, extra_files=extra)


async def publish_to_fleet(
  fleet,
  model: vlm.Qwen25VL,
  root: str,
  version: int | str,
  *,
  dtype: str = "bfloat16",
  pause_mode: str = "abort",
  extra_files: Mapping[str, str | bytes] | None = None,
) -> PublishReport:
  """Writes the checkpoint, then pause -> flush -> update -> continue everywhere.

  Args:
    fleet: a `fleet.Fleet`.
    model: the trainer's model (parameters may be sharded; gathered on write).
    root: folder that holds the versions.
    version: the new weight version (sent as a string, as SGLang expects).
    dtype: tensor dtype on disk.
    pause_mode: SGLang's pause mode.
    extra_files: copied into the folder (default: the shipped tokenizer.json).

  Returns:
    The report, with seconds per phase and servers that failed (marked down).
  """
  t = time.perf_counter()
  path = await asyncio.get_running_loop().run_in_executor(
    None, lambda: write_checkpoint(model, root, version, dtype=dtype, extra_files=extra_files)
  )
  write_s = time.perf_counter() - t
  seconds, failed = await fleet.update_weights(path, str(version), pause_mode=pause_mode)
  return PublishReport(str(version), path, {"write": write_s, **seconds}, failed)


def publish_in_process(engines: Sequence, model: vlm.Qwen25VL, version: int | str) -> PublishReport:
  """Hands the arrays to in-process engines (Engine or EmbeddedRollout)."""
  from flax import nnx

  t = time.perf_counter()
  state = nnx.split(model)[1]
  for e in engines:
    e.update_params(state, str(version))
  return PublishReport(str(version), None, {"swap": time.perf_counter() - t}, [])
