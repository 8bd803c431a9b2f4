r"""Does GRPO improve the model? The default run against its controls, over seeds.

  python bench/learning.py                          # default x 3 seeds + controls
  python bench/learning.py --runs default --seeds 0,1,2
  python bench/learning.py --runs lr --lrs 1e-4,3e-4,1e-3 --seeds 0
  python bench/learning.py --json bench/results/learning-<machine>-<commit>.json
  python bench/learning.py --variant tiny_base \
    --runs default,blind,random_reward,format_only,sharpen --seeds 0,1,2,3,4 \
    --control-seeds 0,1,2,3,4       # the job from the committed base

Each run is the main job (configs/vlm.py, tiny variant, or --variant) in-process,
with overrides, in a temporary work directory. Held-out accuracy is sampled
at the training temperature (eval/accuracy, 95% half-interval
eval/accuracy_ci95: rl/evaluation.py). Per run the script reports the
accuracy at the RL start (step 0, after the SFT warm-up) and at the last
evaluation, and the gain with its 95% interval (the two evaluations are on
the same prompts with the same sampling seeds, so the interval of the gain
is taken conservatively as the root sum of squares of the two intervals).

Runs:
  default   the default config; the gain must hold on every seed.
  reversed  rl.reward.fn = accuracy_reversed (1 - accuracy): accuracy must fall.
  zeroed    rl.reward.fn = constant: every GRPO advantage is 0, so the policy
            gets no signal and accuracy must stay flat within the interval.
  blind     data.blind: the same questions with pixel-free media (flat grey
            images and frames), in training and evaluation.
  random_reward  rl.reward.fn = random (a fair coin per response).
  format_only    rl.reward.fn = format (the answer's correctness unrewarded),
                 evaluated with accuracy (eval.reward).
  sharpen   no RL step: the RL-start model evaluated at temperature 0.5 and
            greedily (what sharpening the warm-up's policy alone gives).
  lr        the default with optim.lr set to each of --lrs (the sweep that
            chose the default).
  sweep     the default with one setting changed per run (--sweep KEY=V1,V2:
            prompts per step, responses per prompt, KL, updates per batch).
  stress    the off-policy correction under stress, per seed of --seeds,
            paired with sync, every arm at sync's eta (1.0, no tail
            batching, so lag is not confounded with it): stale (fixed lag
            --stale-lag, default 4, the decoupled weights truncated at
            rl.is_cap, the default), stale_w1 (weights fixed at 1:
            rl.is_mode=off), stale_mask (rl.is_mode=mask), stale_coupled
            (PPO-clip against the behaviour policy: rl.prox=batch); with
            the learning rate raised by --set optim.lr=... and several
            updates per batch by --set rl.updates_per_batch=2, as in
              python bench/learning.py --runs stress --seeds 0,1,2 --set optim.lr=9e-4
            Each run records its responses (coordinator.response_records):
            the table adds the mean truncated share and behaviour KL over
            steps and quantiles of the responses' mean importance weights.
  speed     time to accuracy, per seed of --seeds, paired: sync (lag 0, no
            tail batching: the baseline), tail (tail batching alone, the
            default's eta 1.25 with recycling), lag (fixed lag --lag alone),
            tail_lag (both) and adaptive (the Flux controller with tail
            batching); --arms picks some of them. Each evaluation records
            its wall time: the run's step time up to it (`step_s`,
            evaluations and checkpoints left out) and its clock time since
            the RL start (`clock_s`). The table gives each arm's time to 90%
            of the baseline's mean final gain over seeds, its speed-up over
            the baseline paired by seed, and a TOST of its final accuracy
            against the baseline's (paired, margin --margin), for sampled
            and greedy accuracy, then the accuracy x wall-time front: per
            arm, the arms that beat it on both mean time and mean final
            accuracy. Files run at several --lag pool, a row a lag. Use
            --placement disjoint for wall times that let running ahead pay.
  normalizer  the loss normalizers (rl.loss_agg_mode) on the default job,
            per seed of --seeds, paired with token_mean (the default):
            seq_mean_token_mean and token_sum_norm (Dr. GRPO's constant
            divisor). AdamW is invariant to a constant scale of the loss up
            to its epsilon and gradient clipping, so token_sum_norm runs at
            the default learning rate; --set optim.lr=... retunes every arm.
  controller  the adaptive controller (default tail batching) started from
            async ratios 0.1 (from_0.1) and 0.9 (from_0.9), per seed of
            --seeds: the table gives the share of steps after step 20 whose
            staleness EMA is in the band (target +- tolerance), the ratio on
            the way, the mean allowed lag and trained gap, and accuracy.
  parity    the lag modes and tail batching at an equal number of trained
            samples, per seed of --seeds: sync (lag 0, no tail batching),
            recycle (the default: lag 0, eta 1.25 with recycling), fixed2
            (lag 2) and adaptive (the Flux controller), both with the
            default's tail batching. The table adds each mode's accuracy
            difference from sync, paired by seed, with its 95% interval
            (t over seeds), and its trained samples/s over sync's.

--placement disjoint (bench/cores.py) pins this process, the trainer, to
--trainer-cores and runs the rollout engine as a server process under
taskset on --rollout-cores, so that running ahead can pay in wall time.
Two stand-ins make rollout dominate the step as it does on GPUs:
--decode-step-ms F gives each of the server's decode steps a floor of F ms
whatever its batch, as a memory-bound device's step reads every weight (so
a round's long tail costs what it does there), and --rollout-duty D lets
the server run only D of the time (SIGSTOP / SIGCONT), a uniformly slower
device; each run records the duty achieved.

Baseline and fluxjax are in the same run: the controls are the baseline the
default's gain is measured against. `--tables FILE [FILE ...]` prints the
tables again from recorded --json files (their runs pooled), so seeds added
by a later invocation join the earlier ones.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import math
import os
import statistics
import sys
import tempfile
import time

import ml_collections
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cores  # noqa: E402  (these live next to this script)
import quintiles  # noqa: E402
import runinfo  # noqa: E402
from fluxjax import config_args  # noqa: E402
from fluxjax.rl import loop, losses, metrics  # noqa: E402
from learning_arms import (  # noqa: E402
  CONTROLLER,
  CONTROLS,
  PAIRED,
  PER_STEP,
  PER_STEP_ASYNC,
  PHASES,
  SETTLE_STEPS,
)
from learning_tables import arm_label, print_tables  # noqa: E402
from seedstats import mean_recorded  # noqa: E402


def _set(config, dotted: str, value) -> None:
  *path, leaf = dotted.split(".")
  section = config
  for name in path:
    section = section[name]
  section[leaf] = value


def _literal(value: str):
  """The Python literal `value`, or the string itself."""
  try:
    return ast.literal_eval(value)
  except (ValueError, SyntaxError):
    return value


def _parse(item: str) -> tuple[str, object]:
  """KEY=VALUE -> (KEY, the literal VALUE)."""
  key, _, value = item.partition("=")
  return key, _literal(value)


def run_one(
  name: str, seed: int, overrides: dict, keep: str | None, base: ml_collections.ConfigDict
) -> dict:
  """One main job, `base` (a configs/vlm.py variant) with `overrides`; returns
  its accuracy trajectory and timing."""
  config = copy.deepcopy(base)
  config.seed = seed
  config.data.seed = seed
  for key, value in overrides.items():
    _set(config, key, value)
  workdir = keep or tempfile.mkdtemp(prefix=f"fluxjax-learning-{name}-{seed}-")
  t0 = time.perf_counter()
  loop.run(config, workdir)
  return summarize(name, seed, overrides, workdir, time.perf_counter() - t0)


def summarize(name: str, seed: int, overrides: dict, workdir: str, seconds: float) -> dict:
  """One run's figures from its work directory's metrics."""
  records = metrics.read_metrics(workdir)
  step_time = _cumulative_step_seconds(records)
  t_start = next(r["time"] for r in records if r["step"] == 0 and "eval/accuracy" in r)
  evals = [
    {
      "step": r["step"],
      "step_s": step_time.get(r["step"], 0.0),
      "clock_s": r["time"] - t_start,
      "accuracy": r["eval/accuracy"],
      "ci95": r.get("eval/accuracy_ci95", float("nan")),
      "greedy": r.get("eval/accuracy_greedy"),
      "pass_at_k": next((v for k, v in r.items() if k.startswith("eval/pass@")), None),
      "by_difficulty": {
        k.split("/")[-1]: v for k, v in r.items() if k.startswith("eval/accuracy/")
      },
    }
    for r in records
    if "eval/accuracy" in r
  ]
  start = next(e for e in evals if e["step"] == 0)
  end = evals[-1]
  gain = end["accuracy"] - start["accuracy"]
  steps_all = sorted((r for r in records if "perf/step_seconds" in r), key=lambda r: r["step"])
  steps = [r for r in steps_all if r["step"] >= 2]
  mean = lambda key: mean_recorded([r.get(key) for r in steps])
  bins = [name for name, _, _ in losses.is_weight_bins()]
  trained = loop.read_trained(workdir)
  weights = [  # each recorded response's mean importance weight
    resp["token_means"]["is_weight"] for t in trained for resp in t.get("responses", ())
  ]
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  rl = config["rl"]
  per_step = rl["prompts_per_step"] * rl["responses_per_prompt"]
  train_s = sum(r["perf/step_seconds"] for r in steps)
  by_step = {r["step"]: r for r in records if "eval/accuracy" in r}
  return {
    # Trained responses per second over steps 2.. (step 1 carries the compilations).
    "samples_per_s": len(steps) * per_step / train_s if train_s else float("nan"),
    "name": name,
    "seed": seed,
    "overrides": overrides,
    "seconds": seconds,
    "workdir": workdir,
    "start": start,
    "end": end,
    "gain": gain,
    "gain_ci95": math.hypot(start["ci95"], end["ci95"]),
    "evals": evals,
    # Every eval/* figure (per task, level, length band, prior, reasoning
    # share) of the RL start and the last evaluation.
    "start_metrics": _eval_figures(by_step[start["step"]]),
    "end_metrics": _eval_figures(by_step[end["step"]]),
    "prompts_per_step": rl["prompts_per_step"],
    # Each trained response of steps 2.. (coordinator.response_records), for
    # run_plan's quintile table; not kept in the result file.
    "responses": quintiles.responses(trained, after_step=1),
    "per_step": {key: [r.get(f"rollout/{key}") for r in steps_all] for key in PER_STEP},
    "per_step_async": {key: [r.get(f"async/{key}") for r in steps_all] for key in PER_STEP_ASYNC},
    "band_share": _band_share(steps_all, config["coordinator"]["lag"]),
    "phase_seconds": {
      key: mean_recorded([r.get(key) for r in steps])
      for key in PHASES
      if any(key in r for r in steps)
    },
    "truncated_share": mean("train/is_truncated"),
    # Tokens whose clipped branch was taken: with rl.prox=batch (coupled
    # PPO-clip against mu) the share the staleness pushed out of the clip.
    "clipfrac": mean("train/clipfrac"),
    "behaviour_kl": mean("train/behaviour_kl"),
    "trained_gap": mean("async/trained_gap"),
    # Quantiles of the responses' mean importance weights (a histogram's shape).
    "is_weight_quantiles": (
      dict(zip(("p1", "p50", "p99", "max"), np.quantile(weights, [0.01, 0.5, 0.99, 1.0]).tolist()))
      if weights
      else None
    ),
    # Per-token histogram of the raw weight pi_prox / mu: each bin's share of
    # the trained tokens, the mean over steps 2.. (None: recorded before it).
    "is_weight_histogram": (
      {name: mean(f"train/{name}") for name in bins}
      if any(f"train/{bins[0]}" in r for r in steps)
      else None
    ),
  }


def _band_share(steps: list[dict], lag: dict) -> float | None:
  """The share of the steps after SETTLE_STEPS whose staleness EMA is within
  the run's band (`coordinator.lag`: target +- tolerance); None without an EMA."""
  settled = [r.get("async/staleness_ema") for r in steps if r["step"] > SETTLE_STEPS]
  if not settled or any(x is None for x in settled):
    return None
  band = lambda x: abs(x - lag["target_staleness"]) <= lag["tolerance"]
  return statistics.fmean(band(x) for x in settled)


