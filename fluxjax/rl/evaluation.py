"""Held-out evaluation: the rollout policy's responses to held-out prompts, scored.

`Evaluator.evaluate` samples responses per held-out prompt at the training temperature
(and, with `eval.greedy`, one greedy each) outside the training stream, and scores them
in the reward pool; `summarize` turns the scores into metrics. The metrics are listed in
docs/metrics.md, "Evaluation metrics"; how a response is scored in docs/rewards.md,
"Evaluation".
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Sequence

import numpy as np

from fluxjax import settings as settings_lib
from fluxjax.data import meta as meta_lib
from fluxjax.rl import reward_fns, reward_pool, reward_spec, sft
from fluxjax.rl.requests import Requests
from fluxjax.rollout.backend import LoopThread, Sampler
from fluxjax.rollout.protocol import Completion

log = logging.getLogger(__name__)

Z95 = 1.959964  # two-sided 95% normal quantile
# Upper ends (tokens) of the reference-response length bands; longer is the last band.
LENGTH_BANDS = (16, 32, 48)


class Evaluator:
  """Held-out metrics of the rollout policy (docs/metrics.md, "Evaluation metrics").

  Sampling reads whatever version rollout serves: the caller settles a
  deferred publish first (`Coordinator.evaluate`).

  Args:
    settings: the run's settings (`eval`, `rl.reward`).
    requests: prompts and requests, as training asks them.
    rollout: the backend, open on `thread`'s loop.
    rewards: the reward pool.
    thread: the rollout thread's loop; every backend call runs on it.
  """

  def __init__(
    self,
    settings: settings_lib.Settings,
    requests: Requests,
    rollout: Sampler,
    rewards: reward_pool.RewardScheduler,
    thread: LoopThread,
  ):
    self._eval = settings.eval
    self._threshold = settings.rl.reward.correct_threshold
    self._requests = requests
    self._rollout = rollout
    self._rewards = rewards
    self._thread = thread
    # Evaluation's reward when it is not the run's (None: the pool's own).
    spec = reward_spec.evaluation(settings.rl.reward.fn, settings.eval.reward)
    self._reward = None if spec == settings.rl.reward.fn else reward_spec.parse(spec)

  def evaluate(self, samples: Sequence[meta_lib.SampleMeta]) -> dict[str, float]:
    """`summarize` of the samples that fit the prompt budget, how many did not,
    and the seconds it took."""
    t0 = time.perf_counter()
    samples, skipped = self._within_budget(samples)
    sampled = self.sample(samples, self._eval.samples_per_prompt)
    scores = self._correct(samples, sampled)
    reasoning = [[reward_fns.reasons(c.text) for c in cs] for cs in sampled]
    greedy = greedy_reasoning = None
    if self._eval.greedy:
      firsts = self.sample(samples, 1, greedy=True)
      greedy = [s[0] for s in self._correct(samples, firsts)]
      greedy_reasoning = [reward_fns.reasons(cs[0].text) for cs in firsts]
    log.debug("eval: %s", [(cs[0].text[:40], s.answer) for s, cs in zip(samples[:3], sampled)])
    tok = self._requests.tokenizer
    bands = [length_band(len(sft.answer_ids(tok, s.answer or "", s.solution))) for s in samples]
    out = summarize(
      scores,
      [s.difficulty for s in samples],
      greedy,
      [s.task for s in samples],
      bands,
      reasoning,
      greedy_reasoning,
      [s.answer or "" for s in samples],
    )
    out["eval/skipped_too_long"] = float(skipped)
    out["eval/seconds"] = time.perf_counter() - t0
    return out

  def sample(
    self, samples: Sequence[meta_lib.SampleMeta], responses: int, *, greedy: bool = False
  ) -> list[list[Completion]]:
    """`responses` completions per sample, all requests at once (no admission, no rewards)."""
    return self._thread.call(self._responses(samples, responses, greedy))

  async def _responses(
    self, samples: Sequence[meta_lib.SampleMeta], responses: int, greedy: bool
  ) -> list[list[Completion]]:
    prompts = [self._requests.prompt(s) for s in samples]

    async def one(sample, prompt, j):
      request = self._requests.request(sample, prompt, index=j, greedy=greedy)
      return await self._rollout.generate(request, sample.id)

    done = await asyncio.gather(
      *(asyncio.gather(*(one(s, p, j) for j in range(responses))) for s, p in zip(samples, prompts))
    )
    return [list(d) for d in done]

  def _correct(
    self, samples: Sequence[meta_lib.SampleMeta], completions: Sequence[Sequence[Completion]]
  ) -> list[list[float]]:
    """Per prompt, 1.0 for each response whose evaluation reward is correct, else 0.0."""
    futures = [
      [
        self._rewards.submit(
          c.text,
          s.answer or "",
          fn=self._reward,
          key=s.id,
          context=reward_spec.RewardContext.of(s),
        )
        for c in cs
      ]
      for s, cs in zip(samples, completions, strict=True)
    ]
    return [[float(f.result().reward >= self._threshold) for f in fs] for fs in futures]

  def _within_budget(
    self, samples: Sequence[meta_lib.SampleMeta]
  ) -> tuple[list[meta_lib.SampleMeta], int]:
    """(the held-out samples whose prompts fit the prompt budget, how many did
    not); the backend would refuse those, as in training."""
    budget = self._requests.prompt_budget
    fits = [s for s in samples if len(self._requests.prompt(s)) <= budget]
    skipped = len(samples) - len(fits)
    if skipped:
      log.warning(
        "evaluation skips %d of %d held-out prompts longer than %d tokens "
        "(config_rules.prompt_budget)",
        skipped,
        len(samples),
        budget,
      )
    if not fits:
      raise ValueError(
        f"every one of the {len(samples)} held-out prompts is longer than {budget} tokens "
        "(the rollout context or the trainer's longest sequence, less rl.max_new_tokens; "
        "config_rules.prompt_budget); raise --config.rollout.context_length or "
        "--config.sharding.capacity, or use shorter evaluation data"
      )
    return fits, skipped


def length_band(tokens: int) -> str:
  """The band label of a reference response of `tokens` tokens: "00-16" ... "49+"."""
  lo = 0
  for hi in LENGTH_BANDS:
    if tokens <= hi:
      return f"{lo:02d}-{hi}"
    lo = hi + 1
  return f"{lo}+"


def pass_at_k(n: int, c: int, k: int) -> float:
  """P(at least one of k draws without replacement is correct), c of n correct."""
  if not 0 < k <= n:
    raise ValueError(f"pass@k needs 0 < k <= n, got k={k}, n={n}")
  if n - c < k:
    return 1.0
  return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
  """(mean, 95% half-interval) of independent values; 0 half-width for fewer than two."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    raise ValueError("no values")
  if x.size < 2:
    return float(x.mean()), 0.0
  return float(x.mean()), float(Z95 * x.std(ddof=1) / math.sqrt(x.size))


