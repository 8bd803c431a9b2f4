r"""Packed-segment attention on a GPU: the xla reference vs the GPU backends.

  python bench/attention.py                       # 4k, 16k, 32k, 64k tokens
  python bench/attention.py --backends xla,pallas_gpu,cudnn,tokamax_gpu
  python bench/attention.py --backends cudnn,tokamax_gpu_autotuned --tokens 16384,65536
  python bench/attention.py --tokens 4096 --mixtures image_heavy --reps 5
  python bench/attention.py --variants            # also alternative tiles at 16k
  python bench/attention.py --json PATH           # also write the figures, command, commit
  python bench/attention.py --backends xla,xla_blocked --tokens 2048  # on a CPU

One packed row (B = 1) of T tokens per case, filled with sequence lengths
drawn from a mixture of bench/mixtures.py (first fit in draw order, a drawn
sequence longer than the row is cut to it, what is left is padding), causal,
segment ids and in-sequence positions as the trainer builds them. Shapes are
the Qwen2.5-VL-7B decoder's: 28 query heads over 4 kv heads, head dim 128,
bf16.

Per case and backend: median wall time of the jitted forward and of
forward + backward (dq, dk, dv) over --reps runs after two warm-ups, and the
compiled program's memory (arguments + outputs + temporaries, from XLA's
memory analysis). A backend that does not fit reports the error instead.
The parity columns compare pallas_gpu with xla on the same bf16 inputs
(||a - b|| / ||b|| of the output and each gradient; bf16 rounding, not a
bug), and a last fp32 case gives the max abs errors at "highest" precision.

Cost-model columns (the same on any machine):
  needed TF   attention FLOPs the masks require, forward (QK^T, PV) +
              backward (dV, dP, dQ, dK) = 6 matmuls x 2 x heads x head dim
              per visible query-key pair;
  dense TF    the same over all T x T pairs (what xla computes);
  kernel TF   what the kernels compute over the tiles they visit (forward 2,
              dq 3, dk/dv 4 matmuls per tile pair; the backward recomputes
              QK^T twice);
  min GB      fewest bytes fwd + bwd must move: q, k, v, o, do read, o, dq,
              dk, dv written once (bf16);
  floor ms    max(needed FLOPs / 798 TFLOP/s, min bytes / 3.0 TB/s): the
              bf16 matmul rate and copy bandwidth seen on this workplace's
              H100 (.library/device/KINDS.md), so a lead, not a bound.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import mixtures  # noqa: E402  (lives next to this script)
import runinfo  # noqa: E402
from fluxjax.models import attention as attn_lib  # noqa: E402
from fluxjax.models import config as model_config  # noqa: E402
from fluxjax.models.attention import pallas as ap  # noqa: E402
from fluxjax.models.attention import xla  # noqa: E402
from fluxjax.planning import balance  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128
PEAK_FLOPS, PEAK_BYTES = 798e12, 3.0e12  # H100 readings of KINDS.md


def pack_row(mixture: str, tokens: int, seed: int) -> np.ndarray:
  """Lengths of the sequences packed into one row of `tokens` (first fit)."""
  draws = getattr(mixtures, mixture)(512, seed)
  lengths, room = [], tokens
  for n in draws:
    n = int(min(n, tokens))
    if n <= room:
      lengths.append(n)
      room -= n
  return np.asarray(lengths)


def row_arrays(lengths: np.ndarray, tokens: int):
  seg = np.zeros(tokens, np.int32)
  pos = np.zeros(tokens, np.int32)
  start = 0
  for i, n in enumerate(lengths):
    seg[start : start + n] = i + 1
    pos[start : start + n] = np.arange(n)
    start += n
  return jnp.asarray(seg[None]), jnp.asarray(pos[None])


def kernel_flops(blocks: ap.BlockSizes, seg, pos) -> float:
  """FLOPs of the matmuls the three kernels run over the tiles they visit."""
  per_pair = 2.0 * HEADS * HEAD_DIM
  total = 0.0
  for rows_q, bq, bk, matmuls in (
    (True, blocks.fwd_q, blocks.fwd_k, 2),
    (True, blocks.dq_q, blocks.dq_k, 3),
    (False, blocks.dkv_q, blocks.dkv_k, 4),
  ):
    q_ranges = xla.block_ranges(seg, pos, bq)
    k_ranges = xla.block_ranges(seg, pos, bk)
    table = (
      ap._visit_table(q_ranges, k_ranges, True, True)
      if rows_q
      else ap._visit_table(k_ranges, q_ranges, True, False)
    )
    total += float(np.asarray(table[..., 0]).sum()) * bq * bk * matmuls * per_pair
  return total


def make_fns(backend: str, kw: dict, blocks: ap.BlockSizes | None, interpret: bool = False):
  if backend == "pallas_gpu":
    attend = lambda q, k, v: ap.pallas_attention(
      q, k, v, causal=True, block_sizes=blocks, interpret=interpret, **kw
    )
  else:
    attend = lambda q, k, v: attn_lib.attention(q, k, v, backend=backend, causal=True, **kw)

  def fwd_bwd(q, k, v, do):
    out, vjp = jax.vjp(attend, q, k, v)
    return (out, *vjp(do))

  return jax.jit(attend), jax.jit(fwd_bwd)


def timed(fn, args, reps: int) -> float:
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return statistics.median(times)


# tokamax_gpu with the kernel configs `tokamax.autotune` picks for this
# case's forward + backward (untuned, tokamax uses one default config).
TOKAMAX_AUTOTUNED = "tokamax_gpu_autotuned"


def autotuned(fwd_bwd, args):
  """The autotuning result for `fwd_bwd(*args)`: a context whose configs
  apply to the tokamax kernels traced inside it."""
  import tokamax

  return tokamax.autotune(fwd_bwd, *args)


def run_backend(backend, kw, args, reps, blocks=None, interpret=False):
  """(fwd s, fwd+bwd s, program GB, outputs) or the error's first line."""
  tune = backend == TOKAMAX_AUTOTUNED
  fwd, fwd_bwd = make_fns("tokamax_gpu" if tune else backend, kw, blocks, interpret)
  try:
    with autotuned(fwd_bwd, args) if tune else contextlib.nullcontext():
      compiled = fwd_bwd.lower(*args).compile()
      mem = compiled.memory_analysis()
      gb = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes) / 1e9
      t_fb = timed(compiled, args, reps)
      outs = jax.device_get(compiled(*args))
      t_f = timed(fwd, args[:3], reps)
    return t_f, t_fb, gb, outs
  except Exception as e:
    line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"{type(e).__name__}: {line[:110]}"


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def random_qkv_do(seed: int, tokens: int, dtype) -> tuple[jax.Array, ...]:
  """q, k, v and the output cotangent of one row, standard normal."""
  key = jax.random.split(jax.random.key(seed), 4)
  shapes = [(1, tokens, HEADS, HEAD_DIM)] + [(1, tokens, KV_HEADS, HEAD_DIM)] * 2
  shapes.append(shapes[0])
  return tuple(jax.random.normal(kk, sh, dtype) for kk, sh in zip(key, shapes))


