"""FlexUlysses planner invariants, as properties over random length lists."""

import hypothesis
import hypothesis.strategies as st
import pytest

from fluxjax.sharding import flex_planner, planners

lengths = st.lists(st.integers(1, 5000), min_size=1, max_size=40)
devices = st.sampled_from([1, 2, 4, 8, 16])


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(lengths, devices, st.sampled_from([1, 2, 4, 8]))
def test_placement_invariants(lens, num_devices, p_max):
  hypothesis.assume(p_max <= num_devices)
  fp = flex_planner.plan_flex(lens, num_devices, p_max)
  assert len(fp.placements) == len(lens)  # every sequence placed exactly once
  for h, pl in zip(lens, fp.placements):
    assert pl.p >= 1 and pl.p & (pl.p - 1) == 0 and pl.p <= p_max  # powers of two
    assert pl.first % pl.p == 0  # aligned blocks: groups of all degrees nest
    assert pl.first + pl.p <= num_devices
  if fp.baseline_feasible:
    assert max(fp.memory()) <= fp.m_th * (1 + 1e-9)
  # Determinism.
  again = flex_planner.plan_flex(lens, num_devices, p_max)
  assert [(p.p, p.first) for p in again.placements] == [(p.p, p.first) for p in fp.placements]


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(lengths, st.sampled_from([2, 4, 8]))
def test_plans_place_every_chunk_once(lens, p_max):
  """As a Plan: each sequence in exactly one row whose slices cover it, once."""
  plan = planners.plan_flex_ulysses(lens, 8, p_max, capacity=4096,
                                    buckets=(256, 512, 1024, 2048, 4096))
  plan.validate()
  rows_of = {}
  for m, rows in enumerate(plan.microbatches):
    for r in rows:
      for s in r.seqs:
        rows_of.setdefault(s, []).append((m, r))
      # A row's tokens fit in its degree's section on each of its devices.
      cap, _ = plan.section(r)
      assert sum(lens[s] for s in r.seqs) <= r.degree * cap
  assert sorted(rows_of) == list(range(len(lens)))
  assert all(len(v) == 1 for v in rows_of.values())
  degrees = [d for d, _ in plan.levels]
  assert degrees == sorted(degrees, reverse=True)  # highest-sharding-first layout


def test_merge_and_reorder_reduce_communication():
  """A few long and many short sequences: short ones end local, long ones split."""
  lens = [8000, 7000] + [200] * 30
  fp = flex_planner.plan_flex(lens, 8, 8)
  assert fp.placements[0].p > 1 and fp.placements[1].p > 1
  assert all(pl.p == 1 for pl in fp.placements[2:])
  s = flex_planner._State(tuple(lens), 8, 8, fp.m_th)
  flex_planner._baseline(s)
  baseline = s.pl
  base_comm = sum(flex_planner.comm_cost(h, p.p) for h, p in zip(lens, baseline))
  assert fp.communication() <= base_comm


def test_bad_arguments():
  with pytest.raises(ValueError, match="power-of-two device count"):
    flex_planner.plan_flex([1, 2], 6, 2)
  with pytest.raises(ValueError, match="p_max 16"):
    flex_planner.plan_flex([1, 2], 8, 16)
  with pytest.raises(ValueError, match="sequence 1 has 9000 tokens > flex_ulysses"):
    planners.plan_flex_ulysses([10, 9000], 8, 2, capacity=4096, buckets=(4096,))


def test_reorder_never_breaks_the_memory_threshold():
  """A case where greedy short-item re-placement paints itself into a corner."""
  fp = flex_planner.plan_flex([76, 114, 109, 199, 176], 4, 2)
  assert fp.baseline_feasible and max(fp.memory()) <= fp.m_th
