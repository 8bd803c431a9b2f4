"""bench/mfu.py's FLOP counter against the model's own parameter shapes.

MFU is only as right as its numerator: every matmul weight a token (or patch)
passes through must be counted once, x2 per multiply-add, x3 for training.
"""

import os
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config, vlm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import mfu


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
  assert mfu.vision_flops(cfg, side, 1) == attention + matmuls


def test_attention_pairs_are_causal_per_sequence():
  cfg = config.preset("tiny")
  one = mfu.text_flops(cfg, [8]) - mfu.text_flops(cfg, [1]) * 8
  t = cfg.text
  per_pair = 3 * t.num_layers * 4 * t.num_heads * t.head_dim
  assert one == per_pair * (8 * 9 // 2 - 8)
  # Packing two sequences does not add cross-sequence pairs.
  assert mfu.text_flops(cfg, [8, 8]) == 2 * mfu.text_flops(cfg, [8])
