r"""The training path on an accelerator against the same code on the host CPU.

  python bench/gpu_check.py                     # tiny preset, fp32
  python bench/gpu_check.py --dtype bfloat16 --scale 8
  python bench/gpu_check.py --attention pallas_gpu   # the GPU kernels vs xla on the CPU
  python bench/gpu_check.py --json PATH         # also write the figures (command, machine, commit)

The tests run on a fake CPU mesh only; this is the check that the library is
right on a GPU as well (no CPU-only shortcut). One mixed batch (text, images,
a video, one sequence longer than the capacity for ulysses) goes through
planner -> materializer -> the strategy's jitted accumulation on a one-device
mesh of the accelerator and on a one-device mesh of the CPU, with the same
parameters. Printed per strategy: the loss on each, the relative loss
difference, the largest relative gradient difference over parameters
(||g_acc - g_cpu|| / ||g_cpu||), and the median wall time of the compiled
step on each device (5 runs after one warm-up).

With --dtype bfloat16 the differences measure bf16 rounding, not a bug; the
fp32 run is the parity check (matmuls at "highest" precision on both).
With --attention pallas_gpu the accelerator runs the model with that
attention backend and the CPU keeps the xla reference, so the check covers
the GPU kernels (text and vision attention, every strategy) as well.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import runinfo  # noqa: E402  (lives next to this script)
from fluxjax import config_args  # noqa: E402
from fluxjax.models import config as config_lib  # noqa: E402
from fluxjax.models import sharded  # noqa: E402
from fluxjax.parallel import batch as batch_lib  # noqa: E402
from fluxjax.parallel import (  # noqa: E402
  random_batch,
  strategies,
  train_step,
)
from fluxjax.sharding import mesh as mesh_lib  # noqa: E402


def run(strategy, cfg, params_host, graphdef, seqs, device, patches):
  """(loss, grads on host, median step seconds) of one strategy on one device."""
  mesh = mesh_lib.make_mesh(sp_axes=strategy.sp_axes(), devices=[device])
  plan = strategy.plan([len(s) for s in seqs], mesh.size)
  host = batch_lib.materialize(plan, seqs, cfg, patches)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  with jax.set_mesh(mesh):
    params = jax.device_put(params_host, replicated)
    batch = batch_lib.to_device(host, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    step = jax.jit(
      strategy.accumulate_fn(mesh, plan, graphdef, shardings, train_step.policy_gradient_loss)
    )
    out = jax.block_until_ready(step(params, batch))
    times = []
    for _ in range(5):
      t = time.perf_counter()
      jax.block_until_ready(step(params, batch))
      times.append(time.perf_counter() - t)
  loss, grads, _ = jax.device_get(out)
  return float(loss), grads, statistics.median(times)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--dtype", default="float32")
  p.add_argument("--scale", type=int, default=1, help="sequence length multiplier")
  p.add_argument(
    "--capacity",
    type=int,
    default=None,
    help="tokens per row; default 256 x scale (the batch's lengths scale too)",
  )
  p.add_argument("--patches", type=int, default=256)
  p.add_argument(
    "--attention",
    default="xla",
    help="attention backend on the accelerator (the CPU always runs xla)",
  )
  p.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures here, with the command, machine, commit and date",
  )
  args = p.parse_args()
  # Without the scaling, --scale 8 (longest sequence 1222) did not fit ulysses'
  # 256-token rows and the documented bf16 command stopped after packed_dp.
  args.capacity = args.capacity or 256 * args.scale
  jax.config.update("jax_default_matmul_precision", "highest")

  accel = [d for d in jax.devices() if d.platform != "cpu"]
  cpu = jax.devices("cpu")[0]
  if not accel:
    raise SystemExit("no accelerator found: this check compares one against the CPU")
  cfg = config_lib.preset(args.preset, dtype=args.dtype)
  accel_cfg = cfg.replace(attention_backend=args.attention)
  print(f"python {' '.join(sys.argv)}")
  print(
    f"accelerator: {accel[0].device_kind} ({accel[0].platform}); jax {jax.__version__}; "
    f"preset {args.preset}, dtype {args.dtype}; attention {args.attention} on the "
    f"accelerator, {cfg.attention_backend} on the cpu"
  )
  cpu_mesh = mesh_lib.make_mesh(devices=[cpu])
  create = lambda c: sharded.create_sharded_model(
    c, cpu_mesh, seed=0, log_table=False, max_replicated_bytes=1 << 40
  )
  graphdef, params = nnx.split(create(cfg), nnx.Param)
  # The backend is static module state: the accelerator needs its own graphdef
  # (the parameters are the CPU model's, shared by both runs).
  accel_graphdef = graphdef if accel_cfg == cfg else nnx.split(create(accel_cfg), nnx.Param)[0]
  params_host = jax.device_get(params)
  # Mixed signs of advantages: the loss is not one-signed, as in RL.
  seqs = random_batch.mixed_batch(cfg, 0, long=True, scale=args.scale, advantage_range=(-1.0, 1.5))
  print(
    f"batch: {len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens, "
    f"longest {max(len(s) for s in seqs)}"
  )
  print(
    "| strategy | loss (accel) | loss (cpu) | rel loss diff | max rel grad diff | "
    "step ms (accel) | step ms (cpu) |"
  )
  print("|---|---|---|---|---|---|---|")
  rows = []
  for name, sp in (("packed_dp", 1), ("ulysses", 1), ("flex_ulysses", 1)):
    cap = max(args.capacity, max(len(s) for s in seqs)) if name == "packed_dp" else args.capacity
    scfg = config_args.load_config(arg="tiny").sharding
    scfg.update(strategy=name, sp=sp, capacity=cap, capacity_buckets=(), sync="layer")
    scfg.balance_vision = False
    la, ga, ta = run(
      strategies.get_strategy(scfg, accel_cfg),
      accel_cfg,
      params_host,
      accel_graphdef,
      seqs,
      accel[0],
      args.patches,
    )
    lc, gc, tc = run(
      strategies.get_strategy(scfg, cfg), cfg, params_host, graphdef, seqs, cpu, args.patches
    )
    rel = jax.tree.leaves(
      jax.tree.map(
        lambda a, c: float(
          np.linalg.norm(np.asarray(a, np.float64) - np.asarray(c, np.float64))
          / max(np.linalg.norm(np.asarray(c, np.float64)), 1e-30)
        ),
        ga,
        gc,
      )
    )
    print(
      f"| {name} | {la:.6f} | {lc:.6f} | {abs(la - lc) / max(abs(lc), 1e-30):.2e} | "
      f"{max(rel):.2e} | {ta * 1e3:.1f} | {tc * 1e3:.1f} |"
    )
    rows.append(
      {
        "strategy": name,
        "loss_accel": la,
        "loss_cpu": lc,
        "rel_loss_diff": abs(la - lc) / max(abs(lc), 1e-30),
        "max_rel_grad_diff": max(rel),
        "step_ms_accel": ta * 1e3,
        "step_ms_cpu": tc * 1e3,
      }
    )
  if args.json:
    runinfo.write(
      args.json,
      "gpu_check.py",
      {
        "args": vars(args),
        "accelerator": {"device_kind": accel[0].device_kind, "platform": accel[0].platform},
        "attention": {"accelerator": args.attention, "cpu": cfg.attention_backend},
        "batch": {
          "sequences": len(seqs),
          "tokens": sum(len(s) for s in seqs),
          "longest": max(len(s) for s in seqs),
        },
        "rows": rows,
      },
    )


if __name__ == "__main__":
  main()
