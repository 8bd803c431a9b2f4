"""The FLOP counter (fluxjax/models/flops.py) against the model's own parameter shapes.

MFU is only as right as its numerator: every matmul weight a token (or patch)
passes through must be counted once, x2 per multiply-add, x3 for training.
"""

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config, vlm
from fluxjax.models import flops as mfu


def _kernel_sizes(cfg) -> dict[str, int]:
  """Weight elements per matmul group, from the model's parameter tree."""
  model = nnx.eval_shape(lambda: vlm.create_model(cfg, 0))
  sizes = {"text": 0, "vision": 0, "merger": 0}
  for path, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
    name = jax.tree_util.keystr(path)
    if "kernel" not in name and "lm_head" not in name:
      continue  # norms, biases and the embedding lookup are no matmuls
    group = "merger" if "merger" in name else "vision" if "visual" in name else "text"
    sizes[group] += int(np.prod(x.shape))
  return sizes


@pytest.mark.parametrize("preset", ["tiny", "3b", "7b"])
def test_flops_count_every_weight_once(preset):
  cfg = config.preset(preset)
  sizes = _kernel_sizes(cfg)
  if cfg.text.tie_word_embeddings:  # the LM head is the embedding, used as a matmul
    sizes["text"] += cfg.text.vocab_size * cfg.text.hidden_size
  # One token of length 1 has a single (self) attention pair.
  attention_1 = 3 * cfg.text.num_layers * 4 * cfg.text.num_heads * cfg.text.head_dim
  assert mfu.text_flops(cfg, [1]) - attention_1 == 6 * sizes["text"]
  side = 2 * cfg.vision.spatial_merge_size  # small enough for one window
  v = cfg.vision
  patches = side * side
  attention = 3 * 4 * v.hidden_size * v.depth * patches**2
  matmuls = 6 * (patches * sizes["vision"] + patches // v.merge_unit * sizes["merger"])
  assert mfu.vision_flops(cfg, [(1, side, side)]) == attention + matmuls
  # A clip of 3 frame groups: attention stays within each one.
  assert mfu.vision_flops(cfg, [(3, side, side)]) == 3 * (attention + matmuls)


def test_window_blocks_attend_within_their_windows():
  cfg = config.preset("7b")
  v = cfg.vision
  window = v.window_merged_units * v.spatial_merge_size
  full = len(v.fullatt_block_indexes)
  h, w = window + 2, 2 * window  # a remainder row of windows
  one_frame = mfu.vision_flops(cfg, [(1, h, w)])
  matmul_only = mfu.vision_flops(cfg, [(1, h, w)]) - 3 * 4 * v.hidden_size * (
    full * (h * w) ** 2 + (v.depth - full) * (window**2 + 2**2) * (2 * window**2)
  )
  # Removing the attention leaves what the patches' matmuls alone cost.
  patches = h * w
  per_patch = 2 * v.patch_dim * v.hidden_size + v.depth * 2 * (
    4 * v.hidden_size**2 + 3 * v.hidden_size * v.intermediate_size
  )
  merged = (
    patches // v.merge_unit * 2 * (16 * v.hidden_size**2 + 4 * v.hidden_size * v.out_hidden_size)
  )
  assert matmul_only == 3 * (patches * per_patch + merged)
  assert one_frame > matmul_only


def test_attention_pairs_are_causal_per_sequence():
  cfg = config.preset("tiny")
  one = mfu.text_flops(cfg, [8]) - mfu.text_flops(cfg, [1]) * 8
  t = cfg.text
  per_pair = 3 * t.num_layers * 4 * t.num_heads * t.head_dim
  assert one == per_pair * (8 * 9 // 2 - 8)
  # Packing two sequences does not add cross-sequence pairs.
  assert mfu.text_flops(cfg, [8, 8]) == 2 * mfu.text_flops(cfg, [8])
