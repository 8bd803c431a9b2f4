"""fluxjax/faults.py: one streak type, its limits from the config, totals under one name."""

import pytest

from fluxjax import config_args, faults
from fluxjax.rl import config_rules
from fluxjax.settings import Settings


def test_a_streak_stops_at_its_limit_in_a_row_and_counts_every_failure():
  s = faults.Streak("x", limit=3)
  assert [s.fail(), s.fail()] == [False, False]
  s.ok()  # a success ends the streak, not the total
  assert [s.fail(), s.fail(), s.fail()] == [False, False, True]
  assert (s.in_a_row, s.total) == (3, 5)
  never = faults.Streak("y", limit=0)
  assert not any(never.fail() for _ in range(1000))


def test_every_limit_comes_from_the_config_and_totals_round_trip():
  limits = config_args.load_config(arg="tiny").faults
  run = faults.Faults(limits)
  for name in ("nonfinite_steps", "unwritten_publishes", "failed_rounds", "prompt_errors"):
    assert run.streak(name).limit == limits[name]
  run.streak("failed_rounds").fail()
  run.streak("failed_rounds").fail()
  assert run.totals()["faults/failed_rounds_total"] == 2.0
  assert run.totals()["faults/prompt_errors_total"] == 0.0
  resumed = faults.Faults(limits)
  resumed.set_state(run.get_state())
  assert resumed.totals() == run.totals()
  assert resumed.streak("failed_rounds").in_a_row == 0  # a streak does not outlive the process
  with pytest.raises(KeyError, match=r"add faults\.no_such_fault to the config"):
    run.streak("no_such_fault")


def test_a_negative_limit_is_refused_with_its_flag():
  config = config_args.load_config(arg="tiny")
  config.faults.failed_rounds = -1
  with pytest.raises(ValueError, match=r"--config\.faults\.failed_rounds"):
    config_rules._check_faults(Settings.of(config))
