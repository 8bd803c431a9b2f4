r"""Adaptive async: trained samples/s, staleness and held-out accuracy per lag mode.

  python bench/async.py                      # rollout and trainer on disjoint cores
  python bench/async.py --placement shared   # both on every core, in one process
  python bench/async.py --steps 60 --modes sync,fixed:1,fixed:2,adaptive --json PATH
  python bench/async.py --placement shared --steps 150 --modes 'adaptive,adaptive/lr*3@75'

Each mode runs the real GRPO loop (`fluxjax.rl.loop.run`: producer thread,
tail batching with recycling, stream trainer, weight publishing) on the
default config (configs/vlm.py: the tiny preset, the reasoning_tiny mix, the
SFT warm-up), the same seed and data, one mode after the other, each in a
fresh work directory. Only the lag mode differs.

Placement. `disjoint` (default): this process, the trainer, is pinned to
`--trainer-cores` (sched_setaffinity, before JAX starts) and the rollout
engine runs as a separate server process (`python -m fluxjax.rollout.server`,
SGLang's protocol) pinned to `--rollout-cores` with `taskset`; the loop
drives it as a fleet of one (`rollout.backend=sglang`), weights published
through disk every step (pause -> update_weights_from_disk -> continue). So
rollout and training can overlap, as on a cluster where they run on
different GPUs. `shared`: the embedded engine in a thread of this process,
both on every core (what overlap cannot speed up).

Reported per mode, from the run's metrics.jsonl:

  samples/s     trained responses per second: (steps - 1) * P * R over the
                summed perf/step_seconds of steps 2.. (step 1 carries the
                compilations; evaluations fall outside steps);
  staleness     mean async/staleness (rl/async_control.py, the Flux metric)
                and the target the adaptive controller holds it to;
  version gap   mean per-token gap between the version that sampled a token
                and the version it trains;
  lag           mean allowed lag (the controller's, in adaptive mode);
  wait s        mean time the trainer waited for groups;
  accuracy      held-out eval/accuracy at step 0 and after the last step,
                with its 95% interval (`--eval-prompts` x 4 samples);
  controller    the share of steps after the 10th with the staleness EMA
                inside the band (target +- tolerance), sync barriers by cause
                (hard bound, sync_interval) and hard-bound ones per 20 steps,
                the trained tokens' full version gap (recycled ones included).

With `--quintiles` every run records its trained responses
(`coordinator.response_records`) and each mode gets a table per response-length
quintile, the edges taken from the first mode's lengths (bench/quintiles.py):
version gap, carried share, truncated share, loss weight per prompt and per
token, accuracy; e.g. tail batching against eta 1.0 and the two normalizers:
  python bench/async.py --placement shared --quintiles --set data.mix=reasoning_tail \
    --set rl.max_new_tokens=64 --modes \
    'sync/rollout.tail_batching.eta=1.0,sync,sync/rl.loss_agg_mode=token-sum-norm'

A mode `MODE/lr*X@S` multiplies the learning rate by X once S updates are
done (optim.lr_scale_steps): a step change in KL. Its row adds the async
ratio and the EMA at S, S + 10 and S + 20, and the first step after S at
which the ratio went down. `MODE/KEY=VALUE` sets any other config field for
that mode, e.g. `sync/rollout.tail_batching.continue_in=next_round`;
`--set KEY=VALUE` sets one for every mode.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # runs from a checkout without `pip install -e .`, as the others
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cores  # noqa: E402  (these live next to this script)
import quintiles  # noqa: E402
import runinfo  # noqa: E402

PER_STEP_KEYS = (
  "step",
  "time",
  "perf/step_seconds",
  "async/staleness",
  "async/version_gap",
  "async/allowed_lag",
  "train/is_weight",
  "rollout/wait_seconds",
  "rollout/reward_mean",
  "async/staleness_ema",
  "async/async_ratio",
  "async/sync_barrier",
  "async/trained_gap",
  "async/kl",
)
SETTLED_AFTER = 10  # steps before the EMA-in-band share is counted


def parse_mode(mode: str) -> tuple[str, int, tuple[int, float] | None, dict]:
  """ "sync", "fixed:2", "adaptive/lr*3@75", "sync/rollout.tail_batching.eta=1.0" ->
  (lag mode, fixed lag, (step, lr scale) or None, other config overrides)."""
  lag_mode, *changes = mode.split("/")
  name, _, lag = lag_mode.partition(":")
  if name not in ("sync", "fixed", "adaptive"):
    raise ValueError(f"unknown mode {mode!r}: sync, fixed:K or adaptive, then /lr*X@S, /KEY=V")
  step_change, overrides = None, {}
  for change in changes:
    if change.startswith("lr*") and "@" in change:
      scale, _, step = change[3:].partition("@")
      step_change = (int(step), float(scale))
    elif "=" in change:
      key, _, value = change.partition("=")
      try:
        overrides[key] = ast.literal_eval(value)
      except (ValueError, SyntaxError):
        overrides[key] = value  # a bare string
    else:
      raise ValueError(f"{mode!r}: {change!r} is neither lr*X@S nor KEY=VALUE")
  return name, int(lag or 1), step_change, overrides


def make_config(mode: str, args, urls: tuple[str, ...]):
  from fluxjax import config_args

  c = config_args.load_config(os.path.join(ROOT, "configs", "vlm.py"), "tiny")
  c.total_steps = args.steps
  c.eval.every, c.eval.prompts = args.steps, args.eval_prompts
  c.checkpoint.every = 10**6  # no checkpoint inside the measured steps
  c.sft.enabled = not args.no_sft
  c.coordinator.response_records = args.quintiles
  if args.P:
    c.rl.prompts_per_step = args.P
  if args.R:
    c.rl.responses_per_prompt = args.R
  c.coordinator.lag.mode, c.coordinator.lag.fixed_lag, change, overrides = parse_mode(mode)
  if change is not None:
    c.optim.lr_scale_steps, c.optim.lr_scales = (change[0],), (change[1],)
  # Every mode's --set first, then the mode's own overrides.
  common = parse_mode("/".join(["sync", *args.set]))[3] if args.set else {}
  for key, value in {**common, **overrides}.items():
    *path, field = key.split(".")
    section = c
    for name in path:
      section = section[name]
    if field not in section:
      raise ValueError(f"mode {mode!r}: no config field {key}")
    section[field] = value
  cores.use_server(c, urls)
  return c


def run_mode(mode: str, args, workdir: str, urls: tuple[str, ...]) -> dict:
  from fluxjax.rl import loop, metrics

  c = make_config(mode, args, urls)
  t0 = time.perf_counter()
  loop.run(c, workdir)
  wall = time.perf_counter() - t0
  recs = metrics.read_metrics(workdir)
  steps = [r for r in recs if r["step"] >= 1 and "perf/step_seconds" in r]
  evals = {r["step"]: r for r in recs if "eval/accuracy" in r}
  mean = lambda k: statistics.fmean(float(r[k]) for r in steps if k in r)
  per_step = c.rl.prompts_per_step * c.rl.responses_per_prompt
  timed = steps[1:]
  first, last = evals[0], evals[max(evals)]
  return {
    "mode": mode,
    "steps": len(steps),
    "wall_s": wall,
    "samples_per_s": len(timed) * per_step / sum(r["perf/step_seconds"] for r in timed),
    "staleness": mean("async/staleness"),
    "staleness_target": float(c.coordinator.lag.target_staleness),
    "version_gap": mean("async/version_gap"),
    "lag": mean("async/allowed_lag"),
    "is_weight": mean("train/is_weight"),
    "wait_s": mean("rollout/wait_seconds"),
    "reward": mean("rollout/reward_mean"),
    "accuracy_start": first["eval/accuracy"],
    "accuracy_end": last["eval/accuracy"],
    "accuracy_end_ci95": last["eval/accuracy_ci95"],
    "accuracy_step": max(evals),
    **controller_figures(steps, c.coordinator.lag, parse_mode(mode)[2]),
    # What the means above are taken over, for --json.
    "per_step": [{k: r[k] for k in PER_STEP_KEYS if k in r} for r in steps],
    # Steps 2.. as samples/s (step 1 waits on compilation, not on tail batching).
    "responses": quintiles.responses(loop.read_trained(workdir), after_step=1),
  }


def controller_figures(steps: list[dict], lag, change) -> dict:
  """The controller's figures of one run (the module docstring)."""
  by_step = {r["step"]: r for r in steps}
  settled = [r for r in steps if r["step"] > SETTLED_AFTER]
  in_band = [
    abs(r["async/staleness_ema"] - lag.target_staleness) <= lag.tolerance + 1e-12 for r in settled
  ]
  last = steps[-1]
  out = {
    "ema_in_band": statistics.fmean(in_band) if in_band else float("nan"),
    "hard_bound_barriers": last["async/hard_bound_barriers_total"],
    "interval_barriers": last["async/interval_barriers_total"],
    "hard_bound_per_20_steps": 20 * last["async/hard_bound_barriers_total"] / len(steps),
    "trained_gap": statistics.fmean(r["async/trained_gap"] for r in steps),
  }
  if change is not None and "async/async_ratio" in last:
    at = change[0]
    out["step_change"] = {
      "step": at,
      "lr_scale": change[1],
      **{
        f"{key}_at_{at + d}": by_step[at + d][f"async/{key}"]
        for d in (0, 10, 20)
        if at + d in by_step
        for key in ("async_ratio", "staleness_ema")
      },
      "first_ratio_drop": next(
        (
          s
          for s in sorted(by_step)
          if s > at and by_step[s]["async/async_ratio"] < by_step[at]["async/async_ratio"]
        ),
        None,
      ),
    }
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--steps", type=int, default=60, help="GRPO steps per mode")
  p.add_argument("--P", type=int, default=0, help="prompts per step (0: the config's)")
  p.add_argument("--R", type=int, default=0, help="responses per prompt (0: the config's)")
  p.add_argument("--modes", default="sync,fixed:1,fixed:2,adaptive")
  p.add_argument("--placement", choices=("disjoint", "shared"), default="disjoint")
  p.add_argument("--trainer-cores", default="0", help="disjoint: this process's cores")
  p.add_argument("--rollout-cores", default="1", help="disjoint: the server's cores (taskset)")
  p.add_argument("--eval-prompts", type=int, default=128)
  p.add_argument("--no-sft", action="store_true", help="skip the warm-up (no learning signal)")
  p.add_argument(
    "--quintiles", action="store_true", help="record responses; figures per length quintile"
  )
  p.add_argument(
    "--set", action="append", default=[], metavar="KEY=VALUE", help="a config field, every mode"
  )
  p.add_argument(
    "--json",
    metavar="PATH",
    help="also write the figures here, with the command, machine, commit and date",
  )
  args = p.parse_args(argv)
  for mode in args.modes.split(","):
    parse_mode(mode)
  print(f"python {' '.join(sys.argv)}")
  servers, server_cmd = None, ""
  if args.placement == "disjoint":
    servers, server_cmd = cores.pin_and_launch(
      args.trainer_cores, args.rollout_cores, make_config("sync", args, ())
    )
    print(f"trainer on cores {args.trainer_cores}; rollout server: {server_cmd}")
  urls = tuple(servers.urls) if servers else ()
  rows = []
  try:
    with tempfile.TemporaryDirectory() as tmp:
      for mode in args.modes.split(","):
        workdir = os.path.join(tmp, re.sub(r"[^\w.=-]", "_", mode))
        rows.append(run_mode(mode, args, workdir, urls))
        print(f"  {mode}: done in {rows[-1]['wall_s']:.1f} s", flush=True)
  finally:
    if servers is not None:
      servers.stop()
  base = rows[0]["samples_per_s"]
  print(
    f"\n{args.placement} placement, {args.steps} steps per mode; accuracy: held-out, "
    f"{args.eval_prompts} prompts x 4, step 0 -> step {rows[0]['accuracy_step']}"
  )
  print(
    "| mode | samples/s | vs first | staleness (target) | version gap | allowed lag | "
    "trainer wait s | accuracy |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['mode']} | {r['samples_per_s']:.1f} | {r['samples_per_s'] / base:.2f}x | "
      f"{r['staleness']:.3f} ({r['staleness_target']:.2f}) | {r['version_gap']:.2f} | "
      f"{r['lag']:.2f} | {r['wait_s']:.2f} | {r['accuracy_start']:.3f} -> "
      f"{r['accuracy_end']:.3f} +- {r['accuracy_end_ci95']:.3f} |"
    )
  print(
    f"\ncontroller: EMA in the band (target {rows[0]['staleness_target']:.2f}) after step "
    f"{SETTLED_AFTER}, sync barriers by cause"
  )
  print("| mode | EMA in band | hard-bound barriers (per 20 steps) | interval | trained gap |")
  print("|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['mode']} | {r['ema_in_band']:.3f} | {r['hard_bound_barriers']:.0f} "
      f"({r['hard_bound_per_20_steps']:.2f}) | {r['interval_barriers']:.0f} | "
      f"{r['trained_gap']:.2f} |"
    )
  for r in rows:
    if "step_change" in r:
      print(f"{r['mode']}: {r['step_change']}")
  if args.quintiles:
    inner = quintiles.edges(rows[0]["responses"])
    P = make_config(rows[0]["mode"], args, ()).rl.prompts_per_step
    for r in rows:
      r["quintiles"] = quintiles.table(r["responses"], inner, P)
      print(f"\n{r['mode']}: per response-length quintile (edges from {rows[0]['mode']})")
      print(quintiles.markdown(r["quintiles"]))
  for r in rows:
    del r["responses"]  # the quintile tables carry what --json keeps of them
  if args.json:
    runinfo.write(
      args.json,
      "async.py",
      {
        "args": vars(args),
        "rollout_server": server_cmd,
        "rows": [dict(r, samples_per_s_vs_first=r["samples_per_s"] / base) for r in rows],
      },
    )


if __name__ == "__main__":
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.WARNING)
  main()
