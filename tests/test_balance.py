"""Cost model, Karmarkar-Karp, LB-Micro / LB-Mini and the bubble rate."""

import itertools

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from fluxjax.models import config
from fluxjax.planning import balance

TINY = balance.CostShape(
  num_layers=2, hidden=8, num_heads=4, num_kv_heads=2, head_dim=2, intermediate=16, vocab=32
)
QWEN_7B = config.preset("7b").cost_shape()

_costs = st.lists(st.integers(0, 1000), min_size=0, max_size=40)


def _sums(costs, parts):
  c = np.asarray(costs, dtype=np.float64)
  return [float(c[p].sum()) for p in parts]


# --- cost model ---------------------------------------------------------------------


def test_cost_shape_reads_the_text_config():
  cfg = config.preset("7b")
  s = cfg.cost_shape()
  t = cfg.text
  assert (
    s.num_layers,
    s.hidden,
    s.num_heads,
    s.num_kv_heads,
    s.head_dim,
    s.intermediate,
    s.vocab,
  ) == (
    t.num_layers,
    t.hidden_size,
    t.num_heads,
    t.num_kv_heads,
    t.head_dim,
    t.intermediate_size,
    t.vocab_size,
  )
  assert s.bytes_per_elem == 2 and cfg.cost_shape(4).bytes_per_elem == 4


def test_attention_cost_counts_causal_pairs():
  for n in (1, 2, 7, 64):
    pairs = int(np.tril(np.ones((n, n))).sum())  # (query, key) with key <= query
    want = TINY.num_layers * 2 * 2 * pairs * TINY.num_heads * TINY.head_dim
    assert balance.attention_cost(n, TINY) == want


def test_linear_cost_counts_every_matmul_weight_once_per_token():
  s = TINY
  q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
  weights = {
    "q": (s.hidden, q),
    "k": (s.hidden, kv),
    "v": (s.hidden, kv),
    "o": (q, s.hidden),
    "gate": (s.hidden, s.intermediate),
    "up": (s.hidden, s.intermediate),
    "down": (s.intermediate, s.hidden),
  }
  per_token = s.num_layers * sum(a * b for a, b in weights.values()) + s.hidden * s.vocab
  assert balance.linear_cost(10, s) == 2 * per_token * 10
  assert balance.linear_cost(0, s) == 0


def test_costs_vectorize():
  lengths = np.array([0, 1, 100, 5000])
  np.testing.assert_array_equal(
    balance.sequence_cost(lengths, QWEN_7B),
    [balance.sequence_cost(int(n), QWEN_7B) for n in lengths],
  )
  assert balance.sequence_cost(100, QWEN_7B) == balance.attention_cost(
    100, QWEN_7B
  ) + balance.linear_cost(100, QWEN_7B)


def test_all_to_all_bytes_pads_heads_and_replicates_kv():
  s = QWEN_7B  # 28 query heads, 4 KV heads, head_dim 128, bf16
  assert balance.ulysses_all_to_all_bytes(1000, 1, s) == 0
  # sp=4: q and out move 28 heads each, k and v 4 each; 3/4 leaves the device.
  per_token_layer = 128 * (2 * 28 + 2 * 4) * 2
  assert balance.ulysses_all_to_all_bytes(1000, 4, s) == pytest.approx(
    0.75 * 1000 * per_token_layer * 28
  )
  # sp=8: 28 heads pad to 32, 4 KV heads replicate to 8.
  per_token_layer = 128 * (2 * 32 + 2 * 8) * 2
  assert balance.ulysses_all_to_all_bytes(1000, 8, s) == pytest.approx(
    7 / 8 * 1000 * per_token_layer * 28
  )


def test_balance_ratio():
  assert balance.balance_ratio([1, 1, 1, 1]) == 1.0
  assert balance.balance_ratio([4, 0, 0, 0]) == 4.0
  assert balance.balance_ratio([0, 0]) == 1.0


# --- Karmarkar-Karp -----------------------------------------------------------------


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_costs, st.integers(1, 9))
def test_kk_covers_every_item_once_and_spread_is_at_most_the_largest_item(costs, k):
  parts = balance.karmarkar_karp(costs, k)
  assert len(parts) == k
  assert sorted(i for p in parts for i in p) == list(range(len(costs)))
  assert all(p == sorted(p) for p in parts)
  sums = _sums(costs, parts)
  assert sums == sorted(sums, reverse=True)
  # Combining two tuples never widens the larger spread, and every tuple
  # starts with spread <= its largest item.
  assert sums[0] - sums[-1] <= max(costs, default=0) + 1e-9


