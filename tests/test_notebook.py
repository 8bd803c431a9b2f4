"""notebooks/mesh.ipynb runs top to bottom (CI executes it so it keeps working)."""

import os

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_mesh_notebook_executes(tmp_path):
  nb = nbformat.read(os.path.join(ROOT, "notebooks", "mesh.ipynb"), as_version=4)
  # A fresh kernel process; the notebook sets its own fake-mesh flags.
  # The kernel runs in tmp_path: the notebook's figures go there, not into the checkout.
  client = nbclient.NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
  )
  client.execute()
  outputs = "".join(
    o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
  )
  assert "packed_dp" in outputs and "flex_ulysses" in outputs
  assert "loss" in outputs
  assert (tmp_path / "notebook_out" / "plans.png").exists()
