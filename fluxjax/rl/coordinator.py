"""The coordinator: GRPO steps from prompts to applied updates, rollout running ahead.

  prompts (ShadowLoader: metadata; workers decode media ahead)
    -> producer thread (rl/producer.py): tail-batched rounds on the rollout
       backend, admitted within the allowed lag, each response scored in the
       reward pool as it finishes, each kept group queued when complete
    -> stream trainer (rl/stream_trainer.py): GRPO sequences of finished
       groups planned (lengths only), materialized and accumulated while
       rollout continues; one update when the batch is complete
    -> weights published to the rollout backend (in process or the fleet);
       the new version opens admission for the rounds it allows.

Every token carries the policy version that sampled it. After each step the
staleness of the batch (version gap, KL(behaviour || current), importance
weight variance, measured in the step) feeds the admission controller, which
in `adaptive` mode moves the allowed lag with a PID (rl/async_control.py).
`coordinator.lag.mode = sync` makes rollout wait for each update, so every
sample is on-policy (importance weights 1 up to engine numerics).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import os
import queue
import time
import uuid
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging

from fluxjax.data import materializer as materializer_lib
from fluxjax.data import meta as meta_lib
from fluxjax.models import inputs
from fluxjax.models.config import ModelConfig
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rl import advantages as adv_lib
from fluxjax.rl import async_control, losses, producer as producer_lib, rewards, tail_batching
from fluxjax.rl import trajectories
from fluxjax.rl.stream_trainer import StreamTrainer
from fluxjax.rollout import publish
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel.strategies import Strategy


def sampling_seed(run_seed: int, uid: int, index: int) -> int:
  """The seed of response `index` to the sample at stream position `uid`.

  Derived, not drawn: the engine samples a seeded request's tokens the same
  whatever shares its batch, so which requests reach it first (thread timing)
  cannot change a run's samples, and a retried request repeats its response.
  """
  digest = hashlib.blake2b(f"{run_seed}:{uid}:{index}".encode(), digest_size=4).digest()
  return int.from_bytes(digest, "little") >> 1  # SGLang takes a non-negative int32


@dataclasses.dataclass
class StepResult:
  groups: list[trajectories.Group]
  metrics: dict  # host floats
  trained: list[str]  # sample ids trained this step, in order


class Coordinator:
  """Owns the per-step flow; the run loop (rl/loop.py) owns the schedule."""

  def __init__(self, config, model_cfg: ModelConfig, tokenizer: Tokenizer, mesh,
               strategy: Strategy, graphdef, state, state_shardings, tx, loader, rollout,
               reward_scheduler: rewards.RewardScheduler, *, publish_root: str | None = None):
    self.config = config
    self.cfg = model_cfg
    self.tokenizer = tokenizer
    self.mesh = mesh
    self.strategy = strategy
    self.graphdef = graphdef
    self.loader = loader
    self.rollout = rollout
    self.rewards = reward_scheduler
    self.publish_root = publish_root
    self.patch_source = materializer_lib.Materializer(loader.store, loader.pool)
    self.trainer = StreamTrainer(model_cfg, mesh, strategy, graphdef, state, state_shardings,
                                 tx, losses.make_loss_fn(config.rl),
                                 patch_source=self.patch_source)
    self.version = 0  # weight version published to rollout
    self.steps = 0    # RL updates applied
    rl = config.rl
    self.P, self.R = int(rl.prompts_per_step), int(rl.responses_per_prompt)
    batcher = tail_batching.TailBatcher(self.P, self.R,
                                        float(config.rollout.tail_batching.eta))
    batcher.start_epoch([])  # a streamed epoch: topped up from the loader
    admission = async_control.AdmissionController.from_config(config.coordinator.lag, self.P)
    self.producer = producer_lib.Producer(
        rollout, reward_scheduler, batcher, admission, next_samples=loader.next_batch,
        make_body=lambda sample, prompt, j: self.request(sample, prompt, index=j),
        prompt_fn=self.prompt, release=loader.release,
        max_prompt_tokens=int(config.rollout.context_length) - int(rl.max_new_tokens))
    # Trained sample uids of the (streamed) epoch, for exactly-once on resume.
    self.consumed: set[int] = set()
    self.filtered = 0
    self._started = False
    # Every backend call runs on the rollout thread's loop (a fleet's HTTP
    # session belongs to one loop); rounds start only with `start()`.
    self.producer.start_loop()
    if hasattr(rollout, "check_health"):  # a Fleet: open its session there
      self.producer.call(rollout.start())

  @property
  def state(self):
    return self.trainer.state

  @state.setter
  def state(self, value):
    self.trainer.state = value

  # -- rollout ---------------------------------------------------------------
  def prompt(self, sample: meta_lib.SampleMeta) -> inputs.SequenceInputs:
    return inputs.sequence_from_chat(sample.messages(), list(sample.media), self.tokenizer,
                                     self.cfg)

  def request(self, sample: meta_lib.SampleMeta, prompt: inputs.SequenceInputs, *,
              index: int = 0, greedy: bool = False) -> dict:
    """The /generate body for response `index` of `sample`."""
    rl = self.config.rl
    params = {"max_new_tokens": int(rl.max_new_tokens),
              "temperature": 0.0 if greedy else float(rl.temperature),
              "stop_token_ids": list(self.tokenizer.eos_ids)}
    if self.config.rollout.seeded:
      params["sampling_seed"] = sampling_seed(int(self.config.seed), sample.uid, index)
    return {
        "rid": uuid.uuid4().hex,
        "input_ids": prompt.tokens_T.tolist(),
        "image_data": [m.path for m in sample.media if m.kind == "image"] or None,
        "video_data": [m.path for m in sample.media if m.kind == "video"] or None,
        "sampling_params": params,
        "return_logprob": True,
    }

  async def rollout_groups(self, samples: Sequence[meta_lib.SampleMeta], responses: int,
                           *, greedy: bool = False) -> list[trajectories.Group]:
    """R responses per prompt, scored as each finishes (evaluation; no admission)."""
    prompts = [self.prompt(s) for s in samples]

    async def respond_and_score(sample, prompt, j):
      completion = await self.rollout.generate(
          self.request(sample, prompt, index=j, greedy=greedy), sample.id)
      scored = await asyncio.wrap_future(
          self.rewards.submit(completion.text, sample.answer or "", key=sample.id))
      return completion, scored.reward

    done = await asyncio.gather(*(asyncio.gather(*(respond_and_score(s, p, j)
                                                   for j in range(responses)))
                                  for s, p in zip(samples, prompts)))
    return [trajectories.Group(s.id, p, [c for c, _ in d], [r for _, r in d], s.answer)
            for s, p, d in zip(samples, prompts, done)]

  def start(self) -> None:
    """Starts rollout (after any restore)."""
    if not self._started:
      self.producer.set_version(self.version, self.steps)
      self.producer.start()
      self._started = True

  # -- training --------------------------------------------------------------
  def sequences(self, groups: Sequence[trajectories.Group]) -> list[batch_lib.TrainSequence]:
    rl = self.config.rl
    out = []
    for g in groups:
      out.extend(trajectories.group_sequences(g, std_normalize=rl.adv_std_normalize,
                                              agg_mode=rl.loss_agg_mode))
    return out

  def _next_item(self):
    while True:
      try:
        return self.producer.out.get(timeout=5.0)
      except queue.Empty:
        if not self.producer.alive:
          raise RuntimeError("the rollout thread died") from None

  def step(self) -> StepResult:
    """One GRPO step: consume P groups as they finish, update once, publish.

    Raises:
      StopIteration: the data is exhausted and nothing is left to train.
    """
    self.start()
    rl = self.config.rl
    chunk = max(1, int(self.config.coordinator.get("stream_groups", 0)) or math.ceil(self.P / 2))
    refills_left = int(rl.max_refill_rounds) * self.P if rl.dynamic_sampling else 0
    t0 = time.perf_counter()
    kept: list[producer_lib.KeptGroup] = []
    pending: list[producer_lib.KeptGroup] = []
    rounds: list[dict] = []
    unrefilled = filtered = 0
    while len(kept) + unrefilled < self.P:
      item = self._next_item()
      if isinstance(item, StopIteration):
        if kept or pending:
          break
        raise StopIteration
      if isinstance(item, BaseException):
        raise RuntimeError("rollout failed") from item
      if isinstance(item, producer_lib.RoundEnd):
        rounds.append(item.stats)
        continue
      if rl.dynamic_sampling and adv_lib.is_degenerate_group(item.group.rewards):
        # DAPO: a group whose rewards are all equal has no gradient; drop it
        # and let one more prompt through admission while the budget lasts.
        filtered += 1
        self.consumed.add(item.sample.uid)
        self._done_with([item])
        if refills_left > 0:
          refills_left -= 1
          self.producer.give_back(1)
        else:
          unrefilled += 1
        continue
      kept.append(item)
      pending.append(item)
      if len(pending) >= chunk:
        self.trainer.add(self.sequences([k.group for k in pending]))
        pending = []
    if pending:
      self.trainer.add(self.sequences([k.group for k in pending]))
    t_rollout = time.perf_counter() - t0
    if not kept:
      raise RuntimeError("dynamic sampling filtered every group of the step; "
                         "raise rl.max_refill_rounds")
    gaps = self._version_gaps(kept)
    device_metrics = self.trainer.apply()
    self.steps += 1
    train = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    t_publish = self.publish()
    self.consumed.update(k.sample.uid for k in kept)
    self._done_with(kept)
    self.patch_source.release()
    self.filtered += filtered

    iw_var = max(train.get("is_weight_sq", 1.0) - train.get("is_weight", 1.0) ** 2, 0.0)
    stale = async_control.combine_staleness(gaps["mean"], gaps["max"],
                                            train.get("behaviour_kl", 0.0), iw_var)
    lag = self.producer.call(self._observe(stale["staleness"]))
    groups = [k.group for k in kept]
    all_rewards = [r for g in groups for r in g.rewards]
    lengths = [len(c.output_ids) for g in groups for c in g.completions]
    elapsed = time.perf_counter() - t0
    host = {"rollout/reward_mean": float(np.mean(all_rewards)),
            "rollout/accuracy": float(np.mean([r >= 1.0 for r in all_rewards])),
            "rollout/response_len_mean": float(np.mean(lengths)),
            "rollout/response_len_max": float(np.max(lengths)),
            "rollout/wait_seconds": t_rollout, "rollout/rounds": float(len(rounds)),
            "rollout/filtered_groups": float(filtered),
            "perf/step_seconds": elapsed,
            "perf/tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
            "publish/seconds": t_publish, "policy/version": float(self.version),
            "async/allowed_lag": float(lag), **{f"async/{k}": v for k, v in stale.items()},
            **{f"train/{k}": v for k, v in train.items()}}
    if rounds:
      host["rollout/round_seconds"] = float(np.mean([r["wall_s"] for r in rounds]))
      host["rollout/long_rounds"] = float(sum(r["kind"] == "long" for r in rounds))
      for key in ("aborted", "deferred", "tokens_discarded"):
        host[f"rollout/{key}"] = float(sum(r.get(key, 0) for r in rounds))
      idle = [r["slot_idle_fraction"] for r in rounds if "slot_idle_fraction" in r]
      if idle:
        host["rollout/slot_idle_fraction"] = float(np.mean(idle))
    host.update(self.fault_counts())
    return StepResult(groups, host, [k.sample.id for k in kept])

  async def _observe(self, staleness: float) -> int:
    return self.producer.admission.observe(staleness)

  def _version_gaps(self, kept) -> dict:
    """Version gap of every trained token against the version being updated."""
    tags = [async_control.parse_version(v)
            for k in kept for c in k.group.completions
            for v in c.token_versions(default=str(k.launch_version))]
    return async_control.version_gap(np.asarray(tags), self.version)

  def _done_with(self, kept) -> None:
    self.loader.release([k.sample for k in kept])
    self.producer.done_with([k.sample.uid for k in kept])

  def fault_counts(self) -> dict:
    """Counted events of the run so far (faults, skips, reward failures)."""
    out = {k: float(v) for k, v in self.producer.counts.items()}
    out["rollout/filtered_groups_total"] = float(self.filtered)
    out.update(self.rewards.metrics())
    if hasattr(self.rollout, "metrics"):  # a fleet: retries, servers down
      out.update(self.rollout.metrics())
    return out

  def publish(self, new_version: bool = True) -> float:
    """Hands the weights to the rollout backend; returns seconds taken.

    `new_version=False` re-publishes the current version (after a resume).
    """
    from flax import nnx
    self.version += int(new_version)
    # The engine gets its own buffers: the next update donates the trainer's,
    # while rollout goes on sampling from these.
    params = jax.tree.map(lambda x: x.copy(), self.trainer.state.params)
    model = nnx.merge(self.graphdef, params)
    t = time.perf_counter()
    if hasattr(self.rollout, "update_params"):  # in process: arrays handed over
      publish.publish_in_process([self.rollout], model, self.version)
    else:  # a fleet: versioned HF folder, pause -> update -> resume
      root = self.publish_root or os.path.join("/tmp", "fluxjax_weights")
      report = self.producer.call(publish.publish_to_fleet(self.rollout, model, root,
                                                           self.version))
      if report.failed:
        logging.warning("weight update failed on %s", report.failed)
    self.producer.set_version(self.version, self.steps)
    return time.perf_counter() - t

  def evaluate(self, samples: Sequence[meta_lib.SampleMeta]) -> float:
    """Held-out accuracy: one greedy response per prompt, scored by `accuracy`."""
    groups = self.producer.call(self.rollout_groups(samples, 1, greedy=True))
    scores = [rewards.get("accuracy")(g.completions[0].text, g.answer or "") for g in groups]
    logging.info("eval: %s", [(g.completions[0].text[:40], g.answer) for g in groups[:3]])
    return float(np.mean(scores)) if scores else 0.0

  # -- checkpointed state ----------------------------------------------------
  def get_state(self) -> tuple[dict, dict]:
    """(coordinator state, data state) for a checkpoint taken between steps."""
    snap = self.producer.snapshot(self.loader.get_state, self.consumed)
    data = snap.pop("loader")
    return {"version": self.version, "steps": self.steps, "filtered": self.filtered,
            **snap}, data

  def set_state(self, state: dict, data: dict) -> None:
    """Restores `get_state()` (before `start`)."""
    self.version = int(state["version"])
    self.steps = int(state.get("steps", 0))
    self.filtered = int(state.get("filtered", 0))
    self.loader.set_state(data)
    if "batcher" in state:
      self.producer.restore(state, self.steps)
      self.consumed = set(int(u) for u in state["batcher"]["trained"])

  def close(self) -> None:
    """Stops rollout (the producer, then a fleet's session)."""
    if hasattr(self.rollout, "check_health"):
      try:
        self.producer.call(self.rollout.close(), timeout=30)
      except Exception:  # noqa: BLE001 - closing after a failure
        logging.exception("closing the fleet")
    self.producer.stop()
