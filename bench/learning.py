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
            and greedy accuracy. Use --placement disjoint for wall times
            that let running ahead pay.
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

Baseline and fluxjax are in the same run: the controls are the baseline the
default's gain is measured against. `--tables FILE [FILE ...]` prints the
tables again from recorded --json files (their runs pooled), so seeds added
by a later invocation join the earlier ones.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cores  # noqa: E402  (these live next to this script)
import quintiles  # noqa: E402
import runinfo  # noqa: E402
from fluxjax import config_args  # noqa: E402
from fluxjax.rl import loop, losses, metrics  # noqa: E402
from seedstats import t_interval, time_to_gain, tost  # noqa: E402

Arms = dict[str, dict[str, object]]  # arm -> its config overrides

_NO_TAIL: dict[str, object] = {"rollout.tail_batching.eta": 1.0}
PARITY: Arms = {
  "sync": _NO_TAIL,
  "recycle": {},
  "fixed2": {"coordinator.lag.mode": "fixed", "coordinator.lag.fixed_lag": 2},
  "adaptive": {"coordinator.lag.mode": "adaptive"},
}
_STALE: dict[str, object] = {
  **_NO_TAIL,
  "coordinator.lag.mode": "fixed",
  "coordinator.lag.fixed_lag": "{stale_lag}",
}
STRESS: Arms = {
  "sync": PARITY["sync"],
  "stale": _STALE,
  "stale_w1": {**_STALE, "rl.is_mode": "off"},
  "stale_mask": {**_STALE, "rl.is_mode": "mask"},
  "stale_coupled": {**_STALE, "rl.prox": "batch"},
}
# The arms of --runs speed; "{lag}" is --lag.
SPEED: Arms = {
  "sync": _NO_TAIL,
  "tail": {},
  "lag": {**_NO_TAIL, "coordinator.lag.mode": "fixed", "coordinator.lag.fixed_lag": "{lag}"},
  "tail_lag": {"coordinator.lag.mode": "fixed", "coordinator.lag.fixed_lag": "{lag}"},
  "adaptive": {"coordinator.lag.mode": "adaptive"},
}
# The adaptive controller started far from its setpoint, below and above it.
CONTROLLER: Arms = {
  f"from_{ratio}": {"coordinator.lag.mode": "adaptive", "coordinator.lag.initial_ratio": ratio}
  for ratio in (0.1, 0.9)
}
# name: (arms, overrides every arm adds); sync is the baseline of each.
PAIRED: dict[str, tuple[Arms, dict[str, object]]] = {
  "parity": (PARITY, {}),
  "stress": (STRESS, {"coordinator.response_records": True}),
  "speed": (SPEED, {}),
}
# The rollout/* figures each run keeps per step (item: the response lengths'
# tail and how often the policy reasons).
PER_STEP = ("response_len_p50", "response_len_p99", "reasoning_share")
# The async/* figures each run keeps per step: what the controller saw and set.
PER_STEP_ASYNC = ("async_ratio", "staleness", "staleness_ema", "allowed_lag", "trained_gap")
# The controller is judged on the steps after this one (issue: 90% in band).
SETTLE_STEPS = 20
# Where a step's time goes, each run's mean over its steps 2.. (docs/metrics.md).
PHASES = ("perf/step_seconds", "rollout/wait_seconds", "perf/update_seconds", "publish/seconds")
# Time to accuracy is the time to this share of the baseline's mean final gain.
GAIN_SHARE = 0.9

CONTROLS: Arms = {
  "default": {},
  "reversed": {"rl.reward.fn": "accuracy_reversed"},
  "zeroed": {"rl.reward.fn": "constant"},
  "blind": {"data.blind": True},
  "random_reward": {"rl.reward.fn": "random"},
  # `format` is an ordinary reward, not a registered control, so the run's
  # evaluation is told to score accuracy.
  "format_only": {"rl.reward.fn": "format", "eval.reward": "accuracy"},
  # The RL-start model decoded at a lower temperature (and greedily): what
  # sharpening alone gives, without any RL step.
  "sharpen": {"total_steps": 0, "rl.temperature": 0.5},
}


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


