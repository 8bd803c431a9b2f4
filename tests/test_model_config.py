"""Presets, config.json conversion and logical axis annotations."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config as config_lib
from fluxjax.models import hf_io, vlm
from fluxjax.sharding import axes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Published parameter counts of the Qwen2.5-VL checkpoints (model cards / index.json).
PUBLISHED_BILLIONS = {"3b": 3.75, "7b": 8.29, "32b": 33.45}


def _our_shapes(cfg):
  """{HF name: shape} of our abstract model, through the exporter's name map."""
  shapes = {}
  for key, var in nnx.to_flat_state(nnx.state(vlm.abstract_model(cfg), nnx.Param)):
    path = ".".join(map(str, key))
    stack, template, _ = hf_io._leaf_rule(path)
    shape = var.get_value().shape
    for i in range(shape[0] if stack else 1):
      shapes[template.format(i)] = int(np.prod(shape[1:] if stack else shape))
  return shapes


@pytest.mark.parametrize("name", ["tiny", "3b", "7b", "32b"])
def test_presets_match_transformers_architecture(name):
  """Each preset, exported to config.json, builds the same tensors in transformers."""
  cfg = config_lib.preset(name)
  hf_cfg = transformers.Qwen2_5_VLConfig(**config_lib.to_hf_dict(cfg))
  with torch.device("meta"):
    hf = transformers.Qwen2_5_VLForConditionalGeneration(hf_cfg)
  theirs = {hf_io.canonical_hf_name(k): v.numel() for k, v in hf.state_dict().items()}
  if cfg.text.tie_word_embeddings:
    theirs.pop("lm_head.weight", None)
  ours = _our_shapes(cfg)
  assert ours == theirs
  if name in PUBLISHED_BILLIONS:
    assert sum(ours.values()) / 1e9 == pytest.approx(PUBLISHED_BILLIONS[name], abs=0.01)
  else:
    assert 1e5 < sum(ours.values()) < 1e6  # "a few hundred thousand"


def test_config_json_round_trip_and_published_layout(tmp_path):
  cfg = config_lib.preset("7b")
  assert config_lib.from_hf_dict(config_lib.to_hf_dict(cfg)) == cfg
  # transformers 5 nests text fields under text_config and uses rope_parameters.
  hf_cfg = transformers.Qwen2_5_VLConfig(**config_lib.to_hf_dict(cfg))
  hf_cfg.save_pretrained(tmp_path)
  with open(tmp_path / "config.json") as f:
    saved = json.load(f)
  assert "text_config" in saved
  assert config_lib.load_hf_config(str(tmp_path)) == cfg


def test_bad_configs_are_clear_errors():
  with pytest.raises(ValueError, match="mrope_section"):
    config_lib.preset("tiny").replace(
      text=config_lib.TextConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        mrope_section=(16, 24, 24),
      )
    )
  with pytest.raises(ValueError, match="unknown model preset"):
    config_lib.preset("13b")
  with pytest.raises(ValueError, match="qwen2_5_vl"):
    config_lib.from_hf_dict({"model_type": "llama"})


def test_every_parameter_names_its_logical_axes():
  model = vlm.abstract_model(config_lib.preset("7b"))
  for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    names = var.get_metadata().get("out_sharding")
    shape = var.get_value().shape
    assert names is not None and len(names) == len(shape), key
    assert all(n is None or n in axes.ALL_WEIGHT_AXES for n in names), (key, names)
    # Every dimension larger than a head is named, so the rules can shard it.
    assert all(n is not None for n, s in zip(names, shape) if s > 256), (key, names, shape)


def test_abstract_model_allocates_nothing():
  model = vlm.abstract_model(config_lib.preset("32b"))
  leaves = jax.tree.leaves(nnx.state(model))
  assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
