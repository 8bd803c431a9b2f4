"""bench/seedstats.py against scipy's own tests, and bench/learning.py's speed table."""

import argparse
import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest
from scipy import stats

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import learning
import learning_arms
import learning_tables
import runinfo
import seedstats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("n", [2, 3, 5, 8, 12, 40])
def test_t_interval_is_scipys_for_any_number_of_seeds(n):
  values = np.random.default_rng(n).normal(0.1, 0.05, n).tolist()
  low, high = stats.t.interval(0.95, n - 1, loc=np.mean(values), scale=stats.sem(values))
  assert seedstats.t_interval(values) == pytest.approx((high - low) / 2, rel=1e-9)
  assert np.isnan(seedstats.t_interval(values[:1]))


@pytest.mark.parametrize("seed", range(12))
def test_tost_is_two_one_sided_scipy_tests(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(3, 12))
  values = rng.normal(rng.uniform(-0.08, 0.08), rng.uniform(0.005, 0.06), n).tolist()
  margin = 0.05
  result = seedstats.tost(values, margin)
  p_low = stats.ttest_1samp(values, -margin, alternative="greater").pvalue
  p_high = stats.ttest_1samp(values, margin, alternative="less").pvalue
  assert result.p == pytest.approx(max(p_low, p_high), rel=1e-9)
  # Equivalent at alpha exactly when the 90% interval lies inside the margin.
  assert result.equivalent == (-margin < result.low and result.high < margin)
  assert result.equivalent == (result.p < 0.05)


def test_tost_refuses_equivalence_without_spread_outside_the_margin():
  assert seedstats.tost([0.01, 0.01, 0.01], 0.05).equivalent
  assert not seedstats.tost([0.07, 0.07], 0.05).equivalent
  assert not seedstats.tost([0.0], 0.05).equivalent  # one seed proves nothing


def test_time_to_gain_is_the_first_evaluation_past_the_gain():
  evals = [
    {"accuracy": 0.30, "step_s": 0.0},
    {"accuracy": 0.36, "step_s": 50.0},
    {"accuracy": 0.41, "step_s": 100.0},
    {"accuracy": 0.38, "step_s": 150.0},
  ]
  assert seedstats.time_to_gain(evals, 0.1, "accuracy", "step_s") == 100.0
  assert seedstats.time_to_gain(evals, 0.2, "accuracy", "step_s") is None
  assert seedstats.time_to_gain(evals, 0.05, "greedy", "step_s") is None


def _args(**kw):
  base = dict(
    runs="speed",
    seeds="0,1",
    control_seeds="0",
    set=[],
    arms=None,
    lag=3,
    stale_lag=5,
    sweep=[],
    quintiles=False,
  )
  return argparse.Namespace(**{**base, **kw})


def test_speed_plan_pairs_every_arm_with_sync_per_seed():
  plan = learning.build_plan(_args())
  assert [(n, s) for n, s, _ in plan] == [(arm, s) for s in (0, 1) for arm in learning_arms.SPEED]
  overrides = {(n, s): o for n, s, o in plan}
  assert overrides[("lag", 0)]["coordinator.lag.fixed_lag"] == 3
  assert overrides[("lag", 0)]["rollout.tail_batching.eta"] == 1.0
  assert "rollout.tail_batching.eta" not in overrides[("tail_lag", 1)]
  picked = learning.build_plan(_args(runs="parity,speed", arms="sync,adaptive", seeds="0"))
  assert [n for n, _, _ in picked] == ["sync", "adaptive"]  # each once across both
  stress = {(n, s): o for n, s, o in learning.build_plan(_args(runs="stress", seeds="0"))}
  assert stress[("stale_coupled", 0)]["coordinator.lag.fixed_lag"] == 5
  assert stress[("stale_coupled", 0)]["rl.prox"] == "batch"
  # Every stress arm at sync's eta: the lag is not confounded with tail batching.
  assert {o["rollout.tail_batching.eta"] for o in stress.values()} == {1.0}
  with pytest.raises(SystemExit, match="unknown arms"):
    learning.build_plan(_args(arms="sync,lag9"))


