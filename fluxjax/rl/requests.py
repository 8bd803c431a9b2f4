"""What rollout is asked for a sample: its prompt and the request of each response.

The producer (rl/producer.py) asks through a `RequestSource`; the run's is
`Requests`, which evaluation (rl/evaluation.py) shares, so both sample alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Protocol

from fluxjax import settings as settings_lib
from fluxjax.data import meta as meta_lib
from fluxjax.models import inputs
from fluxjax.models.config import ModelConfig
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel.strategies import Strategy
from fluxjax.rl import config_rules
from fluxjax.rollout.protocol import GenerateRequest


def sampling_seed(run_seed: int, uid: int, index: int) -> int:
  """The seed of response `index` to the sample at stream position `uid`.

  Derived, not drawn: the engine samples a seeded request's tokens the same
  whatever shares its batch, so which requests reach it first (thread timing)
  cannot change a run's samples, and a retried request repeats its response.
  """
  digest = hashlib.blake2b(f"{run_seed}:{uid}:{index}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little") >> 1  # SGLang takes a non-negative int32


class RequestSource(Protocol):
  """What the producer needs to ask rollout for a sample's responses."""

  @property
  def prompt_budget(self) -> int:
    """Tokens a prompt may take; longer ones are skipped before rollout."""
    ...

  def prompt(self, sample: meta_lib.SampleMeta) -> inputs.SequenceInputs: ...

  def request(
    self,
    sample: meta_lib.SampleMeta,
    prompt: inputs.SequenceInputs,
    index: int = 0,
    greedy: bool = False,
  ) -> GenerateRequest:
    """The request for response `index` of `sample`."""
    ...

  def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
    """The text of token ids (a response continued from a partial one)."""
    ...


@dataclasses.dataclass(frozen=True)
class Requests:
  """The run's prompts and requests.

  Attributes:
    tokenizer: the run's tokenizer (chat template, stop tokens, decoding).
    cfg: the policy's model config (vision pads in the prompt).
    max_new_tokens: each response's budget (rl.max_new_tokens).
    temperature: the sampling temperature (rl.temperature).
    seed: the run's seed when requests are seeded (rollout.seeded), else None.
    prompt_budget: the longest prompt rollout takes (config_rules.prompt_budget).
  """

  tokenizer: Tokenizer
  cfg: ModelConfig
  max_new_tokens: int
  temperature: float
  seed: int | None
  prompt_budget: int

  @classmethod
  def of(
    cls, settings: settings_lib.Settings, tokenizer: Tokenizer, cfg: ModelConfig, strategy: Strategy
  ) -> Requests:
    rl = settings.rl
    return cls(
      tokenizer,
      cfg,
      rl.max_new_tokens,
      rl.temperature,
      settings.seed if settings.rollout.seeded else None,
      config_rules.prompt_budget(settings, strategy),
    )

  def prompt(self, sample: meta_lib.SampleMeta) -> inputs.SequenceInputs:
    return inputs.sequence_from_chat(
      sample.messages(), list(sample.media), self.tokenizer, self.cfg
    )

  def request(
    self,
    sample: meta_lib.SampleMeta,
    prompt: inputs.SequenceInputs,
    index: int = 0,
    greedy: bool = False,
  ) -> GenerateRequest:
    """The request for response `index` of `sample` (greedy: temperature 0)."""
    params = {
      "max_new_tokens": self.max_new_tokens,
      "temperature": 0.0 if greedy else self.temperature,
      "stop_token_ids": list(self.tokenizer.response_stop_ids),
    }
    if self.seed is not None:
      params["sampling_seed"] = sampling_seed(self.seed, sample.uid, index)
    return GenerateRequest.of(
      prompt.tokens_T.tolist(),
      params,
      image_data=[m.path for m in sample.media if m.kind == "image"],
      video_data=[m.path for m in sample.media if m.kind == "video"],
    )

  def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
