"""GRPO advantages, DAPO dynamic sampling and loss-aggregation weights.

Host-side numpy: the coordinator computes these per completed group, before
`fluxjax.parallel.batch.materialize` packs them into the train batch. Entry points:
`group_advantages` (GRPO), `filter_groups` (DAPO), `aggregation_weights`,
`aggregation_scale` and `loss_normalizer` (veRL's `loss_agg_mode`).

Shape letters: B sequences (responses) in a batch, G groups, R responses per
group, T tokens of one sequence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum-norm")


def group_advantages(
  rewards_B: np.ndarray, group_ids_B: np.ndarray, *, std_normalize: bool = True, eps: float = 1e-6
) -> np.ndarray:
  """GRPO group-normalized advantage of each sequence.

  GRPO (Shao et al. 2024, veRL `compute_grpo_outcome_advantage`): each prompt is
  sampled R times; response i of a group with rewards r_1..r_R gets

    A_i = (r_i - mean(r)) / (std(r) + eps)    (std_normalize=True)
    A_i =  r_i - mean(r)                      (std_normalize=False, Dr. GRPO)

  with the *unbiased* std (ddof=1), as torch.std in veRL and TRL computes it. A
  group of one response has no baseline: mean = r, so A = 0 (veRL instead sets
  mean 0, std 1; a lone response carries no relative signal and we do not invent
  one). The sequence advantage is then broadcast over the response tokens.

  Args:
    rewards_B: scalar reward of each response.
    group_ids_B: the group (prompt) of each response; any hashable ints.
    std_normalize: divide by the group's unbiased std + eps.
    eps: keeps a zero-variance group finite (its advantages are 0 anyway).

  Returns:
    float32 [B] advantages.
  """
  rewards_B = np.asarray(rewards_B, np.float64)
  group_ids_B = np.asarray(group_ids_B)
  if rewards_B.shape != group_ids_B.shape or rewards_B.ndim != 1:
    raise ValueError(
      f"rewards {rewards_B.shape} and group ids {group_ids_B.shape} must be equal 1-D shapes"
    )
  adv_B = np.zeros_like(rewards_B)
  for g in np.unique(group_ids_B):
    idx = np.flatnonzero(group_ids_B == g)
    r = rewards_B[idx]
    centred = r - r.mean()
    denom = r.std(ddof=1) + eps if len(r) > 1 else 0.0
    # Equal rewards give centred == 0; skipping the division keeps eps = 0 finite.
    if std_normalize and denom > 0:
      centred = centred / denom
    adv_B[idx] = centred
  return adv_B.astype(np.float32)


def grpo_advantages_GR(
  rewards_GR: np.ndarray, *, std_normalize: bool = True, eps: float = 1e-6
) -> np.ndarray:
  """`group_advantages` for rewards laid out [groups, responses per group]."""
  rewards_GR = np.asarray(rewards_GR, np.float64)
  g, r = rewards_GR.shape
  ids = np.repeat(np.arange(g), r)
  return group_advantages(
    rewards_GR.reshape(-1), ids, std_normalize=std_normalize, eps=eps
  ).reshape(g, r)


def token_advantages(adv: float, response_mask_T: np.ndarray) -> np.ndarray:
  """A sequence's advantage on its response tokens, 0 on prompt tokens."""
  return (np.asarray(response_mask_T, np.float32) != 0) * np.float32(adv)


def is_degenerate_group(rewards: Sequence[float], tol: float = 0.0) -> bool:
  """True when all rewards of a group are equal (within tol): no gradient."""
  r = np.asarray(rewards, np.float64)
  return r.size == 0 or float(r.max() - r.min()) <= tol


@dataclasses.dataclass
class GroupFilter:
  """Outcome of DAPO dynamic sampling over completed groups.

  Attributes:
    keep: group keys with reward variance, in input order.
    refill: group keys with equal rewards; drop them and sample new prompts.
    all_correct / all_wrong: how many refilled groups sat at the max / min
      reward (solved vs unsolved prompts; logged as curriculum signals).
  """

  keep: list
  refill: list
  all_correct: int = 0
  all_wrong: int = 0

  @property
  def keep_fraction(self) -> float:
    n = len(self.keep) + len(self.refill)
    return len(self.keep) / n if n else 0.0