def _eval_figures(record: dict) -> dict[str, float]:
  return {k.removeprefix("eval/"): v for k, v in record.items() if k.startswith("eval/")}


def _cumulative_step_seconds(records: list[dict]) -> dict[int, float]:
  """Step -> the run's step time up to and including it (perf/step_seconds:
  rollout wait, training and publish; evaluations and checkpoints left out)."""
  total, out = 0.0, {}
  for r in sorted((r for r in records if "perf/step_seconds" in r), key=lambda r: r["step"]):
    total += r["perf/step_seconds"]
    out[r["step"]] = total
  return out


def _arguments() -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument(
    "--runs",
    default="default,reversed,zeroed",
    help=f"comma list of {','.join(CONTROLS)},lr,sweep,{','.join(PAIRED)}",
  )
  p.add_argument(
    "--variant",
    default="tiny",
    help="configs/vlm.py's variant every run starts from (tiny_base: from the committed base)",
  )
  p.add_argument("--seeds", default="0,1,2", help="seeds of the default and paired runs")
  p.add_argument("--control-seeds", default="0", help="seeds of the control runs")
  p.add_argument("--lrs", default="1e-4,3e-4,1e-3", help="optim.lr values of the lr sweep")
  p.add_argument(
    "--sweep",
    action="append",
    default=[],
    metavar="KEY=V1,V2",
    help="with --runs sweep: one run per value of KEY (Python literals), e.g. "
    "rl.prompts_per_step=8,32 or rl.kl_coef=0.0,0.01; repeatable",
  )
  p.add_argument(
    "--set",
    action="append",
    default=[],
    metavar="KEY=VALUE",
    help="extra config override for every run (Python literal values), e.g. rl.temperature=0.7",
  )
  p.add_argument("--lag", type=int, default=2, help="speed: the fixed lag of lag and tail_lag")
  p.add_argument("--stale-lag", type=int, default=4, help="stress: the fixed lag of its arms")
  p.add_argument("--arms", help="a paired or controller run: some of its arms")
  p.add_argument("--margin", type=float, default=0.05, help="speed: the TOST's equivalence margin")
  p.add_argument("--placement", choices=("shared", "disjoint"), default="shared")
  p.add_argument("--trainer-cores", default="0", help="disjoint: this process's cores")
  p.add_argument("--rollout-cores", default="1", help="disjoint: the server's cores (taskset)")
  p.add_argument(
    "--rollout-duty",
    type=float,
    default=1.0,
    help="disjoint: the share of time the server may run (bench/cores.py Throttle), "
    "for a rollout-bound job as on GPUs",
  )
  p.add_argument(
    "--decode-step-ms",
    type=float,
    default=0.0,
    help="disjoint: the server's floor under each decode step (--min-decode-step-ms), "
    "a memory-bound rollout device as on GPUs",
  )
  p.add_argument(
    "--quintiles",
    action="store_true",
    help="record every trained response; figures per response-length quintile over seeds",
  )
  p.add_argument("--keep", metavar="DIR", help="keep each run's work directory under DIR")
  p.add_argument("--json", metavar="PATH", help="write every run's figures here")
  p.add_argument(
    "--tables",
    nargs="+",
    metavar="FILE",
    help="print the tables of recorded --json files; run nothing",
  )
  return p.parse_args()


