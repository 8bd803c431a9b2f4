"""Tail batching vs plain rounds on the embedded engine, long-tailed response lengths.

  python bench/tail.py [--prompts 160] [--P 16] [--R 4] [--slots 128] [--seeds 5] [--json PATH]

Defaults: P = 16 prompts x R = 4 responses per step (64 kept responses, a small
GRPO batch; real ones are 256-8192), 128 decode slots so a speculative round
(20 x 5 = 100 requests) runs without queueing, 10 rounds per epoch. The
smaller batch of the first version (P = 8 on 64 slots, 80 prompts) is in
bench/README.md too: the longest response of a batch grows with the batch,
and that tail is what tail batching takes out of short rounds.

Model: the tiny preset with random weights (fluxjax.models.config.preset("tiny")),
served by EmbeddedRollout (the engine in a background thread, driven through
the same `generate(request, group)` / `abort(rid)` interface as the fleet).

Response lengths. Random weights have no natural stopping point, so every
request is sent with ignore_eos=True and max_new_tokens = L, which fixes its
length. L is log-normal with a cap, drawn per request:
  log L = log(median) + sigma_prompt * z_p + sigma_resp * z_pj,
  z ~ N(0, 1), L = min(cap, max(1, round(exp(.)))),
with z_p shared by the responses of prompt p (some prompts are hard: all their
responses run long, which is what sends them to the long round) and z_pj per
response. Marginally log L ~ N(log median, sigma_prompt^2 + sigma_resp^2).
Lengths are a seeded function of (prompt, response index), so a prompt rerun in
a long round asks for the same lengths. Requests carry a logit_bias of -100 on
the two vision placeholder ids: random weights would sample them (2 of 512
ids), and a partial response holding one cannot be continued.

Configurations, each one epoch over the same prompts, P prompts x R responses
kept per round (every configuration trains the same P*R*prompts/P responses):
  baseline          plain rounds: launch P x R, wait for all (no TailBatcher).
  eta 1.0           TailBatcher with eta 1.0 (must equal the baseline).
  eta 1.25 / 1.5    TailBatcher with recycling (the default): short rounds
                    launch ceil(eta P) prompts x R responses; a deferred
                    prompt's responses are continued in its long round
                    (prompt + partial tokens, max_new_tokens = L - done).
  eta 1.25 next-round  the same, a deferred prompt continued first in the
                    next short round (APRIL's order) instead of a long round.
  eta 1.25 discard  Flexes as published: ceil(eta P) x ceil(eta R), the first
                    R of a prompt kept, aborted work discarded.

Per configuration: rounds, mean / max round time, the engine's prefill and
decode seconds (and time per decode step), slot-idle fraction (decode
slot-steps with no request / all decode slot-steps, over all num_slots slots)
and bubble fraction (idle slot-steps among the slots the round launched,
min(launched, num_slots): slots left idle waiting for the round's tail),
decode tokens discarded (decoded, then neither trained nor carried) over all
decoded, and the length bias: the mean length of the kept responses over the
mean drawn length of every response launched for the same prompts (1.0: the
kept set does not favour short responses; below 1: it does).
Compilation is excluded (warm-up first).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import numpy as np

import runinfo
from fluxjax.models import config, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rl import round_driver as rd
from fluxjax.rl import tail_batching as tb
from fluxjax.rollout import protocol
from fluxjax.rollout.embedded import EmbeddedRollout

# (name, eta, recycle, continue_in): the default (recycling, long rounds),
# APRIL's order, and Flexes as published.
CONFIGS = (
  ("eta 1.0", 1.0, True, "long_round"),
  ("eta 1.25", 1.25, True, "long_round"),
  ("eta 1.25 next-round", 1.25, True, "next_round"),
  ("eta 1.25 discard", 1.25, False, "long_round"),
  ("eta 1.5", 1.5, True, "long_round"),
)


class Lengths:
  """The documented log-normal response-length model (see the module docstring)."""

  def __init__(self, median, sigma_prompt, sigma_resp, cap, seed=0):
    self.median, self.sp, self.sr, self.cap, self.seed = median, sigma_prompt, sigma_resp, cap, seed

  def __call__(self, p: int, j: int) -> int:
    zp = np.random.default_rng([self.seed, p]).normal()
    zr = np.random.default_rng([self.seed, p, j + 1]).normal()
    x = math.log(self.median) + self.sp * zp + self.sr * zr
    return int(min(self.cap, max(1, round(math.exp(x)))))


async def baseline_epoch(rollout, prompts, P, R, make_request):
  """Plain synchronous rounds: P prompts x R responses, wait for the slowest."""
  eng = rollout.engine
  rows = []
  for i in range(0, len(prompts), P):
    chunk = prompts[i : i + P]
    steps0 = eng.stats["decode_steps"]
    t0 = time.perf_counter()
    outs = await asyncio.gather(
      *(
        rollout.generate(dataclasses.replace(make_request(p, j), rid=f"base-{p}-{j}"), str(p))
        for p in chunk
        for j in range(R)
      )
    )
    wall = time.perf_counter() - t0
    steps = eng.stats["decode_steps"] - steps0
    busy = sum(max(len(c.output_ids) - 1, 0) for c in outs)
    rows.append(
      {
        "kind": "plain",
        "tokens_generated": sum(len(c.output_ids) for c in outs),
        "tokens_discarded": 0,
        "wall_s": wall,
        "decode_steps": steps,
        "busy": busy,
        "launched": len(outs),
        "max_kept_len": max(len(c.output_ids) for c in outs),
      }
    )
  return rows


async def tail_epoch(rollout, prompts, P, R, eta, recycle, continue_in, make_request, lengths):
  """One epoch of tail-batched rounds; per round the stats plus the length bias.

  Length bias: the kept responses' mean length over the mean drawn length of
  every response launched for the same prompts (all ceil(eta R) of a
  speculative prompt, whether it finished or not).
  """
  b = tb.TailBatcher(P, R, eta, recycle=recycle, continue_in=continue_in)
  b.start_epoch(prompts)
  rows = []
  tag = f"eta{eta}{'r' if recycle else 'd'}{continue_in[0]}"
  while (
    res := await rd.run_round(
      rollout, b, make_request, rid_prefix=tag, decode=rollout.tokenizer.decode
    )
  ) is not None:
    s = dataclasses.asdict(res.stats)
    s["busy"] = round((1 - s["slot_idle_fraction"]) * s["decode_steps"] * rollout.engine.num_slots)
    s["launched"] = len(res.plan.prompts) * res.plan.responses
    s["kept_len_sum"] = sum(len(c.output_ids) for g in res.groups.values() for c in g)
    s["kept_n"] = sum(len(g) for g in res.groups.values())
    drawn = [lengths(p, j) for p in res.groups for j in range(res.plan.responses)]
    s["drawn_len_sum"], s["drawn_n"] = sum(drawn), len(drawn)
    rows.append(s)
  assert sorted(b.trained) == sorted(prompts), "a prompt was lost or trained twice"
  return rows


def summarize(rows, slots):
  steps = sum(r["decode_steps"] for r in rows)
  busy = sum(r["busy"] for r in rows)
  own = sum(r["decode_steps"] * min(r["launched"], slots) for r in rows)
  walls = [r["wall_s"] for r in rows]
  return {
    "rounds": len(rows),
    "long": sum(r["kind"] == "long" for r in rows),
    "mean": float(np.mean(walls)),
    "max": float(np.max(walls)),
    "total": float(np.sum(walls)),
    "idle": 1 - busy / (steps * slots),
    "bubble": 1 - busy / own,
    "maxlen": float(np.mean([r["max_kept_len"] for r in rows])),
    "generated": float(sum(r.get("tokens_generated", r.get("busy", 0)) for r in rows)),
    "discarded": float(sum(r.get("tokens_discarded", 0) for r in rows)),
    "bias": (
      (sum(r["kept_len_sum"] for r in rows) / sum(r["kept_n"] for r in rows))
      / (sum(r["drawn_len_sum"] for r in rows) / sum(r["drawn_n"] for r in rows))
      if all("kept_n" in r for r in rows)
      else 1.0
    ),
  }


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--prompts", type=int, default=160)
  p.add_argument("--P", type=int, default=16)
  p.add_argument("--R", type=int, default=4)
  p.add_argument("--slots", type=int, default=128)
  p.add_argument("--prompt-len", type=int, default=16)
  p.add_argument("--median", type=float, default=16.0)
  p.add_argument("--sigma-prompt", type=float, default=1.2)
  p.add_argument("--sigma-resp", type=float, default=1.0)
  p.add_argument("--cap", type=int, default=384)
  p.add_argument("--seed", type=int, default=0, help="first seed")
  p.add_argument(
    "--seeds",
    type=int,
    default=5,
    help="workloads (prompts and length draws) seed, seed+1, ...; the table "
    "shows means over them, and the speedups are listed per seed",
  )
  p.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures (per seed and per round too) here, with the "
    "command, machine, commit and date",
  )
  args = p.parse_args()

  cfg = config.preset(args.preset)
  model = vlm.create_model(cfg, 0)
  tok = Tokenizer.default()
  seeds = list(range(args.seed, args.seed + args.seeds))
  workloads = {}
  for seed in seeds:
    rng = np.random.default_rng(seed)
    workloads[seed] = (
      {i: rng.integers(0, 490, args.prompt_len).tolist() for i in range(args.prompts)},
      Lengths(args.median, args.sigma_prompt, args.sigma_resp, args.cap, seed),
    )

  # Random weights sample the vision placeholder ids (2 of the tiny preset's
  # 512) about 1 token in 250; a response holding one cannot be continued (no
  # media backs it), and a trained policy practically never emits them. So
  # the workload keeps them out, with SGLang's logit_bias.
  no_placeholders = {str(cfg.image_token_id): -100.0, str(cfg.video_token_id): -100.0}

  def request_maker(seed):
    prompt_ids, lengths = workloads[seed]
    return lambda p, j: protocol.GenerateRequest.of(
      prompt_ids[p],
      {
        "max_new_tokens": lengths(p, j),
        "ignore_eos": True,
        "temperature": 1.0,
        "logit_bias": no_placeholders,
      },
    )

  all_l = np.array(
    [workloads[s][1](p, j) for s in seeds for p in range(args.prompts) for j in range(8)]
  )
  rollout = EmbeddedRollout(
    model, tok, num_slots=args.slots, context_length=args.prompt_len + args.cap, seed=args.seed
  )

  async def run():
    # Warm-up: compile every prefill bucket (a continued response's prompt is
    # the prompt plus its partial tokens) and the decode step.
    first = workloads[seeds[0]][0][0]
    for bucket in rollout.engine.buckets:
      n = min(bucket, rollout.engine.capacity - 2)
      await rollout.generate(
        protocol.GenerateRequest.of(
          (first * (n // len(first) + 1))[:n], {"max_new_tokens": 2, "ignore_eos": True}
        ),
        None,
      )
    prompts = list(range(args.prompts))
    out = {}
    stats = rollout.engine.stats

    async def timed(name, epoch):
      before = dict(stats)
      rows = await epoch
      engine = {k: stats[k] - before[k] for k in ("prefill_s", "decode_s", "decode_steps")}
      out.setdefault(name, []).append((rows, engine))

    for seed in seeds:  # configurations alternate within a seed: same machine state
      make_request = request_maker(seed)
      await timed("baseline", baseline_epoch(rollout, prompts, args.P, args.R, make_request))
      lengths = workloads[seed][1]
      for name, eta, recycle, continue_in in CONFIGS:
        epoch = tail_epoch(
          rollout, prompts, args.P, args.R, eta, recycle, continue_in, make_request, lengths
        )
        await timed(name, epoch)
    await rollout.close()
    return out

  t0 = time.perf_counter()
  results = asyncio.run(run())
  total = time.perf_counter() - t0

  print(
    f"machine: {platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} "
    f"{jax.default_backend()}; preset {args.preset} (random weights), EmbeddedRollout "
    f"{args.slots} slots"
  )
  print(
    f"workload: {args.prompts} prompts x {args.prompt_len} tokens, P={args.P} prompts x "
    f"R={args.R} responses kept per round; lengths forced with ignore_eos=True and "
    f"max_new_tokens ~ min({args.cap}, LogNormal(log {args.median:g}, "
    f"prompt sigma {args.sigma_prompt:g} + response sigma {args.sigma_resp:g})): "
    f"p50 {np.median(all_l):.0f}, p90 {np.percentile(all_l, 90):.0f}, "
    f"p99 {np.percentile(all_l, 99):.0f}, max {all_l.max()}, "
    f"at cap {np.mean(all_l == args.cap):.1%}"
  )
  print(
    f"seeds {seeds}; every column is the mean over seeds; speedup = baseline mean "
    "round / config mean round, per seed: mean +- std [min, max]"
  )
  print(
    "| config | rounds (long) | mean round s | max round s | epoch s | prefill s | "
    "decode s (ms/step) | mean max len | slot-idle | bubble | discarded / decoded tokens | "
    "length bias | speedup (mean round) |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  base = [summarize(rows, args.slots) for rows, _ in results["baseline"]]
  per_seed = {}
  configs = {}
  for name, runs in results.items():
    ss = [dict(summarize(rows, args.slots), **engine) for rows, engine in runs]
    m = {k: float(np.mean([s[k] for s in ss])) for k in ss[0]}
    per_seed[name] = x = np.array([b["mean"] / s["mean"] for b, s in zip(base, ss)])
    configs[name] = {
      "mean_over_seeds": m,
      "speedup_mean": float(x.mean()),
      "speedup_std": float(x.std()),
      "speedup_min": float(x.min()),
      "speedup_max": float(x.max()),
      "speedup_per_seed": x.tolist(),
      "per_seed": ss,
      "rounds_per_seed": [rows for rows, _ in runs],
    }
    spread = f" +- {x.std():.2f} [{x.min():.2f}, {x.max():.2f}]" if len(x) > 1 else ""
    print(
      f"| {name} | {m['rounds']:.1f} ({m['long']:.1f}) | {m['mean']:.3f} | {m['max']:.3f} | "
      f"{m['total']:.2f} | {m['prefill_s']:.2f} | {m['decode_s']:.2f} "
      f"({1e3 * m['decode_s'] / max(m['decode_steps'], 1):.2f}) | {m['maxlen']:.0f} | "
      f"{m['idle']:.1%} | {m['bubble']:.1%} | "
      f"{m['discarded']:.0f} / {m['generated']:.0f} ({m['discarded'] / m['generated']:.1%}) | "
      f"{m['bias']:.3f} | {x.mean():.2f}x{spread} |"
    )
  if len(seeds) > 1:
    print("speedup per seed (" + ", ".join(map(str, seeds)) + "):")
    for name, x in per_seed.items():
      print(f"  {name}: " + " ".join(f"{v:.2f}x" for v in x))
  print(f"bench wall time {total:.0f} s")
  if args.json:
    runinfo.write(
      args.json,
      "tail.py",
      {
        "args": vars(args),
        "seeds": seeds,
        "lengths": {
          "p50": float(np.median(all_l)),
          "p90": float(np.percentile(all_l, 90)),
          "p99": float(np.percentile(all_l, 99)),
          "max": int(all_l.max()),
          "at_cap_fraction": float(np.mean(all_l == args.cap)),
        },
        "configs": configs,
        "bench_wall_s": total,
      },
    )


if __name__ == "__main__":
  main()
