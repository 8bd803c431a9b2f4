"""The HF transformers peer for parity tests: a random tiny Qwen2.5-VL.

The config exercises GQA, M-RoPE sections, window + full attention and the
merger; token ids match the shipped synthetic tokenizer. Every weight, biases
and norms included, is randomized so that none goes untested.
"""

import torch
import transformers

TOL = 1e-4
IMG, VID, VSTART, VEND = 502, 503, 499, 500


def hf_config(tie=False):
  """A tiny config; images of > 8 patches per side span several windows."""
  return transformers.Qwen2_5_VLConfig(
    vision_config=dict(
      depth=4,
      hidden_size=32,
      intermediate_size=64,
      num_heads=2,
      out_hidden_size=64,
      fullatt_block_indexes=[1, 3],
      window_size=112,
      tokens_per_second=2,
    ),
    text_config=dict(
      vocab_size=512,
      hidden_size=64,
      intermediate_size=128,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      rms_norm_eps=1e-6,
      max_position_embeddings=4096,
      rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    ),
    image_token_id=IMG,
    video_token_id=VID,
    vision_start_token_id=VSTART,
    vision_end_token_id=VEND,
    tie_word_embeddings=tie,
  )


def random_hf_model(tie=False, seed=0):
  torch.manual_seed(seed)
  model = transformers.Qwen2_5_VLForConditionalGeneration(hf_config(tie)).eval().float()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q" in name:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.08 * torch.randn_like(p))
  return model
