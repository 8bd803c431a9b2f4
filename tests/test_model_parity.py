"""Parity with HF transformers' Qwen2_5_VLForConditionalGeneration (torch, fp32).

The peer is built from a random tiny config that exercises GQA, M-RoPE sections,
window + full attention (images span several windows) and the 2x2 merger, with
every weight (biases and norms included) randomized so that none is untested.
Weights travel through `save_pretrained` -> our loader, and our exporter ->
`from_pretrained`, so the checkpoint layouts are tested on the way.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402

from fluxjax.models import hf_export, hf_load, vision, vlm  # noqa: E402
from hf_peer import IMG, TOL, VEND, VID, VSTART, random_hf_model  # noqa: E402


@pytest.fixture(scope="module")
def peer(tmp_path_factory):
  hf = random_hf_model()
  folder = tmp_path_factory.mktemp("hf_ckpt")
  hf.save_pretrained(folder)
  ours = hf_load.load_hf_checkpoint(str(folder))
  return hf, ours


def build_prompt(rng, spans):
  """Token ids from spans: ("text", n) | ("image", grid) | ("video", grid)."""
  ids, types = [], []
  for kind, arg in spans:
    if kind == "text":
      ids += list(rng.integers(0, 490, arg))
      types += [0] * arg
    else:
      t, h, w = arg
      n = t * h * w // 4
      ids += [VSTART] + [IMG if kind == "image" else VID] * n + [VEND]
      types += [0] + [1 if kind == "image" else 2] * n + [0]
  return np.array(ids, np.int64), np.array(types, np.int64)


def run_hf(hf, ids, types, images=(), videos=(), second_per_grid=None):
  kw = dict(input_ids=torch.tensor(ids[None]), mm_token_type_ids=torch.tensor(types[None]))
  if images:
    kw["pixel_values"] = torch.tensor(np.concatenate([p for p, _ in images]))
    kw["image_grid_thw"] = torch.tensor([g for _, g in images])
  if videos:
    kw["pixel_values_videos"] = torch.tensor(np.concatenate([p for p, _ in videos]))
    kw["video_grid_thw"] = torch.tensor([g for _, g in videos])
    kw["second_per_grid_ts"] = torch.tensor(second_per_grid, dtype=torch.float32)
  with torch.no_grad():
    positions = hf.model.get_rope_index(
      kw["input_ids"],
      kw["mm_token_type_ids"],
      kw.get("image_grid_thw"),
      kw.get("video_grid_thw"),
      kw.get("second_per_grid_ts"),
    )[0]
    logits = hf(**kw).logits[0].numpy()
  return logits, positions[:, 0].numpy()


def run_ours(ours, ids, positions_3T, media=(), capacity=None):
  vis = None
  if media:
    vis = vision.make_vision_inputs(
      [p for p, _ in media], [g for _, g in media], ours.cfg.vision, capacity
    )
  t = len(ids)
  batch = vlm.PackedInputs(
    tokens_BT=ids[None].astype(np.int32),
    positions_3BT=positions_3T[:, None].astype(np.int32),
    segment_ids_BT=np.ones((1, t), np.int32),
    segment_pos_BT=np.arange(t, dtype=np.int32)[None],
    vision=vis,
  )
  return np.asarray(jax.jit(lambda m, b: m.logits(b))(ours, batch))[0]


def patches(rng, grid):
  return (rng.standard_normal((int(np.prod(grid)), 1176)).astype(np.float32), tuple(grid))


def test_text_only(peer):
  hf, ours = peer
  rng = np.random.default_rng(0)
  ids, types = build_prompt(rng, [("text", 23)])
  want, pos = run_hf(hf, ids, types)
  got = run_ours(ours, ids, pos)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_one_image_several_windows(peer):
  hf, ours = peer
  rng = np.random.default_rng(1)
  # 16x12 patches -> 8x6 merged units -> 2x2 windows of <= 4x4 units.
  img = patches(rng, (1, 16, 12))
  ids, types = build_prompt(rng, [("text", 5), ("image", img[1]), ("text", 7)])
  want, pos = run_hf(hf, ids, types, images=[img])
  got = run_ours(ours, ids, pos, [img], capacity=int(np.prod(img[1])) + 16)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_several_images_of_different_sizes(peer):
  hf, ours = peer
  rng = np.random.default_rng(2)
  imgs = [patches(rng, g) for g in [(1, 4, 4), (1, 16, 12), (1, 10, 20)]]
  ids, types = build_prompt(
    rng,
    [
      ("text", 3),
      ("image", imgs[0][1]),
      ("text", 2),
      ("image", imgs[1][1]),
      ("image", imgs[2][1]),
      ("text", 4),
    ],
  )
  want, pos = run_hf(hf, ids, types, images=imgs)
  got = run_ours(ours, ids, pos, imgs)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_video(peer):
  hf, ours = peer
  rng = np.random.default_rng(3)
  vid = patches(rng, (3, 12, 10))  # 3 temporal groups, each its own full-attention frame
  ids, types = build_prompt(rng, [("text", 4), ("video", vid[1]), ("text", 6)])
  want, pos = run_hf(hf, ids, types, videos=[vid], second_per_grid=[1.0])
  got = run_ours(ours, ids, pos, [vid])
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


def test_image_and_video_packed_in_one_row(peer):
  """Two sequences in one packed row equal two separate HF forwards."""
  hf, ours = peer
  rng = np.random.default_rng(4)
  img, vid = patches(rng, (1, 8, 8)), patches(rng, (2, 8, 4))
  ids_a, types_a = build_prompt(rng, [("text", 3), ("image", img[1]), ("text", 5)])
  ids_b, types_b = build_prompt(rng, [("text", 6), ("video", vid[1]), ("text", 2)])
  want_a, pos_a = run_hf(hf, ids_a, types_a, images=[img])
  want_b, pos_b = run_hf(hf, ids_b, types_b, videos=[vid], second_per_grid=[0.5])
  ta, tb, pad = len(ids_a), len(ids_b), 5
  ids = np.concatenate([ids_a, ids_b, np.zeros(pad, np.int64)])
  pos = np.concatenate([pos_a, pos_b, np.zeros((3, pad), np.int64)], axis=1)
  seg = np.concatenate([np.full(ta, 1), np.full(tb, 2), np.zeros(pad)]).astype(np.int32)
  spos = np.concatenate([np.arange(ta), np.arange(tb), np.zeros(pad)]).astype(np.int32)
  vis = vision.make_vision_inputs(
    [img[0], vid[0]], [img[1], vid[1]], ours.cfg.vision, capacity=64 + 64 + 32
  )
  batch = vlm.PackedInputs(
    ids[None].astype(np.int32), pos[:, None].astype(np.int32), seg[None], spos[None], vis
  )
  got = np.asarray(ours.logits(batch))[0]
  np.testing.assert_allclose(got[:ta], want_a, atol=TOL, rtol=0)
  np.testing.assert_allclose(got[ta : ta + tb], want_b, atol=TOL, rtol=0)


def test_padded_batch_forward(peer):
  """The HF-style padded forward (left padding) matches HF row by row."""
  hf, ours = peer
  rng = np.random.default_rng(5)
  rows = [build_prompt(rng, [("text", n)])[0] for n in (9, 14)]
  width = 14
  ids = np.zeros((2, width), np.int64)
  mask = np.zeros((2, width), np.int64)
  for i, r in enumerate(rows):
    ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
  with torch.no_grad():
    want = hf(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)[None].repeat(3, 0)
  got = np.asarray(ours.logits(vlm.padded_inputs(ids, mask, positions)))
  for i, r in enumerate(rows):
    np.testing.assert_allclose(
      got[i, width - len(r) :], want[i, width - len(r) :], atol=TOL, rtol=0
    )


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_into_transformers(tmp_path, tie):
  """Our export -> from_pretrained gives our logits; sharded export reads back."""
  hf = random_hf_model(tie=tie, seed=7)
  hf.save_pretrained(tmp_path / "src")
  ours = hf_load.load_hf_checkpoint(str(tmp_path / "src"))
  assert ours.cfg.text.tie_word_embeddings == tie
  # Perturb our weights so the round trip cannot pass by reading the source back.
  ours.model.norm.weight[...] = ours.model.norm.weight[...] * 1.5
  hf_export.save_hf_checkpoint(
    ours, str(tmp_path / "out"), dtype="float32", max_shard_bytes=200_000
  )
  files = sorted(p.name for p in (tmp_path / "out").iterdir())
  assert "model.safetensors.index.json" in files and "config.json" in files
  assert sum(f.endswith(".safetensors") for f in files) > 1
  back = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
    tmp_path / "out", dtype=torch.float32
  ).eval()
  rng = np.random.default_rng(8)
  img = patches(rng, (1, 8, 12))
  ids, types = build_prompt(rng, [("text", 4), ("image", img[1]), ("text", 3)])
  want, pos = run_hf(back, ids, types, images=[img])
  got = run_ours(ours, ids, pos, [img])
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  before, _ = run_hf(hf, ids, types, images=[img])
  assert np.abs(before - want).max() > 1e-3, "export did not carry the perturbed weights"
  reread = hf_load.load_hf_checkpoint(str(tmp_path / "out"))
  np.testing.assert_allclose(run_ours(reread, ids, pos, [img]), got, atol=1e-6, rtol=0)


def test_load_into_sharded_arrays(peer, tmp_path, devices):
  """Loading straight into an 8-way sharding fills every shard correctly."""
  hf, ours = peer
  hf.save_pretrained(tmp_path)
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Explicit,))
  from flax import nnx

  shardings = {}
  for key, var in nnx.to_flat_state(nnx.state(vlm.abstract_model(ours.cfg), nnx.Param)):
    shape = var.get_value().shape
    dim = next((i for i, s in enumerate(shape) if s % 8 == 0), None)
    spec = [None] * len(shape)
    if dim is not None:
      spec[dim] = "fsdp"
    shardings[key] = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
  sharded = hf_load.load_hf_checkpoint(str(tmp_path), shardings=shardings)
  want = dict(nnx.to_flat_state(nnx.state(ours, nnx.Param)))
  n_sharded = 0
  for key, var in nnx.to_flat_state(nnx.state(sharded, nnx.Param)):
    value = var.get_value()
    assert value.sharding == shardings[key]
    n_sharded += len(value.sharding.device_set) == 8 and not value.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want[key].get_value()))
  assert n_sharded > 20
