"""Load balance of packed_dp, fixed-degree Ulysses and FlexUlysses, as cost-model figures.

Usage (from the repository root):
  python bench/balance.py [--devices 8,32,64,128] [--seqs-per-device 16]
      [--capacity 16384] [--seed 0] [--json PATH] [--quick]

For each mixture of bench/mixtures.py and each device count, the same batch is
planned by packed_dp, ulysses sp=2/4/8 and flex_ulysses p_max=8
(fluxjax.planning.planners) and each plan is scored under the Qwen2.5-VL-7B
cost model (bf16):

  refused     sequences longer than the strategy's row (degree x capacity):
              it cannot train them. The other columns cover the rest.
  mb          microbatches (every device runs all of them).
  tok/dev     most tokens one device holds in one microbatch (<= capacity).
  fill        placed tokens / (mb x devices x capacity): static-buffer use.
  attn        max/mean over devices of attention FLOPs (FlexRL's balance ratio).
  cost        max/mean over devices of attention + linear FLOPs.
  lockstep    sum over microbatches of the slowest device's cost, over the
              mean device's total: the slowdown per-layer sync (FSDP) pays
              against perfect balance, 1 / (1 - ODC's bubble rate).
  a2a GB      Ulysses all-to-all bytes of one step, forward + backward, summed
              over layers and devices (tokens actually held, not padding).

A summary puts flex_ulysses beside fixed sp=8 on the same batches. Then
(unless --quick) ODC's LB-Micro vs LB-Mini bubble rates on long_context_sft
(8 devices, 64K microbatch cap, as ODC's golden setting), and the planners'
median wall and CPU time for 2048 sequences on 128 devices.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mixtures
import runinfo
from fluxjax.models import config as model_config
from fluxjax.planning import balance, planners
from fluxjax.planning import plan as plan_lib

# (name, degree); flex_ulysses' degree is its p_max. Its degrees are priced like
# fixed sp=8's (query heads padded to a multiple of the degree).
STRATEGIES = (
  ("packed_dp", 1),
  ("ulysses sp=2", 2),
  ("ulysses sp=4", 4),
  ("ulysses sp=8", 8),
  ("flex_ulysses p_max=8", 8),
)
COLUMNS = ("strategy", "refused", "mb", "tok/dev", "fill", "attn", "cost", "lockstep", "a2a GB")


def _plan(name, lengths, devices, sp, capacity, shape):
  if name.startswith("flex_ulysses"):
    return planners.plan_flex_ulysses(
      lengths, devices, sp, capacity, plan_lib.default_buckets(capacity)
    )
  if sp == 1:
    return planners.plan_packed_dp(lengths, devices, capacity, shape)
  return planners.plan_ulysses(lengths, devices, sp, capacity, shape)


def score(
  name: str, lengths: np.ndarray, devices: int, sp: int, capacity: int, shape: balance.CostShape
) -> dict:
  """Plans the sequences that fit one row and returns the cost-model figures."""
  keep = lengths <= sp * capacity
  plan = _plan(name, lengths[keep], devices, sp, capacity, shape)
  plan.validate()
  loads = planners.plan_loads(plan, shape)
  cost = loads.cost
  total = cost.sum()
  # Static buffers move whole capacity slices, padding included.
  static_a2a = sum(
    r.degree
    * balance.ulysses_all_to_all_bytes(plan.section(r)[0] if r.seqs else capacity, r.degree, shape)
    for rows in plan.microbatches
    for r in rows
  )
  return {
    "refused": int((~keep).sum()),
    "microbatches": plan.num_microbatches,
    "max_tokens_per_device": float(loads.tokens.max()) if loads.tokens.size else 0.0,
    "fill": float(loads.tokens.sum() / (plan.num_microbatches * devices * capacity))
    if plan.num_microbatches
    else 0.0,
    "attention_ratio": balance.balance_ratio(loads.attention.sum(axis=0)),
    "cost_ratio": balance.balance_ratio(cost.sum(axis=0)),
    "lockstep": float(cost.max(axis=1).sum() / (total / devices)) if total > 0 else 1.0,
    "a2a_bytes_fwd_bwd": 2.0 * float(loads.all_to_all_bytes.sum()),
    "a2a_bytes_fwd_bwd_static": 2.0 * static_a2a,
    "attention_flops": float(loads.attention.sum()),
    "linear_flops": float(loads.linear.sum()),
  }


def _row(name: str, s: dict) -> tuple[str, ...]:
  if s["microbatches"] == 0:
    return (name, str(s["refused"])) + ("-",) * (len(COLUMNS) - 2)
  return (
    name,
    str(s["refused"]),
    str(s["microbatches"]),
    f"{s['max_tokens_per_device']:.0f}",
    f"{s['fill']:.2f}",
    f"{s['attention_ratio']:.3f}",
    f"{s['cost_ratio']:.3f}",
    f"{s['lockstep']:.3f}",
    f"{s['a2a_bytes_fwd_bwd'] / 1e9:.1f}",
  )


def format_table(rows: list[tuple[str, ...]], header=COLUMNS) -> str:
  widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
  fmt = lambda r: "  ".join(
    c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
  )
  return "\n".join([fmt(header), fmt(tuple("-" * w for w in widths)), *map(fmt, rows)])


def odc_bubbles(
  seed: int, shape: balance.CostShape, devices: int = 8, cap: int = 65536, minibatches: int = 64
) -> tuple[str, dict]:
  """ODC Table 6's comparison on long_context_sft, under the same cost model."""
  out, rows = {}, []
  for mbs in (1, 2, 4, 8):
    lengths = mixtures.long_context_sft(minibatches * mbs * devices, seed)
    costs = balance.sequence_cost(lengths, shape)
    micro = balance.lb_micro(costs, lengths, devices, cap, mbs)
    mini = balance.lb_mini(costs, lengths, devices, cap, mbs)
    r = {
      "collective_lb_micro": balance.bubble_rate(micro, costs, "layer"),
      "odc_lb_micro": balance.bubble_rate(micro, costs, "minibatch"),
      "odc_lb_mini": balance.bubble_rate(mini, costs, "minibatch"),
    }
    out[mbs] = r
    rows.append((str(mbs),) + tuple(f"{100 * v:.2f}" for v in r.values()))
  header = ("minibatch/device", "Collective LB-Micro %", "ODC LB-Micro %", "ODC LB-Mini %")
  return format_table(rows, header), out


