"""The ShadowLoader end to end: worker decode parity, bad input, checkpoints.

Every loader runs real spawned preprocessor processes on real JPEG/PNG/MP4
files; patches read from the store must equal the model processor's output
for the same file, bit for bit.
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from fluxjax.data import materializer as mat_lib
from fluxjax.data import pipeline, readers, synth, workers
from fluxjax.models import config as config_lib
from fluxjax.models import inputs, processor
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import batch as batch_lib
from fluxjax.planning import planners
from helpers import lying_png, process_alive

CFG = processor.VisionProcessorConfig(
  image_min_pixels=28 * 28 * 4,
  image_max_pixels=28 * 28 * 16,
  video_min_pixels=28 * 28 * 4,
  video_max_pixels=28 * 28 * 8,
  video_max_frames=8,
)
TINY = synth.SynthConfig(fps=2.0, video_scale=0.15, image_scale=0.3, max_seconds=6.0)
MODEL = config_lib.preset("tiny")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
  out = tmp_path_factory.mktemp("mix")
  rows = readers.read_rows(synth.generate(str(out), "video_heavy", 12, 7, TINY))
  rows += readers.read_rows(synth.generate(str(out / "ih"), "image_heavy", 8, 8, TINY))
  return out, rows


def _all_batches(loader):
  out = []
  for batch in loader:
    out.append(batch)
    loader.release(batch)
  return out


def test_worker_patches_equal_the_processors(data):
  _, rows = data
  kinds = set()
  with pipeline.ShadowLoader(rows, 4, CFG, num_workers=2, num_epochs=1, shuffle=False) as loader:
    for batch in loader:
      assert len(batch) == 4
      for sample in batch:
        for ref in sample.media:
          got = loader.store.read(ref.media_id)
          want = workers.preprocess_file(ref.kind, ref.path, CFG)
          assert got.dtype == np.float32
          np.testing.assert_array_equal(got, want.patches)
          kinds.add((ref.kind, os.path.splitext(ref.path)[1]))
      loader.release(batch)
    assert loader.store.bytes_in_use == 0 and len(loader.store) == 0
    assert loader.emitted == len(rows)
  assert kinds == {("image", ".jpg"), ("image", ".png"), ("video", ".mp4")}


def _train_sequences(samples):
  tok = Tokenizer.default()
  seqs = []
  for s in samples:
    seq = inputs.sequence_from_chat(s.messages(), s.media, tok, MODEL)
    t = len(seq)
    seqs.append(
      batch_lib.TrainSequence(
        seq, np.ones(t, np.float32), np.ones(t, np.float32), np.zeros(t, np.float32)
      )
    )
  return seqs


def _planned(samples):
  """(sequences, packed plan on 8 devices, patch capacity) of a batch."""
  seqs = _train_sequences(samples)
  plan = planners.plan_packed_dp([len(s) for s in seqs], 8, 4096, MODEL.cost_shape())
  return seqs, plan, batch_lib.patch_capacity_for(plan, seqs, MODEL, (512, 1024, 4096))


def test_materializer_builds_the_same_vision_buffers(data):
  _, rows = data
  with pipeline.ShadowLoader(rows, 6, CFG, num_workers=2, num_epochs=1, shuffle=False) as loader:
    samples = loader.next_batch()
    seqs, plan, cap = _planned(samples)
    # The reference: the same sequences holding in-process processor output.
    ref_seqs = []
    for s in seqs:
      media = [workers.preprocess_file(m.kind, m.path, CFG) for m in s.inputs.media]
      ref_seqs.append(
        batch_lib.TrainSequence(
          inputs.SequenceInputs(
            s.inputs.tokens_T, s.inputs.positions_3T, media, s.inputs.mrope_delta
          ),
          s.loss_mask_T,
          s.advantages_T,
          s.old_logprobs_T,
        )
      )
    want = batch_lib.materialize(plan, ref_seqs, MODEL, cap)

    mat = mat_lib.Materializer(loader.store)
    got = batch_lib.materialize(plan, seqs, MODEL, cap, patch_source=mat)
    np.testing.assert_array_equal(got.inputs.vision.patches_BNP, want.inputs.vision.patches_BNP)

    # One step ahead: only this process's devices' items, then a measured wait.
    placement = batch_lib.media_placement(plan, seqs, MODEL)
    mat.prepare(placement, devices={0, 1, 2, 3})
    waited = mat.wait()
    assert waited >= 0 and mat.steps == 1
    local = mat.local_items(placement, {0, 1, 2, 3})
    assert set(mat._ready) == {m.id for m in local}  # pylint: disable=protected-access
    got = batch_lib.materialize(plan, seqs, MODEL, cap, patch_source=mat)
    np.testing.assert_array_equal(got.inputs.vision.patches_BNP, want.inputs.vision.patches_BNP)
    mat.release()
    loader.release(samples)


def test_a_process_materializes_only_its_own_devices_media(data):
  """A process of a multi-controller run fills its own devices' vision rows,
  equal to the full batch's, and reads no other device's media."""
  _, rows = data
  with pipeline.ShadowLoader(rows, 6, CFG, num_workers=2, num_epochs=1, shuffle=False) as loader:
    samples = loader.next_batch()
    seqs, plan, cap = _planned(samples)
    source = mat_lib.Materializer(loader.store)
    for balance in (False, True):
      want = batch_lib.materialize(plan, seqs, MODEL, cap, source, balance_vision=balance)
      units = batch_lib.vision_assignment(plan, seqs, MODEL, balance)
      for mine in ({0, 1, 2, 3}, {4, 5, 6, 7}):
        read = []
        got = batch_lib.materialize(
          plan,
          seqs,
          MODEL,
          cap,
          lambda item, read=read: read.append(item.id) or source(item),
          balance_vision=balance,
          devices=mine,
        )
        local = sorted(mine)
        expected = {u.item.id for m in units for d, us in m[0].items() if d in mine for u in us}
        assert set(read) == expected
        for name in ("patches_BNP", "frame_ids_BN", "window_ids_BN", "hw_BN2"):
          np.testing.assert_array_equal(
            getattr(got.inputs.vision, name)[:, local], getattr(want.inputs.vision, name)[:, local]
          )
        # Where embeddings go is metadata: every device's token rows are whole.
        np.testing.assert_array_equal(got.inputs.vision_index_BT, want.inputs.vision_index_BT)
        np.testing.assert_array_equal(got.inputs.tokens_BT, want.inputs.tokens_BT)
      assert {u.item.id for m in units for us in m[0].values() for u in us}, "no media"
    loader.release(samples)


def test_slices_read_only_their_frames(data):
  _, rows = data
  with pipeline.ShadowLoader(rows, 12, CFG, num_workers=1, num_epochs=1, shuffle=False) as loader:
    batch = loader.next_batch()
    video = next(m for s in batch for m in s.media if m.grid_thw[0] >= 2)
    full = workers.preprocess_file("video", video.path, CFG).patches
    mat = mat_lib.Materializer(loader.store)
    part = video.slice(slice(1, 2))
    got = mat(part)
    start, stop = part.patch_rows
    np.testing.assert_array_equal(got, full[start:stop])
    assert mat.bytes_read == got.nbytes == full.nbytes // video.grid_thw[0]


def media_probe(path):
  return pipeline.meta_lib.probe("image", path)


def _cut(src, dst, fraction):
  blob = open(src, "rb").read()
  open(dst, "wb").write(blob[: int(len(blob) * fraction)])


def _bad_file(kind, folder, rows):
  """A row whose media is broken in one way; returns (row, skip kind)."""
  img = next(r for r in rows if r["images"])
  vid = max((r for r in rows if r["videos"]), key=lambda r: os.path.getsize(r["videos"][0]))
  if kind == "missing":
    return dict(img, id="bad", images=[str(folder / "gone.jpg")]), "missing"
  if kind == "corrupt":
    path = folder / "corrupt.jpg"
    path.write_bytes(b"\xff\xd8\xff\xe0 this is no jpeg" * 10)
    return dict(img, id="bad", images=[str(path)]), "corrupt"
  if kind == "truncated_image":
    path = folder / "cut.png"
    src = img["images"][0]
    if not src.endswith(".png"):
      import PIL.Image  # pylint: disable=import-outside-toplevel

      PIL.Image.open(src).save(folder / "full.png")
      src = folder / "full.png"
    _cut(src, path, 0.5)  # the header survives, the pixel data does not
    return dict(img, id="bad", images=[str(path)]), "corrupt"
  if kind == "truncated_mp4":
    path = folder / "cut.mp4"
    _cut(vid["videos"][0], path, 0.6)  # faststart: the index survives
    return dict(vid, id="bad", videos=[str(path)]), "truncated"
  if kind == "unsupported":
    path = folder / "text.mp4"
    path.write_text("plain text, not a container\n" * 20)
    return dict(vid, id="bad", videos=[str(path)]), "unsupported"
  if kind == "decompression_bomb":
    path = folder / "bomb.png"
    path.write_bytes(lying_png(100_000, 100_000))  # a tiny file, 10G pixels claimed
    return dict(img, id="bad", images=[str(path)]), "size"
  if kind == "too_large":
    big = max((r for r in rows if r["images"]), key=lambda r: np.prod(media_probe(r["images"][0])))
    return dict(big, id="bad"), "size"
  raise ValueError(kind)


@pytest.mark.parametrize(
  "kind",
  [
    "missing",
    "corrupt",
    "truncated_image",
    "truncated_mp4",
    "unsupported",
    "too_large",
    "decompression_bomb",
  ],
)
def test_bad_input_is_a_counted_skip_and_the_batch_stays_full(kind, data, tmp_path, caplog):
  _, rows = data
  bad, reason = _bad_file(kind, tmp_path, rows)
  good = [r for r in rows if r["images"]][:4]
  limits = pipeline.meta_lib.MediaLimits()
  if kind == "too_large":
    # The limit sits just below the bad image; smaller images stay good.
    pixels = lambda r: np.prod(pipeline.meta_lib.probe("image", r["images"][0]))
    limits = pipeline.meta_lib.MediaLimits(max_image_pixels=pixels(bad) - 1)
    good = [r for r in rows if r["images"] and pixels(r) < pixels(bad)]
    good = (good * 4)[:4]
  caplog.set_level(logging.WARNING, logger="fluxjax.data.pipeline")
  with pipeline.ShadowLoader(
    [good[0], bad] + good[1:], 4, CFG, num_workers=1, num_epochs=1, shuffle=False, limits=limits
  ) as loader:
    batch = loader.next_batch()
    assert len(batch) == 4 and "bad" not in [s.id for s in batch]
    assert loader.skipped == 1
    assert loader.metrics()[f"data/skipped/{reason}"] == 1
    assert loader.store.bytes_in_use > 0
    loader.release(batch)
    assert loader.store.bytes_in_use == 0
  assert any("skipping sample bad" in r.getMessage() for r in caplog.records)


def test_a_hung_decoder_costs_one_timeout_and_its_worker_is_restarted(data):
  """The only worker stops (SIGSTOP: a decoder looping forever). The sample it
  holds times out and the worker is killed and restarted, so the samples
  queued behind it fail at once instead of each waiting out the timeout."""
  _, rows = data
  with pipeline.ShadowLoader(
    rows, 2, CFG, num_workers=1, num_epochs=1, shuffle=False, decode_timeout_s=1.0
  ) as loader:
    stuck = loader.pool._procs[0].pid  # pylint: disable=protected-access
    os.kill(stuck, signal.SIGSTOP)
    batch = loader.next_batch()
    assert len(batch) == 2
    m = loader.metrics()
    assert m["data/skipped/timeout"] == 1
    assert m["data/skipped"] == 1 + m.get("data/skipped/worker", 0)
    assert loader.pool.restarts == 1 and not process_alive(stuck)
    loader.release(batch)


def test_truncated_mp4_probes_fine_and_fails_in_the_worker(data, tmp_path):
  _, rows = data
  bad, _ = _bad_file("truncated_mp4", tmp_path, rows)
  sample = pipeline.meta_lib.ToMeta(CFG)(0, bad)
  assert sample.error is None  # the header promised every frame


def test_resume_neither_repeats_nor_loses_a_sample(data, tmp_path):
  _, rows = data
  rows = list(rows)
  rows[5] = dict(rows[5], images=[str(tmp_path / "missing.png")], videos=[], media_order=["image"])
  kw = dict(num_workers=2, num_epochs=1, seed=11)
  with pipeline.ShadowLoader(rows, 3, CFG, **kw) as loader:
    seen = [s.id for _ in range(3) for s in loader.next_batch()]
    # Samples of the next batch are already decoding in the lookahead window.
    assert loader.store.bytes_in_use > 0
    state = json.loads(json.dumps(loader.get_state()))
  with pipeline.ShadowLoader(rows, 3, CFG, **kw) as loader:
    loader.set_state(state)
    rest = [s.id for b in _all_batches(loader) for s in b]
  good = {r["id"] for i, r in enumerate(rows) if i != 5}
  assert len(seen) + len(rest) == len(set(seen + rest))
  assert set(seen + rest) == good


def test_dispatch_goes_to_the_least_loaded_worker(data):
  _, rows = data
  store = pipeline.store_lib.MetaStore()
  to_meta = pipeline.meta_lib.ToMeta(CFG)
  refs = [m for i, r in enumerate(rows) for m in to_meta(i, r).media]
  with workers.WorkerPool(2, CFG, store) as pool:
    # Hold the workers' loads by hand: dispatch follows the smaller one.
    with pool._lock:  # pylint: disable=protected-access
      pool._load[:] = [10**9, 0]  # pylint: disable=protected-access
    assert pool.submit(refs[0]) == 1
    with pool._lock:  # pylint: disable=protected-access
      pool._load[1] = 2 * 10**9  # pylint: disable=protected-access
    assert pool.submit(refs[1]) == 0
    assert pool.submit(refs[1]) == -1  # already in the store
    for ref in refs[:2]:
      assert store.wait(ref.media_id, timeout=30).status == "ready"
  store.close()
  assert store.bytes_in_use == 0


def test_pickle_transport_gives_the_same_patches(data):
  _, rows = data
  to_meta = pipeline.meta_lib.ToMeta(CFG)
  ref = next(m for i, r in enumerate(rows) for m in to_meta(i, r).media if m.kind == "video")
  store = pipeline.store_lib.MetaStore()
  with workers.WorkerPool(1, CFG, store, transport="pickle") as pool:
    pool.submit(ref)
    got = store.read(ref.media_id, timeout=30)
  np.testing.assert_array_equal(got, workers.preprocess_file("video", ref.path, CFG).patches)
  store.close()


def test_no_segment_outlives_the_loader(data):
  _, rows = data
  if not os.path.isdir("/dev/shm"):
    pytest.skip("no /dev/shm to inspect")
  with pipeline.ShadowLoader(rows, 4, CFG, num_workers=2, num_epochs=1) as loader:
    loader.next_batch()  # leave consumed and prefetched items behind
    prefix = loader.pool.segment_prefix
    # Its workers' segments, not another process's (the other xdist worker).
    ours = lambda: {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    assert ours(), "the workers made no named segment to check"
  assert not ours(), ours()


def test_a_dataset_with_no_usable_sample_is_an_error(tmp_path):
  """Repeating epochs of nothing but bad files must fail loudly, not spin."""
  rows = [
    {
      "id": f"gone{i}",
      "prompt": "What colour?",
      "answer": "red",
      "images": [str(tmp_path / f"gone{i}.jpg")],
    }
    for i in range(3)
  ]
  with pipeline.ShadowLoader(rows, 2, processor.VisionProcessorConfig(), num_workers=0) as loader:
    with pytest.raises(RuntimeError, match="no usable sample in a whole pass over the 3 rows"):
      loader.next_batch()
    assert loader.skipped == 3


_KILLED_PARENT = """
import sys, time
from fluxjax.data import store as store_lib, workers
from fluxjax.models import processor
cfg = processor.VisionProcessorConfig()
pool = workers.WorkerPool(2, cfg, store_lib.MetaStore())
print(" ".join(str(p.pid) for p in pool._procs), flush=True)  # pylint: disable=protected-access
time.sleep(600)
"""


def test_workers_exit_when_their_parent_is_killed():
  """A loader process killed with SIGKILL (no close) leaves no worker behind."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  parent = subprocess.Popen(
    [sys.executable, "-c", _KILLED_PARENT], stdout=subprocess.PIPE, text=True, env=env
  )
  try:
    pids = [int(p) for p in parent.stdout.readline().split()]
  finally:
    parent.send_signal(signal.SIGKILL)
    parent.wait()
  assert len(pids) == 2

  deadline = time.monotonic() + 10 * workers.PARENT_CHECK_S + 5
  while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not [p for p in pids if process_alive(p)], "workers outlived their killed parent"


def test_a_group_wide_stop_signal_leaves_the_workers_to_their_parent(data):
  """A scheduler's SIGTERM (or Ctrl-C's SIGINT) reaches the whole process
  group; the workers outlive it, so the parent's own shutdown stops them and
  nothing is counted as a crash."""
  _, rows = data
  to_meta = pipeline.meta_lib.ToMeta(CFG)
  refs = [m for i, r in enumerate(rows) for m in to_meta(i, r).media][:2]
  store = pipeline.store_lib.MetaStore()
  with workers.WorkerPool(1, CFG, store) as pool:
    pool.submit(refs[0])
    assert store.wait(refs[0].media_id, timeout=30).status == "ready"  # started and serving
    proc = pool._procs[0]  # pylint: disable=protected-access
    for sig in (signal.SIGTERM, signal.SIGINT):
      os.kill(proc.pid, sig)
    pool.submit(refs[1])
    assert store.wait(refs[1].media_id, timeout=30).status == "ready"
    assert proc.is_alive() and pool.restarts == 0
  assert not proc.is_alive()  # close still stops it
  store.close()
