"""Qwen2.5-VL model configuration: presets and HF `config.json` conversion.

The dataclasses hold architecture only; run-time choices (compute dtype,
attention backend, remat, logprob chunking) live in `ModelConfig` too so that
one object travels from the run config to every jitted function.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable
from typing import Any

from fluxjax.planning import balance


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """The vision tower (ViT with window attention and a 2x2 patch merger)."""

  depth: int = 32
  hidden_size: int = 1280
  intermediate_size: int = 3420
  num_heads: int = 16
  in_channels: int = 3
  patch_size: int = 14
  temporal_patch_size: int = 2
  spatial_merge_size: int = 2
  window_size: int = 112  # in pixels; 112 / 14 / 2 = 4 merged units per window side
  fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
  out_hidden_size: int = 3584  # the text model's width
  tokens_per_second: int = 2
  rope_theta: float = 10000.0
  rms_norm_eps: float = 1e-6

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads

  @property
  def patch_dim(self) -> int:
    return self.in_channels * self.temporal_patch_size * self.patch_size**2

  @property
  def merge_unit(self) -> int:
    return self.spatial_merge_size**2

  @property
  def window_merged_units(self) -> int:
    """Side of one attention window, in merged (2x2) units."""
    return self.window_size // self.spatial_merge_size // self.patch_size


@dataclasses.dataclass(frozen=True)
class TextConfig:
  """The Qwen2 decoder with M-RoPE."""

  vocab_size: int = 152064
  hidden_size: int = 3584
  intermediate_size: int = 18944
  num_layers: int = 28
  num_heads: int = 28
  num_kv_heads: int = 4
  rope_theta: float = 1_000_000.0
  mrope_section: tuple[int, ...] = (16, 24, 24)
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  max_position_embeddings: int = 128000

  @property
  def head_dim(self) -> int:
    return self.hidden_size // self.num_heads


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Everything a forward pass needs to know about the model."""

  vision: VisionConfig = VisionConfig()
  text: TextConfig = TextConfig()
  image_token_id: int = 151655
  video_token_id: int = 151656
  vision_start_token_id: int = 151652
  vision_end_token_id: int = 151653
  bos_token_id: int = 151643
  eos_token_id: int = 151645
  # Run-time choices.
  dtype: str = "float32"  # compute dtype; "bfloat16" on GPU
  param_dtype: str = "float32"
  attention_backend: str = "auto"  # fluxjax/models/attention/: auto, xla, xla_blocked, cudnn, ...
  decode_attention: str = "xla"  # the engine's decode steps: xla, pallas_gpu (models/decode.py)
  # What each scanned layer keeps for the backward pass (layers.REMAT_POLICIES):
  # "none", "full" (recompute everything), "save_dots", "save_dots_attention".
  remat: str = "none"
  logprob_vocab_chunk: int = 8192  # vocabulary chunk for target-token logprobs
  # Where text positions resume after a vision span (models/rope_index.py):
  # "max_plus_one" (Qwen's original rule, SGLang/vLLM/veRL) or "grid_extent"
  # (transformers 5). Trainer and rollout server must agree.
  mrope_text_after_vision: str = "max_plus_one"

  def __post_init__(self):
    t, v = self.text, self.vision
    if t.hidden_size % t.num_heads:
      raise ValueError(f"text hidden_size {t.hidden_size} not divisible by num_heads {t.num_heads}")
    if t.num_heads % t.num_kv_heads:
      raise ValueError(f"num_heads {t.num_heads} not divisible by num_kv_heads {t.num_kv_heads}")
    if 2 * sum(t.mrope_section) != t.head_dim:
      raise ValueError(
        f"mrope_section {t.mrope_section} must sum to head_dim/2 = {t.head_dim // 2}"
      )
    from fluxjax.models.layers import REMAT_POLICIES  # local: config stays light to import

    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"model.remat {self.remat!r} unknown; available: {sorted(REMAT_POLICIES)}")
    if v.hidden_size % v.num_heads or v.head_dim % 4:
      raise ValueError(
        f"vision head_dim {v.hidden_size}/{v.num_heads} must be a multiple of 4 (2D rotary)"
      )
    if v.out_hidden_size != t.hidden_size:
      raise ValueError(
        f"vision out_hidden_size {v.out_hidden_size} != text hidden_size {t.hidden_size}"
      )
    if self.mrope_text_after_vision not in ("max_plus_one", "grid_extent"):
      raise ValueError(
        f"mrope_text_after_vision must be max_plus_one or grid_extent, "
        f"got {self.mrope_text_after_vision!r}"
      )
    if any(not 0 <= i < v.depth for i in v.fullatt_block_indexes):
      raise ValueError(f"fullatt_block_indexes {v.fullatt_block_indexes} outside depth {v.depth}")

  def replace(self, **kw) -> ModelConfig:
    return dataclasses.replace(self, **kw)

  def cost_shape(self, bytes_per_elem: int = 2) -> balance.CostShape:
    """The decoder dimensions the planners' cost model reads (bf16 activations)."""
    t = self.text
    return balance.CostShape(
      num_layers=t.num_layers,
      hidden=t.hidden_size,
      num_heads=t.num_heads,
      num_kv_heads=t.num_kv_heads,
      head_dim=t.head_dim,
      intermediate=t.intermediate_size,
      vocab=t.vocab_size,
      bytes_per_elem=bytes_per_elem,
    )