def test_controller_runs_start_the_adaptive_controller_below_and_above_its_setpoint(capsys):
  plan = learning.build_plan(_args(runs="controller", seeds="0,1"))
  assert [(n, s) for n, s, _ in plan] == [(a, s) for s in (0, 1) for a in ("from_0.1", "from_0.9")]
  for name, _, overrides in plan:
    assert overrides["coordinator.lag.mode"] == "adaptive"
    assert overrides["coordinator.lag.initial_ratio"] == float(name.removeprefix("from_"))
  one = learning.build_plan(_args(runs="controller", arms="from_0.1", seeds="0,1"))
  assert [(n, s) for n, s, _ in one] == [("from_0.1", 0), ("from_0.1", 1)]
  # The band is the run's own: EMAs 0.05 (out) for steps 1-25, then 0.14 (in).
  lag = {"target_staleness": 0.15, "tolerance": 0.05}
  steps = [{"step": k, "async/staleness_ema": 0.05 if k <= 25 else 0.14} for k in range(1, 41)]
  assert learning._band_share(steps, lag) == 15 / 20
  assert learning._band_share(steps, {**lag, "tolerance": 0.1}) == 1.0
  assert learning._band_share([{"step": 30}], lag) is None  # no controller
  run = _run("from_0.1", 0, 0.3, [0.5], 10.0)
  ratios = [0.1 + 0.01 * k for k in range(40)]
  run["per_step_async"] = {
    "async_ratio": ratios,
    "allowed_lag": [0.0] + [2.0] * 39,  # step 1's is left out, as in the run's means
    "trained_gap": [1.5] * 40,
    # The terms' means over the steps after step 20 only.
    "staleness_kl": [0.5] * 20 + [0.02] * 20,
    "staleness_iw": [0.01] * 40,
    "staleness_gap": [0.1] * 40,
  }
  summary = {"band_share": 0.75, "trained_gap": 1.5, "behaviour_kl": 3e-4}
  learning_tables.print_controller([{**run, **summary}])
  row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| from_0.1"))
  cells = [c.strip() for c in row.split("|")[1:-1]]
  assert cells[2:8] == [
    "75%",
    "0.10, 0.19, 0.29, 0.49, 0.49",
    "2.00",
    "1.50",
    "0.0003",
    "0.020 / 0.010 / 0.100",
  ]
  # A record from before the terms were logged shows none.
  del run["per_step_async"]["staleness_kl"]
  learning_tables.print_controller([{**run, **summary}])
  row = next(r for r in capsys.readouterr().out.splitlines() if r.startswith("| from_0.1"))
  assert [c.strip() for c in row.split("|")[1:-1]][7] == "-"


def _run(name, seed, start, accuracies, seconds_per_eval):
  evals = [
    {"step": 10 * i, "accuracy": a, "greedy": a, "step_s": seconds_per_eval * i,
     "clock_s": 2 * seconds_per_eval * i}
    for i, a in enumerate([start, *accuracies])
  ]  # fmt: skip
  return {"name": name, "seed": seed, "start": evals[0], "end": evals[-1], "evals": evals}


