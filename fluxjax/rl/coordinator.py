"""The coordinator: one GRPO step from prompts to an applied update.

  prompts (ShadowLoader: metadata; workers decode media ahead)
    -> rollout: R responses per prompt, n=1 requests with behaviour logprobs
    -> rewards: scored in a process pool as responses arrive
    -> groups -> trainer sequences (GRPO advantages, aggregation weights)
    -> plan (strategy, lengths only) -> materialize (pixels from the store)
    -> jitted step -> new weights published to the rollout engines.

This first version runs rollout and training in lock-step (`coordinator.lag.mode
= sync`): tail batching and the adaptive lag controller (rl/tail_batching.py,
rl/async_control.py) plug in at `rollout_groups` and the admission of prompts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging

from fluxjax import train_step
from fluxjax.data import materializer as materializer_lib
from fluxjax.data import meta as meta_lib
from fluxjax.models import inputs
from fluxjax.models.config import ModelConfig
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rl import losses, rewards, trajectories
from fluxjax.rollout import publish
from fluxjax.sharding import batch as batch_lib
from fluxjax.sharding.strategies import Strategy

PATCH_BUCKETS = (256, 1024, 4096, 16384, 65536)


@dataclasses.dataclass
class StepResult:
  groups: list[trajectories.Group]
  metrics: dict  # device values for the train part; host floats for the rest


class Coordinator:
  """Owns the per-step flow; the run loop (train.py) owns the schedule."""

  def __init__(self, config, model_cfg: ModelConfig, tokenizer: Tokenizer, mesh,
               strategy: Strategy, graphdef, state, state_shardings, tx, loader, rollout,
               reward_scheduler: rewards.RewardScheduler):
    self.config = config
    self.cfg = model_cfg
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.strategy = strategy
    self.graphdef = graphdef
    self.state = state
    self.state_shardings = state_shardings
    self.tx = tx
    self.loader = loader
    self.rollout = rollout
    self.rewards = reward_scheduler
    self.loss_fn = losses.make_loss_fn(config.rl)
    self.patch_source = materializer_lib.Materializer(loader.store, loader.pool)
    self.version = 0
    self._steps = {}  # compiled steps by plan layout (flex levels change shapes)

  # -- rollout ---------------------------------------------------------------
  def prompt(self, sample: meta_lib.SampleMeta) -> inputs.SequenceInputs:
    return inputs.sequence_from_chat(sample.messages(), list(sample.media), self.tokenizer,
                                     self.cfg)

  def request(self, sample: meta_lib.SampleMeta, prompt: inputs.SequenceInputs, *,
              greedy: bool = False) -> dict:
    rl = self.config.rl
    return {
        "rid": uuid.uuid4().hex,
        "input_ids": prompt.tokens_T.tolist(),
        "image_data": [m.path for m in sample.media if m.kind == "image"] or None,
        "video_data": [m.path for m in sample.media if m.kind == "video"] or None,
        "sampling_params": {"max_new_tokens": int(rl.max_new_tokens),
                            "temperature": 0.0 if greedy else float(rl.temperature),
                            "stop_token_ids": list(self.tokenizer.eos_ids)},
        "return_logprob": True,
    }

  async def rollout_groups(self, samples: Sequence[meta_lib.SampleMeta], responses: int,
                           *, greedy: bool = False) -> list[trajectories.Group]:
    """R responses per prompt (one request each, so each can be aborted)."""
    prompts = [self.prompt(s) for s in samples]

    async def respond_and_score(sample, prompt):
      # Each response is scored as soon as it finishes, while others decode.
      completion = await self.rollout.generate(self.request(sample, prompt, greedy=greedy),
                                               sample.id)
      scored = await asyncio.wrap_future(
          self.rewards.submit(completion.text, sample.answer or "", key=sample.id))
      return completion, scored.reward

    tasks = [[asyncio.ensure_future(respond_and_score(s, p)) for _ in range(responses)]
             for s, p in zip(samples, prompts)]
    groups = []
    for sample, prompt, ts in zip(samples, prompts, tasks):
      done = await asyncio.gather(*ts)
      groups.append(trajectories.Group(sample.id, prompt, [c for c, _ in done],
                                       [r for _, r in done], sample.answer))
    return groups

  # -- training --------------------------------------------------------------
  def sequences(self, groups: Sequence[trajectories.Group]) -> list[batch_lib.TrainSequence]:
    rl = self.config.rl
    out = []
    for g in groups:
      out.extend(trajectories.group_sequences(g, std_normalize=rl.adv_std_normalize,
                                              agg_mode=rl.loss_agg_mode))
    return out

  def _step_fn(self, plan):
    key = (plan.level_layout(), plan.num_microbatches)
    if key not in self._steps:
      accumulate = self.strategy.accumulate_fn(self.mesh, plan, self.graphdef,
                                               self.state_shardings.params, self.loss_fn)
      self._steps[key] = train_step.make_train_step(
          self.graphdef, self.tx, state_shardings=self.state_shardings,
          accumulate_fn=accumulate)
    return self._steps[key]

  def train(self, seqs: Sequence[batch_lib.TrainSequence]) -> dict:
    plan = self.strategy.plan([len(s) for s in seqs], self.mesh.size)
    host = batch_lib.materialize(plan, seqs, self.cfg, PATCH_BUCKETS,
                                 patch_source=self.patch_source,
                                 balance_vision=self.strategy.balance_vision)
    step = self._step_fn(plan)
    with jax.set_mesh(self.mesh):
      self.state, metrics = step(self.state, batch_lib.to_device(host, self.mesh))
    return metrics

  def publish(self, new_version: bool = True) -> float:
    """Hands the weights to the in-process engine; returns seconds taken.

    `new_version=False` re-publishes the current version (after a resume).
    """
    from flax import nnx
    self.version += int(new_version)
    model = nnx.merge(self.graphdef, self.state.params)
    report = publish.publish_in_process([self.rollout], model, self.version)
    return sum(report.seconds.values())

  def step(self, samples: Sequence[meta_lib.SampleMeta]) -> StepResult:
    """One synchronous GRPO step."""
    t0 = time.perf_counter()
    groups = asyncio.run(self.rollout_groups(samples, self.config.rl.responses_per_prompt))
    t_rollout = time.perf_counter() - t0
    seqs = self.sequences(groups)
    device_metrics = self.train(seqs)
    t_publish = self.publish()
    self.patch_source.release()
    all_rewards = [r for g in groups for r in g.rewards]
    lengths = [len(c.output_ids) for g in groups for c in g.completions]
    tokens = sum(lengths)
    elapsed = time.perf_counter() - t0
    host = {"rollout/reward_mean": float(np.mean(all_rewards)),
            "rollout/response_len_mean": float(np.mean(lengths)),
            "rollout/seconds": t_rollout, "perf/step_seconds": elapsed,
            "perf/tokens_per_s": tokens / max(elapsed, 1e-9),
            "publish/seconds": t_publish, "policy/version": float(self.version)}
    return StepResult(groups, {"device": device_metrics, "host": host})

  def evaluate(self, samples: Sequence[meta_lib.SampleMeta]) -> float:
    """Held-out accuracy: one greedy response per prompt, scored by `accuracy`."""
    groups = asyncio.run(self.rollout_groups(samples, 1, greedy=True))
    scores = [rewards.get("accuracy")(g.completions[0].text, g.answer or "") for g in groups]
    logging.info("eval: %s", [(g.completions[0].text[:40], g.answer) for g in groups[:3]])
    return float(np.mean(scores)) if scores else 0.0