# The HF architecture of every preset (config.json's `architectures`).
ARCHITECTURE = "Qwen2_5_VLForConditionalGeneration"


def shape_summary(cfg: ModelConfig) -> dict[str, int]:
  """The sizes that decide whether two processes hold the same architecture
  (a rollout server reports them; a fleet compares them with the trainer's)."""
  t, v = cfg.text, cfg.vision
  return {
    "vocab_size": t.vocab_size,
    "hidden_size": t.hidden_size,
    "intermediate_size": t.intermediate_size,
    "num_layers": t.num_layers,
    "num_heads": t.num_heads,
    "num_kv_heads": t.num_kv_heads,
    "vision_depth": v.depth,
    "vision_hidden_size": v.hidden_size,
  }


def _preset_tiny() -> ModelConfig:
  # A few hundred thousand parameters; ids match the shipped synthetic tokenizer
  # (ordinary tokens 0..489, Qwen's 22 special tokens at 490..511 in Qwen order).
  return ModelConfig(
    # 8 query heads over 2 kv heads: every Ulysses degree up to 8 (with kv
    # replication) is possible on the fake 8-device mesh.
    vision=VisionConfig(
      depth=4,
      hidden_size=32,
      intermediate_size=64,
      num_heads=2,
      fullatt_block_indexes=(1, 3),
      out_hidden_size=128,
    ),
    text=TextConfig(
      vocab_size=512,
      hidden_size=128,
      intermediate_size=256,
      num_layers=2,
      num_heads=8,
      num_kv_heads=2,
      mrope_section=(2, 3, 3),
      tie_word_embeddings=False,
      max_position_embeddings=8192,
    ),
    image_token_id=502,
    video_token_id=503,
    vision_start_token_id=499,
    vision_end_token_id=500,
    bos_token_id=490,
    eos_token_id=492,
    logprob_vocab_chunk=128,
  )


def _preset_3b() -> ModelConfig:
  return ModelConfig(
    vision=VisionConfig(out_hidden_size=2048),
    text=TextConfig(
      vocab_size=151936,
      hidden_size=2048,
      intermediate_size=11008,
      num_layers=36,
      num_heads=16,
      num_kv_heads=2,
      tie_word_embeddings=True,
    ),
  )


def _preset_7b() -> ModelConfig:
  return ModelConfig()


def _preset_32b() -> ModelConfig:
  return ModelConfig(
    vision=VisionConfig(intermediate_size=3456, out_hidden_size=5120),
    text=TextConfig(
      vocab_size=152064,
      hidden_size=5120,
      intermediate_size=27648,
      num_layers=64,
      num_heads=40,
      num_kv_heads=8,
    ),
  )


