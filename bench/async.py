r"""Adaptive async: steps/s and staleness for sync, fixed lag 1 and adaptive lag.

  python bench/async.py                 # 12 steps each, tiny preset, embedded engine
  python bench/async.py --steps 20 --eta 1.0
  python bench/async.py --json PATH     # also write the figures (with command, machine, commit)

Each mode runs the real GRPO loop (`fluxjax.rl.loop.run`: producer thread,
tail batching, stream trainer, weight publishing) on the same config, seed,
synthetic data and run length, one after the other in this process, in a
fresh work directory each. Reported per mode, from the run's metrics.jsonl:

  steps/s       (steps - 1) / wall time from the end of step 1 to the end of
                the last step (step 1 carries the compilations, so it is left
                out of every mode alike);
  staleness     mean of async/staleness over steps (rl/async_control.py:
                clip(0.4 KL/0.1 + 0.3 log1p(Var w)/2 + 0.3 gap/max_lag, 0, 1));
  version gap   mean per-token gap between the version that sampled a token
                and the version it trains (0 in sync mode by construction);
  lag           mean allowed lag (the async controller's in adaptive mode);
  is_weight     mean truncated importance weight pi / mu of trained tokens;
  wait s        mean time the trainer waited for groups (rollout not hidden).

Ratios are against sync. On a CPU the engine and the trainer share the same
cores, so overlap buys less than on a GPU cluster, where rollout and training
run on different devices; the staleness figures hold on any machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a checkout without `pip install -e .`, as the others
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import runinfo  # noqa: E402  (lives next to this script)

PER_STEP_KEYS = (
  "step",
  "time",
  "async/staleness",
  "async/version_gap",
  "async/allowed_lag",
  "train/is_weight",
  "rollout/wait_seconds",
  "rollout/reward_mean",
)


def run_mode(mode: str, args, workdir: str) -> dict:
  from fluxjax import config_args
  from fluxjax.rl import loop, metrics

  c = config_args.load_config(os.path.join(ROOT, "configs", "vlm.py"))
  c.total_steps, c.eval.every = args.steps, 0
  c.checkpoint.every = 10**6  # no checkpoint inside the measured steps
  c.sft.enabled = False  # RL only: the warm-up is not what is measured
  c.rl.prompts_per_step, c.rl.responses_per_prompt = args.P, args.R
  c.rl.max_new_tokens = args.max_new_tokens
  c.rollout.tail_batching.eta = args.eta
  c.data.synth_train = max(c.data.synth_train, 4 * args.P * args.steps)
  c.eval.prompts = 2
  c.coordinator.lag.mode = mode
  c.coordinator.lag.fixed_lag = 1
  t0 = time.perf_counter()
  loop.run(c, workdir)
  wall = time.perf_counter() - t0
  recs = [r for r in metrics.read_metrics(workdir) if r["step"] >= 1]
  times = [r["time"] for r in recs]
  mean = lambda k: statistics.fmean(float(r[k]) for r in recs if k in r)
  return {
    "mode": mode,
    "steps": len(recs),
    "wall_s": wall,
    "steps_per_s": (len(recs) - 1) / (times[-1] - times[0]),
    "staleness": mean("async/staleness"),
    "version_gap": mean("async/version_gap"),
    "lag": mean("async/allowed_lag"),
    "is_weight": mean("train/is_weight"),
    "wait_s": mean("rollout/wait_seconds"),
    "reward": mean("rollout/reward_mean"),
    # What the means above are taken over, for --json.
    "per_step": [{k: r[k] for k in PER_STEP_KEYS if k in r} for r in recs],
  }


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--P", type=int, default=8, help="prompts per step")
  p.add_argument("--R", type=int, default=4, help="responses per prompt")
  p.add_argument("--max-new-tokens", type=int, default=24)
  p.add_argument("--eta", type=float, default=1.25, help="tail batching eta")
  p.add_argument("--modes", default="sync,fixed,adaptive")
  p.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures here, with the command, machine, commit and date",
  )
  args = p.parse_args(argv)
  print(f"python {' '.join(sys.argv)}")
  print(
    f"config: tiny preset, embedded engine, {args.steps} steps x {args.P} prompts x "
    f"{args.R} responses, max_new_tokens {args.max_new_tokens}, eta {args.eta}"
  )
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for mode in args.modes.split(","):
      rows.append(run_mode(mode, args, os.path.join(tmp, mode)))
      print(f"  {mode}: done in {rows[-1]['wall_s']:.1f} s", flush=True)
  base = rows[0]["steps_per_s"]
  print(
    "\n| mode | steps/s | vs sync | staleness | version gap | allowed lag | is_weight "
    "| trainer wait s | reward |"
  )
  print("|---|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['mode']} | {r['steps_per_s']:.3f} | {r['steps_per_s'] / base:.2f}x | "
      f"{r['staleness']:.3f} | {r['version_gap']:.2f} | {r['lag']:.2f} | "
      f"{r['is_weight']:.3f} | {r['wait_s']:.2f} | {r['reward']:.3f} |"
    )
  if args.json:
    runinfo.write(
      args.json,
      "async.py",
      {
        "args": vars(args),
        "rows": [dict(r, steps_per_s_vs_first_mode=r["steps_per_s"] / base) for r in rows],
      },
    )


if __name__ == "__main__":
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.WARNING)
  main()