def _optimum(costs, k):
  best = float("inf")
  for assign in itertools.product(range(k), repeat=len(costs)):
    best = min(best, max(np.bincount(assign, weights=costs, minlength=k)))
  return best


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.lists(st.integers(0, 60), min_size=1, max_size=8), st.integers(2, 3))
def test_kk_is_within_the_differencing_bound_of_the_optimum(costs, k):
  # Michiels et al. (2007): LDM's largest part <= (4/3 - 1/(3k)) * optimum.
  got = max(_sums(costs, balance.karmarkar_karp(costs, k)))
  assert got <= (4 / 3 - 1 / (3 * k)) * _optimum(costs, k) + 1e-9


@hypothesis.settings(max_examples=300, deadline=None)
@hypothesis.given(_costs.filter(bool), st.integers(1, 8), st.booleans())
def test_kk_is_no_worse_than_round_robin_on_sorted_input(costs, k, equal):
  # Not a published theorem, but held on >40k random and adversarially searched
  # instances; a failure here is worth a look, not a loosened bound.
  equal = equal and len(costs) % k == 0
  c = np.asarray(costs, dtype=np.float64)
  order = np.lexsort((np.arange(c.size), -c))
  round_robin = max(c[order[j::k]].sum() for j in range(k))
  assert max(_sums(costs, balance.karmarkar_karp(costs, k, equal_size=equal))) <= round_robin


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(_costs, st.integers(1, 6), st.randoms(use_true_random=False))
def test_kk_is_deterministic_and_depends_on_costs_only(costs, k, rnd):
  a = balance.karmarkar_karp(costs, k)
  assert balance.karmarkar_karp(list(costs), k) == a
  shuffled = list(costs)
  rnd.shuffle(shuffled)
  assert _sums(shuffled, balance.karmarkar_karp(shuffled, k)) == _sums(costs, a)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(st.integers(1, 6), st.integers(0, 6), st.data())
def test_kk_equal_size_gives_equal_counts(k, per_part, data):
  costs = data.draw(st.lists(st.integers(0, 10**6), min_size=k * per_part, max_size=k * per_part))
  parts = balance.karmarkar_karp(costs, k, equal_size=True)
  assert [len(p) for p in parts] == [per_part] * k
  assert sorted(i for p in parts for i in p) == list(range(len(costs)))


def test_kk_edge_cases():
  assert balance.karmarkar_karp([5, 1], 4) == [[0], [1], [], []]
  assert balance.karmarkar_karp([3, 1, 2], 1) == [[0, 1, 2]]
  assert balance.karmarkar_karp([], 3) == [[], [], []]
  with pytest.raises(ValueError, match="multiple of k=2"):
    balance.karmarkar_karp([1, 2, 3], 2, equal_size=True)
  with pytest.raises(ValueError, match="non-negative"):
    balance.karmarkar_karp([1, -2], 2)
  with pytest.raises(ValueError, match="k must be"):
    balance.karmarkar_karp([1], 0)


def test_kk_balances_a_uniform_batch_exactly():
  parts = balance.karmarkar_karp([7.0] * 64, 8)
  assert [len(p) for p in parts] == [8] * 8


# --- LB-Micro, LB-Mini, bubble rate ---------------------------------------------------


def _long_tail(n, seed):
  rng = np.random.default_rng(seed)
  lengths = np.minimum(rng.lognormal(np.log(9000), 1.1, n), 65536).astype(np.int64)
  return lengths, balance.sequence_cost(lengths, QWEN_7B)


