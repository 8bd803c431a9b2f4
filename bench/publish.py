"""Weight publishing to a fleet: the disk path against the distributed broadcast.

  python bench/publish.py [--servers 2] [--sizes tiny,400m] [--repeats 3] [--json PATH]

For each model size, S fluxjax servers (real processes on loopback, one CPU
device each) start from an HF folder of random weights, and this process
publishes another random model to them `--repeats` times through each
transport of rollout/publish.py:

  disk         write a bf16 HF folder, then pause -> flush ->
               update_weights_from_disk -> continue (the current default);
  distributed  pause -> flush -> update_weights_from_distributed while this
               process broadcasts the bf16 layer tensors over gloo -> continue
               (the group is made at the first publish, timed as `join`).

Per transport: seconds the trainer is blocked (the publish call), seconds the
servers are paused (pause through update), bytes written to disk, bytes the
trainer broadcast, and the peak RSS growth of the trainer and of each server
over its RSS before the transport's first publish (VmHWM after clearing it;
torch's import counts for the distributed one). Disk runs first. Ratios are distributed / disk.
In-process swapping (the embedded engine) moves no bytes and is not run here.

Then the cost model: what each transport costs a Qwen2.5-VL-7B or 32B trainer
on N hosts publishing to S servers, from assumed bandwidths (flags): the disk
path gathers fp32 leaves to every host (process_allgather), writes bf16 from
process 0 and every server reads the folder; the broadcast gathers bf16 per
layer to process 0 and sends each byte once down a pipelined NCCL tree.
One trainer process here; two processes (and the per-process disk writes)
are not measured yet.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
from flax import nnx

import runinfo
from fluxjax.models import config, hf_io, vlm
from fluxjax.rollout import fleet as fleet_lib

# Parameters in bf16 of the published models (Qwen2.5-VL, LM and vision tower).
PROJECTED = {"7b": 8.29e9, "32b": 33.5e9}


def model_config(size: str) -> config.ModelConfig:
  """tiny, or a ~400M-parameter text stack on the tiny vocabulary and vision tower."""
  tiny = config.preset("tiny")
  if size == "tiny":
    return tiny
  if size != "400m":
    raise ValueError(f"unknown size {size!r}: tiny or 400m")
  text = dataclasses.replace(
    tiny.text,
    hidden_size=1024,
    intermediate_size=4096,
    num_layers=24,
    num_heads=16,
    num_kv_heads=4,
    mrope_section=(8, 12, 12),
  )
  return dataclasses.replace(
    tiny, text=text, vision=dataclasses.replace(tiny.vision, out_hidden_size=1024)
  )


def random_model(cfg: config.ModelConfig, seed: int) -> vlm.Qwen25VL:
  """Random weights held as device arrays, as a trainer's are."""
  graphdef, state = nnx.split(vlm.abstract_model(cfg))
  rng = np.random.default_rng(seed)
  state = jax.tree.map(
    lambda x: jax.device_put((0.02 * rng.standard_normal(x.shape, np.float32)).astype(x.dtype)),
    state,
  )
  return nnx.merge(graphdef, state)


def _clear_peak(pid: int | str = "self") -> None:
  with open(f"/proc/{pid}/clear_refs", "w") as f:
    f.write("5")  # resets VmHWM to the current RSS


def _peak_and_now(pid: int | str = "self") -> tuple[int, int]:
  fields = {}
  with open(f"/proc/{pid}/status") as f:
    for line in f:
      key, _, value = line.partition(":")
      if key in ("VmHWM", "VmRSS"):
        fields[key] = int(value.split()[0]) * 1024
  return fields["VmHWM"], fields["VmRSS"]


def _folder_bytes(path: str) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


async def _publishes(fleet, model, transport: str, repeats: int, pids: list[int]) -> dict:
  """One untimed publish (it makes the distributed group and imports torch),
  then `repeats` timed ones; the peak RSS growth covers all of them (over
  the RSS before the first: what was allocated once and kept counts)."""
  fleet.weight_sync = transport
  rss0 = {p: _peak_and_now(p)[1] for p in ["self", *pids]}
  for p in rss0:
    _clear_peak(p)
  warm = await fleet.publish(model, 99)
  if warm.failed:
    raise RuntimeError(f"{transport} publish failed: {warm.failed}")
  rows = []
  for i in range(repeats):
    t = time.perf_counter()
    report = await fleet.publish(model, 100 + i)
    blocked = time.perf_counter() - t
    if report.failed:
      raise RuntimeError(f"{transport} publish failed: {report.failed}")
    s = report.seconds
    rows.append(
      {
        "blocked_s": blocked,
        "paused_s": s["pause"] + s["flush"] + s["update"],
        "seconds": s,
        "written_bytes": _folder_bytes(report.path) if report.path else 0,
        "sent_bytes": report.sent_bytes,
      }
    )
  growth = {str(p): _peak_and_now(p)[0] - rss0[p] for p in rss0}
  return {"join_s": warm.seconds.get("join", 0.0), "rows": rows, "peak_rss_growth_bytes": growth}