def planner_times(seed: int, shape: balance.CostShape, capacity: int, repeats: int = 11):
  """Median wall and CPU (process) time of each planner, 2048 sequences on 128 devices.

  The machine may be shared: wall time then includes waiting for a core,
  CPU time does not, so both are given, with the load average.
  """
  rows, out = [], {}
  for name, draw in mixtures.MIXTURES.items():
    lengths = draw(2048, seed)
    cells = [name]
    for strat, sp in STRATEGIES:
      fit = lengths[lengths <= sp * capacity]
      wall, cpu = [], []
      for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        _plan(strat, fit, 128, sp, capacity, shape)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
      ms, cpu_ms = 1e3 * float(np.median(wall)), 1e3 * float(np.median(cpu))
      out.setdefault(name, {})[strat] = ms
      out[name][strat + " cpu"] = cpu_ms
      cells.append(f"{ms:.1f} ({cpu_ms:.1f})")
    rows.append(tuple(cells))
  header = ("mixture: wall (cpu) ms",) + tuple(s for s, _ in STRATEGIES)
  return format_table(rows, header), out


def flex_summary(raw: dict) -> str:
  """flex_ulysses against fixed sp=8 on the same batches: ratios side by side."""
  rows = []
  for name, by_devices in raw["mixtures"].items():
    for d, by_strat in by_devices.items():
      f, u = by_strat["flex_ulysses p_max=8"], by_strat["ulysses sp=8"]
      rows.append(
        (
          name,
          d,
          f"{u['attention_ratio']:.3f}",
          f"{f['attention_ratio']:.3f}",
          f"{f['cost_ratio']:.3f}",
          f"{f['lockstep']:.3f}",
          f"{u['a2a_bytes_fwd_bwd'] / 1e9:.0f}",
          f"{f['a2a_bytes_fwd_bwd'] / 1e9:.0f}",
          f"{f['a2a_bytes_fwd_bwd'] / u['a2a_bytes_fwd_bwd']:.2f}x",
        )
      )
  header = (
    "mixture",
    "devices",
    "sp=8 attn",
    "flex attn",
    "flex cost",
    "flex lockstep",
    "sp=8 a2a GB",
    "flex a2a GB",
    "flex/sp=8 a2a",
  )
  return format_table(rows, header)


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  ap.add_argument(
    "--devices",
    default="8,32,64,128",
    help="comma-separated device counts (multiples of 8, for sp=8)",
  )
  ap.add_argument("--seqs-per-device", type=int, default=16, help="batch size = devices x this")
  ap.add_argument("--capacity", type=int, default=16384, help="tokens per device per microbatch")
  ap.add_argument("--seed", type=int, default=0, help="mixture seed")
  ap.add_argument(
    "--json",
    default=None,
    metavar="PATH",
    help="write the raw figures here, with the command, machine, commit and date",
  )
  ap.add_argument(
    "--quick", action="store_true", help="skip the ODC bubble table and the planner timings"
  )
  args = ap.parse_args(argv)
  devices = [int(d) for d in args.devices.split(",")]
  shape = model_config.preset("7b").cost_shape()

  print(f"# python bench/balance.py {' '.join(sys.argv[1:])}".rstrip())
  print(
    f"# {runinfo.cpu_model()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
    f"numpy {np.__version__}; cost model: Qwen2.5-VL-7B decoder "
    f"({shape.num_layers} layers, {shape.num_heads}q/{shape.num_kv_heads}kv heads x "
    f"{shape.head_dim}), bf16 all-to-all"
  )
  raw = {"args": vars(args), "batches": {}, "mixtures": {}}
  for name, draw in mixtures.MIXTURES.items():
    for d in devices:
      lengths = draw(d * args.seqs_per_device, args.seed)
      raw["batches"].setdefault(name, {})[str(d)] = {
        "sequences": int(lengths.size),
        "median_tokens": int(np.median(lengths)),
        "max_tokens": int(lengths.max()),
        "capacity": args.capacity,
      }
      print(
        f"\n## {name}: {lengths.size} sequences (median {int(np.median(lengths))}, "
        f"max {lengths.max()} tokens) on {d} devices, capacity {args.capacity}"
      )
      rows = []
      for strat, sp in STRATEGIES:
        s = score(strat, lengths, d, sp, args.capacity, shape)
        raw["mixtures"].setdefault(name, {}).setdefault(str(d), {})[strat] = s
        rows.append(_row(strat, s))
      print(format_table(rows))

  print("\n## flex_ulysses p_max=8 vs ulysses sp=8 (same batches as above)")
  print(flex_summary(raw))
  if not args.quick:
    table, raw["odc_bubbles"] = odc_bubbles(args.seed, shape)
    print("\n## ODC bubble rate, long_context_sft, 8 devices, 64K microbatch cap, 64 minibatches")
    print(table)
    load = os.getloadavg()[0]
    table, raw["planner_ms"] = planner_times(args.seed, shape, args.capacity)
    load_after = os.getloadavg()[0]
    raw["planner_load_average_1min"] = {"before": load, "after": load_after, "cpus": os.cpu_count()}
    print(
      "\n## planner median wall (CPU) time of 11 runs, 2048 sequences on 128 devices "
      f"(too-long ones dropped); 1-min load average {load:.1f} before, "
      f"{load_after:.1f} after, on {os.cpu_count()} CPUs"
    )
    print(table)
  if args.json:
    runinfo.write(args.json, "balance.py", raw)


if __name__ == "__main__":
  main()
