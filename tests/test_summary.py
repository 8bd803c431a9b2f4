"""The summary a run ends with (rl/summary.py), from hand-made records."""

import json
import logging

from fluxjax.rl import summary


def _eval(acc, ci, greedy, **breakdown):
  """An evaluation's metrics, as rl/evaluation.py names them."""
  out = {
    "eval/accuracy": acc,
    "eval/accuracy_ci95": ci,
    "eval/accuracy_greedy": greedy,
    "eval/pass@4": min(1.0, 2 * acc),
    "eval/prompts": 16.0,
    "eval/samples": 64.0,
  }
  out.update({k.replace("__", "/"): v for k, v in breakdown.items()})
  return out


def _records():
  """A warm-up from step -2, the RL start at 0 and two RL steps, the last evaluated."""
  step = lambda s, secs, **m: {"step": s, "time": 100.0 + s, "perf/step_seconds": secs, **m}
  return [
    {"step": -2, "time": 90.0, **_eval(0.0, 0.0, 0.0)},
    {"step": -1, "time": 91.0, "sft/loss": 2.0, "sft/nonfinite": 1.0},
    {"step": 0, "time": 92.0, "sft/nonfinite": 0.0, "sft/seconds": 3.0},
    {
      "step": 0,
      "time": 93.0,
      **_eval(
        0.25,
        0.1,
        0.5,
        eval__task__count=0.2,
        eval__task_greedy__count=0.3,
        eval__prior__count=0.25,
        **{"eval__task_level__count@hard": 0.1},
        eval__accuracy__easy=0.4,
        **{"eval__band__17-32": 0.1},
      ),
    },
    step(
      1,
      2.0,
      **{
        "data/skipped": 0.0,
        "faults/failed_rounds_total": 1.0,
        "fleet/servers_down": 1.0,
        "reward/timeout": 0.0,
        "rollout/filtered_groups": 2.0,
        "rollout/filtered_groups_total": 2.0,
        "rollout/reward_mean": "nan",
      },
    ),
    step(
      2,
      3.0,
      **{
        "data/skipped": 0.0,
        "data/skipped/corrupt": 1.0,
        "faults/failed_rounds_total": 1.0,
        "fleet/servers_down": 0.0,
        "reward/timeout": 0.0,
        "rollout/filtered_groups": 1.0,
        "rollout/filtered_groups_total": 3.0,
      },
      **_eval(
        0.5,
        0.12,
        0.75,
        eval__task__count=0.4,
        eval__task__colour=0.6,
        eval__accuracy__easy=0.7,
        **{"eval__band__17-32": 0.35},
      ),
    ),
  ]


def _merged(records):
  """One record per step, as metrics.read_metrics returns them."""
  by_step = {}
  for r in records:
    by_step[r["step"]] = {**by_step.get(r["step"], {}), **r}
  return [by_step[s] for s in sorted(by_step)]


TRAINED = [{"step": 1, "ids": ["a", "b", "c"]}, {"step": 2, "ids": ["d", "e"]}]


def _summary(**kwargs):
  args = dict(wall_s=75.0, workdir="/runs/my run")
  return summary.summarize(_merged(_records()), TRAINED, **{**args, **kwargs})


def test_start_and_end_accuracy_with_intervals_and_the_change():
  s = _summary()
  assert (s.start.step, s.end.step, s.warm_up.step) == (0, 2, -2)
  assert (s.start.accuracy, s.start.ci95, s.end.accuracy, s.end.ci95) == (0.25, 0.1, 0.5, 0.12)
  assert s.accuracy_change == 0.25
  text = "\n".join(s.lines())
  assert "step 0 -> step 2 (16 prompts, 64 samples" in text
  assert "sampled            0.250 ± 0.100 -> 0.500 ± 0.120  (+0.250)" in text
  assert "greedy             0.500 -> 0.750  (+0.250)" in text
  assert "pass@4             0.500 -> 1.000  (+0.500)" in text
  assert "before the SFT warm-up (step -2): 0.000 ± 0.000" in text


def test_per_task_and_per_difficulty_rows():
  lines = _summary().lines()
  assert "  task count         0.200 -> 0.400  (+0.200)" in lines
  # A task evaluated at the end only: no start, no change.
  assert "  task colour        - -> 0.600" in lines
  assert "  difficulty easy    0.400 -> 0.700  (+0.300)" in lines
  assert "  length band 17-32  0.100 -> 0.350  (+0.250)" in lines
  assert "  greedy count       0.300 -> -" in lines
  assert "  count@hard         0.100 -> -" in lines
  assert "  answer priors (each task's most common answer): count 0.250" in lines
  assert _summary().end.by_task == {"colour": 0.6, "count": 0.4}


