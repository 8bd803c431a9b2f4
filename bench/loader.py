"""Centralized decode vs ShadowLoader (1/2/4 workers) against a fixed-time step.

Usage (from the repository root):
  python bench/loader.py [--mixes image_heavy,video_heavy] [--n 48]
      [--batch 8] [--workers 1,2,4] [--step-s auto] [--json PATH]

For each mix, a synthetic dataset is written (fluxjax.data.synth, defaults)
and every configuration runs in a fresh subprocess (peak RSS is per process)
over the same samples in the same order, with a simulated compute step of
fixed duration (a sleep: the host is idle, as it is while the accelerator
runs a jitted step):

  centralized  the controller decodes and preprocesses every image/video of
               the batch itself (fluxjax.models.media + processor), then
               hands the tensors to the step (veRL's single controller).
  shadow-k     ShadowLoader with k preprocessor processes: the controller
               holds metadata only and dispatches decodes least-loaded, two
               batches ahead; a separate trainer process (standing in for the
               worker that owns the devices) materializes the next batch's
               patches from the shared-memory store one step ahead. The step
               waits only for what is not ready.

Columns: ctrl RSS = the controller's peak RSS; trainer RSS = the trainer
process's (shadow only); data/step = time on the critical path per step
(decode for centralized; waits for the loader and for materialization for
shadow), also as % of the step; samples/s over the whole run.

--step-s auto sets the step per mix to 1.5 x the centralized decode time of
a batch (median over batches), measured first in the same run, so
centralized data loading costs about 67% of the step (FlexRL reports 57% of
veRL's step time). Not shorter: a
2-core machine has 2 x step CPU-seconds per step to decode, copy into and
read out of the store, so shorter steps cannot hide the work.
Also measured: the cost of moving one item's patches from a worker by
pickling through a queue vs writing/reading a shared-memory segment.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from fluxjax.data import pipeline, synth, workers
from fluxjax.data import store as store_lib
from fluxjax.models import processor

# The published Qwen2.5-VL image bounds and FlexRL's 64-frame cap (7B runs).
PROC = dict(image_max_pixels=12845056, video_max_frames=64)


def _cfg():
  return processor.VisionProcessorConfig(**PROC)


def _peak_rss_mb() -> float:
  """This process's peak RSS (VmHWM; ru_maxrss would carry the parent's)."""
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) / 1024
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_centralized(manifest, batch, steps, step_s):
  cfg = _cfg()
  data = 0.0
  start = time.perf_counter()
  samples, per_step = 0, []
  with pipeline.ShadowLoader(manifest, batch, cfg, num_workers=0, num_epochs=1, seed=0) as loader:
    for _ in range(steps):
      t0 = time.perf_counter()
      metas = loader.next_batch()
      tensors = [
        workers.preprocess_file(m.kind, m.path, cfg).patches for s in metas for m in s.media
      ]
      per_step.append(time.perf_counter() - t0)
      data += per_step[-1]
      time.sleep(step_s)  # the step consumes `tensors`
      del tensors
      samples += len(metas)
  wall = time.perf_counter() - start
  return {
    "ctrl_rss_mb": _peak_rss_mb(),
    "data_s": data / steps,
    "samples_s": samples / wall,
    # The first batch also pays lazy imports and codec start-up.
    "data_median_s": float(np.median(per_step[1:] or per_step)),
  }


def _trainer(inbox, outbox):
  """Materializes a step's items from the store slots named in each message."""
  held = None
  while True:
    msg = inbox.get()
    if msg is None:
      break
    del held  # the previous step's buffers
    held = [store_lib.read_shared(slot, shape, rows) for slot, shape, rows in msg]
    outbox.put((sum(b.nbytes for b in held), _peak_rss_mb()))


def run_shadow(manifest, batch, steps, step_s, num_workers):
  cfg = _cfg()
  ctx = mp.get_context("spawn")
  inbox, outbox = ctx.Queue(), ctx.Queue()
  trainer = ctx.Process(target=_trainer, args=(inbox, outbox), daemon=True)
  trainer.start()
  data = 0.0
  samples, trainer_rss = 0, 0.0
  with pipeline.ShadowLoader(
    manifest, batch, cfg, num_workers=num_workers, num_epochs=1, seed=0, lookahead=3 * batch
  ) as loader:

    def prepare(metas):
      # Metadata only crosses to the trainer: slot names, shapes, rows.
      msg = []
      for s in metas:
        for m in s.media:
          e = loader.store.get(m.media_id)
          msg.append((e.slot, e.shape, m.patch_rows))
      inbox.put(msg)

    # Warm-up (worker start, the first two batches' decode) is reported
    # apart: a long run pays it once.
    start = time.perf_counter()
    cur = loader.next_batch()
    prepare(cur)
    nxt = loader.next_batch()
    warmup = time.perf_counter() - start
    start = time.perf_counter()
    for i in range(steps):
      t0 = time.perf_counter()
      _, trainer_rss = outbox.get()  # the step's buffers are materialized
      if nxt is not None:
        prepare(nxt)  # one step ahead
      data += time.perf_counter() - t0
      time.sleep(step_s)
      samples += len(cur)
      loader.release(cur)
      t1 = time.perf_counter()
      cur = nxt
      nxt = loader.next_batch() if i + 2 < steps else None
      data += time.perf_counter() - t1
    wall = time.perf_counter() - start
    inbox.put(None)
    trainer.join(10)
  return {
    "ctrl_rss_mb": _peak_rss_mb(),
    "trainer_rss_mb": trainer_rss,
    "data_s": data / steps,
    "samples_s": samples / wall,
    "loader_wait_s": loader.wait_s / steps,
    "warmup_s": warmup,
  }


