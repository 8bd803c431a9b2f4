"""The controller's peak RSS does not grow with media size (it holds MediaRefs).

Each run is a fresh subprocess (peak RSS is per process and never falls) that
drives a ShadowLoader through every batch of a dataset, as the controller
does; the same dataset with 16x the pixels per image and per video frame must
leave its peak RSS within 20 MB. The decoded patches grow 16x, in the workers.
"""

import json
import os
import subprocess
import sys

import numpy as np
import PIL.Image

from fluxjax.data import drawing, synth

# Bounds wide enough that the processor keeps the 16x growth.
PROC = dict(
  image_min_pixels=28 * 28,
  image_max_pixels=1 << 22,
  video_min_pixels=28 * 28,
  video_max_pixels=1 << 22,
  video_max_frames=16,
  video_cap_pixels_per_frame=False,
)


def _write(folder, scale):
  os.makedirs(folder, exist_ok=True)
  rng = np.random.default_rng(0)
  rows = []
  for i in range(12):
    path = os.path.join(folder, f"{i}.jpg")
    image, q, a = synth.count_image(rng, 120 * scale, 160 * scale)
    image.save(path, quality=85)
    rows.append({"id": f"i{i}", "prompt": q, "answer": a, "images": [path]})
  for i in range(4):
    path = os.path.join(folder, f"{i}.mp4")
    h, w = 48 * scale, 64 * scale
    frames = np.asarray(PIL.Image.new("RGB", (w, h), drawing.RGB["red"]))
    synth.write_video(path, lambda k: frames, 16, h, w, 2)
    rows.append(
      {"id": f"v{i}", "prompt": "Which colour appears last?", "answer": "red", "videos": [path]}
    )
  manifest = os.path.join(folder, "manifest.jsonl")
  with open(manifest, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  return manifest


def _controller_main(manifest):
  """Runs in the subprocess: drive the loader, print peak RSS and patch bytes."""
  from fluxjax.data import pipeline  # pylint: disable=import-outside-toplevel
  from fluxjax.models import processor  # pylint: disable=import-outside-toplevel

  cfg = processor.VisionProcessorConfig(**PROC)
  with pipeline.ShadowLoader(manifest, 4, cfg, num_workers=1, num_epochs=2, seed=0) as loader:
    for batch in loader:
      loader.release(batch)
    peak_store = loader.store.peak_bytes
  print(json.dumps({"rss_mb": _peak_rss_mb(), "store_mb": peak_store / 2**20}))


def _peak_rss_mb():
  """Peak RSS of this process: VmHWM, since ru_maxrss survives exec and so
  would report the parent's peak if that was higher."""
  import resource  # pylint: disable=import-outside-toplevel

  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run(manifest):
  here = os.path.dirname(os.path.abspath(__file__))
  code = (
    f"import sys; sys.path.insert(0, {here!r}); import test_data_rss as t;"
    f" t._controller_main({manifest!r})"
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_controller_rss_is_flat_when_media_grow_16x(tmp_path):
  small = _run(_write(str(tmp_path / "x1"), 1))
  large = _run(_write(str(tmp_path / "x4"), 4))
  # The work did grow: the workers stored ~16x the patch bytes.
  assert large["store_mb"] > 10 * small["store_mb"]
  assert large["rss_mb"] - small["rss_mb"] < 20, (small, large)