def test_speed_table_reads_time_to_accuracy_and_equivalence(capsys):
  # sync gains 0.2 by its 4th evaluation; tail reaches 90% of that (0.18) at
  # its 2nd, at the same seconds per evaluation: a 2x speed-up, same finals.
  results = []
  for seed, noise in enumerate([0.0, 0.004, -0.003, 0.002]):
    results.append(_run("sync", seed, 0.3, [0.33, 0.40, 0.45, 0.5 + noise], 10.0))
    results.append(_run("tail", seed, 0.3, [0.40, 0.49, 0.5, 0.5 - noise], 10.0))
  learning_tables.print_speed(results, margin=0.05)
  out = capsys.readouterr().out
  tail_rows = [line for line in out.splitlines() if line.startswith("| tail |")]
  tail_rows = [line for line in tail_rows if line.count("|") == 11]  # not the front's
  assert len(tail_rows) == 2  # sampled and greedy
  cells = [c.strip() for c in tail_rows[0].split("|")[1:-1]]
  assert cells[3] == "4/4" and cells[4] == "20"
  assert cells[5].startswith("2.00x") and cells[6].startswith("2.00x")
  assert cells[-1] == "yes"
  # sync is the baseline: its row compares with nothing.
  sync_rows = [line for line in out.splitlines() if line.startswith("| sync |")]
  sync_rows = [line for line in sync_rows if line.count("|") == 11]  # not the front's
  assert len(sync_rows) == 2 and all(line.endswith("| - | - | - | - | - |") for line in sync_rows)


def test_speed_table_says_where_each_arms_steps_went(capsys):
  """The phase table: each arm's samples/s and step phases, averaged over
  its seeds; a run recorded before a phase was logged shows '-' there."""
  results = []
  for seed, wait in enumerate([1.0, 3.0]):
    for name, update in (("sync", 2.0), ("lag", 1.0)):
      run = _run(name, seed, 0.3, [0.5], 10.0)
      phases = {"perf/step_seconds": wait + update, "rollout/wait_seconds": wait}
      if seed == 0 or name == "sync":
        phases["perf/update_seconds"] = update
      results.append({**run, "samples_per_s": 40.0 + seed, "phase_seconds": phases})
  learning_tables.print_phases(results)
  rows = {r.split("|")[1].strip(): r for r in capsys.readouterr().out.splitlines() if "|" in r}
  sync = [c.strip() for c in rows["sync"].split("|")[1:-1]]
  assert sync == ["sync", "2", "40.5", "4.00", "2.00", "2.00", "-"]
  lag = [c.strip() for c in rows["lag"].split("|")[1:-1]]
  assert lag[3:6] == ["3.00", "2.00", "-"]  # seed 1 had no update seconds


def test_corrections_are_paired_by_seed_against_the_uncorrected_arm(capsys):
  results = [_run("stale_w1", s, 0.3, [a], 1.0) for s, a in enumerate([0.2, 0.3, 0.25])]
  results += [_run("stale", s, 0.3, [a], 1.0) for s, a in enumerate([0.4, 0.4, 0.3])]
  results += [_run("stale_mask", 7, 0.3, [0.9], 1.0)]  # no w = 1 run of seed 7: no pair
  learning_tables.print_corrections(results)
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| stale")]
  assert len(rows) == 1, rows
  cells = [c.strip() for c in rows[0].split("|")[1:-1]]
  # Differences 0.2, 0.1, 0.05: mean 0.117, sd 0.0764, t(2) 4.303 / sqrt(3).
  assert cells[:4] == ["stale", "3", "+0.117 +- 0.190", "+0.200, +0.100, +0.050"]
  # Against the default (truncated weights): the same pairs, the other way.
  learning_tables.print_corrections(results, control="stale")
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| stale")]
  assert [c.strip() for c in rows[0].split("|")[1:-1]][:3] == ["stale_w1", "3", "-0.117 +- 0.190"]


