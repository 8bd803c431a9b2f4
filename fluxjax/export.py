r"""A run's policy as an HF folder: python -m fluxjax.export WORKDIR OUT [--step N] [--sft].

`export` restores a checkpoint of the run in WORKDIR (`restored_policy`) and writes OUT,
which transformers, SGLang and `--config.model.hf_path` load (docs/config.md, "Exporting
the policy"). The restore is sharded as in training: no process holds the whole model.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

log = logging.getLogger("fluxjax.export")


def load_run_config(workdir: str):
  """The ConfigDict a run wrote to WORKDIR/config.json, over today's defaults
  for fields added since (each logged)."""
  from fluxjax import config_args

  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise SystemExit(f"fluxjax.export: {path} not found: is {workdir} a run's work directory?")
  config, notes = config_args.load_saved(path)
  for note in notes:
    log.warning("%s: %s", path, note)
  return config


@contextlib.contextmanager
def restored_policy(workdir: str, step: int | None = None, sft: bool = False):
  """Yields (policy, step, validated config) of checkpoint `step` (None: the
  latest) of the run in `workdir`, an RL checkpoint or (`sft`) a warm-up
  one, on this process's devices.

  It reads the run's resolved config (WORKDIR/config.json) and builds its policy. The
  restore reads the whole train state (the optimizer's moments too) onto the devices the
  run's mesh settings give here, sharded as in training. A warm-up checkpoint is one of
  WORKDIR/sft, which is all a pretraining run such as configs/pretrain.py writes.
  """
  from fluxjax.data import materializer as materializer_lib
  from fluxjax.data import store as store_lib
  from fluxjax.rl import loop

  config = load_run_config(workdir)
  validated = loop.validate(config)
  with contextlib.ExitStack() as stack:
    store = store_lib.MetaStore(1 << 20)
    stack.callback(store.close)
    policy = loop.build_policy(
      config,
      workdir,
      stack,
      materializer_lib.Materializer(store),
      owns_media=False,
      validated=validated,
    )
    step = _restore_sft(policy, workdir, step) if sft else _restore(policy, workdir, step)
    yield policy, step, validated


def export(
  workdir: str, out: str, step: int | None = None, dtype: str = "bfloat16", sft: bool = False
) -> int:
  """Writes checkpoint `step` (None: the latest) of the run in `workdir` to
  `out`, an RL checkpoint or (`sft`) a warm-up one; returns the step written.

  OUT holds the weights as safetensors (`dtype`; sharded above 4 GiB a file, with an
  index), config.json, the run's tokenizer.json and its vision preprocessing
  (preprocessor_config.json, video_preprocessor_config.json): transformers'
  `Qwen2_5_VLForConditionalGeneration.from_pretrained(OUT)` and SGLang load it. The
  folder appears complete or not at all (written beside it, then renamed).
  """
  from fluxjax.rl import loop

  with restored_policy(workdir, step, sft) as (policy, step, validated):
    proc = loop.processor_config(validated.settings.data.vision)
    loop.export_hf(policy, out, validated.tokenizer, proc, dtype)
  log.info("exported step %d of %s to %s (%s)", step, workdir, out, dtype)
  return step


def _restore(policy, workdir: str, step: int | None) -> int:
  step = policy.latest_step() if step is None else step
  if step is None:
    raise SystemExit(f"fluxjax.export: no RL checkpoint in {workdir} (a warm-up one: --sft)")
  policy.restore(step)
  return step


def _restore_sft(policy, workdir: str, step: int | None) -> int:
  resumed = policy.sft_begin(step=step)
  if resumed is None:
    raise SystemExit(f"fluxjax.export: no SFT warm-up checkpoint under {workdir}/sft")
  policy.sft_finish()
  policy.sft_end()
  return resumed[0]


def main(argv: list[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("workdir", help="the run's work directory (--workdir of fluxjax.train)")
  p.add_argument("out", help="the HF folder to write (must not exist)")
  p.add_argument("--step", type=int, help="the checkpoint's step (default: the latest)")
  p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
  p.add_argument(
    "--sft", action="store_true", help="a checkpoint of the SFT warm-up (of a pretraining run)"
  )
  args = p.parse_args(argv)
  if os.path.exists(args.out):
    sys.exit(f"fluxjax.export: {args.out} exists; name a new folder")
  from fluxjax import logs

  logs.configure()
  try:
    export(args.workdir, args.out, args.step, args.dtype, sft=args.sft)
  except FileNotFoundError as e:  # e.g. a step the run no longer keeps
    sys.exit(f"fluxjax.export: {e}")


if __name__ == "__main__":
  main()