def shuffled_row(seed: int, tokens: int) -> tuple[np.ndarray, dict]:
  """(lengths, mask kwargs) of an image_heavy row in shuffled buffer order.

  Masks must come from segment ids and positions, not buffer indices.
  """
  lengths = pack_row("image_heavy", tokens, seed)
  seg, pos = row_arrays(lengths, tokens)
  perm = np.random.default_rng(seed).permutation(tokens)
  seg, pos = seg[:, perm], pos[:, perm]
  return lengths, dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)


def fp32_parity(seed: int, tokens: int, interpret: bool) -> dict:
  """Max abs error of pallas_gpu vs xla in fp32 ("highest") on a small packed row."""
  lengths, kw = shuffled_row(seed, tokens)
  q, k, v, do = random_qkv_do(seed, tokens, jnp.float32)
  with jax.default_matmul_precision("highest"):
    ref = jax.device_get(make_fns("xla", kw, None)[1](q, k, v, do))
    got = jax.device_get(make_fns("pallas_gpu", kw, None, interpret)[1](q, k, v, do))
  print(
    f"\nfp32 parity, {tokens} tokens shuffled ({len(lengths)} sequences), "
    f"{HEADS}/{KV_HEADS} heads, head dim {HEAD_DIM}, matmul precision highest:"
  )
  print("| tensor | max abs err | max abs ref | rel norm err |")
  print("|---|---|---|---|")
  rows = []
  for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
    print(f"| {name} | {np.abs(a - b).max():.2e} | {np.abs(b).max():.3g} | {rel_err(a, b):.2e} |")
    rows.append(
      {
        "tensor": name,
        "max_abs_err": float(np.abs(a - b).max()),
        "max_abs_ref": float(np.abs(b).max()),
        "rel_norm_err": rel_err(a, b),
      }
    )
  return {
    "tokens": tokens,
    "sequences": len(lengths),
    "shuffled": True,
    "matmul_precision": "highest",
    "rows": rows,
  }