def test_paired_table_shows_the_clip_fraction_only_where_every_seed_kept_it(capsys):
  figures = {"samples_per_s": 1.0, "seconds": 60.0, "trained_gap": 6.0, "truncated_share": 0.0,
             "behaviour_kl": 0.0}  # fmt: skip
  results = [{**_run("sync", s, 0.3, [0.5], 1.0), **figures} for s in (0, 1)]
  results += [
    {**_run("stale_coupled", s, 0.3, [0.4], 1.0), **figures, "clipfrac": c}
    for s, c in ((0, 0.1), (1, 0.3))
  ]
  results += [{**_run("stale_mask", s, 0.3, [0.4], 1.0), **figures} for s in (0, 1)]
  results[-1]["clipfrac"] = 0.2  # seed 0 recorded before the figure was kept
  learning_tables.print_paired(results, learning_arms.STRESS)
  lines = capsys.readouterr().out.splitlines()
  rows = {r.split("|")[1].strip(): r for r in lines if r.startswith("| ")}
  clip = lambda name: [c.strip() for c in rows[name].split("|")[1:-1]][8]
  assert clip("stale_coupled") == "0.2000" and clip("stale_mask") == "-"


def test_normalizer_runs_are_paired_with_token_mean_the_default(capsys):
  plan = learning.build_plan(_args(runs="normalizer", seeds="0,1"))
  arms = list(learning_arms.NORMALIZER)
  assert [(n, s) for n, s, _ in plan] == [(a, s) for s in (0, 1) for a in arms]
  modes = {n: o.get("rl.loss_agg_mode") for n, _, o in plan}
  assert modes == {"token_mean": None, "seq_mean_token_mean": "seq-mean-token-mean",
                   "token_sum_norm": "token-sum-norm"}  # fmt: skip
  figures = {"samples_per_s": 1.0, "seconds": 60.0, "trained_gap": 0.0, "truncated_share": 0.0,
             "behaviour_kl": 0.0}  # fmt: skip
  ends = {"token_mean": (0.5, 0.6), "token_sum_norm": (0.4, 0.4), "seq_mean_token_mean": (0.5, 0.5)}
  results = [{**_run(arm, s, 0.3, [ends[arm][s]], 1.0), **figures} for arm in arms for s in (0, 1)]
  learning_tables.print_paired(results, learning_arms.NORMALIZER)
  lines = capsys.readouterr().out.splitlines()
  assert "minus token_mean, 95% (t, paired)" in next(r for r in lines if r.startswith("| mode"))
  cells = [[c.strip() for c in r.split("|")[1:-1]] for r in lines if r.startswith("| ")]
  rows = {c[0]: c for c in cells}
  assert rows["token_mean"][2].startswith("+0.000")
  assert rows["token_sum_norm"][2].startswith("-0.150")  # -0.1 and -0.2
  assert rows["seq_mean_token_mean"][2].startswith("-0.050")  # 0 and -0.1


def test_weight_histograms_average_each_arms_seeds_that_record_them(capsys):
  names = [name for name, _, _ in learning_tables.losses.is_weight_bins()]
  one_hot = lambda i: {n: float(j == i) for j, n in enumerate(names)}
  results = [
    {"name": "stale", "seed": 0, "is_weight_histogram": one_hot(0)},
    {"name": "stale", "seed": 1, "is_weight_histogram": one_hot(len(names) - 1)},
    {"name": "stale_w1", "seed": 0, "is_weight_histogram": None},  # recorded before it
  ]
  learning_tables.print_weight_histograms(results)
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| stale")]
  assert len(rows) == 1, rows
  cells = [c.strip() for c in rows[0].split("|")[1:-1]]
  assert cells[:2] == ["stale", "2"]
  assert cells[2:] == ["0.5000"] + ["0.0000"] * (len(names) - 2) + ["0.5000"]


def _task_run(name, seed, end_colour, p99s):
  start = {
    "task/colour": 0.2,
    "prior/colour": 0.25,
    "task/count": 0.4,
    "prior/count": 0.3,
    "reasoning_share/hard": 0.1,
    "reasoning_share": 0.05,
  }
  end = {
    "task/colour": end_colour,
    "task/count": 0.5,
    "task_greedy/colour": end_colour + 0.1,
    "reasoning_share/hard": 0.4,
    "reasoning_share": 0.2,
  }
  per_step = {
    "response_len_p50": [8.0] * len(p99s),
    "response_len_p99": p99s,
    "reasoning_share": [0.1] * len(p99s),
  }
  return {"name": name, "seed": seed, "start_metrics": start, "end_metrics": end,
          "per_step": per_step}  # fmt: skip


