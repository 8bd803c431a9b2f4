"""Metadata without pixels: MediaRef grids, slices, probing cache, Grain state."""

import json

import numpy as np
import orbax.checkpoint as ocp
import pytest

from fluxjax.data import meta, pipeline, readers, synth, workers
from fluxjax.models import config as config_lib
from fluxjax.models import inputs, processor
from fluxjax.models.tokenizer import Tokenizer

CFG = processor.VisionProcessorConfig(
  image_min_pixels=28 * 28 * 4,
  image_max_pixels=28 * 28 * 16,
  video_min_pixels=28 * 28 * 4,
  video_max_pixels=28 * 28 * 8,
  video_max_frames=8,
)
TINY = synth.SynthConfig(fps=2.0, video_scale=0.15, image_scale=0.3, max_seconds=6.0)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  out = tmp_path_factory.mktemp("ih")
  return readers.read_rows(synth.generate(str(out), "image_heavy", 16, 0, TINY))


def test_media_ref_grid_is_the_processors(rows):
  to_meta = meta.ToMeta(CFG)
  seen = set()
  for i, row in enumerate(rows):
    sample = to_meta(i, row)
    assert sample.error is None
    for ref in sample.media:
      pv = workers.preprocess_file(ref.kind, ref.path, CFG)
      assert ref.grid_thw == pv.grid_thw
      assert ref.second_per_grid == pv.second_per_grid
      assert ref.num_patches == pv.patches.shape[0]
      seen.add(ref.kind)
  assert seen == {"image", "video"}


def test_slice_is_a_fake_tensor_shard():
  ref = meta.MediaRef("7/0", "video", "v.mp4", 90, 160, 40, 2.0, 8, (4, 6, 10), 1.0)
  part = ref.slice(slice(1, 3))
  assert part.grid_thw == (2, 6, 10) and part.id == "7/0[1:3]"
  assert part.patch_rows == (60, 180)
  assert part.slice((1, 2)).patch_rows == (120, 180)
  assert ref.slice(slice(0, 4)).id == "7/0"
  with pytest.raises(ValueError):
    ref.slice(slice(2, 2))
  with pytest.raises(ValueError):
    ref.slice(slice(0, 4, 2))


def test_media_refs_plug_into_sequence_from_chat(rows):
  cfg = config_lib.preset("tiny")
  to_meta = meta.ToMeta(CFG)
  for i, row in enumerate(rows[:6]):
    sample = to_meta(i, row)
    seq = inputs.sequence_from_chat(sample.messages(), sample.media, Tokenizer.default(), cfg)
    pads = np.isin(seq.tokens_T, [cfg.image_token_id, cfg.video_token_id])
    assert pads.sum() == sample.num_vision_tokens()


def test_probing_is_cached_and_reads_no_pixels(rows, monkeypatch):
  path = next(r["videos"][0] for r in rows if r["videos"])
  meta.probe("video", path)
  hits = meta.probe_cache_info().hits
  loads = []
  monkeypatch.setattr(meta.media_lib, "load_video", lambda *a: loads.append(a))
  meta.media_ref("x", "video", path, CFG)
  assert meta.probe_cache_info().hits == hits + 1 and not loads


def test_bad_headers_become_errors_not_exceptions(tmp_path, rows):
  (tmp_path / "junk.jpg").write_bytes(b"not an image")
  row = dict(rows[0], images=[str(tmp_path / "junk.jpg")], videos=[], media_order=["image"])
  assert "cannot read image header" in meta.ToMeta(CFG)(0, row).error
  row = dict(rows[0], images=[str(tmp_path / "nope.png")], videos=[], media_order=["image"])
  assert "file not found" in meta.ToMeta(CFG)(0, row).error
  img = next(r for r in rows if r["images"])
  small = meta.MediaLimits(max_image_pixels=100)
  assert "exceeds" in meta.ToMeta(CFG, small)(0, img).error


def _uids(loader, n):
  return [s.uid for _ in range(n) for s in loader.next_batch()]


def test_metadata_state_round_trips_through_orbax_json(rows, tmp_path):
  kw = dict(num_workers=0, seed=5, read_threads=1)
  with pipeline.ShadowLoader(rows, 3, CFG, **kw) as loader:
    first = _uids(loader, 2)
    state = loader.get_state()
    rest = _uids(loader, 3)
  json.dumps(state)
  ckpt = ocp.Checkpointer(ocp.JsonCheckpointHandler())
  ckpt.save(tmp_path / "data", state)
  restored = ckpt.restore(tmp_path / "data")
  with pipeline.ShadowLoader(rows, 3, CFG, **kw) as loader:
    loader.set_state(restored)
    again = _uids(loader, 3)
  assert again == rest
  assert not set(first) & set(rest)
  # Grain's shuffle: the same seed gives the same order of row ids.
  with pipeline.ShadowLoader(rows, 3, CFG, **kw) as loader:
    assert _uids(loader, 5) == first + rest
