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
  # Heavy imports after flag parsing, so --help stays fast.
  import jax
  from fluxjax.models import config as model_config
  from fluxjax.models import hf_io
  from fluxjax.sharding import mesh as mesh_lib
  from fluxjax.sharding import rules
  from fluxjax.sharding import strategies

  # --- Mesh and strategy -------------------------------------------------------
  mesh_lib.maybe_initialize_distributed(config.distributed)
  overrides = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                   attention_backend=config.model.attention_backend, remat=config.model.remat,
                   logprob_vocab_chunk=config.model.logprob_vocab_chunk,
                   mrope_text_after_vision=config.model.mrope_text_after_vision)
  model_cfg = (model_config.load_hf_config(config.model.hf_path, **overrides)
               if config.model.hf_path else model_config.preset(config.model.preset, **overrides))
  try:
    strategy = strategies.get_strategy(config.sharding, model_cfg)
    mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.fsdp, strategy.sp_axes())
  except ValueError as e:  # a configuration mistake: say what, not where
    sys.exit(f"fluxjax.train: bad configuration: {e}")
  logging.info("strategy %s (sp=%d) on mesh %s", strategy.name, strategy.sp, dict(mesh.shape))

  # --- Model, created sharded --------------------------------------------------
  if config.model.hf_path:
    model = hf_io.load_hf_checkpoint(config.model.hf_path, model_cfg,
                                     shardings=rules.model_shardings(model_cfg, mesh))
  else:
    model = rules.create_sharded_model(model_cfg, mesh, seed=config.seed,
                                       max_replicated_bytes=config.sharding.max_replicated_bytes)
  del model, jax

  # The RL loop (coordinator, rollout fleet, data) is built by later issues;
  # until it is wired, fail loudly rather than pretend to train.
  sys.exit("fluxjax.train: the RL training loop is not yet wired (model, HF I/O, mesh, "
           "sharding strategies and the train step are; see README 'Status'). "
           "Nothing was trained.")


if __name__ == "__main__":
  app.run(main)