def filter_groups(
  rewards_by_group: Mapping[Hashable, Sequence[float]],
  *,
  tol: float = 0.0,
  max_reward: float = 1.0,
  min_reward: float = 0.0,
) -> GroupFilter:
  """DAPO dynamic sampling: splits completed groups into keep and refill.

  DAPO dynamic sampling (Yu et al. 2025, veRL `algorithm.filter_groups`): a
  group whose rewards are all equal has A = 0 for every response, hence no
  policy gradient; such groups are dropped and the coordinator samples more
  prompts until the batch is full.

  The coordinator calls this as groups complete and, while the kept groups
  fall short of the batch, samples replacement prompts for `refill` (bounded
  by `rl.max_refill_rounds`, after which it trains on what it has).

  Args:
    rewards_by_group: {group key: rewards of its responses}.
    tol: rewards within tol of each other count as equal.
    max_reward, min_reward: the reward range, only to count solved/unsolved.

  Returns:
    A GroupFilter.
  """
  out = GroupFilter(keep=[], refill=[])
  for key, rewards in rewards_by_group.items():
    if is_degenerate_group(rewards, tol):
      out.refill.append(key)
      value = float(np.mean(rewards)) if len(rewards) else min_reward
      out.all_correct += value >= max_reward
      out.all_wrong += value <= min_reward
    else:
      out.keep.append(key)
  return out


def aggregation_weights(response_mask_T: np.ndarray, mode: str) -> np.ndarray:
  """Per-token loss weights of one sequence for `loss_agg_mode`.

  Loss aggregation (veRL's `loss_agg_mode`). With l_it the per-token loss of
  token t of sequence i, L_i the response length of sequence i and N the number
  of sequences with L_i > 0, veRL's aggregates are

    token-mean:           sum_i sum_t l_it / sum_i L_i
    seq-mean-token-mean:  (1/N) sum_i [ (1/L_i) sum_t l_it ]
    seq-mean-token-sum:   (1/N) sum_i sum_t l_it

  and Dr. GRPO's constant normalizer (veRL's seq-mean-token-sum-norm), with
  N_step = prompts_per_step * responses_per_prompt and L_max = max_new_tokens:

    token-sum-norm:       sum_i sum_t l_it / (N_step L_max)

  Every token of token-sum-norm weighs the same whatever batch it lands in.
  Token-mean divides by the batch's own token count: where tail batching sorts
  batches by length (a long round's responses are long), a long response's
  tokens weigh less than in a mixed batch and a short one's more.

  The train step computes sum w_it l_it / sum w_it over the GLOBAL batch, where
  w is `loss_mask` (see fluxjax/parallel/train_step.py). `aggregation_weights` gives w:

    token-mean:           w_it = 1                 -> exactly the aggregate
    seq-mean-token-mean:  w_it = 1 / L_i           -> sum w = N, exactly
    seq-mean-token-sum:   w_it = 1                 -> token-mean, i.e. the
                          aggregate divided by c = sum_i L_i / N
    token-sum-norm:       w_it = 1, and the train step divides by the
                          constant `loss_normalizer` instead of sum w

  A weighted mean cannot express a sum, so seq-mean-token-sum comes out as
  token-mean, which has the same gradient direction and is smaller by the
  batch's mean response length c; `aggregation_scale` returns c. Multiply the
  normalized loss by c to get veRL's value; under Adam, a constant
  scale changes only the eps and grad-clip interplay.

  Goes into `TrainSequence.loss_mask_T`; the train step's division by the
  global sum of weights then yields the mode's aggregate.

  Args:
    response_mask_T: 1 on trained (response) tokens, 0 elsewhere.
    mode: one of AGG_MODES.

  Returns:
    float32 [T] weights, 0 outside the response.
  """
  mask_T = (np.asarray(response_mask_T) != 0).astype(np.float32)
  if mode in ("token-mean", "seq-mean-token-sum", "token-sum-norm"):
    return mask_T
  if mode == "seq-mean-token-mean":
    length = mask_T.sum()
    return mask_T / length if length > 0 else mask_T
  raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")


def aggregation_scale(response_masks: Sequence[np.ndarray], mode: str) -> float:
  """c with c * (normalized loss of `aggregation_weights`) = veRL's aggregate.

  1 for the mean modes; for seq-mean-token-sum the batch's mean response
  length, sum_i L_i / N, over the whole optimizer batch.
  """
  if mode not in AGG_MODES:
    raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
  if mode != "seq-mean-token-sum":
    return 1.0
  lengths = np.array([(np.asarray(m) != 0).sum() for m in response_masks])
  nonempty = lengths[lengths > 0]
  return float(nonempty.mean()) if nonempty.size else 1.0


def loss_normalizer(mode: str, responses_per_step: int, max_new_tokens: int) -> float | None:
  """What the train step divides the summed token losses by: a constant for
  token-sum-norm (N_step L_max), None for the others (the batch's summed
  weights)."""
  if mode not in AGG_MODES:
    raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
  if mode != "token-sum-norm":
    return None
  if responses_per_step < 1 or max_new_tokens < 1:
    raise ValueError("token-sum-norm needs responses per step and max_new_tokens >= 1")
  return float(responses_per_step * max_new_tokens)