def build_plan(args: argparse.Namespace) -> list[tuple[str, int, dict]]:
  """(run name, seed, config overrides) for every run --runs asks for."""
  extra = dict(_parse(item) for item in args.set)
  if args.quintiles:
    extra["coordinator.response_records"] = True
  seeds = [int(s) for s in args.seeds.split(",") if s]
  control_seeds = [int(s) for s in args.control_seeds.split(",") if s]
  arms = args.arms.split(",") if args.arms else None
  known = {m for modes, _ in PAIRED.values() for m in modes} | set(CONTROLLER)
  if arms and set(arms) - known:
    sys.exit(f"unknown arms {sorted(set(arms) - known)}; choose from {sorted(known)}")

  def chosen(arm: str) -> bool:
    return arms is None or arm in arms

  plan: list[tuple[str, int, dict]] = []
  for name in args.runs.split(","):
    if name == "default":
      plan += [("default", s, dict(extra)) for s in seeds]
    elif name in CONTROLS:
      plan += [(name, s, {**extra, **CONTROLS[name]}) for s in control_seeds]
    elif name == "sweep":
      for item in args.sweep:
        key, _, values = item.partition("=")
        for value in values.split(","):
          plan.append((f"{key}={value}", control_seeds[0], {**extra, key: _literal(value)}))
    elif name == "lr":
      plan += [
        (f"lr={lr}", control_seeds[0], {**extra, "optim.lr": float(lr)})
        for lr in args.lrs.split(",")
      ]
    elif name == "controller":
      plan += [
        (arm, s, {**extra, **o}) for s in seeds for arm, o in CONTROLLER.items() if chosen(arm)
      ]
    elif name in PAIRED:
      modes, added = PAIRED[name]
      plan += [
        (mode, s, {**extra, **_with_lags(modes[mode], args), **added})
        for s in seeds
        for mode in modes
        if chosen(mode)
        and not any(m == mode and t == s for m, t, _ in plan)  # a shared baseline runs once
      ]
    else:
      sys.exit(f"unknown run {name!r}")
  return plan


