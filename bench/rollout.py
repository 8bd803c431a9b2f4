"""Rollout engine throughput: continuous batching vs a one-at-a-time decode loop.

  python bench/rollout.py [--preset tiny] [--requests 32] [--prompt-len 32] [--new-tokens 64]
      [--slots 32] [--decode-steps 1,8] [--json PATH]
  python bench/rollout.py --preset 3b --dtype bfloat16 --slots 256 --concurrency 1,32,256 \
      --loop-requests 2 --new-tokens 128 --prefill-len 1024 \
      --decode-attention xla,pallas_gpu                            # on a GPU

Both sides run the same model and the same jitted KV-cache kernels
(models/decode.py); both are greedy with EOS ignored, so every request
generates exactly --new-tokens tokens. Compilation is excluded (warm-up first).

  loop     one request at a time: prefill, then one decode step per token on a
           1-slot cache, the token fetched to the host each step (a plain
           generate loop with a KV cache).
  engine   fluxjax.rollout.engine.Engine with 32 slots; a driver keeps
           1, 8 or 32 requests in flight until all --requests are done;
           once per --decode-steps value (num_continuous_decode_steps:
           decode steps per jitted call, one fetch of the tokens per call)
           and per --decode-attention value (model.decode_attention: the
           xla reference, or pallas_gpu reading the cache in place).

Reports generated tokens/s (the median of --repeats timed runs) and the
ratio to the loop, in one run. Each
concurrency level runs max(--requests, level) requests (--loop-requests for
the loop), all admitted at once when the level allows, so prefill is inside
the timing.

Cost model: KV-cache bytes per token = 2 (k, v) x layers x kv heads x head
dim x dtype bytes; the memory-bandwidth bound of one decode step at batch b
and context c is (decoder and LM-head bytes + b x c x KV bytes per token) / bandwidth,
with c = prompt + new tokens / 2 (the mean context) and the bandwidth the
copy rate seen on this workplace's GPUs (.library/device/KINDS.md; --bandwidth
overrides). --prefill-len also times prefill alone (new tokens 1) at the
largest level, in prompt tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
import op_profile
from flax import nnx

import runinfo
from fluxjax.models import config, decode, flops, inputs, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout import sampling_params

# Device-to-device copy rates seen on this workplace's GPUs (bytes read + written).
BANDWIDTH = {"H100": 3.0e12, "H200": 4.3e12}


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
  sp = sampling_params.SamplingParams(max_new_tokens=new_tokens, top_k=1, ignore_eos=True)
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


def agreement(engine, seq, loop_out, new_tokens):
  """How many leading greedy tokens the engine and the loop share (a sanity
  check, not a timing)."""
  sp = sampling_params.SamplingParams(max_new_tokens=new_tokens, top_k=1, ignore_eos=True)
  check = engine.generate([engine_lib.EngineRequest("check", seq, sp)])[0]
  return next((i for i, (a, b) in enumerate(zip(check.output_ids, loop_out)) if a != b), new_tokens)


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--requests", type=int, default=32)
  p.add_argument("--prompt-len", type=int, default=32)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--slots", type=int, default=32)
  p.add_argument("--dtype", default="float32", help="compute and parameter dtype")
  p.add_argument("--concurrency", default="1,8,32", help="requests in flight, comma list")
  p.add_argument("--repeats", type=int, default=3, help="timed runs per row; the median")
  p.add_argument(
    "--profile",
    metavar="DIR",
    help="also trace one more run at the largest level per --decode-attention and "
    "--decode-steps value into DIR/<attention>-steps<K>-c<level> and print its time by op "
    "(bench/op_profile.py)",
  )
  p.add_argument("--decode-steps", default="1,8", help="engine decode steps per call, comma list")
  p.add_argument(
    "--decode-attention",
    default="xla",
    help="decode steps' attention (model.decode_attention), comma list: xla, pallas_gpu",
  )
  p.add_argument("--loop-requests", type=int, default=0, help="loop baseline requests; 0: all")
  p.add_argument("--prefill-len", type=int, default=0, help="also time prefill at this length")
  p.add_argument("--bandwidth", type=float, default=None, help="bytes/s; default by device")
  p.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures here, with the command, machine, commit and date",
  )
  args = p.parse_args()
  if args.profile:  # before JAX first touches a device
    op_profile.expose_ops(op_profile.hlo_dir_of(args.profile))
  levels = [int(c) for c in args.concurrency.split(",")]
  steps_per_call = [int(k) for k in args.decode_steps.split(",")]
  backends = args.decode_attention.split(",")
  cfg = config.preset(args.preset, dtype=args.dtype, param_dtype=args.dtype)
  model = vlm.create_model(cfg, 0)
  tok = Tokenizer.default()
  capacity = max(args.prompt_len + args.new_tokens, args.prefill_len + 1)
  bucket = args.prompt_len
  rng = np.random.default_rng(0)
  draw = lambda n, length: [
    inputs.sequence_from_tokens(rng.integers(0, 490, length), [], cfg) for _ in range(n)
  ]
  seqs = draw(max([args.requests, *levels]), args.prompt_len)

  loop = make_loop(model, capacity)
  loop(seqs[0], 3, bucket)  # compile
  loop_seqs = seqs[: args.loop_requests or args.requests]
  loop_runs = []
  for _ in range(args.repeats):
    t = time.perf_counter()
    loop_outs = [loop(s, args.new_tokens, bucket) for s in loop_seqs]
    loop_runs.append(len(loop_seqs) * args.new_tokens / (time.perf_counter() - t))
  loop_tps = statistics.median(loop_runs)
  print(f"measured: loop, {loop_tps:,.0f} tokens/s", flush=True)

  t = cfg.text
  itemsize = jnp.dtype(args.dtype).itemsize
  kv_per_token = 2 * t.num_layers * t.num_kv_heads * t.head_dim * itemsize
  # What one decode step reads: the decoder layers and the LM head (the
  # vision tower and the embedding rows are not touched).
  param_bytes = flops.decoder_matmul_weights(t) * itemsize
  dev = jax.devices()[0]
  bandwidth = args.bandwidth or next(
    (v for k, v in BANDWIDTH.items() if k in dev.device_kind), None
  )
  context = args.prompt_len + args.new_tokens / 2

  def bound(c):
    if not bandwidth:
      return None
    return c * bandwidth / (param_bytes + c * context * kv_per_token)

  def save(partial: bool = False) -> None:
    """Writes --json; after each measured row too, so a run stopped by its
    time limit keeps what it measured (`partial` then says so)."""
    if not args.json:
      return
    runinfo.write(
      args.json,
      "rollout.py",
      {
        "partial": partial,
        "args": vars(args),
        "device_kind": dev.device_kind,
        "param_bytes": param_bytes,
        "kv_bytes_per_token": kv_per_token,
        "bandwidth": bandwidth,
        "prefill_tokens_per_s": prefill_tps,
        "rows": [
          {
            "mode": "loop (one at a time)",
            "decode_steps_per_call": 1,
            "concurrent_requests": 1,
            "generated_tokens_per_s": loop_tps,
            "vs_loop": 1.0,
            "bandwidth_bound": bound(1),
          }
        ]
        + [
          {
            "mode": "engine",
            "decode_attention": backend,
            "decode_steps_per_call": k,
            "concurrent_requests": c,
            "generated_tokens_per_s": tps,
            "vs_loop": tps / loop_tps,
            "bandwidth_bound": bound(c),
          }
          for backend, k, c, tps in rows
        ],
        "tokens_agreeing_with_loop": agree,
      },
    )

  buckets = sorted({bucket, capacity} | ({args.prefill_len} if args.prefill_len else set()))
  rows, prefill_tps, agree = [], None, args.new_tokens
  for k, backend in itertools.product(steps_per_call, backends):
    # decode_step reads the choice from the model's config (models/decode.py).
    model.cfg = dataclasses.replace(model.cfg, decode_attention=backend)
    engine = engine_lib.Engine(
      model,
      tok,
      num_slots=args.slots,
      capacity=capacity,
      prefill_buckets=buckets,
      num_continuous_decode_steps=k,
    )
    run_engine(engine, seqs[:2], 3, 2)  # compile
    for c in levels:
      n = max(args.requests, c)
      run_engine(engine, seqs[:c], 2, c)  # this level's slot bucket compiles
      runs = []
      for _ in range(args.repeats):
        t = time.perf_counter()
        tokens = run_engine(engine, seqs[:n], args.new_tokens, c)
        runs.append(tokens / (time.perf_counter() - t))
      rows.append((backend, k, c, statistics.median(runs)))
      print(
        f"measured: {backend}, {k} decode steps per call, {c} concurrent: "
        f"{rows[-1][3]:,.0f} tokens/s",
        flush=True,
      )
      save(partial=True)
    if args.profile:  # the largest level once more, traced apart from the timed runs
      trace_dir = os.path.join(args.profile, f"{backend}-steps{k}-c{levels[-1]}")
      with op_profile.capture(trace_dir):
        run_engine(engine, seqs[: max(args.requests, levels[-1])], args.new_tokens, levels[-1])
      where = "device" if jax.default_backend() == "gpu" else "host"
      op_profile.report(trace_dir, where=where, hlo_dir=op_profile.hlo_dir_of(args.profile))
    if args.prefill_len and prefill_tps is None:
      long_seqs = draw(levels[-1], args.prefill_len)
      run_engine(engine, long_seqs[:1], 1, 1)  # compile
      t = time.perf_counter()
      run_engine(engine, long_seqs, 1, levels[-1])
      prefill_tps = len(long_seqs) * args.prefill_len / (time.perf_counter() - t)
      print(f"measured: prefill, {prefill_tps:,.0f} tokens/s", flush=True)
      save(partial=True)
    agree = min(agree, agreement(engine, seqs[0], loop_outs[0], args.new_tokens))
    del engine  # its KV cache goes before the next one's
  # Greedy ties break differently between batch shapes in bf16 (random
  # weights give near-flat logits): exact agreement is checked in fp32 only.
  if args.dtype == "float32":
    assert agree == args.new_tokens, f"engine and loop disagree from token {agree}"

  print(
    f"machine: {platform.machine()} {os.cpu_count()} CPUs, {dev.device_kind}, jax "
    f"{jax.__version__} {jax.default_backend()}; preset {args.preset} {args.dtype}, "
    f"{args.prompt_len} prompt + {args.new_tokens} new tokens, engine {args.slots} slots"
  )
  print(
    f"decoder + LM head {param_bytes / 1e9:.2f} GB read per step; "
    f"KV cache {kv_per_token} bytes per token; "
    f"bandwidth {bandwidth / 1e12 if bandwidth else float('nan'):.1f} TB/s"
  )
  print(
    "| mode | decode steps per call | concurrent requests | generated tokens/s | vs loop "
    "| bandwidth bound | of bound |"
  )
  print("|---|---|---|---|---|---|---|")

  def of_bound(c, tps):  # the bound's cell and the share of it reached
    return f"{bound(c):,.0f} | {tps / bound(c):.0%}" if bandwidth else "- | -"

  print(f"| loop (one at a time) | 1 | 1 | {loop_tps:,.0f} | 1.00x | {of_bound(1, loop_tps)} |")
  for backend, k, c, tps in rows:
    print(
      f"| engine, {backend} | {k} | {c} | {tps:,.0f} | {tps / loop_tps:.2f}x | {of_bound(c, tps)} |"
    )
  if prefill_tps:
    print(f"prefill: {levels[-1]} x {args.prefill_len} tokens, {prefill_tps:,.0f} tokens/s")
  save()


if __name__ == "__main__":
  main()