def test_only_non_zero_fault_counters_each_by_its_kind():
  s = _summary()
  # Cumulative counters: the latest value; servers down: the most at once;
  # SFT's per-step flag: summed. Zeros, per-step counts with a *_total
  # beside them and non-finite values are left out.
  assert s.faults == {
    "data/skipped/corrupt": 1.0,
    "faults/failed_rounds_total": 1.0,
    "fleet/servers_down": 1.0,
    "rollout/filtered_groups_total": 3.0,
    "sft/nonfinite": 1.0,
  }
  assert "faults and skips: data/skipped/corrupt 1, faults/failed_rounds_total 1," in "\n".join(
    s.lines()
  )
  clean = [{k: v for k, v in r.items() if k in ("step", "reward/timeout")} for r in _records()]
  assert summary.summarize(clean, [], wall_s=1.0, workdir="w").faults == {}
  assert "faults and skips: none" in summary.summarize(clean, [], wall_s=1.0, workdir="w").lines()


def test_trained_samples_per_second_over_the_rl_steps():
  s = _summary()
  assert (s.rl_steps, s.samples, s.step_seconds) == (2, 5, 5.0)
  assert s.samples_per_s == 1.0
  assert "throughput: 5 samples trained in 2 RL steps: 1 samples/s (5.0 s of step time)" in (
    s.lines()
  )


def test_a_resumed_run_counts_its_own_steps_and_keeps_the_start():
  s = _summary(resumed_from=1, total_steps=2)
  assert (s.rl_steps, s.samples, s.step_seconds) == (1, 2, 3.0)
  assert s.start.step == 0 and s.end.step == 2  # the first invocation's step 0
  assert s.lines()[0] == (
    "run summary (/runs/my run): 2 RL steps; this invocation 75 s wall time, resumed from step 1"
  )


def test_a_run_the_data_stopped_early_says_so():
  header = _summary(total_steps=5, wall_s=600.0).lines()[0]
  assert header.startswith("run summary (/runs/my run): 2 RL steps of 5 (the data ran out);")
  assert "this invocation 10.0 min wall time" in header and "resumed" not in header


def test_no_evaluation_after_the_start():
  s = summary.summarize(_merged(_records())[:3], [], wall_s=5.0, workdir="w")
  assert s.start.step == 0 and s.end is None and s.accuracy_change is None
  lines = s.lines()
  assert "held-out accuracy, step 0 -> no later evaluation" in lines[1]
  assert "  sampled            0.250 ± 0.100 -> -" in lines
  assert "throughput: no RL steps in this invocation" in lines


def test_report_writes_summary_json_and_logs_the_lines(tmp_path, caplog):
  (tmp_path / "metrics.jsonl").write_text("")
  (tmp_path / "tb").mkdir()
  with caplog.at_level(logging.INFO, logger="fluxjax"):
    s = summary.report(str(tmp_path), _merged(_records()), TRAINED, wall_s=75.0)
  saved = json.loads((tmp_path / summary.JSON).read_text())
  assert saved["start"]["accuracy"] == 0.25 and saved["end"]["accuracy"] == 0.5
  assert saved["start"]["ci95"] == 0.1 and saved["end"]["ci95"] == 0.12
  assert saved["samples_per_s"] == 1.0 and saved["accuracy_change"] == 0.25
  assert saved["text"] == s.lines()
  # Only the records that are there (no trained.jsonl or train.log here).
  assert saved["files"] == {
    "metrics": str(tmp_path / "metrics.jsonl"),
    "TensorBoard": str(tmp_path / "tb"),
  }
  assert f"curves: python -m fluxjax.plot {tmp_path}" in caplog.text
  logged = [r.getMessage() for r in caplog.records if r.name == "fluxjax.rl.summary"]
  assert logged == s.lines()


def test_the_plot_and_export_commands_quote_the_work_directory():
  s = _summary()
  assert s.plot_command == "python -m fluxjax.plot '/runs/my run'"
  export = "HF folder of the last checkpoint: python -m fluxjax.export '/runs/my run' OUT"
  assert export in s.lines()