def test_task_table_reads_each_run_per_task_and_the_length_tail(capsys):
  results = [_task_run("default", s, 0.6 + 0.02 * s, [40.0, 50.0, 60.0]) for s in range(3)]
  results += [_task_run("blind", s, 0.25, [30.0, 30.0, 30.0]) for s in range(3)]
  learning_tables.print_tasks(results)
  out = capsys.readouterr().out.splitlines()
  header = next(line for line in out if line.startswith("| task |"))
  assert [c.strip() for c in header.split("|")[1:-1]] == [
    "task", "prior", "RL start", "default", "blind", "default greedy"
  ]  # fmt: skip
  colour = [c.strip() for c in next(x for x in out if x.startswith("| colour |")).split("|")[1:-1]]
  assert colour[1:3] == ["0.250", "0.200"]
  assert colour[3].startswith("0.620 +- ") and colour[4].startswith("0.250 +- ")
  assert colour[5] == "0.720"
  shares = next(x for x in out if x.startswith("| default |") and "->" in x)
  assert shares.split("|")[2:6] == [" - ", " - ", " 0.10 -> 0.40 ", " 0.05 -> 0.20 "]
  tails = {x.split("|")[1].strip(): x for x in out if x.startswith("| ") and "%" in x}
  assert tails["default"].split("|")[2:5] == [" 9 ", " 67% ", " 50 "]
  assert tails["blind"].split("|")[3] == " 0% "


def _kill_resume_record(path, seed: int, killed: list[float], shadows: list[float]) -> None:
  kill = {"point": "generation", "victim": 0, "step": 2, "in_flight": 3, "partial": 1, "queued": 0}
  row = {
    "seed": seed,
    "kills": [kill],
    "sync_kills": [kill],
    "accounting": {"drawn": 34, "trained": 32, "held": 2, "dropped": {}, "redone": 5},
    "sync_parameters_equal": True,
    "sync_parameters": 102,
    "wall_s": 600.0,
    "lengths": {"killed": killed, "reference": shadows},
    "run_lengths": {"others": shadows},
  }
  path.write_text(json.dumps({"bench": "kill_resume.py", "seeds": [row], "error": None}))


