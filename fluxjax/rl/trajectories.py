"""From finished GRPO groups to the trainer's sequences.

A `Group` is one prompt with its R responses (sampled by the rollout engine, which also
reported the behaviour logprob of every sampled token) and their rewards;
`group_sequences` makes each response a `TrainSequence`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from fluxjax.models.inputs import SequenceInputs
from fluxjax.parallel.batch import TrainSequence
from fluxjax.rl import advantages as adv_lib
from fluxjax.rollout.protocol import Completion


@dataclasses.dataclass
class Group:
  """One prompt and its responses.

  Attributes:
    key: the sample's id (also the fleet's affinity key).
    prompt: the prompt's tokens, positions and media.
    completions: the R responses, in any order.
    rewards: one reward per completion.
    answer: the reference answer (for metrics).
    reward_terms: per completion, each reward function's value (empty
      where the call failed), for metrics.
  """

  key: str
  prompt: SequenceInputs
  completions: list[Completion]
  rewards: list[float]
  answer: str | None = None
  reward_terms: list[dict[str, float]] = dataclasses.field(default_factory=list)


class MissingLogprobs(ValueError):
  """A response without a behaviour logprob for every token, and why.

  Attributes:
    nonfinite: the backend sent null where a logprob should be, which is how
      a server writes a NaN or infinite one: the weights that sampled the
      response have non-finite logits.
    versions: the weight versions that sampled the tokens lacking one.
  """

  def __init__(self, message: str, *, nonfinite: bool = False, versions: Sequence[str] = ()):
    super().__init__(message)
    self.nonfinite, self.versions = nonfinite, list(versions)


def missing_logprobs(key: str, completion: Completion) -> MissingLogprobs | None:
  """Why `completion` lacks behaviour logprobs (None if it has them all)."""
  lps, n = completion.logprobs, len(completion.output_ids)
  where = f"group {key}: response {completion.rid}"
  if not lps:
    return MissingLogprobs(
      f"{where} lacks behaviour logprobs: its request did not ask for them"
      " (return_logprob) or the backend sent no output_token_logprobs"
    )
  if len(lps) != n:
    return MissingLogprobs(f"{where} lacks behaviour logprobs: {len(lps)} for {n} tokens")
  nulls = [i for i, lp in enumerate(lps) if lp is None or not math.isfinite(lp)]
  if not nulls:
    return None
  per_token = completion.versions()
  versions = sorted({per_token[i] for i in nulls})
  return MissingLogprobs(
    f"{where} lacks a finite behaviour logprob for {len(nulls)} of its"
    f" {n} tokens (first at token {nulls[0]}) under weight version(s)"
    f" {', '.join(versions)}: a null logprob is a NaN or infinite one, so those"
    " weights have non-finite logits",
    nonfinite=True,
    versions=versions,
  )


def group_sequences(
  group: Group, *, std_normalize: bool = True, agg_mode: str = "token-mean", eps: float = 1e-6
) -> list[TrainSequence]:
  """The group's responses as trainer sequences.

  Each sequence is the prompt's tokens and M-RoPE positions continued by the response,
  loss weights on the response tokens only (in the `agg_mode` aggregation), the
  group-normalized advantage on every response token, and the behaviour logprobs aligned
  with the tokens they score. A response continued across rounds (a partial rollout)
  carries each token's own behaviour logprob, so the importance weight of every token is
  taken against the policy version that sampled it; the per-token versions
  (`Completion.versions`) feed the staleness.
  """
  if len(group.completions) != len(group.rewards):
    raise ValueError(
      f"group {group.key}: {len(group.completions)} completions but {len(group.rewards)} rewards"
    )
  advantages = adv_lib.grpo_advantages_GR(
    np.asarray(group.rewards, np.float32)[None], std_normalize=std_normalize, eps=eps
  )[0]
  prompt_len = len(group.prompt)
  out = []
  for completion, advantage in zip(group.completions, advantages):
    if not completion.output_ids:
      raise ValueError(f"group {group.key}: empty response {completion.rid}")
    missing = missing_logprobs(group.key, completion)
    if missing is not None:
      raise missing
    seq = group.prompt.extend(completion.output_ids)
    response = np.zeros(len(seq), np.float32)
    response[prompt_len:] = 1.0
    behaviour = np.zeros(len(seq), np.float32)
    behaviour[prompt_len:] = np.asarray(completion.logprobs, np.float32)
    out.append(
      TrainSequence(
        inputs=seq,
        loss_mask_T=adv_lib.aggregation_weights(response, agg_mode),
        advantages_T=adv_lib.token_advantages(float(advantage), response),
        old_logprobs_T=behaviour,
      )
    )
  return out
