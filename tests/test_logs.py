"""Log routing: fluxjax's progress on the console, third-party chatter in the file."""

import io
import logging
import pathlib
import re

import pytest

from fluxjax import logs

ROOT_CALL = re.compile(r"\blogging\.(debug|info|warning|error|exception|critical)\(")


@pytest.fixture
def restore_logging():
  """configure() rewires the root logger; put pytest's handlers back afterwards."""
  root = logging.getLogger()
  saved = (list(root.handlers), root.level, logging.getLogger("fluxjax").level)
  yield
  for handler in list(root.handlers):
    root.removeHandler(handler)
    handler.close()
  for handler in saved[0]:
    root.addHandler(handler)
  root.setLevel(saved[1])
  logging.getLogger("fluxjax").setLevel(saved[2])


def test_console_shows_fluxjax_progress_and_file_keeps_everything(tmp_path, restore_logging):
  console = io.StringIO()
  logs.configure(console=console)
  path = logs.add_file(str(tmp_path))
  logging.getLogger("fluxjax.rl.loop").info("step 1/2 | reward 0.5")
  logging.getLogger("fluxjax.rl.evaluation").debug("eval: answers")
  logging.getLogger("absl").info("orbax: 58 lines of checkpoint detail")
  logging.getLogger("absl").warning("orbax: internal layout note")
  logging.getLogger("absl").error("orbax: the save failed")
  logging.getLogger("jax._src.xla_bridge").info("platform detail")
  logging.getLogger("jax._src.xla_bridge").warning("no GPU found")
  for handler in logging.getLogger().handlers:
    handler.flush()

  shown = console.getvalue()
  assert "step 1/2 | reward 0.5" in shown
  assert "the save failed" in shown and "no GPU found" in shown
  for hidden in ("eval: answers", "58 lines", "internal layout", "platform detail"):
    assert hidden not in shown, hidden
  # Warnings carry their level and origin; progress lines stay plain.
  assert "WARNING jax._src.xla_bridge] no GPU found" in shown
  assert "INFO" not in shown

  with open(path) as f:
    kept = f.read()
  for line in (
    "step 1/2",
    "eval: answers",
    "58 lines",
    "internal layout",
    "the save failed",
    "platform detail",
    "no GPU found",
  ):
    assert line in kept, line


def test_library_modules_use_their_own_loggers():
  """One convention: `log = logging.getLogger(__name__)`; no absl or root-logger calls."""
  package = pathlib.Path(logs.__file__).parent
  offenders = []
  for path in sorted(package.rglob("*.py")):
    text = path.read_text()
    if "from absl import logging\n" in text or ROOT_CALL.search(text):
      offenders.append(str(path.relative_to(package)))
  assert not offenders, offenders