def transport_cost(mb: float = 64.0, reps: int = 5) -> dict:
  """Seconds to move `mb` of float32 patches: pickled queue vs shm segment."""
  rows = int(mb * 2**20 / 4 / 1176)
  arr = np.random.default_rng(0).standard_normal((rows, 1176), dtype=np.float32)
  ctx = mp.get_context("spawn")
  q = ctx.Queue()
  t = []
  for _ in range(reps):
    t0 = time.perf_counter()
    q.put(arr)
    out = q.get()
    t.append(time.perf_counter() - t0)
  assert out.shape == arr.shape
  s = []
  for _ in range(reps):
    t0 = time.perf_counter()
    name = store_lib.write_shared(arr)
    back = store_lib.read_shared(name, arr.shape, (0, arr.shape[0]))
    store_lib.unlink_shared(name)
    s.append(time.perf_counter() - t0)
  assert back.shape == arr.shape
  q.close()
  return {"mb": mb, "pickle_queue_s": float(np.median(t)), "shm_write_read_s": float(np.median(s))}


def _child(args):
  """Runs one configuration in this (fresh) process; prints JSON."""
  mode, manifest, batch, steps, step_s = args[:5]
  batch, steps, step_s = int(batch), int(steps), float(step_s)
  if mode == "centralized":
    out = run_centralized(manifest, batch, steps, step_s)
  else:
    out = run_shadow(manifest, batch, steps, step_s, int(mode.split("-")[1]))
  print("RESULT " + json.dumps(out))


def _spawn(*args) -> dict:
  proc = subprocess.run(
    [sys.executable, os.path.abspath(__file__), "--child", *map(str, args)],
    capture_output=True,
    text=True,
    check=True,
  )
  line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
  return json.loads(line[len("RESULT ") :])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--mixes", default="image_heavy,video_heavy")
  parser.add_argument("--n", type=int, default=48)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--workers", default="1,2,4")
  parser.add_argument("--step-s", default="auto")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures here, with the command, machine, commit and date",
  )
  parser.add_argument("--child", nargs=5)
  args = parser.parse_args()
  if args.child:
    _child(args.child)
    return
  steps = args.n // args.batch
  print(
    f"# machine: {platform.processor() or platform.machine()}, "
    f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
  )
  print(f"# batch {args.batch}, {steps} steps per run, processor {PROC}")
  results = {"transport": transport_cost()}
  t = results["transport"]
  print(
    f"# moving {t['mb']:.0f} MB of patches: pickled queue "
    f"{t['pickle_queue_s'] * 1e3:.0f} ms, shm write+read "
    f"{t['shm_write_read_s'] * 1e3:.0f} ms"
  )
  header = (
    "mix",
    "config",
    "step s",
    "ctrl RSS MB",
    "trainer RSS MB",
    "data/step s",
    "data % step",
    "samples/s",
  )
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header))
  with tempfile.TemporaryDirectory() as tmp:
    for mix in args.mixes.split(","):
      manifest = synth.generate(os.path.join(tmp, mix), mix, args.n, args.seed)
      if args.step_s == "auto":
        # Calibrate: the centralized decode time of a batch, without a step.
        probe = _spawn("centralized", manifest, args.batch, steps, 0.0)
        step_s = round(1.5 * probe["data_median_s"], 2)
      else:
        step_s = float(args.step_s)
      configs = ["centralized"] + [f"shadow-{k}" for k in args.workers.split(",")]
      for config in configs:
        r = _spawn(config, manifest, args.batch, steps, step_s)
        results[f"{mix}/{config}"] = dict(r, step_s=step_s)
        row = (
          mix,
          config,
          f"{step_s:.2f}",
          f"{r['ctrl_rss_mb']:.0f}",
          f"{r['trainer_rss_mb']:.0f}" if "trainer_rss_mb" in r else "-",
          f"{r['data_s']:.3f}",
          f"{100 * r['data_s'] / step_s:.1f}",
          f"{r['samples_s']:.2f}",
        )
        print("| " + " | ".join(row) + " |", flush=True)
  if args.json:
    # Imported here, not at the top: the children's peak RSS is a result.
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import runinfo

    runinfo.write(
      args.json,
      "loader.py",
      {
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "processor": PROC,
        "steps_per_run": steps,
        **results,
      },
    )


if __name__ == "__main__":
  main()
