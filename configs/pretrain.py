r"""Pretraining the base model that the main job post-trains.

  python -m fluxjax.train --config=configs/pretrain.py --workdir=workdir/pretrain
  python -m fluxjax.train --config=configs/pretrain.py:smoke --workdir=/tmp/pretrain

The default run's settings (configs/vlm.py) and tiny preset, trained by
the SFT path alone: no RL steps, many warm-up
steps on a pre-generated pool (the `pretrain` mix of fluxjax/data/synth.py:
every chain task, the text-only copy drills and the main job's direct-answer
tasks), a cosine schedule,
checkpoints every `sft.checkpoint_every` steps (a killed run resumes from the latest when
started again with the same command), and at the end an HF folder
(`sft.export_dir`: fp32 weights, config.json, the tokenizer and the vision
preprocessing) that `--config.model.hf_path` loads.

Each chain-task sample shows its chain with a stable per-sample probability
`sft.chain_fraction` of its level (a quarter on average, more on harder
items) and answers directly otherwise, so the base can reason but, left to
choose, mostly answers at once. On medium and hard items, and on the main
job's direct-answer tasks, a direct answer is taught as a guess
(`sft.guess`: another item's answer of the same task and level): there the
base knows the answer's format and prior but only its chain reads the item,
so RL has the choice to learn, and the direct tasks' pixels.

`refine` trains an existing base (`--config.model.hf_path`, by default the
committed one, which it replaces) for 1,400 steps of these rules at a lower
learning rate: the committed base is the second run's (10,000 steps from
scratch, bench/README.md) refined so once; its card keeps its parent's.
`smoke` keeps every setting but the sizes (a few steps, a small pool) and
exports into the work directory, never over the committed base.

Reading this file imports no JAX.
"""

import os

import ml_collections

from fluxjax import config_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE_DIR = config_args.TINY_BASE


MODIFIERS = {
  "refine": "1,400 steps of these rules on the base at model.hf_path (default: the committed one)",
  "smoke": "a few steps on a small pool, exported into the work directory",
}
# Where the post-training job's direct answers carry no skill: its
# direct-answer tasks, and the chain tasks' harder levels.
GUESS = dict(tasks=("colour", "count_colour", "last_colour"), levels=("medium", "hard"))


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = config_args.parse_arg(arg, **dict.fromkeys(MODIFIERS, False))
  c = config_args.load_config(os.path.join(REPO, "configs", "vlm.py"), "tiny")
  c.total_steps = 0  # the SFT path alone
  # 4 layers (tiny4) at batch 32 copied no better than 2 (bench/README.md).
  c.model.preset = "tiny"
  c.data.mix = "pretrain"
  # A pool the 0.5M-parameter model cannot memorize in its 4 epochs (10,000
  # steps of 32).
  c.data.synth_train, c.data.synth_eval = 80_000, 512
  c.eval.prompts, c.eval.samples_per_prompt = 512, 1
  # The longest reference responses (hard colour_list and pair_census) run
  # to about 61 tokens.
  c.rl.max_new_tokens = 80
  # Batch 16 for twice the steps copied and chained worse than 32
  # (bench/README.md, the fourth run).
  c.sft.steps = 10_000
  c.sft.batch_size = 32
  c.sft.lr, c.sft.warmup_steps, c.sft.end_lr_frac = 2e-3, 200, 0.05
  # A quarter on average. At 0.25 on every level the direct answer paid more
  # than the chain under sampling on most medium and hard items, and RL
  # switched the chains off (bench/README.md, the fifth run); more chains
  # and fewer direct answers on harder items make the chain the better bet
  # where it has work to do.
  c.sft.chain_fraction.update(dict(easy=0.1, medium=0.25, hard=0.45, other=0.25))
  # Even so the base's direct answers matched its chains on most medium and
  # hard items, since the same items taught both, and RL switched the chains
  # off (bench/README.md, the sixth run); with guessed direct answers there,
  # RL switched them on.
  c.sft.guess.update(GUESS)
  c.sft.eval_every = 2500
  c.sft.checkpoint_every = 250
  c.sft.export_dir = BASE_DIR
  if arg.refine:
    c.model.hf_path = BASE_DIR
    c.data.synth_train = 32_000
    c.eval.prompts = 256
    c.sft.steps, c.sft.lr, c.sft.warmup_steps = 1_400, 1e-3, 50
    c.sft.eval_every = 0
  if arg.smoke:
    c.data.synth_train, c.data.synth_eval = 256, 16
    c.eval.prompts = 16
    c.sft.steps, c.sft.warmup_steps, c.sft.eval_every, c.sft.checkpoint_every = 12, 2, 6, 5
    c.sft.export_dir = "base"  # inside the work directory
  return c