def summarize(
  scores: Sequence[Sequence[float]],
  difficulties: Sequence[str] | None = None,
  greedy: Sequence[float] | None = None,
  tasks: Sequence[str] | None = None,
  bands: Sequence[str] | None = None,
  reasoning: Sequence[Sequence[bool]] | None = None,
  greedy_reasoning: Sequence[bool] | None = None,
  answers: Sequence[str] | None = None,
) -> dict[str, float]:
  """Metrics of one evaluation (docs/metrics.md, "Evaluation metrics").

  Args:
    scores: per prompt, the scores of its sampled responses (same count each).
    difficulties: per prompt, its difficulty label ("" = none); prompts
      without one are left out of the breakdown.
    greedy: per prompt, the score of its greedy response, or None.
    tasks: per prompt, its task name ("" = none), for a per-task breakdown.
    bands: per prompt, its reference length band ("" = none).
    reasoning: per prompt, whether each sampled response reasons first.
    greedy_reasoning: per prompt, whether its greedy response does.
    answers: per prompt, its reference answer, for each task's answer prior.
  """
  if not scores:
    raise ValueError("nothing was evaluated")
  n = len(scores[0])
  if n == 0 or any(len(s) != n for s in scores):
    raise ValueError("every prompt needs the same, non-zero number of samples")
  per_prompt = [float(np.mean(s)) for s in scores]
  accuracy, ci = mean_ci95(per_prompt)
  correct = [sum(1 for x in s if x >= 1.0) for s in scores]
  out = {
    "eval/accuracy": accuracy,
    "eval/accuracy_ci95": ci,
    f"eval/pass@{n}": float(np.mean([pass_at_k(n, c, n) for c in correct])),
    "eval/prompts": float(len(scores)),
    "eval/samples": float(len(scores) * n),
  }
  if greedy is not None:
    if len(greedy) != len(scores):
      raise ValueError(f"{len(greedy)} greedy scores for {len(scores)} prompts")
    out["eval/accuracy_greedy"] = float(np.mean(greedy))
  for labels in (difficulties, tasks, bands, answers, reasoning, greedy_reasoning):
    if labels is not None and len(labels) != len(scores):
      raise ValueError(f"{len(labels)} labels for {len(scores)} prompts")
  out.update(_by_label("eval/accuracy/", difficulties, per_prompt))
  out.update(_by_label("eval/task/", tasks, per_prompt))
  out.update(_by_label("eval/band/", bands, per_prompt))
  if tasks is not None and difficulties is not None:
    both = [f"{t}@{d}" if t and d else "" for t, d in zip(tasks, difficulties, strict=True)]
    out.update(_by_label("eval/task_level/", both, per_prompt))
  if tasks is not None and greedy is not None:
    out.update(_by_label("eval/task_greedy/", tasks, [float(g) for g in greedy]))
  if tasks is not None and answers is not None:
    out.update(answer_priors(tasks, answers))
  if reasoning is not None:
    out.update(_reasoning_shares(reasoning, difficulties))
  if greedy_reasoning is not None:
    out["eval/reasoning_share_greedy"] = float(np.mean(greedy_reasoning))
  return out


def _by_label(prefix: str, labels: Sequence[str] | None, values: Sequence[float]) -> dict:
  """prefix + label: the mean of `values` over the prompts with that label ("" = none)."""
  if labels is None:
    return {}
  return {
    prefix + label: float(np.mean([v for v, x in zip(values, labels, strict=True) if x == label]))
    for label in sorted({x for x in labels if x})
  }


def answer_priors(tasks: Sequence[str], answers: Sequence[str]) -> dict[str, float]:
  """eval/prior/<task>: the share of the task's prompts whose answer is its
  most common one, what always giving one answer would score at best."""
  out = {}
  for task in sorted({t for t in tasks if t}):
    counts = collections.Counter(a for t, a in zip(tasks, answers, strict=True) if t == task)
    out[f"eval/prior/{task}"] = max(counts.values()) / sum(counts.values())
  return out


def _reasoning_shares(
  reasoning: Sequence[Sequence[bool]], difficulties: Sequence[str] | None
) -> dict[str, float]:
  share = [float(np.mean(r)) for r in reasoning]
  out = {"eval/reasoning_share": float(np.mean(share))}
  out.update(_by_label("eval/reasoning_share/", difficulties, share))
  return out
