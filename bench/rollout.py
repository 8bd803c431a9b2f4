"""Rollout engine throughput: continuous batching vs a one-at-a-time decode loop.

  python bench/rollout.py [--preset tiny] [--requests 32] [--prompt-len 32] [--new-tokens 64]
      [--slots 32] [--json PATH]

Both sides run the same model and the same jitted KV-cache kernels
(models/decode.py); both are greedy with EOS ignored, so every request
generates exactly --new-tokens tokens. Compilation is excluded (warm-up first).

  loop     one request at a time: prefill, then one decode step per token on a
           1-slot cache, the token fetched to the host each step (a plain
           generate loop with a KV cache).
  engine   fluxjax.rollout.engine.Engine with 32 slots; a driver keeps
           1, 8 or 32 requests in flight until all --requests are done.

Reports generated tokens/s and the ratio to the loop, in one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import runinfo
from fluxjax.models import config, decode, inputs, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout import protocol


def make_loop(model, capacity):
  """The baseline: jitted prefill + decode on a 1-slot cache, greedy."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def prefill(state, cache, tokens_P, positions_3P, length):
    m = nnx.merge(graphdef, state)
    logits, cache = decode.prefill(m, cache, jnp.int32(0), tokens_P, positions_3P, length)
    return jnp.argmax(logits).astype(jnp.int32), cache

  @jax.jit
  def step(state, cache, token, length, rope_pos):
    m = nnx.merge(graphdef, state)
    logits, cache = decode.decode_step(m, cache, token[None], length[None], rope_pos[None])
    return jnp.argmax(logits[0]).astype(jnp.int32), cache

  def generate(seq, new_tokens, bucket):
    cache = decode.init_cache(model, 1, capacity)
    n = len(seq)
    tokens = np.zeros(bucket, np.int32)
    tokens[:n] = seq.tokens_T
    pos = np.zeros((3, bucket), np.int32)
    pos[:, :n] = seq.positions_3T
    tok, cache = prefill(state, cache, tokens, pos, np.int32(n))
    out = [int(tok)]
    for i in range(new_tokens - 1):
      length = np.int32(n + i)
      tok, cache = step(state, cache, tok, length, length + np.int32(seq.mrope_delta))
      out.append(int(tok))  # a real loop looks at each token (EOS check)
    return out

  return generate


def run_engine(engine, seqs, new_tokens, concurrency):
  sp = protocol.SamplingParams(max_new_tokens=new_tokens, top_k=1, ignore_eos=True)
  pending = list(enumerate(seqs))
  inflight, done = [], 0
  tag = f"c{concurrency}-{time.time_ns()}"
  while done < len(seqs):
    while pending and len(inflight) < concurrency:
      i, s = pending.pop(0)
      inflight.append(engine.submit(engine_lib.EngineRequest(f"{tag}-{i}", s, sp)))
    engine.step()
    finished = [r for r in inflight if r.done.is_set()]
    done += len(finished)
    inflight = [r for r in inflight if not r.done.is_set()]
  return done * new_tokens


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--requests", type=int, default=32)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--slots", type=int, default=32)
  p.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures here, with the command, machine, commit and date",
  )
  args = p.parse_args()

  cfg = config.preset(args.preset)
  model = vlm.create_model(cfg, 0)
  tok = Tokenizer.default()
  capacity = args.prompt_len + args.new_tokens
  bucket = args.prompt_len
  rng = np.random.default_rng(0)
  seqs = [
    inputs.sequence_from_tokens(rng.integers(0, 490, args.prompt_len), [], cfg)
    for _ in range(args.requests)
  ]

  loop = make_loop(model, capacity)
  loop(seqs[0], 3, bucket)  # compile
  t = time.perf_counter()
  loop_outs = [loop(s, args.new_tokens, bucket) for s in seqs]
  loop_tps = args.requests * args.new_tokens / (time.perf_counter() - t)

  engine = engine_lib.Engine(
    model, tok, num_slots=args.slots, capacity=capacity, prefill_buckets=(bucket, capacity)
  )
  run_engine(engine, seqs[:2], 3, 2)  # compile
  rows = []
  for c in (1, 8, 32):
    t = time.perf_counter()
    tokens = run_engine(engine, seqs, args.new_tokens, c)
    rows.append((c, tokens / (time.perf_counter() - t)))
  # Same greedy tokens on both sides (a sanity check, not a timing).
  check = engine.generate(
    [
      engine_lib.EngineRequest(
        "check",
        seqs[0],
        protocol.SamplingParams(max_new_tokens=args.new_tokens, top_k=1, ignore_eos=True),
      )
    ]
  )[0]
  assert check.output_ids == loop_outs[0], "engine and loop disagree"

  print(
    f"machine: {platform.machine()} {os.cpu_count()} CPUs, jax {jax.__version__} "
    f"{jax.default_backend()}; preset {args.preset}, {args.requests} requests x "
    f"{args.prompt_len} prompt + {args.new_tokens} new tokens, engine {args.slots} slots"
  )
  print("| mode | concurrent requests | generated tokens/s | vs loop |")
  print("|---|---|---|---|")
  print(f"| loop (one at a time) | 1 | {loop_tps:,.0f} | 1.00x |")
  for c, tps in rows:
    print(f"| engine | {c} | {tps:,.0f} | {tps / loop_tps:.2f}x |")
  if args.json:
    runinfo.write(
      args.json,
      "rollout.py",
      {
        "args": vars(args),
        "rows": [
          {
            "mode": "loop (one at a time)",
            "concurrent_requests": 1,
            "generated_tokens_per_s": loop_tps,
            "vs_loop": 1.0,
          }
        ]
        + [
          {
            "mode": "engine",
            "concurrent_requests": c,
            "generated_tokens_per_s": tps,
            "vs_loop": tps / loop_tps,
          }
          for c, tps in rows
        ],
        "engine_matches_loop": True,
      },
    )  # the assert above


if __name__ == "__main__":
  main()
