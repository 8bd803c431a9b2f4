"""What each trained response was and what the update made of it.

With `coordinator.response_records` on, the train step sums every loss metric
per sequence (train_step.sequence_sums) and the coordinator turns those sums,
with what the host knows of each response, into one `ResponseRecord` per
trained response; the loop writes them to trained.jsonl beside the step's
sample ids. `bench/async.py --quintiles` (bench/quintiles.py) reads them to
show what tail batching does to responses of each length (their version gap,
truncated share, loss weight and accuracy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from fluxjax.rl import async_control, trajectories


@dataclasses.dataclass(frozen=True)
class ResponseRecord:
  """One trained response of a step.

  Attributes:
    sample_id: the prompt's sample id.
    response: its index among the prompt's responses.
    length: response tokens.
    reward: its reward.
    gap_mean, gap_max: the version gap of its tokens against the policy
      version the step updated (0: sampled by that policy).
    versions: distinct policy versions among its tokens (above 1: continued
      across rounds, or across a publish).
    loss_weight: its share of the update: its summed loss weights over what
      the step divided the summed token losses by.
    token_means: each loss metric (is_truncated, is_weight, behaviour_kl,
      clipfrac, ...) averaged over its trained tokens, weighted as the loss
      weighs them.
  """

  sample_id: str
  response: int
  length: int
  reward: float
  gap_mean: float
  gap_max: float
  versions: int
  loss_weight: float
  token_means: dict[str, float]


def response_records(
  groups: Sequence[trajectories.Group],
  launch_versions: Sequence[int],
  per_sequence: Mapping[str, np.ndarray],
  divisor: float,
  version: int,
) -> list[ResponseRecord]:
  """One record per response, in the order the groups' sequences were trained.

  Args:
    groups: the step's trained groups, in the order they were added.
    launch_versions: each group's policy version when its round was admitted
      (the version of tokens that report none).
    per_sequence: {metric: [slots] per-sequence sums}, "tokens" the summed
      loss weights (train_step.PER_SEQUENCE).
    divisor: what the step divided its summed token losses by.
    version: the policy version the step updated.
  """
  out = []
  slot = 0
  for group, launch in zip(groups, launch_versions, strict=True):
    for j, (c, reward) in enumerate(zip(group.completions, group.rewards, strict=True)):
      tags = async_control.token_versions(c, launch)
      gap = async_control.version_gap(tags, version)
      weight = float(per_sequence["tokens"][slot])
      means = {
        k: float(v[slot]) / weight if weight > 0 else 0.0
        for k, v in per_sequence.items()
        if k != "tokens"
      }
      out.append(
        ResponseRecord(
          sample_id=group.key,
          response=j,
          length=len(c.output_ids),
          reward=float(reward),
          gap_mean=gap["mean"],
          gap_max=gap["max"],
          versions=len(set(tags)),
          loss_weight=weight / divisor,
          token_means=means,
        )
      )
      slot += 1
  return out
