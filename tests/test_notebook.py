"""The notebooks run top to bottom (CI executes them so they keep working)."""

import os

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(name: str, tmp_path) -> str:
  """Runs notebooks/NAME in a fresh kernel in tmp_path; returns its printed text.

  The notebook sets its own fake-mesh flags; its figures go to tmp_path, not
  into the checkout.
  """
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()
  return "".join(
    o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
  )


@pytest.mark.slow
def test_mesh_notebook_executes(tmp_path):
  outputs = execute("mesh.ipynb", tmp_path)
  assert "packed_dp" in outputs and "flex_ulysses" in outputs
  assert "loss" in outputs
  assert (tmp_path / "notebook_out" / "plans.png").exists()


@pytest.mark.slow
def test_grpo_notebook_executes(tmp_path, monkeypatch):
  # Its kernel inherits this environment: the notebook's own 2-device mesh,
  # not the suite's 8 fake devices.
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  outputs = execute("grpo.ipynb", tmp_path)
  assert "logprob" in outputs and "accuracy" in outputs
  for figure in ("group.png", "grpo_curve.png"):
    assert (tmp_path / "notebook_out" / figure).exists()