def _with_lags(overrides: dict, args: argparse.Namespace) -> dict:
  """The arm's overrides with "{lag}" and "{stale_lag}" set from the flags."""
  lags = {"{lag}": args.lag, "{stale_lag}": args.stale_lag}
  return {k: lags.get(v, v) if isinstance(v, str) else v for k, v in overrides.items()}


def main() -> None:
  args = _arguments()
  if args.tables:
    records = [_load(path) for path in args.tables]
    # Each file's --runs: a speed file of sync and adaptive alone holds no arm
    # that only speed runs, yet its tables are speed's.
    kinds = sorted({k for r in records for k in r.get("args", {}).get("runs", "").split(",") if k})
    print_tables(_pool(args.tables, records), kinds, args.margin)
    return
  plan = build_plan(args)
  # Read once, as the code was imported: a config file edited while the runs
  # go on changes none of them.
  base = config_args.load_config(arg=args.variant)
  servers = throttle = None
  if (args.rollout_duty != 1 or args.decode_step_ms) and args.placement != "disjoint":
    sys.exit(
      "--rollout-duty and --decode-step-ms act on the rollout server: "
      "they need --placement disjoint"
    )
  if args.placement == "disjoint":
    flags = ["--min-decode-step-ms", str(args.decode_step_ms)] if args.decode_step_ms else []
    servers, command = cores.pin_and_launch(args.trainer_cores, args.rollout_cores, base, flags)
    print(f"trainer on cores {args.trainer_cores}; rollout server: {command}", flush=True)
    for _, _, overrides in plan:
      overrides.update({"rollout.backend": "sglang", "rollout.urls": tuple(servers.urls)})

  results: list[dict] = []
  try:
    if servers is not None and args.rollout_duty != 1:  # a refused duty still stops the server
      throttle = cores.Throttle([p.pid for p in servers.procs], args.rollout_duty)
    run_plan(plan, args, results, base, throttle)
  finally:
    if throttle is not None:
      throttle.stop()
    if servers is not None:
      servers.stop()
  print_tables(results, args.runs.split(","), args.margin)