def _check_schedules(schedules, lengths, cap, devices):
  seen = [i for s in schedules for d in s for mb in d for i in mb]
  assert sorted(seen) == list(range(len(lengths)))
  for s in schedules:
    assert len(s) == devices
    for d in s:
      for mb in d:
        assert sum(int(lengths[i]) for i in mb) <= cap


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
  st.lists(st.integers(1, 4096), min_size=0, max_size=60),
  st.sampled_from([1, 2, 4, 8]),
  st.sampled_from([None, 1, 2, 4]),
  st.integers(4096, 20000),
)
def test_lb_micro_and_lb_mini_cover_items_and_respect_the_cap(lengths, devices, mbs, cap):
  lengths = np.asarray(lengths, dtype=np.int64)
  costs = balance.sequence_cost(lengths, QWEN_7B)
  micro = balance.lb_micro(costs, lengths, devices, cap, mbs)
  mini = balance.lb_mini(costs, lengths, devices, cap, mbs)
  _check_schedules(micro, lengths, cap, devices)
  _check_schedules(mini, lengths, cap, devices)
  for s in micro:
    assert len({len(d) for d in s}) == 1  # every device runs the same count
  for s in mini:
    assert all(all(mb for mb in d) for d in s)  # no empty microbatches
  if mbs is not None and len(lengths):
    assert len(micro) == len(mini) == -(-len(lengths) // (mbs * devices))


def test_minibatches_are_consecutive_runs():
  lengths, costs = _long_tail(40, 0)
  for s_i, s in enumerate(balance.lb_mini(costs, lengths, 4, 65536, minibatch_size=3)):
    items = sorted(i for d in s for mb in d for i in mb)
    assert items == list(range(12 * s_i, min(12 * (s_i + 1), 40)))


def test_lb_micro_uses_equal_counts_per_device():
  lengths, costs = _long_tail(64, 1)
  (s,) = balance.lb_micro(costs, lengths, 8, 65536)
  assert [sum(len(mb) for mb in d) for d in s] == [8] * 8


def test_too_long_item_is_named():
  with pytest.raises(ValueError, match="item 1 has 9000 tokens > microbatch cap 8192"):
    balance.lb_mini([1.0, 2.0], [10, 9000], 2, 8192)
  with pytest.raises(ValueError, match="item 1"):
    balance.lb_micro([1.0, 2.0], [10, 9000], 2, 8192)


def test_bubble_rate_by_hand():
  costs = [3.0, 1.0, 2.0, 2.0]
  schedule = [[[0], [1]], [[2], [3]]]  # device 0 runs 3 then 1, device 1 runs 2 then 2
  # Per-layer sync: steps last 3 and 2; 8 of 2 x 5 device-units are busy.
  assert balance.bubble_rate([schedule], costs, "layer") == pytest.approx(0.2)
  assert balance.bubble_rate([schedule], costs, "minibatch") == pytest.approx(0.0)
  # A device with fewer microbatches idles through the steps it lacks.
  assert balance.bubble_rate([[[[0]], [[2], [3]]]], costs, "layer") == pytest.approx(
    1 - 7 / (2 * 5)
  )
  assert balance.bubble_rate([], costs) == 0.0
  with pytest.raises(ValueError, match="sync"):
    balance.bubble_rate([schedule], costs, "step")


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(
  st.lists(st.integers(1, 30000), min_size=1, max_size=40),
  st.sampled_from([2, 4, 8]),
  st.sampled_from([None, 1, 2]),
)
def test_minibatch_sync_never_idles_more_than_layer_sync(lengths, devices, mbs):
  lengths = np.asarray(lengths)
  costs = balance.sequence_cost(lengths, QWEN_7B)
  for schedules in (
    balance.lb_micro(costs, lengths, devices, 32768, mbs),
    balance.lb_mini(costs, lengths, devices, 32768, mbs),
  ):
    layer = balance.bubble_rate(schedules, costs, "layer")
    mini = balance.bubble_rate(schedules, costs, "minibatch")
    assert 0.0 <= mini <= layer + 1e-12 < 1.0


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mbs", [2, 4, 8])
def test_lb_mini_idles_less_than_lb_micro_on_a_long_tail(seed, mbs):
  # ODC Table 6: on long-tailed SFT lengths LB-Mini under minibatch sync idles
  # less than LB-Micro under per-layer sync, and less than LB-Micro under ODC.
  lengths, costs = _long_tail(16 * mbs * 8, seed)
  micro = balance.lb_micro(costs, lengths, 8, 65536, mbs)
  mini = balance.lb_mini(costs, lengths, 8, 65536, mbs)
  lb_mini = balance.bubble_rate(mini, costs, "minibatch")
  assert lb_mini < balance.bubble_rate(micro, costs, "layer")
  assert lb_mini <= balance.bubble_rate(micro, costs, "minibatch")