def test_kill_resume_pools_seeds_recorded_by_separate_runs(tmp_path):
  """Seeds run in separate sessions are pooled from their --json files: one
  row each, the length test over all; a seed recorded twice is refused."""
  rng = np.random.default_rng(0)
  files = []
  for seed in (0, 1):
    files.append(tmp_path / f"seed{seed}.json")
    _kill_resume_record(files[-1], seed, list(rng.normal(24, 4, 9)), list(rng.normal(24, 4, 6)))
  script = [sys.executable, os.path.join(ROOT, "bench", "kill_resume.py"), "--pool"]
  out = subprocess.run([*script, *map(str, files)], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  rows = [line for line in out.stdout.splitlines() if line.lstrip()[:1].isdigit()]
  assert [int(r.split("|")[0]) for r in rows] == [0, 1]
  assert "(n=18) against the shadows'" in out.stdout and "(n=12)" in out.stdout
  twice = subprocess.run([*script, str(files[0]), str(files[0])], capture_output=True, text=True)
  assert twice.returncode != 0 and "a seed is recorded twice" in twice.stderr


def test_every_control_that_replaces_the_reward_is_evaluated_on_accuracy():
  """A control run's held-out accuracy is the task's, whatever it was trained
  on: a run trained on the answer's format alone must not report the
  format's reward as its accuracy."""
  from fluxjax import config_args
  from fluxjax.rl import reward_spec

  replaced = [name for name, o in learning_arms.CONTROLS.items() if "rl.reward.fn" in o]
  assert {"format_only", "random_reward", "reversed", "zeroed"} <= set(replaced)
  for name in replaced:
    config = config_args.load_config(arg="tiny_base")
    for key, value in learning_arms.CONTROLS[name].items():
      learning._set(config, key, value)
    scored = reward_spec.evaluation(config.rl.reward.fn, config.eval.reward)
    assert scored == "accuracy", (name, scored)


def test_a_result_names_the_commit_it_started_from(monkeypatch):
  started = runinfo.header("x.py")
  assert started["commit"] == runinfo.commit() and "commit_at_write" not in started
  monkeypatch.setattr(runinfo, "commit", lambda: "0000000")  # HEAD moved during the run
  moved = runinfo.header("x.py")
  assert moved["commit"] == started["commit"] and moved["commit_at_write"] == "0000000"


def test_quintile_tables_take_each_seeds_edges_from_its_first_run(monkeypatch):
  """--quintiles records every response of every run; each run's table is on
  the lengths of its seed's first run (sync), and the responses themselves
  stay out of the result."""
  args = _args(
    runs="speed",
    arms="sync,tail",
    seeds="0,1",
    quintiles=True,
    keep=None,
    variant="tiny",
    json=None,
  )
  plan = learning.build_plan(args)
  assert all(o["coordinator.response_records"] for _, _, o in plan)
  lengths = {("sync", 0): [2, 4, 6, 8], ("tail", 0): [20, 40], ("sync", 1): [1, 50]}
  lengths[("tail", 1)] = [1, 50]

  def run_one(name, seed, overrides, keep, base):
    responses = [
      {"step": 2, "sample_id": f"p{i}", "length": n, "gap_mean": 0.0, "versions": 1,
       "loss_weight": 0.25, "reward": 1.0, "token_means": {"is_truncated": 0.0}}
      for i, n in enumerate(lengths[(name, seed)])
    ]  # fmt: skip
    run = _run(name, seed, 0.3, [0.4], 1.0)
    return {**run, "gain": 0.1, "gain_ci95": 0.1, "seconds": 60.0, "prompts_per_step": 2,
            "responses": responses}  # fmt: skip

  monkeypatch.setattr(learning, "run_one", run_one)
  results = []
  learning.run_plan(plan, args, results, base=ml_collections.ConfigDict())
  by = {(r["name"], r["seed"]): r for r in results}
  assert all("responses" not in r for r in results)
  assert by[("tail", 0)]["quintile_edges_from"] == "sync seed 0"
  # Seed 0's edges lie between 2 and 8: both tail responses land in the last quintile.
  tail = [q["responses"] for q in by[("tail", 0)]["quintiles"]]
  assert sum(tail) == 2 and tail[-1] == 2
  assert by[("tail", 1)]["quintile_edges_from"] == "sync seed 1"


def test_corrections_pair_each_lag_with_the_control_at_that_lag(capsys):
  """Files at --stale-lag 3 and 6 pool: each stale arm is paired with w = 1
  at its own lag, and sync (no lag) is every lag's baseline."""

  def at(name, seed, lag, accuracy):
    run = _run(name, seed, 0.3, [accuracy], 1.0)
    return {**run, "overrides": {"coordinator.lag.fixed_lag": lag}}

  results = [at("stale", s, 3, 0.5) for s in (0, 1)] + [at("stale_w1", s, 3, 0.4) for s in (0, 1)]
  results += [at("stale", s, 6, 0.45) for s in (0, 1)] + [at("stale_w1", s, 6, 0.2) for s in (0, 1)]
  learning_tables.print_corrections(results)
  rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("| stale")]
  cells = [[c.strip() for c in r.split("|")[1:4]] for r in rows]
  assert cells == [["stale 3", "2", "+0.100 +- 0.000"], ["stale 6", "2", "+0.250 +- 0.000"]]
  sync = [
    {**_run("sync", s, 0.3, [0.55], 1.0), "samples_per_s": 1.0, "seconds": 60.0} for s in (0, 1)
  ]
  runs = [{**r, "samples_per_s": 1.0, "seconds": 60.0} for r in results]
  learning_tables.print_paired(sync + runs, learning_arms.STRESS)
  rows = [r.split("|")[1:4] for r in capsys.readouterr().out.splitlines() if r.startswith("| s")]
  assert [(a.strip(), b.strip()) for a, b, _ in rows] == [
    ("sync", "0.550"), ("stale 3", "0.500"), ("stale 6", "0.450"), ("stale_w1 3", "0.400"),
    ("stale_w1 6", "0.200"),
  ]  # fmt: skip


