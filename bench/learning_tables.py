"""bench/learning.py's tables: per run, over seeds, paired against sync, and
the correction, speed, controller, quintile and weight-histogram tables, from
the runs' records (as `summarize` in learning.py writes them)."""

from __future__ import annotations

import math
import statistics

import numpy as np

import quintiles
from fluxjax.rl import losses
from learning_arms import (
  CONTROLLER,
  GAIN_SHARE,
  PAIRED,
  PHASES,
  SETTLE_STEPS,
  SPEED,
  STALENESS_TERMS,
  STRESS,
)
from seedstats import mean_recorded, t_interval, time_to_gain, tost


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
          print_corrections(results, control="stale")
        print_weight_histograms([r for r in results if r["name"] in modes])
  if any(r.get("quintiles") for r in results):
    print_quintiles(results)


def print_table(results: list) -> None:
  print("\n| run | seed | accuracy at RL start | at last eval | gain +- 95% | greedy | wall min |")
  print("|---|---|---|---|---|---|---|")
  for r in results:
    s, e = r["start"], r["end"]
    greedy = f"{s['greedy']:.3f} -> {e['greedy']:.3f}" if s["greedy"] is not None else "-"
    print(
      f"| {arm_label(r)} | {r['seed']} | {s['accuracy']:.3f} +- {s['ci95']:.3f} | "
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
  for name in dict.fromkeys(arm_label(r) for r in results):
    rows = [r for r in results if arm_label(r) == name]
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
  names = list(dict.fromkeys(arm_label(r) for r in rows))
  start = [r["start_metrics"] for r in rows if arm_label(r) == "default"] or [
    rows[0]["start_metrics"]
  ]

  def at(name: str, key: str, when: str = "end_metrics") -> list[float]:
    return [r[when][key] for r in rows if arm_label(r) == name and key in r[when]]

  def ci(vs: list[float]) -> str:
    return (
      f"{mean_recorded(vs):.3f} +- {t_interval(vs):.3f}"
      if len(vs) > 1
      else f"{mean_recorded(vs):.3f}"
    )

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
      fmt = lambda vs: f"{mean_recorded(vs):.3f}" if vs else "-"
      print(
        f"| {name} | {fmt(prior)} | {fmt([m[key] for m in start if key in m])} | {ends} | "
        f"{fmt(greedy)} |"
      )
  print("\n| run | reasoning share, RL start -> end: easy | medium | hard | all |")
  print("|---|---|---|---|---|")
  levels = ("reasoning_share/easy", "reasoning_share/medium", "reasoning_share/hard")
  for n in names:
    cells = [
      f"{mean_recorded(at(n, k, 'start_metrics')):.2f} -> {mean_recorded(at(n, k)):.2f}"
      if at(n, k)
      else "-"
      for k in (*levels, "reasoning_share")
    ]
    print(f"| {n} | " + " | ".join(cells) + " |")
  _print_lengths(rows)


def _print_lengths(rows: list) -> None:
  """The response lengths' tail per trained step, per run over its seeds."""
  print("\n| run | steps | p99 >= 48 on | p99, median step | p99 / p50, median step | min p99 |")
  print("|---|---|---|---|---|---|")
  for n in dict.fromkeys(arm_label(r) for r in rows):
    pairs = [
      (p50, p99)
      for r in rows
      if arm_label(r) == n
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
  """Each mode against the first of `modes` (the baseline), paired by seed
  (same data, prompts and warm-up)."""
  base = next(iter(modes))
  by = {(arm_label(r), r["seed"]): r for r in results}
  seeds = sorted({r["seed"] for r in results if r["name"] == base})
  print(
    f"\n| mode | final accuracy, mean over seeds | minus {base}, 95% (t, paired) | greedy "
    f"minus {base} | samples/s vs {base} | wall min, mean | trained gap | truncated share "
    "| clip fraction | behaviour KL | response IS weight p1 / p50 / p99 / max |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for mode in _arm_labels(results, modes):
    rows = [(by[(mode, s)], by[(base, s)]) for s in seeds if (mode, s) in by]
    if not rows:
      continue
    acc = [r["end"]["accuracy"] for r, _ in rows]
    diff, greedy = _differences(rows, "accuracy"), _differences(rows, "greedy")
    speed = [r["samples_per_s"] / b["samples_per_s"] for r, b in rows]
    minutes = statistics.fmean(r["seconds"] for r, _ in rows) / 60
    avg = lambda key, rows=rows: statistics.fmean(r.get(key, float("nan")) for r, _ in rows)
    # A figure some runs recorded before it was kept shows '-'.
    clip = f"{avg('clipfrac'):.4f}" if all("clipfrac" in r for r, _ in rows) else "-"
    q = [r["is_weight_quantiles"] for r, _ in rows if r.get("is_weight_quantiles")]
    quantiles = (
      " / ".join(f"{statistics.fmean(x[k] for x in q):.3f}" for k in ("p1", "p50", "p99", "max"))
      if q
      else "-"
    )
    print(
      f"| {mode} | {statistics.fmean(acc):.3f} | {_mean_t(diff)} | {_mean_t(greedy)} | "
      f"{statistics.fmean(speed):.2f}x | "
      f"{minutes:.1f} | {avg('trained_gap'):.2f} | {avg('truncated_share'):.4f} | {clip} | "
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


def arm_label(run: dict) -> str:
  """The run's arm, with its lag for the arms whose lag is a flag (--lag,
  --stale-lag), so files at several lags pool into one table, a row a lag."""
  lag = run.get("overrides", {}).get("coordinator.lag.fixed_lag")
  return f"{run['name']} {lag}" if run["name"] in _LAGGED and lag is not None else run["name"]


_LAGGED = {
  arm
  for arms in (SPEED, STRESS)
  for arm, overrides in arms.items()
  if str(overrides.get("coordinator.lag.fixed_lag", "")).startswith("{")
}


def _arm_labels(results: list, arms: dict) -> list[str]:
  """The labels of the runs of `arms`, in the arms' order, then by lag."""

  def order(label: str) -> tuple[int, int]:
    name, _, lag = label.partition(" ")
    return list(arms).index(name), int(lag) if lag else -1

  return sorted({arm_label(r) for r in results if r["name"] in arms}, key=order)


def _by_name(results: list, key: str) -> dict[str, list[dict]]:
  """The runs that recorded `key`, by arm label, in their order."""
  out: dict[str, list[dict]] = {}
  for r in results:
    if r.get(key):
      out.setdefault(arm_label(r), []).append(r)
  return out


def print_corrections(results: list, control: str = "stale_w1") -> None:
  """Each other stale arm minus `control`, paired by seed, sampled and greedy:
  against w = 1 (the uncorrected arm) what each correction keeps, against
  stale (truncated weights, the default) which correction wins."""
  by = {(arm_label(r), r["seed"]): r for r in results}
  print(
    f"\n| arm minus {control} (at its lag) | seeds | sampled, mean +- 95% t | per seed | greedy |"
  )
  print("|---|---|---|---|---|")
  for arm in _arm_labels(results, STRESS):
    name, _, lag = arm.partition(" ")
    against = f"{control} {lag}".strip()
    if not name.startswith("stale") or name == control:
      continue
    pairs = [(by[(arm, s)], by[(against, s)]) for a, s in by if a == arm and (against, s) in by]
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
  by = {(arm_label(r), r["seed"]): r for r in results}
  seeds = sorted({r["seed"] for r in results if r["name"] == "sync"})
  base = [by[("sync", s)] for s in seeds]
  arms = _arm_labels(results, SPEED)
  runs_by_arm = _by_name([r for r in results if r["name"] in SPEED], "evals")
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
    for arm in arms:
      pairs = [(by[(arm, s)], by[("sync", s)]) for s in seeds if (arm, s) in by]
      if pairs:
        print(_speed_row(arm, pairs, key, target, margin))
    print_front({a: runs_by_arm[a] for a in arms}, key, target)
  ordered = {a: i for i, a in enumerate(arms)}
  print_phases(
    sorted((r for r in results if r["name"] in SPEED), key=lambda r: ordered[arm_label(r)])
  )


def print_front(runs_by_arm: dict[str, list[dict]], key: str, target: float) -> None:
  """The accuracy x wall-time front: each arm's mean final `key` and mean step
  time to `target` over its seeds, and the arms that beat it on both means
  (an arm that reached the target on fewer seeds is slower by count first)."""
  points = {}
  for arm, runs in runs_by_arm.items():
    times = [time_to_gain(r["evals"], target, key, "step_s") for r in runs]
    hit = [t for t in times if t is not None]
    final = statistics.fmean(r["end"][key] for r in runs)
    points[arm] = (len(runs) - len(hit), statistics.fmean(hit) if hit else math.inf, final)
  print(f"\n{key}: the accuracy x wall-time front (means over each arm's seeds)")
  print("| arm | seeds | not reached | step time to it, s | final | beaten on both by |")
  print("|---|---|---|---|---|---|")
  for arm, (missed, time, final) in points.items():
    beaten = [
      other
      for other, (m, t, f) in points.items()
      if other != arm
      and (m, t) <= (missed, time)
      and f >= final
      and ((m, t), f) != ((missed, time), final)
    ]
    print(
      f"| {arm} | {len(runs_by_arm[arm])} | {missed} | {time:.0f} | {final:.3f} | "
      f"{', '.join(beaten) or 'none: on the front'} |"
    )


def print_controller(results: list) -> None:
  """Per controller run: the share of steps after SETTLE_STEPS with the
  staleness EMA in the band, the async ratio on the way, the mean allowed
  lag and trained gap over steps 2.. (as the run's other means), and accuracy."""
  print(
    f"\n| run | seed | EMA in band after step {SETTLE_STEPS} | async ratio at steps 1, 10, 20, "
    "40, last | allowed lag, mean | trained gap, mean | behaviour KL | staleness terms "
    f"after step {SETTLE_STEPS}: KL / weights / gap | accuracy start -> end | greedy end |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for r in results:
    per = r["per_step_async"]
    ratio = per["async_ratio"]
    at = [ratio[i] for i in (0, 9, 19, 39) if i < len(ratio)] + ratio[-1:]
    band = r["band_share"]
    print(
      f"| {r['name']} | {r['seed']} | {'-' if band is None else f'{band:.0%}'} "
      f"| {', '.join(f'{x:.2f}' for x in at)} | {mean_recorded(per['allowed_lag'][1:]):.2f} "
      f"| {r['trained_gap']:.2f} | {r['behaviour_kl']:.2g} | {_terms(per)} "
      f"| {r['start']['accuracy']:.3f} -> "
      f"{r['end']['accuracy']:.3f} | {r['end'].get('greedy') or float('nan'):.3f} |"
    )


def _terms(per_step_async: dict) -> str:
  """The staleness terms' means over the steps after SETTLE_STEPS ('-' in a
  record from before they were logged)."""
  if not all(per_step_async.get(t) for t in STALENESS_TERMS):
    return "-"
  return " / ".join(
    f"{mean_recorded(per_step_async[t][SETTLE_STEPS:]):.3f}" for t in STALENESS_TERMS
  )


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
  hit = [t for t in reached if t is not None]
  row = (
    f"| {arm} | {len(pairs)} | {statistics.fmean(r['end'][key] for r, _ in pairs):.3f} | "
    f"{len(hit)}/{len(pairs)} | {statistics.fmean(hit) if hit else float('nan'):.0f} | "
  )
  if arm == "sync":  # the baseline: nothing to compare it with
    return row + "- | - | - | - | - |"
  test = tost([r["end"][key] - b["end"][key] for r, b in pairs], margin)
  fmt = lambda v: f"{statistics.fmean(v):.2f}x +- {t_interval(v):.2f}" if v else "-"
  return row + (
    f"{fmt(ratios['step_s'])} | {fmt(ratios['clock_s'])} | {test.mean:+.3f} "
    f"[{test.low:+.3f}, {test.high:+.3f}] | {test.p:.3f} | {'yes' if test.equivalent else 'no'} |"
  )
