"""packed_dp and Ulysses planners: valid plans, layout, errors, balance."""

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from fluxjax.models import config
from fluxjax.planning import balance, planners

CAP = 4096
SHAPE = config.preset("7b").cost_shape()


@st.composite
def _batches(draw, sp=1):
  """Lengths that fit a degree-sp row, and a device count divisible by sp."""
  devices = sp * draw(st.sampled_from([1, 2, 4, 8]))
  lengths = draw(st.lists(st.integers(0, sp * CAP), min_size=0, max_size=80))
  return lengths, devices


def _ulysses_cases(degrees):
  return st.sampled_from(degrees).flatmap(lambda sp: st.tuples(st.just(sp), _batches(sp)))


def _device_rows(plan):
  """For every device, the row it is in at each microbatch."""
  out = {d: [] for d in range(plan.num_devices)}
  for rows in plan.microbatches:
    for r in rows:
      for d in r.devices:
        out[d].append(r)
  return out


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(_batches())
def test_packed_dp_plans_are_valid(batch):
  lengths, devices = batch
  plan = planners.plan_packed_dp(lengths, devices, CAP, SHAPE)
  plan.validate()
  assert plan.strategy == "packed_dp" and plan.capacity == CAP
  assert plan.lengths == tuple(lengths)
  for rows in plan.microbatches:
    assert [r.devices for r in rows] == [(d,) for d in range(devices)]
  # Every device runs every microbatch: equal counts by construction.
  assert {len(v) for v in _device_rows(plan).values()} <= {plan.num_microbatches}


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(_ulysses_cases([1, 2, 4, 8]))
def test_ulysses_plans_are_valid_with_consecutive_blocks(case):
  sp, (lengths, devices) = case
  plan = planners.plan_ulysses(lengths, devices, sp, CAP, SHAPE)
  plan.validate()
  assert plan.strategy == "ulysses"
  blocks = [tuple(range(g * sp, (g + 1) * sp)) for g in range(devices // sp)]
  for rows in plan.microbatches:
    assert [r.devices for r in rows] == blocks
    assert sorted(d for r in rows for d in r.devices) == list(range(devices))


def test_plans_are_deterministic():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, CAP, 300).tolist()
  assert planners.plan_packed_dp(lengths, 8, CAP, SHAPE) == planners.plan_packed_dp(
    lengths, 8, CAP, SHAPE
  )
  assert planners.plan_ulysses(lengths, 8, 4, CAP, SHAPE) == planners.plan_ulysses(
    lengths, 8, 4, CAP, SHAPE
  )


def test_too_long_sequences_are_named():
  lengths = [100, 200, 300, 9000, 50, 9001]
  with pytest.raises(
    ValueError,
    match=r"sequence 3 has 9000 tokens > packed_dp capacity "
    r"8192 \(and 1 more\); use ulysses or flex_ulysses",
  ):
    planners.plan_packed_dp(lengths, 4, 8192, SHAPE)
  with pytest.raises(
    ValueError,
    match=r"sequence 1 has 40000 tokens > ulysses sp=2 x "
    r"capacity 16384 = 32768",
  ):
    planners.plan_ulysses([10, 40000], 4, 2, 16384, SHAPE)
  # The same sequence fits a degree-2 row.
  planners.plan_ulysses(lengths, 4, 2, 8192, SHAPE).validate()


def test_bad_degrees_are_refused():
  with pytest.raises(ValueError, match="sp=4 does not divide 6 devices"):
    planners.plan_ulysses([10], 6, 4, CAP, SHAPE)
  with pytest.raises(ValueError, match="sp=3 must be a power of two"):
    planners.plan_ulysses([10], 6, 3, CAP, SHAPE)
  with pytest.raises(ValueError, match="negative"):
    planners.plan_packed_dp([10, -1], 2, CAP, SHAPE)
  with pytest.raises(ValueError, match=">= 1"):
    planners.plan_packed_dp([10], 0, CAP, SHAPE)


def test_empty_batch_gives_no_microbatches():
  for plan in (
    planners.plan_packed_dp([], 8, CAP, SHAPE),
    planners.plan_ulysses([], 8, 2, CAP, SHAPE),
  ):
    plan.validate()
    assert plan.num_microbatches == 0


def test_uniform_batch_is_perfectly_balanced():
  plan = planners.plan_packed_dp([1000] * 64, 8, CAP, SHAPE)
  loads = planners.plan_loads(plan, SHAPE)
  assert balance.balance_ratio(loads.attention.sum(axis=0)) == pytest.approx(1.0)
  assert balance.balance_ratio(loads.tokens.sum(axis=0)) == pytest.approx(1.0)
  assert plan.num_microbatches == 2  # 8 x 1000 tokens per device, 4 per microbatch


def test_microbatches_run_heaviest_rows_first():
  rng = np.random.default_rng(3)
  lengths = rng.integers(1, CAP, 200)
  plan = planners.plan_packed_dp(lengths, 4, CAP, SHAPE)
  cost = planners.plan_loads(plan, SHAPE).cost
  assert np.all(np.diff(cost, axis=0) <= 1e-6 * cost.max())


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(_ulysses_cases([1, 2, 4]))
def test_plan_loads_conserve_tokens_and_flops(case):
  sp, (lengths, devices) = case
  plan = planners.plan_ulysses(lengths, devices, sp, CAP, SHAPE)
  loads = planners.plan_loads(plan, SHAPE)
  assert loads.tokens.sum() == pytest.approx(sum(lengths))
  assert loads.attention.sum() == pytest.approx(
    balance.attention_cost(np.array(lengths), SHAPE).sum()
  )
  assert loads.tokens.max(initial=0) <= CAP
  # Devices of one row share its work evenly.
  for m, rows in enumerate(plan.microbatches):
    for r in rows:
      assert len(set(loads.attention[m, list(r.devices)].tolist())) == 1
  if sp == 1:
    assert not loads.all_to_all_bytes.any()


def test_ulysses_beats_packed_dp_on_one_long_sequence():
  # FlexRL Figure 3 (middle): one long outlier makes its packed_dp device the
  # straggler; a degree-4 row spreads it over four devices.
  lengths = [16000] + [1000] * 31
  dp = planners.plan_loads(planners.plan_packed_dp(lengths, 4, 16384, SHAPE), SHAPE)
  sp = planners.plan_loads(planners.plan_ulysses(lengths, 4, 4, 16384, SHAPE), SHAPE)
  assert balance.balance_ratio(sp.attention.sum(axis=0)) < balance.balance_ratio(
    dp.attention.sum(axis=0)
  )


def test_lb_mini_plan_lets_devices_run_different_microbatch_counts():
  """Where attention dominates, cost balance leaves token loads uneven."""
  shape = balance.CostShape(
    num_layers=1, hidden=8, num_heads=1, num_kv_heads=1, head_dim=8, intermediate=8, vocab=8
  )
  # 4 long sequences cost as much as 100 short ones but hold 40% of their tokens.
  lens = [500, 500, 500, 500] + [50] * 100
  plan = planners.plan_packed_dp_lb_mini(lens, 8, 512, shape)
  plan.validate()
  counts = [
    sum(1 for rows in plan.microbatches for r in rows if r.devices == (d,) and r.seqs)
    for d in range(8)
  ]
  assert min(counts) == 1 and max(counts) > 1, counts
  # LB-Micro (layer sync) makes every device run the same count.
  micro = planners.plan_packed_dp(lens, 8, 512, shape)
  assert all(len(rows) == 8 for rows in micro.microbatches)
  assert micro.num_microbatches >= max(counts)
