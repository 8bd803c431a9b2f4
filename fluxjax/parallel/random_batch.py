"""Random mixed batches (text, images, a video) for checking strategies.

The strategy equality tests and bench/gpu_check.py train the same kind of
batch: random token ids with vision spans whose patches are random, RL fields
filled in. Lengths and media grids are small enough for the tiny preset on a
CPU; `scale` stretches the text for a larger check.
"""

from __future__ import annotations

import numpy as np

from fluxjax.models import inputs, processor
from fluxjax.models.config import ModelConfig
from fluxjax.parallel.batch import TrainSequence

# (text tokens, [(kind, (t, h, w) patch grid), ...]) of the mixed batch; the
# last entry is longer than the capacities the checks use.
MIXED = (
  (10, (("image", (1, 4, 4)),)),
  (30, ()),
  (5, (("video", (2, 4, 8)),)),
  (17, ()),
  (40, (("image", (1, 8, 4)),)),
  (9, ()),
  (23, (("image", (1, 4, 8)), ("image", (1, 4, 4)))),
  (12, ()),
)
LONG = (150, (("image", (1, 8, 8)),))


def random_sequence(
  cfg: ModelConfig,
  rng: np.random.Generator,
  n_text: int,
  media=(),
  *,
  advantage_range: tuple[float, float] = (0.5, 1.5),
) -> TrainSequence:
  """`n_text` random tokens, then per (kind, grid) in `media` a vision span and
  4 more tokens. The first third is prompt (loss mask 0); advantages are
  uniform in `advantage_range`, behaviour logprobs uniform in [-3, -0.5]."""
  ids, items = list(rng.integers(0, 490, n_text)), []
  for kind, grid in media:
    n = int(np.prod(grid))
    items.append(
      processor.ProcessedVision(
        rng.standard_normal((n, cfg.vision.patch_dim)).astype(np.float32),
        grid,
        1.0 if kind == "video" else None,
        kind,
      )
    )
    pad = cfg.image_token_id if kind == "image" else cfg.video_token_id
    ids += (
      [cfg.vision_start_token_id]
      + [pad] * (n // 4)
      + [cfg.vision_end_token_id]
      + list(rng.integers(0, 490, 4))
    )
  seq = inputs.sequence_from_tokens(ids, items, cfg)
  t = len(seq)
  return TrainSequence(
    seq,
    loss_mask_T=(np.arange(t) >= t // 3).astype(np.float32),
    advantages_T=rng.uniform(*advantage_range, t).astype(np.float32),
    old_logprobs_T=-rng.uniform(0.5, 3.0, t).astype(np.float32),
  )


def mixed_batch(
  cfg: ModelConfig,
  seed: int = 0,
  *,
  long: bool = False,
  scale: int = 1,
  advantage_range: tuple[float, float] = (0.5, 1.5),
) -> list[TrainSequence]:
  """The MIXED sequences (plus LONG if `long`), text lengths times `scale`."""
  rng = np.random.default_rng(seed)
  spec = MIXED + ((LONG,) if long else ())
  return [
    random_sequence(cfg, rng, scale * n, media, advantage_range=advantage_range)
    for n, media in spec
  ]
