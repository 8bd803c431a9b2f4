r"""Train-step model FLOPs utilization: forward, backward and AdamW on one device.

  python bench/mfu.py                               # 7b shapes, 8 decoder layers
  python bench/mfu.py --layers 8 --remat full,save_dots --attention pallas_gpu,cudnn
  python bench/mfu.py --preset tiny --rows 2 --row-tokens 512 --seq-tokens 256 --image-side 16
      # a CPU smoke test
  python bench/mfu.py --json PATH

The trainer's own path on a one-device mesh: FSDP rules, the packed_dp plan,
the materialized batch, the strategy's accumulation over microbatches and the
optimizer update (`train_step.make_train_step`), fp32 parameters and bf16
compute. The batch is --rows rows of --row-tokens tokens, each filled with
sequences of --seq-tokens tokens that open with an image of --image-side^2
patches (a quarter of them as merged tokens in the text).

Model FLOPs and peaks: fluxjax/models/flops.py (MaxText's convention). MFU =
model FLOPs / step time / peak, with the peak the dense bf16 rate of the
device's datasheet (H100/H200 SXM 989 TFLOP/s); --peak overrides it.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any, NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import op_profile  # noqa: E402  (lives next to this script)

import runinfo  # noqa: E402
from fluxjax import config_args  # noqa: E402
from fluxjax.models import config as config_lib  # noqa: E402
from fluxjax.models import sharded  # noqa: E402
from fluxjax.models.flops import (  # noqa: E402
  datasheet_peak,
  text_flops,
  vision_flops,
)
from fluxjax.parallel import batch as batch_lib  # noqa: E402
from fluxjax.parallel import random_batch, strategies, train_step  # noqa: E402
from fluxjax.sharding import mesh as mesh_lib  # noqa: E402


def make_batch(cfg, args):
  """Sequences that fill --rows rows: an image, then random text."""
  rng = np.random.default_rng(0)
  image_tokens = args.image_side**2 // cfg.vision.merge_unit
  n_text = args.seq_tokens - image_tokens - 6
  per_row = args.row_tokens // args.seq_tokens
  media = (("image", (1, args.image_side, args.image_side)),)
  return [
    random_batch.random_sequence(cfg, rng, n_text, media, advantage_range=(-1.0, 1.5))
    for _ in range(args.rows * per_row)
  ]


class Built(NamedTuple):
  """A compiled train step with what it runs on."""

  step: Any  # the compiled step: (state, batch) -> (state, metrics), state donated
  state: train_step.TrainState
  batch: batch_lib.TrainBatch
  graphdef: Any
  seqs: list
  compile_s: float
  memory: Any  # XLA's memory analysis of the step


def build(cfg, args, device) -> Built:
  """The trainer's step for `make_batch`'s batch on a one-device mesh, compiled."""
  mesh = mesh_lib.make_mesh(devices=[device])
  seqs = make_batch(cfg, args)
  scfg = config_args.load_config(arg="tiny").sharding
  scfg.update(strategy="packed_dp", capacity=args.row_tokens, capacity_buckets=())
  strategy = strategies.get_strategy(scfg, cfg)
  plan = strategy.plan([len(s) for s in seqs], mesh.size)
  patches = args.image_side**2 * (args.row_tokens // args.seq_tokens)
  host = batch_lib.materialize(plan, seqs, cfg, patches)
  optim = config_args.load_config(arg="tiny").optim
  optim.refuse_nonfinite = args.refuse_nonfinite or optim.refuse_nonfinite
  tx = train_step.make_optimizer(optim)
  model = sharded.create_sharded_model(cfg, mesh, log_table=False, max_replicated_bytes=1 << 40)
  graphdef, state, shardings = train_step.create_train_state(model, tx, mesh)
  with jax.set_mesh(mesh):
    batch = batch_lib.to_device(host, mesh)
    accumulate = strategy.accumulate_fn(
      mesh, plan, graphdef, shardings.params, train_step.policy_gradient_loss
    )
    step = train_step.make_train_step(
      graphdef,
      tx,
      state_shardings=shardings,
      accumulate_fn=accumulate,
      check_state=train_step.checks_state(optim),
    )
    t = time.perf_counter()
    compiled = step.lower(state, batch).compile()
  compile_s = time.perf_counter() - t
  return Built(compiled, state, batch, graphdef, seqs, compile_s, compiled.memory_analysis())


def run(cfg, args, device, remat: str, attention: str) -> dict:
  """Compiles and times the train step; returns its figures."""
  cfg = cfg.replace(remat=remat, attention_backend=attention)
  built = build(cfg, args, device)
  compiled, state, batch, seqs, mem = built.step, built.state, built.batch, built.seqs, built.memory
  state, _ = jax.block_until_ready(compiled(state, batch))
  times = []
  for _ in range(args.reps):
    t = time.perf_counter()
    state, metrics = jax.block_until_ready(compiled(state, batch))
    times.append(time.perf_counter() - t)
  if args.profile:  # one more step, traced apart from the timed ones
    trace_dir = os.path.join(args.profile, f"{attention}-{remat}")
    with op_profile.capture(trace_dir):
      state, metrics = jax.block_until_ready(compiled(state, batch))
    where = "device" if device.platform == "gpu" else "host"
    op_profile.report(trace_dir, where=where, hlo_dir=op_profile.hlo_dir_of(args.profile))
  lengths = [len(s) for s in seqs]
  grids = [(1, args.image_side, args.image_side)] * len(seqs)
  flops = text_flops(cfg, lengths) + vision_flops(cfg, grids)
  step_s = statistics.median(times)
  return {
    "remat": remat,
    "attention": attention,
    "sequences": len(seqs),
    "tokens": sum(lengths),
    "microbatches": batch.num_microbatches,
    "compile_s": built.compile_s,
    "step_ms": step_s * 1e3,
    "step_ms_all": [x * 1e3 for x in times],
    "model_tflop": flops / 1e12,
    "tflops_per_s": flops / step_s / 1e12,
    "tokens_per_s": sum(lengths) / step_s,
    "temp_gb": mem.temp_size_in_bytes / 1e9 if mem else None,
    "loss_finite": bool(np.isfinite(float(metrics["loss"]))),
  }


def report(cfg, args, device, remat: str, attention: str, peak: float | None) -> dict:
  """One (attention, remat) row, printed; a failure (out of memory) is a row too."""
  try:
    r = run(cfg, args, device, remat, attention)
  except Exception as e:  # one policy out of memory still lets the others report
    r = {"remat": remat, "attention": attention}
    r["status"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    print(f"| {attention} | {remat} | {r['status']} |", flush=True)
    return r
  r["mfu"] = r["tflops_per_s"] * 1e12 / peak if peak else None
  mfu = f"{r['mfu']:.1%}" if peak else "-"
  temp = f"{r['temp_gb']:.1f}" if r["temp_gb"] is not None else "-"
  print(
    f"| {attention} | {remat} | {r['tokens']} | {r['microbatches']} | {r['compile_s']:.0f} | "
    f"{r['step_ms']:.1f} | {temp} | {r['model_tflop']:.1f} | {r['tflops_per_s']:.0f} | {mfu} |",
    flush=True,
  )
  return r


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="7b")
  p.add_argument("--layers", type=int, default=8, help="decoder layers (the 7b model has 28)")
  p.add_argument("--rows", type=int, default=4, help="rows (microbatches) per step")
  p.add_argument("--row-tokens", type=int, default=8192)
  p.add_argument("--seq-tokens", type=int, default=2048)
  p.add_argument("--image-side", type=int, default=32, help="image side in patches")
  p.add_argument(
    "--refuse-nonfinite",
    choices=train_step.REFUSE_NONFINITE,
    help="optim.refuse_nonfinite (default: configs/vlm.py's): state keeps the updated state "
    "beside the old until known finite, inputs updates in place",
  )
  p.add_argument(
    "--remat",
    default="full,save_dots,save_dots_attention",
    help="comma-separated remat policies (models/layers.py REMAT_POLICIES)",
  )
  p.add_argument(
    "--attention", default="auto", help="comma-separated attention backends (models/attention/)"
  )
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--peak", type=float, default=None, help="peak FLOP/s; default: datasheet")
  p.add_argument("--json", metavar="PATH", help="also write the figures (command, machine, commit)")
  p.add_argument(
    "--profile",
    metavar="DIR",
    help="also trace one more step per row into DIR/<attention>-<remat> and print its "
    "time by op (bench/op_profile.py)",
  )
  args = p.parse_args()
  if args.profile:  # before JAX first touches a device
    op_profile.expose_ops(op_profile.hlo_dir_of(args.profile))
  device = jax.devices()[0]
  base = config_lib.preset(args.preset)
  image_tokens = args.image_side**2 // base.vision.merge_unit
  if args.seq_tokens < image_tokens + 7:
    p.error(
      f"--seq-tokens {args.seq_tokens} leaves no text after an image of --image-side "
      f"{args.image_side} ({image_tokens} tokens and 6 of chat markup): give at least "
      f"{image_tokens + 7} or a smaller --image-side"
    )
  cfg = base.replace(
    text=dataclasses.replace(base.text, num_layers=args.layers),
    dtype="bfloat16",
    param_dtype="float32",
  )
  peak = args.peak or datasheet_peak(device.device_kind)
  print(f"python {' '.join(sys.argv)}")
  print(
    f"device: {device.device_kind} ({device.platform}); jax {jax.__version__}; preset "
    f"{args.preset} with {args.layers} decoder layers; bf16 compute, fp32 parameters; "
    f"peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s"
  )
  print(
    "| attention | remat | tokens | microbatches | compile s | step ms | temp GB | model TFLOP "
    "| TFLOP/s | MFU |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  rows = []
  for attention in args.attention.split(","):
    for remat in args.remat.split(","):
      rows.append(report(cfg, args, device, remat, attention, peak))
  if args.json:
    runinfo.write(
      args.json,
      "mfu.py",
      {"args": vars(args), "device_kind": device.device_kind, "peak_flops": peak, "rows": rows},
    )


if __name__ == "__main__":
  main()