def shuffled_parity(backends: list[str], seed: int, tokens: int) -> dict:
  """bf16 backends on a shuffled buffer vs xla in fp32 on the same bf16 inputs.

  Sorting kernels (cudnn, tokamax_gpu) must mask by segment ids and positions,
  not buffer order: the buffer is permuted before the call.
  """
  lengths, kw = shuffled_row(seed, tokens)
  args = random_qkv_do(seed, tokens, jnp.bfloat16)
  with jax.default_matmul_precision("highest"):
    ref = jax.device_get(make_fns("xla", kw, None)[1](*[a.astype(jnp.float32) for a in args]))
  out = {}
  for backend in backends:
    bkw = dict(kw, max_segments=len(lengths) + 1) if backend == "cudnn" else kw
    try:
      got = jax.device_get(make_fns(backend, bkw, None)[1](*args))
    except Exception as e:  # a backend this machine lacks reports, the others still run
      out[backend] = {"status": f"{type(e).__name__}: {str(e).splitlines()[0][:110]}"}
      print(f"shuffled parity {backend}: {out[backend]['status']}")
      continue
    out[backend] = {
      name: rel_err(np.asarray(a, np.float32), b)
      for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref)
    }
    print(f"shuffled parity {backend} (bf16 vs fp32 xla, rel norm): {out[backend]}", flush=True)
  return out


def _backend_figures(r) -> dict:
  """A run_backend result (or skip message) as JSON figures, without the output arrays."""
  if isinstance(r, str):
    return {"status": r}
  return {"status": "ok", "fwd_ms": r[0] * 1e3, "fwd_bwd_ms": r[1] * 1e3, "program_gb": r[2]}


# Alternatives to the default tiles (ap.BlockSizes()), timed with --variants.
VARIANTS = {
  "fwd 128x128": ap.BlockSizes(fwd_k=128),
  "bwd 8 warps": ap.BlockSizes(num_warps_bwd=8),
  "dq 128x64, dkv 64x128, 8 warps": ap.BlockSizes(dq_q=128, dkv_k=128, num_warps_bwd=8),
  "3 stages": ap.BlockSizes(num_stages=3),
  "tutorial bwd (dq 128x32, dkv 32x128)": ap.BlockSizes(dq_q=128, dq_k=32, dkv_q=32, dkv_k=128),
}


