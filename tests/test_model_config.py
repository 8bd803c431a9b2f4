"""Presets, config.json conversion and logical axis annotations."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config as config_lib
from fluxjax.models import hf_load, vlm
from fluxjax.models import tokenizer as tokenizer_lib
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
    stack, template, _ = hf_load.leaf_rule(path)
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
  theirs = {hf_load.canonical_hf_name(k): v.numel() for k, v in hf.state_dict().items()}
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


def test_a_preset_speaks_its_tokenizer_and_a_checkpoint_must_agree_with_it():
  """Random weights take the tokenizer's special ids (the 3b shape with the
  shipped tokenizer finds its image spans); a checkpoint's ids are fixed by
  its weights, so a disagreeing tokenizer is an error naming the token."""
  tok = tokenizer_lib.Tokenizer.default()
  ids = tok.model_token_ids()
  qwen = config_lib.preset("3b")
  assert qwen.image_token_id == 151655 and ids["image_token_id"] == tok.image_pad_id == 502
  spoken = config_lib.with_tokenizer_ids(qwen, ids, tok.vocab_size, from_checkpoint=False)
  assert {k: getattr(spoken, k) for k in ids} == ids and spoken.text == qwen.text
  with pytest.raises(ValueError, match="image_token_id 151655 in the model, 502 in the tokenizer"):
    config_lib.with_tokenizer_ids(qwen, ids, tok.vocab_size, from_checkpoint=True)
  tiny = config_lib.preset("tiny")  # the shipped tokenizer's own model
  assert config_lib.with_tokenizer_ids(tiny, ids, tok.vocab_size, from_checkpoint=True) == tiny
  with pytest.raises(ValueError, match="tokenizer has 151936 tokens"):
    config_lib.with_tokenizer_ids(tiny, ids, 151936, from_checkpoint=False)


def test_a_runs_tokenizer_is_the_given_one_else_the_checkpoints_else_the_shipped(tmp_path):
  shipped = tokenizer_lib.Tokenizer.default()
  assert tokenizer_lib.resolve("", "").vocab_size == shipped.vocab_size
  assert tokenizer_lib.resolve("", str(tmp_path)).vocab_size == shipped.vocab_size  # none there
  # The checkpoint's own tokenizer.json: here the shipped one less its merges'
  # last ordinary token, told apart by its vocabulary size.
  with open(tokenizer_lib.ASSET_PATH, encoding="utf-8") as f:
    data = json.load(f)
  vocab = data["model"]["vocab"]
  last = max((t for t in vocab if vocab[t] < tokenizer_lib.SYNTHETIC_ORDINARY), key=vocab.get)
  del vocab[last]
  data["model"]["merges"] = [
    m for m in data["model"]["merges"] if "".join(m.split(" ") if isinstance(m, str) else m) != last
  ]
  (tmp_path / "tokenizer.json").write_text(json.dumps(data))
  assert tokenizer_lib.resolve("", str(tmp_path)).vocab_size == shipped.vocab_size - 1
  with pytest.raises(FileNotFoundError, match=r"no tokenizer file at .*no_such\.json"):
    tokenizer_lib.resolve(str(tmp_path / "no_such.json"), str(tmp_path))