def _load(path: str) -> dict:
  with open(path) as f:
    record = json.load(f)
  if record.get("bench") != "learning.py":
    sys.exit(f"{path} is not a learning.py record (bench: {record.get('bench')!r})")
  return record


def _pool(paths: list[str], records: list[dict]) -> list[dict]:
  """The runs of the files' `records`, refusing two runs of one arm (with its
  lag, `arm_label`) and seed: the tables pair by them, so one would be dropped
  unseen."""
  runs, seen = [], {}
  for path, record in zip(paths, records, strict=True):
    for r in record["runs"]:
      key = (arm_label(r), r["seed"])
      if key in seen:
        sys.exit(
          f"{path} and {seen[key]} both hold arm {key[0]!r} seed {key[1]}: "
          "pool files in which each arm and seed ran once"
        )
      seen[key] = path
      runs.append(r)
  return runs


def run_plan(plan, args, results: list, base: ml_collections.ConfigDict, throttle=None) -> None:
  edges: dict[int, tuple] = {}  # seed -> (inner quintile edges, the run they came from)
  for name, seed, overrides in plan:
    keep = os.path.join(args.keep, f"{name}-{seed}") if args.keep else None
    r = run_one(name, seed, overrides, keep, base)
    responses = r.pop("responses")
    if args.quintiles:  # on the lengths of the seed's first run: sync in paired runs
      inner, r["quintile_edges_from"] = edges.setdefault(
        seed, (quintiles.edges(responses), f"{name} seed {seed}")
      )
      r["quintiles"] = quintiles.table(responses, inner, r["prompts_per_step"])
    if throttle is not None:  # achieved, since the server started
      r["rollout_duty"] = throttle.achieved()
    results.append(r)
    print(
      f"{name} seed {seed}: accuracy {r['start']['accuracy']:.3f} -> {r['end']['accuracy']:.3f} "
      f"(step {r['end']['step']}), gain {r['gain']:+.3f} +- {r['gain_ci95']:.3f}, "
      f"{r['seconds'] / 60:.1f} min",
      flush=True,
    )
    if args.json:  # after every run: a long sweep stopped early keeps what it measured
      runinfo.write(args.json, "learning.py", {"args": vars(args), "runs": results})


if __name__ == "__main__":
  main()
