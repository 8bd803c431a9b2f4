r"""The fluxjax entry point: python -m fluxjax.train --config=configs/vlm.py.

Intentionally thin: flags, then library calls. Everything testable lives in the
library modules.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(__file__), "..", "configs", "vlm.py"),
    "Run config file (configs/vlm.py[:variant]).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "workdir/vlm", "Where metrics, config and checkpoints go.")


def main(argv):
  del argv
  config = _CONFIG.value
  from fluxjax.models import config as model_config  # heavy imports after flag parsing
  cfg = model_config.preset(config.model.preset)
  logging.info("model preset %s: text %s, vision %s", config.model.preset, cfg.text, cfg.vision)
  # The RL loop (coordinator, rollout fleet, data, sharded train step) is built
  # by later issues; until it is wired, fail loudly rather than pretend to train.
  sys.exit("fluxjax.train: the RL training loop is not yet wired (model, processing and "
           "HF I/O are; see README 'Status'). Nothing was trained.")


if __name__ == "__main__":
  app.run(main)
