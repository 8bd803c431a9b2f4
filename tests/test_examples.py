"""examples/: the scripts' dry runs check their configs on a CPU."""

import os
import subprocess
import sys

from fluxjax.models import config as model_config
from fluxjax.models import hf_export, vlm
from fluxjax.models.tokenizer import Tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tiny_checkpoint(folder) -> str:
  """A tiny-preset HF folder with the shipped tokenizer (what an export writes)."""
  model = vlm.create_model(model_config.preset("tiny"), seed=0)
  tokenizer = Tokenizer.default().backend.to_str().encode()
  hf_export.save_hf_checkpoint(
    model, str(folder), dtype="float32", extra_files={"tokenizer.json": tokenizer}
  )
  return str(folder)


def test_the_one_node_script_places_four_servers_on_gpus_4_to_7(tmp_path):
  env = dict(
    os.environ,
    DRY_RUN="1",
    MODEL=_tiny_checkpoint(tmp_path / "ckpt"),
    CONFIG="configs/vlm.py:qwen25_vl_7b,smoke",
    WORKDIR=str(tmp_path / "run"),
    PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
  )
  out = subprocess.run(
    ["bash", "examples/one_node_8gpu.sh"],
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.splitlines()
  servers = [line for line in lines if line.startswith("rollout server")]
  assert [s.split()[3] for s in servers] == [f"CUDA_VISIBLE_DEVICES={g}" for g in (4, 5, 6, 7)]
  assert all("sglang.launch_server --model-path" in s for s in servers)
  assert any(line.startswith("router: python -m sglang_router.launch_router") for line in lines)
  assert not (tmp_path / "run").exists()  # a dry run starts nothing
