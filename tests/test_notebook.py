"""The notebooks run top to bottom (CI executes them so they keep working)."""

import os
import re

import pytest

from helpers import xla_flags

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(name: str, tmp_path, parameters: str = "") -> str:
  """Runs notebooks/NAME in a fresh kernel in tmp_path; returns its printed text.

  PARAMETERS, if given, runs as a cell right after the one tagged
  `parameters` (papermill's convention). The notebook sets its own fake-mesh
  flags; its figures go to tmp_path, not into the checkout.
  """
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  if parameters:
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: one cell tagged 'parameters' expected, got {len(tagged)}"
    nb.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(parameters))
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
  monkeypatch.setenv("XLA_FLAGS", xla_flags(devices=2))
  # Every cell runs as written; the sizes are cut (suite time).
  outputs = execute(
    "grpo.ipynb",
    tmp_path,
    "config.data.synth_eval = config.eval.prompts = 16\ngrpo_steps, eval_every = 2, 1",
  )
  assert "logprob" in outputs and "accuracy" in outputs
  # One group's loss and gradient by hand equal the library's.
  (line,) = [x for x in outputs.splitlines() if x.startswith("group loss by hand")]
  by_hand, library = (float(x) for x in re.findall(r"[-+]\d\.\d+", line))
  assert by_hand == pytest.approx(library, abs=1e-6)
  (line,) = [x for x in outputs.splitlines() if x.startswith("largest gradient difference")]
  assert float(line.split()[-1]) < 1e-7
  curve = [line for line in outputs.splitlines() if line.startswith("accuracy [")]
  assert len(curve) == 1 and curve[0].count(",") == 2, curve  # evaluated at steps 0, 1, 2
  for figure in ("group.png", "grpo_curve.png"):
    assert (tmp_path / "notebook_out" / figure).exists()


@pytest.mark.parametrize("name", ["mesh.ipynb", "grpo.ipynb"])
def test_a_notebook_is_stored_executed_with_its_figures_and_run_time(name):
  """A reader on GitHub sees what it does without running it."""
  nb = nbformat.read(os.path.join(ROOT, "notebooks", name), as_version=4)
  outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
  assert any("image/png" in o.get("data", {}) for o in outputs), "no inline figure stored"
  assert any(o.get("text", "").startswith("ran in ") for o in outputs), "no run time stored"
  assert all(c.get("execution_count") for c in nb.cells if c.cell_type == "code")