def measure(size: str, servers: int, repeats: int, workdir: str) -> dict:
  cfg = model_config(size)
  start = os.path.join(workdir, f"{size}-start")
  hf_io.save_hf_checkpoint(random_model(cfg, 0), start, dtype="bfloat16")
  model = random_model(cfg, 1)
  n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  cmd = ["python", "-m", "fluxjax.rollout.server", "--model-path", start, "--num-slots", "2"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  launched = fleet_lib.launch_servers(cmd, servers, env=env, timeout_s=900)
  try:

    async def go():
      async with fleet_lib.Fleet(
        launched.urls, weights_root=os.path.join(workdir, f"{size}-weights")
      ) as fleet:
        pids = [p.pid for p in launched.procs]
        out = {}
        for transport in ("disk", "distributed"):
          out[transport] = await _publishes(fleet, model, transport, repeats, pids)
        return out

    result = asyncio.run(go())
  finally:
    launched.stop()
  return {"size": size, "parameters": n_params, "servers": servers, **result}


def projection(args) -> list[dict]:
  """Seconds each transport takes for the published models (module docstring)."""
  rows = []
  largest = {  # the largest tensor in bf16: what the broadcast adds to a host
    name: 2 * max(int(np.prod(shape)) for _, shape in hf_io.hf_layout(config.preset(name)))
    for name in PROJECTED
  }
  for name, params in PROJECTED.items():
    bf16, fp32 = 2 * params, 4 * params
    for hosts in (1, 2, 4, 16):
      for servers in (1, 8, 32):
        gather_fp32 = fp32 * (hosts - 1) / hosts / args.net_gbps / 1e9 if hosts > 1 else 0.0
        write = bf16 / args.disk_write_gbps / 1e9
        read = bf16 * servers / min(args.fs_read_gbps, servers * args.disk_read_gbps) / 1e9
        disk_blocked = gather_fp32 + write + read
        gather_bf16 = bf16 * (hosts - 1) / hosts / args.net_gbps / 1e9 if hosts > 1 else 0.0
        send = bf16 / args.net_gbps / 1e9  # pipelined: each byte crosses each link once
        rows.append(
          {
            "model": name,
            "hosts": hosts,
            "servers": servers,
            "disk_blocked_s": disk_blocked,
            "disk_paused_s": read,
            "disk_extra_bytes_per_host": fp32,
            "distributed_blocked_s": gather_bf16 + send,
            "distributed_paused_s": send,
            "distributed_extra_bytes_per_host": largest[name],
          }
        )
  return rows


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--servers", type=int, default=2)
  p.add_argument("--sizes", default="tiny,400m")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--net-gbps", type=float, default=25.0, help="GB/s per host link (NCCL)")
  p.add_argument("--disk-write-gbps", type=float, default=2.0, help="GB/s one writer gets")
  p.add_argument("--disk-read-gbps", type=float, default=2.0, help="GB/s one reader gets")
  p.add_argument("--fs-read-gbps", type=float, default=20.0, help="GB/s the shared FS serves")
  p.add_argument("--json", default=None)
  args = p.parse_args()
  t0 = time.time()
  results = []
  with tempfile.TemporaryDirectory(prefix="bench-publish-") as workdir:
    for size in args.sizes.split(","):
      r = measure(size, args.servers, args.repeats, workdir)
      results.append(r)
      print(f"\n{size}: {r['parameters'] / 1e6:.1f}M parameters, {args.servers} servers")
      print(
        "| transport | blocked s | paused s | written MB | sent MB | trainer peak +MB "
        "| server peak +MB |"
      )
      print("|---|---|---|---|---|---|---|")
      med = {}
      for t in ("disk", "distributed"):
        rows = r[t]["rows"]
        m = {k: float(np.median([x[k] for x in rows])) for k in ("blocked_s", "paused_s")}
        med[t] = m
        growth = r[t]["peak_rss_growth_bytes"]
        mine = growth.pop("self") / 1e6
        theirs = max(growth.values()) / 1e6
        written, sent = rows[0]["written_bytes"] / 1e6, rows[0]["sent_bytes"] / 1e6
        print(
          f"| {t} | {m['blocked_s']:.3f} | {m['paused_s']:.3f} | {written:.1f} | {sent:.1f} | "
          f"{mine:.0f} | {theirs:.0f} |"
        )
      for k in ("blocked_s", "paused_s"):
        print(f"  {k}: distributed / disk = {med['distributed'][k] / med['disk'][k]:.2f}")
      print(f"  group join at the first distributed publish: {r['distributed']['join_s']:.3f} s")
  proj = projection(args)
  print("\ncost model (seconds; --net-gbps etc.):")
  print("| model | hosts | servers | disk blocked | disk paused | dist blocked | dist paused |")
  print("|---|---|---|---|---|---|---|")
  for row in proj:
    if row["servers"] in (1, 8) and row["hosts"] in (1, 4, 16):
      print(
        f"| {row['model']} | {row['hosts']} | {row['servers']} | {row['disk_blocked_s']:.1f} | "
        f"{row['disk_paused_s']:.1f} | {row['distributed_blocked_s']:.2f} | "
        f"{row['distributed_paused_s']:.2f} |"
      )
  print(f"bench wall time {time.time() - t0:.0f} s")
  if args.json:
    runinfo.write(
      args.json, "publish.py", {"args": vars(args), "results": results, "projection": proj}
    )


if __name__ == "__main__":
  main()
