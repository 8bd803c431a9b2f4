"""Groups of completions become trainer sequences with the right fields."""

import numpy as np
import pytest

from fluxjax.models import config as config_lib
from fluxjax.models import inputs
from fluxjax.rl import trajectories
from helpers import completion

CFG = config_lib.preset("tiny")


def test_group_sequences_fields():
  prompt = inputs.sequence_from_tokens([5, 6, 7, 8], [], CFG)
  group = trajectories.Group(
    "s1",
    prompt,
    [completion([10, 11, 492], [-0.5, -1.0, -0.1]), completion([12, 492], [-2.0, -0.3])],
    rewards=[1.0, 0.0],
  )
  a, b = trajectories.group_sequences(group, agg_mode="token-mean")
  # GRPO: rewards (1, 0) -> mean 0.5, unbiased std sqrt(0.5) = 0.7071 (as veRL's
  # torch.std) -> advantages 0.5 / 0.7071 = +0.7071 and -0.7071 (eps aside).
  np.testing.assert_allclose(a.advantages_T, [0, 0, 0, 0] + [0.70711] * 3, atol=1e-4)
  np.testing.assert_allclose(b.advantages_T, [0, 0, 0, 0] + [-0.70711] * 2, atol=1e-4)
  np.testing.assert_array_equal(a.loss_mask_T, [0, 0, 0, 0, 1, 1, 1])
  np.testing.assert_allclose(a.old_logprobs_T, [0, 0, 0, 0, -0.5, -1.0, -0.1])
  np.testing.assert_array_equal(a.inputs.tokens_T, [5, 6, 7, 8, 10, 11, 492])
  # Response positions continue the prompt's (text: 4, 5, 6 on every axis).
  np.testing.assert_array_equal(a.inputs.positions_3T[:, 4:], [[4, 5, 6]] * 3)
  # Sequence-mean aggregation: each response's weights sum to 1.
  a2, b2 = trajectories.group_sequences(group, agg_mode="seq-mean-token-mean")
  assert a2.loss_mask_T.sum() == pytest.approx(1.0) and b2.loss_mask_T.sum() == pytest.approx(1.0)
  # eps joins the std in the denominator: 0.5 / (0.7071 + 1).
  c, _ = trajectories.group_sequences(group, eps=1.0)
  np.testing.assert_allclose(c.advantages_T[4:], 0.5 / (0.5**0.5 + 1.0), rtol=1e-5)


def test_missing_logprobs_or_rewards_are_errors():
  prompt = inputs.sequence_from_tokens([5, 6], [], CFG)
  with pytest.raises(ValueError, match=r"lacks a finite behaviour logprob .* non-finite logits"):
    trajectories.group_sequences(
      trajectories.Group("s", prompt, [completion([1, 2], [None, -1.0])], [1.0])
    )
  with pytest.raises(ValueError, match="2 completions but 1 rewards"):
    trajectories.group_sequences(
      trajectories.Group("s", prompt, [completion([1], [-1.0]), completion([2], [-1.0])], [1.0])
    )


def test_a_continued_response_keeps_each_tokens_behaviour_logprob_and_version():
  """A response paused under version 3 and finished under version 5: the
  trainer's behaviour logprobs are each token's own, and the version gap is
  counted per token."""
  from fluxjax.rl import async_control

  cfg = config_lib.preset("tiny")
  prompt = inputs.sequence_from_tokens(np.arange(5), [], cfg)
  head = completion([7, 8], [-0.1, -0.2], version="3").pinned(None)
  tail = completion([9, 10, 11], [-0.3, -0.4, -0.5], version="5").pinned(None)
  whole = head.continued_by(tail, "text")
  assert whole.versions() == ["3", "3", "5", "5", "5"]
  group = trajectories.Group("k", prompt, [whole, completion([7], [-1.0])], [1.0, 0.0])
  seq = trajectories.group_sequences(group)[0]
  np.testing.assert_allclose(seq.old_logprobs_T[5:], [-0.1, -0.2, -0.3, -0.4, -0.5])
  gaps = async_control.version_gap([int(v) for v in whole.versions()], 6)
  assert gaps == {"mean": (3 + 3 + 1 + 1 + 1) / 5, "max": 3.0}
