r"""The fluxjax entry point: python -m fluxjax.train --config=configs/vlm.py.

Intentionally thin: flags, then library calls. Everything testable lives in the
library modules.
"""

import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
  "config",
  os.path.join(os.path.dirname(__file__), "..", "configs", "vlm.py"),
  "Run config file (configs/vlm.py[:variant]).",
  lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
  "workdir", "workdir/vlm", "Where metrics, config and checkpoints go."
)


def main(argv):
  del argv
  config = _CONFIG.value
  # Heavy imports after flag parsing, so --help stays fast.
  import jax

  from fluxjax import logs
  from fluxjax import settings as settings_lib
  from fluxjax.parallel import multihost
  from fluxjax.rl import loop
  from fluxjax.sharding import mesh as mesh_lib

  logs.configure()
  try:
    settings = settings_lib.Settings.of(config)
  except ValueError as e:  # a configuration mistake: say what, not where
    sys.exit(f"fluxjax.train: bad configuration: {e}")
  mesh_lib.maybe_initialize_distributed(settings.distributed)
  process = jax.process_index()
  if process:
    logs.configure(process_index=process)
  try:
    validated = loop.validate(settings)
  except ValueError as e:
    sys.exit(f"fluxjax.train: bad configuration: {e}")
  log_file = logs.add_file(_WORKDIR.value, process)
  logging.getLogger("fluxjax.train").info("full log: %s", log_file)
  with multihost.fail_fast():
    loop.run(config, _WORKDIR.value, validated)


if __name__ == "__main__":
  app.run(main)
