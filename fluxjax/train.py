r"""The fluxjax entry point: python -m fluxjax.train --config=configs/vlm.py.

Intentionally thin: flags, then library calls. Everything testable lives in the
library modules.
"""

import logging
import os
import sys

from absl import app, flags
from ml_collections import config_flags

from fluxjax import config_args

_DEFAULT_CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "vlm.py")
_CONFIG = config_flags.DEFINE_config_file(
  "config",
  _DEFAULT_CONFIG,
  "Run config: a file[:variant][,modifier...], e.g. configs/vlm.py:qwen25_vl_7b,smoke "
  f"(configs/vlm.py's {config_args.describe(_DEFAULT_CONFIG)}). Any field is a flag, "
  "--config.section.field=value; --print_config lists them.",
  lock_config=True,
)
_PRINT_CONFIG = flags.DEFINE_bool(
  "print_config", False, "Print the resolved config (every field, with overrides) and exit."
)
_DRY_RUN = flags.DEFINE_bool(
  "dry_run",
  False,
  "Validate the config on this machine (no GPU needed) and print what the run would do: "
  "model, mesh, data, each launched server's command and GPUs, reward; start nothing.",
)
_WORKDIR = flags.DEFINE_string(
  "workdir",
  "",
  "Where metrics, config and checkpoints go; a run there resumes. Default: "
  "workdir/<config file>[-<its arg>], e.g. workdir/vlm, workdir/vlm-qwen25_vl_7b-smoke.",
)


def default_workdir(config_flag: str) -> str:
  """workdir/<config file's stem>[-<arg, commas as dashes>]: one per variant."""
  path, _, arg = config_flag.partition(":")
  stem = os.path.splitext(os.path.basename(path))[0]
  return os.path.join("workdir", "-".join([stem, *filter(None, arg.split(","))]))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing, with a one-line error for a bad config, variant,
  modifier, field or value instead of a traceback."""
  problem = config_args.check_command_line(argv, _DEFAULT_CONFIG)
  if problem:
    sys.exit(f"fluxjax.train: {problem}")
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"fluxjax.train: {str(e).strip().splitlines()[0]}")


def main(argv):
  del argv
  config = _CONFIG.value
  if _PRINT_CONFIG.value:
    print(config)
    return
  from fluxjax import settings as settings_lib

  try:
    settings = settings_lib.Settings.of(config)
  except ValueError as e:  # a configuration mistake: say what, not where
    sys.exit(f"fluxjax.train: bad configuration: {e}")
  # Heavy imports after the settings are read, so --help and a bad value stay fast.
  import jax

  from fluxjax import logs
  from fluxjax.parallel import multihost
  from fluxjax.rl import loop
  from fluxjax.sharding import mesh as mesh_lib

  logs.configure()
  mesh_lib.maybe_initialize_distributed(settings.distributed)
  process = jax.process_index()
  if process:
    logs.configure(process_index=process)
  try:
    validated = loop.validate(settings)
  except ValueError as e:
    sys.exit(f"fluxjax.train: bad configuration: {e}")
  config_flag = config_flags.get_config_filename(flags.FLAGS["config"])
  workdir = _WORKDIR.value or default_workdir(config_flag)
  if _DRY_RUN.value:
    print("\n".join(loop.plan_lines(validated, workdir)))
    return
  log_file = logs.add_file(workdir, process)
  log = logging.getLogger("fluxjax.train")
  log.info("full log: %s", log_file)
  saved = os.path.join(workdir, "config.json")
  if process == 0 and os.path.exists(saved):
    changed = config_args.differences(saved, config)
    if changed:
      log.warning(
        "%s holds a run whose config differs from this one; it resumes from its checkpoints "
        "with the new settings (a fresh run needs another --workdir): %s",
        workdir,
        "; ".join(changed),
      )
  with multihost.fail_fast():
    loop.run(config, workdir, validated)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