def _smoke(base: ModelConfig) -> ModelConfig:
  """`base`'s architecture at the tiny preset's sizes, for a smoke run on a CPU.

  The attention heads, grouping and embedding tie stay `base`'s (the
  sequence-parallel degrees a strategy may take follow from them); widths
  (head dim 16), depths and vocabulary shrink to the tiny preset's, whose
  token ids match the shipped synthetic tokenizer.
  """
  tiny = _preset_tiny()
  t = base.text
  hidden = 16 * t.num_heads
  text = dataclasses.replace(
    tiny.text,
    hidden_size=hidden,
    intermediate_size=2 * hidden,
    num_heads=t.num_heads,
    num_kv_heads=t.num_kv_heads,
    tie_word_embeddings=t.tie_word_embeddings,
  )
  vision = dataclasses.replace(tiny.vision, out_hidden_size=hidden)
  return dataclasses.replace(tiny, text=text, vision=vision)


def _preset_tiny4() -> ModelConfig:
  """The tiny preset with 4 decoder layers, tried for the base's copy by key;
  at batch 32 it copied no better than 2 layers (bench/README.md, the base)."""
  tiny = _preset_tiny()
  return dataclasses.replace(tiny, text=dataclasses.replace(tiny.text, num_layers=4))


_FULL: dict[str, Callable[[], ModelConfig]] = {
  "3b": _preset_3b,
  "7b": _preset_7b,
  "32b": _preset_32b,
}
SMOKE_SUFFIX = "_smoke"
PRESETS: dict[str, Callable[[], ModelConfig]] = {
  "tiny": _preset_tiny,
  "tiny4": _preset_tiny4,
  **_FULL,
  **{name + SMOKE_SUFFIX: functools.partial(lambda f: _smoke(f()), f) for name, f in _FULL.items()},
}