def write_json(args, dev, blocks, cases, parity32=None, shuffled=None, partial=False) -> None:
  """The run's figures; `partial`: written after each case, so a run stopped
  by its time limit keeps the cases it measured."""
  runinfo.write(
    args.json,
    "attention.py",
    {
      "args": vars(args),
      "device": {"device_kind": dev.device_kind, "platform": dev.platform},
      "shape": {
        "heads": HEADS,
        "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": "bfloat16",
        "causal": True,
        "batch": 1,
      },
      "floor_rates": {"matmul_flop_per_s": PEAK_FLOPS, "bytes_per_s": PEAK_BYTES},
      "default_tiles": str(blocks),
      "cases": cases,
      "fp32_parity": parity32,
      "shuffled_bf16_parity": shuffled,
      **({"partial": True} if partial else {}),
    },
  )


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", default="4096,16384,32768,65536")
  p.add_argument("--mixtures", default="image_heavy,long_context_sft")
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--variants", action="store_true", help="also alternative tiles at 16k")
  p.add_argument(
    "--backends",
    default="xla,pallas_gpu",
    help="comma list of attention backends (xla, pallas_gpu, cudnn, tokamax_gpu; "
    f"{TOKAMAX_AUTOTUNED}: tokamax_gpu autotuned for each case first)",
  )
  p.add_argument(
    "--max-segments",
    type=int,
    default=0,
    help="cudnn's static segment bound; 0: the row's own count (sequences + padding)",
  )
  p.add_argument(
    "--xla-max-tokens",
    type=int,
    default=1 << 30,
    help="skip xla above this row length (it holds T x T fp32 logits per head)",
  )
  p.add_argument("--parity-tokens", type=int, default=2048, help="row of the fp32 parity case")
  p.add_argument(
    "--interpret",
    action="store_true",
    help="Pallas interpret mode: a CPU smoke test of this script, not a benchmark",
  )
  p.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures here, with the command, machine, commit and date",
  )
  args = p.parse_args()
  dev = jax.devices()[0]
  print(f"python {' '.join(sys.argv)}")
  print(
    f"device: {dev.device_kind} ({dev.platform}); jax {jax.__version__}; "
    f"{HEADS}/{KV_HEADS} heads, head dim {HEAD_DIM}, bf16, causal, B=1"
  )
  gpu_only = {"pallas_gpu", "cudnn", "tokamax_gpu", TOKAMAX_AUTOTUNED} & set(
    args.backends.split(",")
  )
  if dev.platform == "cpu" and gpu_only and not args.interpret:
    raise SystemExit(f"no accelerator: {sorted(gpu_only)} run on a GPU only")
  blocks = ap.default_block_sizes(HEAD_DIM, 2)
  print(f"default tiles: {blocks}")
  shape1 = dataclasses.replace(model_config.preset("7b").cost_shape(), num_layers=1)
  rows, cases = [], []
  for mixture in args.mixtures.split(","):
    for tokens in map(int, args.tokens.split(",")):
      lengths = pack_row(mixture, tokens, args.seed)
      seg, pos = row_arrays(lengths, tokens)
      kw = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
      q, k, v, do = random_qkv_do(args.seed, tokens, jnp.bfloat16)
      needed = 3.0 * float(balance.attention_cost(lengths, shape1).sum())
      dense = 3.0 * 4.0 * HEADS * HEAD_DIM * tokens * tokens
      kernel = kernel_flops(blocks.capped(tokens, tokens), seg, pos)
      min_bytes = 2.0 * HEAD_DIM * tokens * (3 * (HEADS + 2 * KV_HEADS) + 3 * HEADS)
      floor = max(needed / PEAK_FLOPS, min_bytes / PEAK_BYTES)
      desc = (
        f"{mixture} {tokens // 1024}k: {len(lengths)} seqs, longest {lengths.max()}, "
        f"padding {tokens - lengths.sum()}"
      )
      print(
        f"\n{desc}; needed {needed / 1e12:.3f} TF, dense {dense / 1e12:.2f} TF, kernel "
        f"tiles {kernel / 1e12:.3f} TF, min {min_bytes / 1e9:.3f} GB, floor "
        f"{floor * 1e3:.3f} ms",
        flush=True,
      )
      res = {}
      n_segments = len(lengths) + int(tokens > lengths.sum())
      for backend in args.backends.split(","):
        bkw = dict(kw)
        if backend == "cudnn":
          bkw["max_segments"] = args.max_segments or n_segments
        if backend == "xla" and tokens > args.xla_max_tokens:
          logits_gb = HEADS * tokens * tokens * 4 / 1e9
          res[backend] = r = f"skipped: its fp32 logits alone are {logits_gb:.0f} GB"
        else:
          res[backend] = r = run_backend(
            backend, bkw, (q, k, v, do), args.reps, interpret=args.interpret
          )
        if isinstance(r, str):
          print(f"  {backend}: {r}", flush=True)
        else:
          print(
            f"  {backend}: fwd {r[0] * 1e3:.3f} ms, fwd+bwd {r[1] * 1e3:.3f} ms, "
            f"program {r[2]:.2f} GB, needed-FLOP rate {needed / r[1] / 1e12:.0f} TF/s",
            flush=True,
          )
      case = {
        "mixture": mixture,
        "tokens": tokens,
        "seqs": len(lengths),
        "longest": int(lengths.max()),
        "padding": int(tokens - lengths.sum()),
        "needed_tflop": needed / 1e12,
        "dense_tflop": dense / 1e12,
        "kernel_tflop": kernel / 1e12,
        "min_gb": min_bytes / 1e9,
        "floor_ms": floor * 1e3,
        **{b: _backend_figures(r) for b, r in res.items()},
      }
      for b, r in res.items():
        if not isinstance(r, str):
          case[b]["needed_tflop_per_s"] = needed / r[1] / 1e12
          if b != "xla" and not isinstance(res.get("xla", "-"), str):
            case[b]["parity_bf16_rel_vs_xla"] = {
              t: rel_err(a, ref)
              for t, a, ref in zip(("out", "dq", "dk", "dv"), r[3], res["xla"][3])
            }
            print(f"  {b} vs xla (bf16, rel): {case[b]['parity_bf16_rel_vs_xla']}", flush=True)
      if args.variants and tokens == 16384:
        case["tile_variants"] = {}
        for name, var in VARIANTS.items():
          r = run_backend("pallas_gpu", kw, (q, k, v, do), args.reps, var, args.interpret)
          print(
            f"  pallas_gpu tiles {name}: "
            + (
              r if isinstance(r, str) else f"fwd {r[0] * 1e3:.3f} ms, fwd+bwd {r[1] * 1e3:.3f} ms"
            ),
            flush=True,
          )
          case["tile_variants"][name] = dict(_backend_figures(r), tiles=str(var))
      cases.append(case)
      if args.json:
        write_json(args, dev, blocks, cases, partial=True)
      if isinstance(res.get("xla"), str) or "xla" not in res:
        # Nothing to compare against: keep no host copies of the outputs.
        res = {b: (r if isinstance(r, str) else r[:3]) for b, r in res.items()}
      rows.append((mixture, tokens, len(lengths), needed, dense, kernel, min_bytes, floor, res))
  parity32 = (
    fp32_parity(args.seed, args.parity_tokens, args.interpret)
    if "pallas_gpu" in args.backends.split(",")
    else None
  )
  sorting = [b for b in args.backends.split(",") if b in ("cudnn", "tokamax_gpu", "pallas_gpu")]
  shuffled = shuffled_parity(sorting, args.seed, args.parity_tokens) if sorting else None

  print(
    "\n| mixture | tokens | seqs | needed TF | kernel TF | floor ms | backend | fwd ms | "
    "fwd+bwd ms | program GB | needed TF/s | x floor | parity vs xla out / dq / dk / dv |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for (mixture, tokens, n, needed, _, kernel, _, floor, res), case in zip(rows, cases):
    for backend, r in res.items():
      head = (
        f"| {mixture} | {tokens} | {n} | {needed / 1e12:.3f} | {kernel / 1e12:.3f} | "
        f"{floor * 1e3:.3f} | {backend} |"
      )
      if isinstance(r, str):
        print(f"{head} {r[:60]} | - | - | - | - | - |")
        continue
      par = case[backend].get("parity_bf16_rel_vs_xla")
      parity = " / ".join(f"{e:.1e}" for e in par.values()) if par else "-"
      print(
        f"{head} {r[0] * 1e3:.2f} | {r[1] * 1e3:.2f} | {r[2]:.2f} | {needed / r[1] / 1e12:.0f} | "
        f"{r[1] / floor:.2f} | {parity} |"
      )
  if args.json:
    write_json(args, dev, blocks, cases, parity32, shuffled)


if __name__ == "__main__":
  main()
