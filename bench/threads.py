r"""The embedded engine's decode thread and a training thread on one device.

  python bench/threads.py                 # tiny preset, 50 train steps
  python bench/threads.py --steps 50 --json PATH

The hazard: the RL loop's rollout engine decodes on a thread of its own while
the trainer launches its step on another; on a GPU both enqueue programs on the
same device. This runs the same work twice, first in sequence (50 train steps,
then the decode rounds) and then at once on two threads, and compares: the
final parameters (the training thread's arithmetic must not change) and every
greedy token (the decode thread's must not either). A hang is caught by a
deadline per phase. Decoding reads a frozen copy of the start parameters, so
both orders must agree exactly; the tolerance only covers nondeterministic
reductions of the GPU libraries.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import mfu  # noqa: E402  (lives next to this script)
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import runinfo  # noqa: E402
from fluxjax.models import config as config_lib  # noqa: E402
from fluxjax.models import inputs  # noqa: E402
from fluxjax.models.tokenizer import Tokenizer  # noqa: E402
from fluxjax.rollout import engine as engine_lib  # noqa: E402
from fluxjax.rollout import sampling_params  # noqa: E402


def train(compiled, state, batch, steps: int):
  for _ in range(steps):
    state, _ = compiled(state, batch)
  return jax.device_get(jax.block_until_ready(state.params))


def decode(engine, seqs, rounds: int, new_tokens: int) -> list[list[int]]:
  sp = sampling_params.SamplingParams(max_new_tokens=new_tokens, top_k=1, ignore_eos=True)
  out = []
  for r in range(rounds):
    reqs = [engine_lib.EngineRequest(f"r{r}-{i}", s, sp) for i, s in enumerate(seqs)]
    out += [c.output_ids for c in engine.generate(reqs)]
  return out


def max_rel_diff(a, b) -> float:
  diffs = jax.tree.map(
    lambda x, y: (
      float(np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
      / max(float(np.linalg.norm(np.asarray(y, np.float64))), 1e-30)
    ),
    a,
    b,
  )
  return max(jax.tree.leaves(diffs))


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny")
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--rounds", type=int, default=20, help="decode rounds of --requests each")
  p.add_argument("--requests", type=int, default=16)
  p.add_argument("--new-tokens", type=int, default=64)
  p.add_argument("--deadline", type=float, default=300.0, help="seconds per phase")
  p.add_argument("--json", metavar="PATH")
  args = p.parse_args()
  batch_args = argparse.Namespace(
    rows=2, row_tokens=512, seq_tokens=256, image_side=8, refuse_nonfinite=None
  )
  device = jax.devices()[0]
  base = config_lib.preset(args.preset)
  cfg = base.replace(dtype="bfloat16" if device.platform == "gpu" else "float32")
  built = mfu.build(cfg, batch_args, device)
  compiled, state0, batch = built.step, built.state, built.batch
  start = jax.device_get(state0)
  model = nnx.merge(built.graphdef, start.params)
  engine = engine_lib.Engine(model, Tokenizer.default(), num_slots=args.requests, capacity=96)
  rng = np.random.default_rng(0)
  seqs = [
    inputs.sequence_from_tokens(rng.integers(0, 490, 32), [], cfg) for _ in range(args.requests)
  ]
  decode(engine, seqs, 1, 2)  # compile

  def fresh():
    return jax.device_put(start, jax.tree.map(lambda x: x.sharding, state0))

  t = time.perf_counter()
  seq_params = train(compiled, fresh(), batch, args.steps)
  seq_tokens = decode(engine, seqs, args.rounds, args.new_tokens)
  sequential_s = time.perf_counter() - t

  result: dict = {}
  state = fresh()
  trainer = threading.Thread(
    target=lambda: result.update(params=train(compiled, state, batch, args.steps)), daemon=True
  )
  t = time.perf_counter()
  trainer.start()
  tokens = decode(engine, seqs, args.rounds, args.new_tokens)
  trainer.join(args.deadline)
  concurrent_s = time.perf_counter() - t
  hung = trainer.is_alive()
  figures = {
    "device_kind": device.device_kind,
    "steps": args.steps,
    "decode_requests": args.rounds * args.requests,
    "sequential_s": sequential_s,
    "concurrent_s": concurrent_s,
    "hung": hung,
    "tokens_equal": tokens == seq_tokens,
    "params_max_rel_diff": None if hung else max_rel_diff(result["params"], seq_params),
  }
  print(f"python {' '.join(sys.argv)}")
  print(f"device: {device.device_kind}; jax {jax.__version__}; preset {args.preset} {cfg.dtype}")
  for k, v in figures.items():
    print(f"{k}: {v}")
  if args.json:
    runinfo.write(args.json, "threads.py", {"args": vars(args), **figures})
  if hung or figures["params_max_rel_diff"] > 1e-5 or not figures["tokens_equal"]:
    raise SystemExit("the two threads changed a result or hung")


if __name__ == "__main__":
  main()