def preset(name: str, **overrides) -> ModelConfig:
  """Returns a named preset (tiny, tiny4, 3b, 7b, 32b, or a full one's `*_smoke`
  version: see `_smoke`) with run-time overrides."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
  return PRESETS[name]().replace(**overrides)


def with_tokenizer_ids(
  cfg: ModelConfig, ids: dict[str, int], vocab_size: int, *, from_checkpoint: bool
) -> ModelConfig:
  """`cfg` speaking a tokenizer's special ids (`Tokenizer.model_token_ids`).

  A checkpoint's ids are fixed by its weights, so a tokenizer that disagrees
  is an error; a preset's random weights take the tokenizer's ids.

  Raises:
    ValueError: the tokenizer's vocabulary exceeds the model's, or (with
      `from_checkpoint`) a special id differs from the checkpoint's config.
  """
  if vocab_size > cfg.text.vocab_size:
    raise ValueError(
      f"the tokenizer has {vocab_size} tokens but the model's vocabulary {cfg.text.vocab_size}"
    )
  differ = {k: (getattr(cfg, k), v) for k, v in ids.items() if getattr(cfg, k) != v}
  if differ and from_checkpoint:
    listed = ", ".join(
      f"{k} {m} in the model, {t} in the tokenizer" for k, (m, t) in differ.items()
    )
    raise ValueError(f"tokenizer and checkpoint disagree on special tokens: {listed}")
  return cfg.replace(**ids)


# --- HF config.json ---------------------------------------------------------------

_TEXT_KEYS = {  # ours -> HF
  "vocab_size": "vocab_size",
  "hidden_size": "hidden_size",
  "intermediate_size": "intermediate_size",
  "num_layers": "num_hidden_layers",
  "num_heads": "num_attention_heads",
  "num_kv_heads": "num_key_value_heads",
  "rms_norm_eps": "rms_norm_eps",
  "max_position_embeddings": "max_position_embeddings",
}
_VISION_KEYS = {
  "depth": "depth",
  "hidden_size": "hidden_size",
  "intermediate_size": "intermediate_size",
  "num_heads": "num_heads",
  "in_channels": "in_channels",
  "patch_size": "patch_size",
  "temporal_patch_size": "temporal_patch_size",
  "spatial_merge_size": "spatial_merge_size",
  "window_size": "window_size",
  "out_hidden_size": "out_hidden_size",
  "tokens_per_second": "tokens_per_second",
}
_TOKEN_KEYS = (
  "image_token_id",
  "video_token_id",
  "vision_start_token_id",
  "vision_end_token_id",
  "bos_token_id",
  "eos_token_id",
)


def from_hf_dict(hf: dict[str, Any], **overrides) -> ModelConfig:
  """Builds a ModelConfig from a Qwen2.5-VL `config.json` dict.

  Reads both the published layout (text fields at top level, `rope_scaling`)
  and transformers 5's (`text_config`, `rope_parameters`).
  """
  model_type = hf.get("model_type")
  if model_type not in ("qwen2_5_vl", None):
    raise ValueError(f"expected a qwen2_5_vl config, got model_type={model_type!r}")
  text_src = dict(hf)
  text_src.update(hf.get("text_config") or {})
  vis_src = hf.get("vision_config") or {}
  rope = text_src.get("rope_parameters") or text_src.get("rope_scaling") or {}
  text_kw = {ours: text_src[k] for ours, k in _TEXT_KEYS.items() if k in text_src}
  theta = rope.get("rope_theta", text_src.get("rope_theta"))
  if theta is not None:
    text_kw["rope_theta"] = float(theta)
  if "mrope_section" in rope:
    text_kw["mrope_section"] = tuple(rope["mrope_section"])
  tie = hf.get("tie_word_embeddings", text_src.get("tie_word_embeddings"))
  if tie is not None:
    text_kw["tie_word_embeddings"] = bool(tie)
  vis_kw = {ours: vis_src[k] for ours, k in _VISION_KEYS.items() if k in vis_src}
  if "fullatt_block_indexes" in vis_src:
    vis_kw["fullatt_block_indexes"] = tuple(vis_src["fullatt_block_indexes"])
  vis_rope = vis_src.get("rope_parameters") or {}
  if "rope_theta" in vis_rope:
    vis_kw["rope_theta"] = float(vis_rope["rope_theta"])
  tok_kw: dict[str, Any] = {}  # keyword arguments of ModelConfig
  for k in _TOKEN_KEYS:
    v = hf.get(k, text_src.get(k))
    if isinstance(v, list):  # eos may be a list in some exports; the first is the turn end
      v = v[0]
    if v is not None:
      tok_kw[k] = int(v)
  return ModelConfig(
    vision=VisionConfig(**vis_kw), text=TextConfig(**text_kw), **tok_kw, **overrides
  )


def to_hf_dict(cfg: ModelConfig, torch_dtype: str = "float32") -> dict[str, Any]:
  """The published Qwen2.5-VL `config.json` layout (what SGLang and HF read)."""
  t, v = cfg.text, cfg.vision
  text = {k: getattr(t, ours) for ours, k in _TEXT_KEYS.items()}
  vision = {k: getattr(v, ours) for ours, k in _VISION_KEYS.items()}
  vision["fullatt_block_indexes"] = list(v.fullatt_block_indexes)
  vision["hidden_act"] = "silu"
  vision["model_type"] = "qwen2_5_vl"
  rope = {"type": "mrope", "rope_type": "default", "mrope_section": list(t.mrope_section)}
  out = {
    "architectures": [ARCHITECTURE],
    "model_type": "qwen2_5_vl",
    **text,
    "hidden_act": "silu",
    "attention_dropout": 0.0,
    "rope_theta": t.rope_theta,
    "rope_scaling": rope,
    "sliding_window": t.max_position_embeddings,
    "use_sliding_window": False,
    "max_window_layers": t.num_layers,
    "tie_word_embeddings": t.tie_word_embeddings,
    "torch_dtype": torch_dtype,
    "use_cache": True,
    "vision_config": vision,
  }
  out.update({k: getattr(cfg, k) for k in _TOKEN_KEYS})
  return out


def load_hf_config(path: str, **overrides) -> ModelConfig:
  """Reads `config.json` from a checkpoint folder (or the file itself)."""
  file = os.path.join(path, "config.json") if os.path.isdir(path) else path
  with open(file) as f:
    return from_hf_dict(json.load(f), **overrides)