def run_one(name: str, seed: int, overrides: dict, keep: str | None, variant: str = "tiny") -> dict:
  """One main job of configs/vlm.py's `variant`; returns its accuracy trajectory and timing."""
  config = config_args.load_config(arg=variant)
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
  mean = lambda key: _mean([r.get(key) for r in steps])
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
      key: _mean([r.get(key) for r in steps]) for key in PHASES if any(key in r for r in steps)
    },
    "truncated_share": mean("train/is_truncated"),
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
  p.add_argument("--arms", help="speed, parity, stress: a comma list of their arms (default all)")
  p.add_argument("--margin", type=float, default=0.05, help="speed: the TOST's equivalence margin")
  p.add_argument("--placement", choices=("shared", "disjoint"), default="shared")
  p.add_argument("--trainer-cores", default="0", help="disjoint: this process's cores")
  p.add_argument("--rollout-cores", default="1", help="disjoint: the server's cores (taskset)")
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
  known = {m for modes, _ in PAIRED.values() for m in modes}
  if arms and set(arms) - known:
    sys.exit(f"unknown arms {sorted(set(arms) - known)}; choose from {sorted(known)}")
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
      plan += [(arm, s, {**extra, **o}) for s in seeds for arm, o in CONTROLLER.items()]
    elif name in PAIRED:
      modes, added = PAIRED[name]
      plan += [
        (mode, s, {**extra, **_with_lags(modes[mode], args), **added})
        for s in seeds
        for mode in modes
        if (arms is None or mode in arms)
        and not any(m == mode and t == s for m, t, _ in plan)  # sync is in each
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
    print_tables([r for path in args.tables for r in _load(path)], [], args.margin)
    return
  plan = build_plan(args)
  servers = None
  if args.placement == "disjoint":
    servers, command = cores.pin_and_launch(
      args.trainer_cores, args.rollout_cores, config_args.load_config(arg=args.variant)
    )
    print(f"trainer on cores {args.trainer_cores}; rollout server: {command}", flush=True)
    for _, _, overrides in plan:
      overrides.update({"rollout.backend": "sglang", "rollout.urls": tuple(servers.urls)})

  results: list[dict] = []
  try:
    run_plan(plan, args, results)
  finally:
    if servers is not None:
      servers.stop()
  print_tables(results, args.runs.split(","), args.margin)


def _load(path: str) -> list[dict]:
  with open(path) as f:
    record = json.load(f)
  if record.get("bench") != "learning.py":
    sys.exit(f"{path} is not a learning.py record (bench: {record.get('bench')!r})")
  return record["runs"]


def print_tables(results: list, runs: list[str], margin: float) -> None:
  """The per-run table, the means over seeds, and each paired comparison that
  `runs` names or (from recorded files) whose own arms the results hold."""
  print_table(results)
  print_means(results)
  print_tasks(results)
  names = {r["name"] for r in results}
  if names & set(CONTROLLER):
    print_controller([r for r in results if r["name"] in CONTROLLER])
  for name, (modes, _) in PAIRED.items():
    others = {m for other, (ms, _) in PAIRED.items() if other != name for m in ms}
    if name in runs or names & (set(modes) - others):
      if name == "speed":
        print_speed(results, margin)
      else:
        print_paired(results, modes)
        if name == "stress":
          print_corrections(results)
        print_weight_histograms([r for r in results if r["name"] in modes])
  if any(r.get("quintiles") for r in results):
    print_quintiles(results)


def run_plan(plan, args, results: list) -> None:
  edges: dict[int, tuple] = {}  # seed -> (inner quintile edges, the run they came from)
  for name, seed, overrides in plan:
    keep = os.path.join(args.keep, f"{name}-{seed}") if args.keep else None
    r = run_one(name, seed, overrides, keep, args.variant)
    responses = r.pop("responses")
    if args.quintiles:  # on the lengths of the seed's first run: sync in paired runs
      inner, r["quintile_edges_from"] = edges.setdefault(
        seed, (quintiles.edges(responses), f"{name} seed {seed}")
      )
      r["quintiles"] = quintiles.table(responses, inner, r["prompts_per_step"])
    results.append(r)
    print(
      f"{name} seed {seed}: accuracy {r['start']['accuracy']:.3f} -> {r['end']['accuracy']:.3f} "
      f"(step {r['end']['step']}), gain {r['gain']:+.3f} +- {r['gain_ci95']:.3f}, "
      f"{r['seconds'] / 60:.1f} min",
      flush=True,
    )
    if args.json:  # after every run: a long sweep stopped early keeps what it measured
      runinfo.write(args.json, "learning.py", {"args": vars(args), "runs": results})


def print_table(results: list) -> None:
  print("\n| run | seed | accuracy at RL start | at last eval | gain +- 95% | greedy | wall min |")
  print("|---|---|---|---|---|---|---|")
  for r in results:
    s, e = r["start"], r["end"]
    greedy = f"{s['greedy']:.3f} -> {e['greedy']:.3f}" if s["greedy"] is not None else "-"
    print(
      f"| {r['name']} | {r['seed']} | {s['accuracy']:.3f} +- {s['ci95']:.3f} | "
      f"{e['accuracy']:.3f} +- {e['ci95']:.3f} | {r['gain']:+.3f} +- {r['gain_ci95']:.3f} | "
      f"{greedy} | {r['seconds'] / 60:.1f} |"
    )


def print_means(results: list) -> None:
  """Per run over its seeds: mean accuracy and gain with t-intervals over seeds,
  beside the mean of the runs' own evaluation intervals."""
  print(
    "\n| run | seeds | sampled at RL start | sampled at end | gain, 95% t over seeds | "
    "mean eval interval | greedy at end | greedy gain, 95% t |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for name in dict.fromkeys(r["name"] for r in results):
    rows = [r for r in results if r["name"] == name]
    start = [r["start"]["accuracy"] for r in rows]
    end = [r["end"]["accuracy"] for r in rows]
    gain = [r["gain"] for r in rows]
    greedy = [(r["start"]["greedy"], r["end"]["greedy"]) for r in rows]
    has_greedy = all(g is not None for pair in greedy for g in pair)
    g_end = [e for _, e in greedy] if has_greedy else []
    g_gain = [e - s for s, e in greedy] if has_greedy else []
    fmt = lambda v: f"{statistics.fmean(v):.3f}" if v else "-"
    print(
      f"| {name} | {len(rows)} | {fmt(start)} | {fmt(end)} | "
      f"{statistics.fmean(gain):+.3f} +- {t_interval(gain):.3f} | "
      f"{statistics.fmean(r['gain_ci95'] for r in rows):.3f} | {fmt(g_end)} | "
      + (f"{statistics.fmean(g_gain):+.3f} +- {t_interval(g_gain):.3f} |" if g_gain else "- |")
    )


def print_tasks(results: list) -> None:
  """Per task, level and length band: each run's final sampled accuracy,
  mean over seeds, beside the answer prior and the RL start; the share of
  responses that reason by level; the response lengths' tail per step."""
  rows = [r for r in results if "end_metrics" in r]
  if not rows:
    return
  names = list(dict.fromkeys(r["name"] for r in rows))
  start = [r["start_metrics"] for r in rows if r["name"] == "default"] or [rows[0]["start_metrics"]]

  def at(name: str, key: str, when: str = "end_metrics") -> list[float]:
    return [r[when][key] for r in rows if r["name"] == name and key in r[when]]

  def ci(vs: list[float]) -> str:
    return f"{_mean(vs):.3f} +- {t_interval(vs):.3f}" if len(vs) > 1 else f"{_mean(vs):.3f}"

  for family, label in (
    ("task/", "task"),
    ("task_level/", "task@level"),
    ("band/", "answer tokens"),
  ):
    keys = sorted({k for m in start for k in m if k.startswith(family)})
    print(f"\n| {label} | prior | RL start | " + " | ".join(names) + " | default greedy |")
    print("|---|---|---|" + "---|" * (len(names) + 1))
    for key in keys:
      name = key.removeprefix(family)
      prior = [m[f"prior/{name}"] for m in start if f"prior/{name}" in m]
      ends = " | ".join(ci(at(n, key)) if at(n, key) else "-" for n in names)
      greedy = at("default", f"task_greedy/{name}")
      fmt = lambda vs: f"{_mean(vs):.3f}" if vs else "-"
      print(
        f"| {name} | {fmt(prior)} | {fmt([m[key] for m in start if key in m])} | {ends} | "
        f"{fmt(greedy)} |"
      )
  print("\n| run | reasoning share, RL start -> end: easy | medium | hard | all |")
  print("|---|---|---|---|---|")
  levels = ("reasoning_share/easy", "reasoning_share/medium", "reasoning_share/hard")
  for n in names:
    cells = [
      f"{_mean(at(n, k, 'start_metrics')):.2f} -> {_mean(at(n, k)):.2f}" if at(n, k) else "-"
      for k in (*levels, "reasoning_share")
    ]
    print(f"| {n} | " + " | ".join(cells) + " |")
  _print_lengths(rows)


def _print_lengths(rows: list) -> None:
  """The response lengths' tail per trained step, per run over its seeds."""
  print("\n| run | steps | p99 >= 48 on | p99, median step | p99 / p50, median step | min p99 |")
  print("|---|---|---|---|---|---|")
  for n in dict.fromkeys(r["name"] for r in rows):
    pairs = [
      (p50, p99)
      for r in rows
      if r["name"] == n
      for p50, p99 in zip(r["per_step"]["response_len_p50"], r["per_step"]["response_len_p99"])
      if p50 is not None and p99 is not None
    ]
    if pairs:
      p99s = [p99 for _, p99 in pairs]
      ratios = [p99 / max(p50, 1.0) for p50, p99 in pairs]
      print(
        f"| {n} | {len(pairs)} | {np.mean([p >= 48 for p in p99s]):.0%} | "
        f"{np.median(p99s):.0f} | {np.median(ratios):.1f} | {min(p99s):.0f} |"
      )


def print_paired(results: list, modes: dict) -> None:
  """Each mode against sync, paired by seed (same data, prompts and warm-up)."""
  by = {(r["name"], r["seed"]): r for r in results}
  seeds = sorted({r["seed"] for r in results if r["name"] == "sync"})
  print(
    "\n| mode | final accuracy, mean over seeds | minus sync, 95% (t, paired) | greedy "
    "minus sync | samples/s vs sync | wall min, mean | trained gap | truncated share "
    "| behaviour KL | response IS weight p1 / p50 / p99 / max |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for mode in modes:
    rows = [(by[(mode, s)], by[("sync", s)]) for s in seeds if (mode, s) in by]
    if not rows:
      continue
    acc = [r["end"]["accuracy"] for r, _ in rows]
    diff, greedy = _differences(rows, "accuracy"), _differences(rows, "greedy")
    speed = [r["samples_per_s"] / b["samples_per_s"] for r, b in rows]
    minutes = statistics.fmean(r["seconds"] for r, _ in rows) / 60
    avg = lambda key, rows=rows: statistics.fmean(r.get(key, float("nan")) for r, _ in rows)
    q = [r["is_weight_quantiles"] for r, _ in rows if r.get("is_weight_quantiles")]
    quantiles = (
      " / ".join(f"{statistics.fmean(x[k] for x in q):.3f}" for k in ("p1", "p50", "p99", "max"))
      if q
      else "-"
    )
    print(
      f"| {mode} | {statistics.fmean(acc):.3f} | {_mean_t(diff)} | {_mean_t(greedy)} | "
      f"{statistics.fmean(speed):.2f}x | "
      f"{minutes:.1f} | {avg('trained_gap'):.2f} | {avg('truncated_share'):.4f} | "
      f"{avg('behaviour_kl'):.4f} | {quantiles} |"
    )


def _differences(pairs: list, key: str) -> list[float]:
  """The final `key` accuracy of each (run, its baseline) pair's run minus its
  baseline's, where both recorded it."""
  ends = [(r["end"].get(key), b["end"].get(key)) for r, b in pairs]
  return [x - y for x, y in ends if x is not None and y is not None]


def _mean_t(values: list[float]) -> str:
  """'mean +- 95% t half-width', or '-' for no values."""
  return f"{statistics.fmean(values):+.3f} +- {t_interval(values):.3f}" if values else "-"


def _by_name(results: list, key: str) -> dict[str, list[dict]]:
  """The runs that recorded `key`, by run name (arm), in their order."""
  out: dict[str, list[dict]] = {}
  for r in results:
    if r.get(key):
      out.setdefault(r["name"], []).append(r)
  return out


def print_corrections(results: list, control: str = "stale_w1") -> None:
  """Each stale arm that corrects (truncated, masked, coupled weights) minus
  the uncorrected stale arm (w = 1), paired by seed, sampled and greedy."""
  by = {(r["name"], r["seed"]): r for r in results}
  arms = [a for a in STRESS if a.startswith("stale") and a != control]
  print(f"\n| arm minus {control} | seeds | sampled, mean +- 95% t | per seed | greedy |")
  print("|---|---|---|---|---|")
  for arm in arms:
    pairs = [(by[(arm, s)], by[(control, s)]) for a, s in by if a == arm and (control, s) in by]
    if not pairs:
      continue
    diff = _differences(pairs, "accuracy")
    print(
      f"| {arm} | {len(pairs)} | {_mean_t(diff)} | {', '.join(f'{d:+.3f}' for d in diff)} | "
      f"{_mean_t(_differences(pairs, 'greedy'))} |"
    )


def print_quintiles(results: list) -> None:
  """Per run name, the per-length quintile figures (bench/quintiles.py), mean
  +- 95% t over its seeds, each seed's on the edges of its first run."""
  for name, runs in _by_name(results, "quintiles").items():
    rows = quintiles.over_seeds([r["quintiles"] for r in runs])
    edges_from = sorted({r["quintile_edges_from"] for r in runs})
    print(f"\n{name}: per response-length quintile, {len(runs)} seeds (edges: {edges_from})")
    print(quintiles.markdown(rows))


def print_weight_histograms(results: list) -> None:
  """Per arm, the per-token histogram of the raw weight pi_prox / mu: each
  bin's share of the trained tokens, the mean over the seeds that record it."""
  by_arm = _by_name(results, "is_weight_histogram")
  if not by_arm:
    return
  bins = losses.is_weight_bins()
  print("\n| arm | seeds | " + " | ".join(f"w in [{lo:g}, {hi:g})" for _, lo, hi in bins) + " |")
  print("|---|---|" + "---|" * len(bins))
  for arm, runs in by_arm.items():
    shares = [statistics.fmean(r["is_weight_histogram"][name] for r in runs) for name, _, _ in bins]
    print(f"| {arm} | {len(runs)} | " + " | ".join(f"{x:.4f}" for x in shares) + " |")


def print_speed(results: list, margin: float) -> None:
  """Time to accuracy per arm against sync, paired by seed, with a TOST of the
  final accuracies; for sampled and for greedy accuracy."""
  by = {(r["name"], r["seed"]): r for r in results}
  seeds = sorted({r["seed"] for r in results if r["name"] == "sync"})
  base = [by[("sync", s)] for s in seeds]
  if not base:
    print("\n(speed: no sync runs, so no baseline)")
    return
  for key in ("accuracy", "greedy"):
    gains = [r["end"][key] - r["start"][key] for r in base if r["end"].get(key) is not None]
    if not gains:
      continue
    target = GAIN_SHARE * statistics.fmean(gains)
    print(
      f"\n{key}: time to {GAIN_SHARE:.0%} of sync's mean final gain ({target:+.3f} over the RL "
      f"start); speed-up = sync's time / the arm's, paired by seed, mean +- 95% t; TOST of the "
      f"final {key} minus sync's, margin {margin}"
    )
    print(
      "| arm | seeds | final, mean | reached | step time to it, s | speed-up (step time) | "
      "speed-up (clock) | final minus sync, 90% interval | TOST p | equivalent |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    if target <= 0:
      print(f"| (sync gained nothing on {key}: no time to accuracy) |")
      continue
    for arm in SPEED:
      pairs = [(by[(arm, s)], by[("sync", s)]) for s in seeds if (arm, s) in by]
      if pairs:
        print(_speed_row(arm, pairs, key, target, margin))
  print_phases([r for r in results if r["name"] in SPEED])


def print_controller(results: list) -> None:
  """Per controller run: the share of steps after SETTLE_STEPS with the
  staleness EMA in the band, the async ratio on the way, the mean allowed
  lag and trained gap over steps 2.. (as the run's other means), and accuracy."""
  print(
    f"\n| run | seed | EMA in band after step {SETTLE_STEPS} | async ratio at steps 1, 10, 20, "
    "40, last | allowed lag, mean | trained gap, mean | accuracy start -> end | greedy end |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for r in results:
    per = r["per_step_async"]
    ratio = per["async_ratio"]
    at = [ratio[i] for i in (0, 9, 19, 39) if i < len(ratio)] + ratio[-1:]
    band = r["band_share"]
    print(
      f"| {r['name']} | {r['seed']} | {'-' if band is None else f'{band:.0%}'} "
      f"| {', '.join(f'{x:.2f}' for x in at)} | {_mean(per['allowed_lag'][1:]):.2f} "
      f"| {r['trained_gap']:.2f} | {r['start']['accuracy']:.3f} -> "
      f"{r['end']['accuracy']:.3f} | {r['end'].get('greedy') or float('nan'):.3f} |"
    )


def _mean(values) -> float:
  """The mean of the values given (None: not recorded); NaN if there are none."""
  present = [v for v in values if v is not None]
  return statistics.fmean(present) if present else float("nan")


def print_phases(results: list) -> None:
  """Each arm's trained samples/s and where its steps' time went (the mean
  over its seeds of each run's mean over steps 2..); a throughput every arm
  shares says one side is the bottleneck."""
  by_arm = _by_name(results, "phase_seconds")  # runs recorded before it have none
  if not by_arm:
    return
  print("\n| arm | seeds | samples/s | " + " | ".join(f"{k}, s" for k in PHASES) + " |")
  print("|---|---|---|" + "---|" * len(PHASES))
  for name, runs in by_arm.items():
    cells = [
      f"{statistics.fmean(r['phase_seconds'][k] for r in runs):.2f}"
      if all(k in r["phase_seconds"] for r in runs)
      else "-"
      for k in PHASES
    ]
    rate = statistics.fmean(r["samples_per_s"] for r in runs)
    print(f"| {name} | {len(runs)} | {rate:.1f} | " + " | ".join(cells) + " |")


def _speed_row(arm: str, pairs: list, key: str, target: float, margin: float) -> str:
  def tta(r: dict, clock: str) -> float | None:
    return time_to_gain(r["evals"], target, key, clock)

  reached = [tta(r, "step_s") for r, _ in pairs]
  ratios: dict[str, list[float]] = {}
  for clock in ("step_s", "clock_s"):
    times = [(tta(r, clock), tta(b, clock)) for r, b in pairs]
    ratios[clock] = [b / t for t, b in times if t and b is not None]
  test = tost([r["end"][key] - b["end"][key] for r, b in pairs], margin)
  hit = [t for t in reached if t is not None]
  fmt = lambda v: f"{statistics.fmean(v):.2f}x +- {t_interval(v):.2f}" if v else "-"
  return (
    f"| {arm} | {len(pairs)} | {statistics.fmean(r['end'][key] for r, _ in pairs):.3f} | "
    f"{len(hit)}/{len(pairs)} | {statistics.fmean(hit) if hit else float('nan'):.0f} | "
    f"{fmt(ratios['step_s'])} | {fmt(ratios['clock_s'])} | {test.mean:+.3f} "
    f"[{test.low:+.3f}, {test.high:+.3f}] | {test.p:.3f} | {'yes' if test.equivalent else 'no'} |"
  )


if __name__ == "__main__":
  main()
