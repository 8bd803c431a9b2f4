"""GRPO advantages, DAPO filtering and loss aggregation against hand-computed values."""

import numpy as np
import pytest

from fluxjax.rl import advantages as adv_lib


def test_group_advantages_hand_computed():
  rewards = np.array([1, 0, 0, 1, 1, 1, 1, 1, 3, 0, 0, 5], np.float32)
  groups = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3])
  got = adv_lib.group_advantages(rewards, groups, eps=0.0)
  # Group 0: mean 0.5, deviations +-0.5, unbiased var = 4 * 0.25 / 3 = 1/3,
  #   std = 0.5773503, A = +-0.5 / 0.5773503 = +-0.8660254.
  # Group 1: all equal -> 0.
  # Group 2: mean 1, deviations (2, -1, -1), var = (4 + 1 + 1) / 2 = 3,
  #   std = 1.7320508, A = (1.1547005, -0.5773503, -0.5773503).
  # Group 3: a lone response has no baseline -> 0.
  want = [
    0.8660254,
    -0.8660254,
    -0.8660254,
    0.8660254,
    0,
    0,
    0,
    0,
    1.1547005,
    -0.5773503,
    -0.5773503,
    0,
  ]
  np.testing.assert_allclose(got, want, atol=1e-6)


def test_group_advantages_eps_and_no_std():
  rewards = np.array([3, 0, 0], np.float32)
  # eps = 1: A = (2, -1, -1) / (1.7320508 + 1) = (0.7320508, -0.3660254, -0.3660254).
  np.testing.assert_allclose(
    adv_lib.group_advantages(rewards, np.zeros(3), eps=1.0),
    [0.7320508, -0.3660254, -0.3660254],
    atol=1e-6,
  )
  # Without std normalization (Dr. GRPO): r - mean = (2, -1, -1).
  np.testing.assert_allclose(
    adv_lib.group_advantages(rewards, np.zeros(3), std_normalize=False), [2, -1, -1]
  )


def test_grpo_advantages_GR_layout():
  got = adv_lib.grpo_advantages_GR(np.array([[1, 0, 0, 1], [3, 0, 0, 0]]), eps=0.0)
  # Row 1: mean 0.75, deviations (2.25, -0.75 x3), var = (5.0625 + 3 * 0.5625) / 3 = 2.25,
  #   std = 1.5, A = (1.5, -0.5, -0.5, -0.5).
  np.testing.assert_allclose(
    got, [[0.8660254, -0.8660254, -0.8660254, 0.8660254], [1.5, -0.5, -0.5, -0.5]], atol=1e-6
  )


def test_token_advantages_only_on_response():
  np.testing.assert_array_equal(
    adv_lib.token_advantages(0.5, np.array([0, 0, 1, 1, 0])), [0, 0, 0.5, 0.5, 0]
  )


def test_filter_groups():
  out = adv_lib.filter_groups({"a": [1, 0, 1], "b": [1, 1], "c": [0, 0, 0], "d": [0.5, 0.5001]})
  assert out.keep == ["a", "d"]
  assert out.refill == ["b", "c"]
  assert (out.all_correct, out.all_wrong) == (1, 1)
  assert out.keep_fraction == 0.5
  # Within tolerance d counts as degenerate too.
  assert adv_lib.filter_groups({"d": [0.5, 0.5001]}, tol=1e-3).refill == ["d"]
  assert adv_lib.is_degenerate_group([2.0, 2.0]) and not adv_lib.is_degenerate_group([0, 1])


def _step_normalization(losses_T, weights_T, microbatches=2):
  """Stand-in for train_step.accumulate: per-microbatch sums over the global weight sum."""
  total = max(sum(w.sum() for w in weights_T), 1.0)
  loss = 0.0
  for k in range(microbatches):
    for per_token, w in list(zip(losses_T, weights_T))[k::microbatches]:
      loss += (per_token * w).sum() / total
  return loss


# Two responses after prompts (prompt tokens carry junk loss that must not count):
#   seq 0: prompt 2 tokens, response losses (1, 3)        -> sum 4,  mean 2
#   seq 1: prompt 1 token,  response losses (2, 2, 2, 6)  -> sum 12, mean 3
#   seq 2: empty response (prompt only)                    -> excluded from N
LOSSES = [np.array([9.0, 9.0, 1.0, 3.0]), np.array([7.0, 2.0, 2.0, 2.0, 6.0]), np.array([5.0, 5.0])]
MASKS = [np.array([0, 0, 1, 1]), np.array([0, 1, 1, 1, 1]), np.array([0, 0])]


@pytest.mark.parametrize(
  "mode,want",
  [
    ("token-mean", 16 / 6),  # (4 + 12) / (2 + 4) = 2.6666667
    ("seq-mean-token-mean", 2.5),  # (2 + 3) / 2
    ("seq-mean-token-sum", 8.0),  # (4 + 12) / 2
  ],
)
def test_aggregation_modes_through_step_normalization(mode, want):
  weights = [adv_lib.aggregation_weights(m, mode) for m in MASKS]
  normalized = _step_normalization(LOSSES, weights)
  scale = adv_lib.aggregation_scale(MASKS, mode)
  # Mean modes are exact under the step's normalization (scale 1); the
  # token-sum mode comes out as token-mean, off by the mean length (6 / 2 = 3).
  assert scale == {"token-mean": 1.0, "seq-mean-token-mean": 1.0, "seq-mean-token-sum": 3.0}[mode]
  np.testing.assert_allclose(normalized * scale, want, rtol=1e-6)


def test_seq_mean_token_mean_weights():
  np.testing.assert_allclose(
    adv_lib.aggregation_weights(np.array([0, 1, 1, 1, 1]), "seq-mean-token-mean"),
    [0, 0.25, 0.25, 0.25, 0.25],
  )
  np.testing.assert_array_equal(
    adv_lib.aggregation_weights(np.zeros(3), "seq-mean-token-mean"), [0, 0, 0]
  )
  with pytest.raises(ValueError):
    adv_lib.aggregation_weights(np.ones(3), "seq-sum")


def test_token_sum_norm_weighs_a_token_the_same_in_any_batch():
  # Dr. GRPO: divided by N_step L_max (3 responses of at most 8 tokens), not
  # by the batch's tokens. seq 0's tokens in a batch alone or with seq 1:
  # under token-mean 1/2 then 1/6 each; under token-sum-norm 1/24 in both.
  normalizer = adv_lib.loss_normalizer("token-sum-norm", 3, 8)
  assert normalizer == 24.0
  weights = [adv_lib.aggregation_weights(m, "token-sum-norm") for m in MASKS]
  total = sum(float((w * loss).sum()) for w, loss in zip(weights, LOSSES))
  assert total / normalizer == pytest.approx(16 / 24)
  for batch in ([0], [0, 1]):
    mean_w = [adv_lib.aggregation_weights(MASKS[i], "token-mean") for i in batch]
    per_token_mean = mean_w[0][-1] / sum(w.sum() for w in mean_w)
    assert per_token_mean == pytest.approx({1: 1 / 2, 2: 1 / 6}[len(batch)])
    assert weights[0][-1] / normalizer == pytest.approx(1 / 24)
  for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
    assert adv_lib.loss_normalizer(mode, 3, 8) is None  # the batch's summed weights
  with pytest.raises(ValueError, match="loss_agg_mode"):
    adv_lib.loss_normalizer("token-sum", 3, 8)
