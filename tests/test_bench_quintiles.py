"""bench/quintiles.py's per-length figures on records whose answers are known."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import quintiles


def _step(step, prompts, weigh):
  """trained.jsonl's line: prompt -> response lengths; loss weights from `weigh`."""
  lengths = [n for ns in prompts.values() for n in ns]
  weights = weigh(lengths)
  out, k = [], 0
  for pid, ns in prompts.items():
    for j, n in enumerate(ns):
      means = {"is_truncated": 0.5 if n > 10 else 0.0}
      out.append(
        dict(
          sample_id=pid,
          response=j,
          length=n,
          reward=float(n <= 10),
          gap_mean=float(n > 10),
          gap_max=float(n > 10),
          versions=1 + (n > 10),
          loss_weight=weights[k],
          token_means=means,
        )
      )
      k += 1
  return {"step": step, "ids": list(prompts), "responses": out}


def _token_mean(lengths):
  return [n / sum(lengths) for n in lengths]


def test_token_mean_over_sorted_batches_weighs_long_tokens_less():
  """A step of short responses and a step of long ones (tail batching's
  sorting): token-mean gives a token of the long step mean(T) / T of the
  average weight; a constant normalizer gives every token the same."""
  short = {"a": [2, 2], "b": [4, 4]}  # 12 tokens
  long = {"c": [20, 20], "d": [16, 16]}  # 72 tokens
  trained = [_step(1, short, _token_mean), _step(2, long, _token_mean)]
  records = quintiles.responses(trained)
  inner = quintiles.edges(records)
  rows = {r["quintile"]: r for r in quintiles.table(records, inner, prompts_per_step=2)}
  first, last = rows[1], rows[max(rows)]
  assert first["length"] == 2 and last["length"] == 20
  assert first["token_weight"] == pytest.approx(42 / 12)  # mean tokens per step 42
  assert last["token_weight"] == pytest.approx(42 / 72)
  assert last["truncated"] == 0.5 and first["truncated"] == 0.0
  assert last["gap"] == 1.0 and last["carried"] == 1.0 and last["accuracy"] == 0.0
  # Prompt weight x P: "a" holds 4 of its step's 12 tokens, "c" 40 of 72.
  assert first["prompt_weight"] == pytest.approx(2 * 4 / 12)
  assert last["prompt_weight"] == pytest.approx(2 * 40 / 72)

  constant = lambda lengths: [n / 100 for n in lengths]
  trained = [_step(1, short, constant), _step(2, long, constant)]
  rows = quintiles.table(quintiles.responses(trained), inner, prompts_per_step=2)
  weights = [r["token_weight"] for r in rows if r["responses"]]
  np.testing.assert_allclose(weights, 42 / 100)


def test_over_seeds_averages_each_seeds_table():
  short = {"a": [2, 2], "b": [4, 4]}
  long = {"c": [20, 20], "d": [16, 16]}
  token_mean = quintiles.responses([_step(1, short, _token_mean), _step(2, long, _token_mean)])
  constant = lambda lengths: [n / 100 for n in lengths]
  flat = quintiles.responses([_step(1, short, constant), _step(2, long, constant)])
  inner = quintiles.edges(token_mean)
  tables = [quintiles.table(records, inner, prompts_per_step=2) for records in (token_mean, flat)]
  rows = quintiles.over_seeds(tables)
  first = rows[0]
  assert first["seeds"] == 2 and first["responses"] == 4
  # Token weights 42/12 (token-mean) and 0.42 (constant): mean and t(1) interval.
  assert first["token_weight"] == pytest.approx((42 / 12 + 0.42) / 2)
  half = 12.7062 * abs(42 / 12 - 0.42) / 2
  assert first["token_weight_ci95"] == pytest.approx(half, rel=1e-4)
  assert first["accuracy"] == 1.0 and first["accuracy_ci95"] == 0.0
  assert "+- 0.000 |" in quintiles.markdown(rows).splitlines()[2]


def test_a_quintiles_label_holds_the_lengths_placed_in_it():
  """Lengths on an edge open the next quintile, and the label says so: six
  7-token answers, two of 8 and two of 30 give edges 7, 7.4 and 12.4, and
  the 7-token answers a quintile labelled [7, 7.4)."""
  steps = [_step(1, {"a": [7, 7, 7, 7, 7], "b": [7, 8, 8, 30, 30]}, _token_mean)]
  records = quintiles.responses(steps)
  inner = quintiles.edges(records)
  np.testing.assert_allclose(inner, [7, 7.4, 12.4])
  rows = quintiles.table(records, inner, prompts_per_step=2)
  assert [r["responses"] for r in rows] == [0, 6, 2, 2]
  lines = quintiles.markdown(rows).splitlines()[2:]
  assert lines[0].startswith("| 1 | <7 | 0 |")
  assert lines[1].startswith("| 2 | >=7 <7.4 (mean 7.0) | 6 |")
  assert lines[2].startswith("| 3 | >=7.4 <12.4 (mean 8.0) | 2 |")
  assert lines[3].startswith("| 4 | >=12.4 (mean 30.0) | 2 |")