def test_pooled_files_keep_lags_apart_and_refuse_one_arm_and_seed_twice(tmp_path):
  """The lag arm at --lag 1 and at --lag 2 pool as two arms; two files that
  both ran one of them on seed 0 would pair by (arm, seed) and one would be
  dropped unseen: refused."""

  def write(name, runs):
    path = tmp_path / name
    path.write_text(json.dumps({"bench": "learning.py", "runs": runs}))
    return str(path)

  def lag(seed, n, accuracy):
    return {
      **_run("lag", seed, 0.3, [accuracy], 1.0),
      "overrides": {"coordinator.lag.fixed_lag": n},
    }

  sync = write("sync.json", [_run("sync", 0, 0.3, [0.5], 1.0)])
  lag1 = write("lag1.json", [lag(0, 1, 0.6), lag(1, 1, 0.6)])
  lag2 = write("lag2.json", [lag(0, 2, 0.7)])
  again = write("again.json", [lag(0, 1, 0.7)])
  pool = lambda *paths: learning._pool(list(paths), [learning._load(p) for p in paths])
  pooled = pool(sync, lag1, lag2)
  assert [(learning_tables.arm_label(r), r["seed"]) for r in pooled] == [
    ("sync", 0), ("lag 1", 0), ("lag 1", 1), ("lag 2", 0)
  ]  # fmt: skip
  with pytest.raises(SystemExit, match=r"again.json and .*lag1.json both hold arm 'lag 1' seed 0"):
    pool(sync, lag1, again)


def test_the_front_names_the_arms_that_beat_each_on_time_and_accuracy(capsys):
  # At 10 s an evaluation: sync reaches 0.48 (90% of its 0.2 gain over 0.3)
  # at 40 s and ends 0.5; lag 1 at 20 s, ending 0.52 (beats sync on both);
  # lag 2 at 10 s, ending 0.45 (faster, less accurate: both on the front);
  # tail never reaches it.
  runs = {
    "sync": [_run("sync", s, 0.3, [0.33, 0.40, 0.45, 0.5], 10.0) for s in (0, 1)],
    "lag 1": [_run("lag", s, 0.3, [0.40, 0.49, 0.5, 0.52], 10.0) for s in (0, 1)],
    "lag 2": [_run("lag", s, 0.3, [0.49, 0.45, 0.45, 0.45], 10.0) for s in (0, 1)],
    "tail": [_run("tail", s, 0.3, [0.31, 0.32, 0.33, 0.34], 10.0) for s in (0, 1)],
  }
  learning_tables.print_front(runs, "accuracy", target=0.18)
  lines = capsys.readouterr().out.splitlines()[4:]  # after the title, header and rule
  rows = {r.split("|")[1].strip(): r.split("|")[2:-1] for r in lines}
  cell = lambda arm, i: rows[arm][i].strip()
  assert (cell("sync", 1), cell("sync", 2), cell("sync", 4)) == ("0", "40", "lag 1")
  assert cell("lag 1", 4) == cell("lag 2", 4) == "none: on the front"
  assert (cell("tail", 1), cell("tail", 2)) == ("2", "inf")
  assert cell("tail", 4) == "sync, lag 1, lag 2"
