"""The coordinator: GRPO steps from prompts to applied updates, rollout running ahead.

  prompts (ShadowLoader: metadata; workers decode media ahead)
    -> producer thread (rl/producer.py): tail-batched rounds on the rollout
       backend, admitted within the allowed lag, each response scored in the
       reward pool as it finishes, each kept group queued when complete
    -> stream trainer (parallel/stream_trainer.py): GRPO sequences of finished
       groups planned (lengths only), materialized and accumulated while
       rollout continues; one update when the batch is complete
    -> weights published to the rollout backend (in process or the fleet);
       the new version opens admission for the rounds it allows.

The coordinator's collaborators are passed in, built and closed by the run
loop (rl/loop.py): the policy worker that owns the train state and runs
every program on the training mesh (rl/worker.py; in a multi-controller run
a `LeaderWorker` that sends each op to the other processes first), the
rollout backend (`rollout.backend.RolloutBackend`, open on the rollout
thread's loop), the loader, the reward pool. The coordinator runs on the
leader only and decides; what others may do to it is its methods
(`restore`, `publish`, `start`, `step`, `close`); what they may read,
read-only properties.

Every token carries the policy version that sampled it. After each step the
staleness of the batch (version gap, KL(behaviour || current), importance
weight variance, measured in the step) feeds the admission controller, which
in `adaptive` mode moves an async ratio, and with it the allowed lag, by
small PID steps and forces sync barriers (rl/async_control.py).
`coordinator.lag.mode = sync` makes rollout wait for each update: every round
is admitted at the current version (docs/training-loop.md, "When training is on-policy").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import logging
import math
import queue
import time
from collections.abc import Sequence

import jax
import numpy as np

from fluxjax import faults as faults_lib
from fluxjax import settings as settings_lib
from fluxjax.data import meta as meta_lib
from fluxjax.models import inputs
from fluxjax.models.config import ModelConfig
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import train_step
from fluxjax.parallel.strategies import Strategy
from fluxjax.rl import advantages as adv_lib
from fluxjax.rl import (
  async_control,
  config_rules,
  evaluation,
  records,
  reward_fns,
  reward_pool,
  reward_spec,
  sft,
  step_metrics,
  tail_batching,
  trajectories,
)
from fluxjax.rl import producer as producer_lib
from fluxjax.rl.policy import Policy
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout.backend import LoopThread, RolloutBackend
from fluxjax.rollout.protocol import Completion, GenerateRequest
from fluxjax.rollout.publish import PublishReport

log = logging.getLogger(__name__)


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
  # One per trained response, with coordinator.response_records on.
  responses: list[records.ResponseRecord] = dataclasses.field(default_factory=list)


class Coordinator:
  """Owns the per-step flow; the run loop (rl/loop.py) owns the schedule.

  A context manager: leaving it stops rollout (`close`).

  Args:
    settings: the run's settings.
    tokenizer: the run's tokenizer (prompts, stop tokens).
    policy: the policy worker (rl/worker.py): the train state and the
      programs that change it.
    loader: the training data (a ShadowLoader).
    rollout: the backend, already started on `thread`'s loop.
    reward_scheduler: scores responses.
    thread: the rollout thread's loop; every backend call runs on it.
  """

  def __init__(
    self,
    settings: settings_lib.Settings,
    tokenizer: Tokenizer,
    policy: Policy,
    loader,
    rollout: RolloutBackend,
    reward_scheduler: reward_pool.RewardScheduler,
    *,
    thread: LoopThread,
  ):
    self._settings = settings
    self._tokenizer = tokenizer
    self._policy = policy
    self._loader = loader
    self._rollout = rollout
    self._rewards = reward_scheduler
    # Evaluation's reward when it is not the run's (None: the pool's own).
    ev_reward = reward_spec.evaluation(settings.rl.reward.fn, settings.eval.reward)
    self._eval_reward = None if ev_reward == settings.rl.reward.fn else reward_spec.parse(ev_reward)
    self._version = 0  # weight version published to rollout
    self._steps = 0  # RL steps taken
    self._updates = 0  # optimizer updates applied (the learning-rate schedule's count)
    self._lr = train_step.lr_schedule(settings.optim)
    # Every counted fault of the run (fluxjax/faults.py), checkpointed together.
    self.faults = faults_lib.Faults(settings.faults.limits())
    rl = settings.rl
    self._P, self._R = int(rl.prompts_per_step), int(rl.responses_per_prompt)
    tail = settings.rollout.tail_batching
    batcher = tail_batching.TailBatcher(
      self._P,
      self._R,
      float(tail.eta),
      recycle=bool(tail.recycle),
      continue_in=str(tail.continue_in),
    )
    batcher.start_epoch([])  # a streamed epoch: topped up from the loader
    admission = async_control.AdmissionController.from_config(
      settings.coordinator.lag, self._P, total_steps=int(settings.total_steps)
    )
    self._staleness_metric = async_control.StalenessMetric.from_config(settings.coordinator.lag)
    # The most versions a group may trail the policy it trains, queue time included.
    self._max_gap = admission.max_gap
    self._producer = producer_lib.Producer(
      rollout,
      reward_scheduler,
      batcher,
      admission,
      next_samples=loader.next_batch,
      make_request=lambda sample, prompt, j: self.request(sample, prompt, index=j),
      prompt_fn=self.prompt,
      decode=self._tokenizer.decode,
      release=loader.release,
      max_prompt_tokens=config_rules.prompt_budget(settings, policy.strategy),
      faults=self.faults,
      request_retries=int(settings.faults.request_retries),
      thread=thread,
    )
    # Trained sample uids of the (streamed) epoch, for exactly-once on resume.
    self._consumed: set[int] = set()
    self._filtered = 0
    self._nonfinite = train_step.NonFiniteGuard(self.faults.streak("nonfinite_steps"))
    # RL steps applied when each weight version was published, to name the step
    # whose update made a policy non-finite.
    self._version_steps: dict[str, int] = {}
    self._unwritten = self.faults.streak("unwritten_publishes")  # reached no server
    self._deferred: PublishReport | None = None  # a publish whose servers' part is pending
    self._started = False
    # Every backend call runs on the rollout thread's loop (a fleet's HTTP
    # session belongs to one loop); rounds start only with `start()`.
    self._producer.start_loop()

  # -- read-only views -------------------------------------------------------
  @property
  def policy(self) -> Policy:
    """The policy worker (every process runs its ops)."""
    return self._policy

  @property
  def cfg(self) -> ModelConfig:
    return self._policy.cfg

  @property
  def tokenizer(self) -> Tokenizer:
    return self._tokenizer

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._policy.mesh

  @property
  def strategy(self) -> Strategy:
    return self._policy.strategy

  @property
  def graphdef(self):
    return self._policy.graphdef

  @property
  def state(self) -> train_step.TrainState:
    """The policy's train state (each update donates it: read it again after one)."""
    return self._policy.state

  @property
  def state_shardings(self) -> train_step.TrainState:
    return self._policy.state_shardings

  @property
  def version(self) -> int:
    """The policy version last published to rollout."""
    return self._version

  @property
  def steps(self) -> int:
    """RL updates applied."""
    return self._steps

  # -- rollout ---------------------------------------------------------------
  def prompt(self, sample: meta_lib.SampleMeta) -> inputs.SequenceInputs:
    return inputs.sequence_from_chat(
      sample.messages(), list(sample.media), self._tokenizer, self.cfg
    )

  def request(
    self,
    sample: meta_lib.SampleMeta,
    prompt: inputs.SequenceInputs,
    *,
    index: int = 0,
    greedy: bool = False,
  ) -> GenerateRequest:
    """The request for response `index` of `sample`."""
    rl = self._settings.rl
    params = {
      "max_new_tokens": int(rl.max_new_tokens),
      "temperature": 0.0 if greedy else float(rl.temperature),
      "stop_token_ids": list(self._tokenizer.response_stop_ids),
    }
    if self._settings.rollout.seeded:
      params["sampling_seed"] = sampling_seed(int(self._settings.seed), sample.uid, index)
    return GenerateRequest.of(
      prompt.tokens_T.tolist(),
      params,
      image_data=[m.path for m in sample.media if m.kind == "image"],
      video_data=[m.path for m in sample.media if m.kind == "video"],
    )

  async def _responses(
    self, samples: Sequence[meta_lib.SampleMeta], responses: int, *, greedy: bool = False
  ) -> list[list[Completion]]:
    """`responses` completions per prompt, all requests at once (no admission, no rewards)."""
    prompts = [self.prompt(s) for s in samples]

    async def one(sample, prompt, j):
      return await self._rollout.generate(
        self.request(sample, prompt, index=j, greedy=greedy), sample.id
      )

    done = await asyncio.gather(
      *(asyncio.gather(*(one(s, p, j) for j in range(responses))) for s, p in zip(samples, prompts))
    )
    return [list(d) for d in done]

  def start(self) -> None:
    """Starts rollout (after any restore)."""
    if not self._started:
      self._producer.set_version(self._version, self._steps)
      self._producer.start()
      self._started = True

  # -- training --------------------------------------------------------------
  def sequences(self, groups: Sequence[trajectories.Group]) -> list[batch_lib.TrainSequence]:
    rl = self._settings.rl
    out = []
    for g in groups:
      try:
        seqs = trajectories.group_sequences(
          g, std_normalize=rl.adv_std_normalize, agg_mode=rl.loss_agg_mode, eps=rl.adv_eps
        )
      except trajectories.MissingLogprobs as e:
        if e.nonfinite:  # the symptom of a non-finite policy: name the step
          raise self._nonfinite_policy(e.versions[0], str(e)) from e
        raise
      out.extend(seqs)
    return out

  def _next_item(self):
    """The rollout thread's next output; meanwhile the items of a deferred
    publish are gathered as its consumer makes room (it wakes this wait)."""
    while True:
      feed = self._deferred.feed if self._deferred is not None else None
      if feed is not None:
        feed.pump(self._policy.announce_gathers)
      try:
        item = self._producer.out.get(timeout=5.0)
      except queue.Empty:
        if not self._producer.alive:
          raise RuntimeError("the rollout thread died") from None
        continue
      if item is not _FEED_TOOK:
        return item

  def step(self) -> StepResult:
    """One GRPO step: consume P groups as they finish, update once, publish.

    Raises:
      StopIteration: the data is exhausted and nothing is left to train.
    """
    self.start()
    t0 = time.perf_counter()
    kept, rounds, filtered, requeued = self._collect()
    t_rollout = time.perf_counter() - t0
    trained_gap, admitted_gap = self._version_gaps(kept)
    publish_wait = self._settle_reads_timed()  # the update donates what a publish reads
    device_metrics = self._policy.apply()
    self._steps += 1
    train = jax.device_get(device_metrics)
    per_sequence = train.pop(train_step.PER_SEQUENCE, None)
    train = {k: float(v) for k, v in train.items()}
    responses = [] if per_sequence is None else self._response_records(kept, per_sequence, train)
    # A refused (non-finite) update left the policy as it was: nothing new to
    # publish. Too many in a row raise here, before anything is checkpointed.
    self._nonfinite.observe(self._steps, train, [k.sample.id for k in kept])
    t_publish = 0.0
    if train.get("nonfinite", 0.0) < 1.0:  # some update of the step applied
      t_publish = self.publish()
    else:
      self.settle_publish()
      self._producer.set_version(self._version, self._steps)  # admission counts the step
    self._consumed.update(k.sample.uid for k in kept)
    self._done_with(kept)
    self._filtered += filtered

    # Var(w) = E[w^2] - E[w]^2 from the step's token means of the importance weights.
    iw_var = max(train.get("is_weight_sq", 1.0) - train.get("is_weight", 1.0) ** 2, 0.0)
    stale = async_control.combine_staleness(
      admitted_gap["mean"],
      admitted_gap["max"],
      train.get("behaviour_kl", 0.0),
      iw_var,
      self._staleness_metric,
    )
    control = self._producer.call(self._observe(stale["staleness"], self._steps))
    groups = [k.group for k in kept]
    lengths = [len(c.output_ids) for g in groups for c in g.completions]
    lr = float(self._lr(self._updates))
    self._updates += round(train.get("updates", 1.0) * (1.0 - train.get("nonfinite", 0.0)))
    elapsed = time.perf_counter() - t0
    host = {
      **step_metrics.batch_metrics(groups, self._settings),
      "optim/lr": lr,
      **step_metrics.device_memory_metrics(),
      "rollout/wait_seconds": t_rollout,
      "rollout/rounds": float(len(rounds)),
      "rollout/filtered_groups": float(filtered),
      "async/stale_requeued": float(requeued),
      "perf/step_seconds": elapsed,
      **step_metrics.throughput_metrics(groups, self.cfg, elapsed, train.get("updates", 1.0)),
      "perf/tokens_per_s": sum(lengths) / max(elapsed, 1e-9),
      "publish/seconds": t_publish,
      **publish_wait,
      "policy/version": float(self._version),
      **{f"async/{k}": v for k, v in stale.items()},
      "async/trained_gap": trained_gap["mean"],
      "async/trained_gap_max": trained_gap["max"],
      **{f"async/{k}": v for k, v in control.items()},
      **{f"train/{k}": v for k, v in train.items()},
    }
    host.update(step_metrics.round_metrics(rounds))
    host.update(self.fault_counts())
    return StepResult(groups, host, [k.sample.id for k in kept], responses)

  def _collect(self) -> tuple[list[producer_lib.KeptGroup], list[dict], int, int]:
    """(the step's P groups, streamed to the trainer as they arrive; its
    rounds' stats; groups DAPO filtered; stale groups sent back)."""
    rl = self._settings.rl
    chunk = max(1, int(self._settings.coordinator.stream_groups) or math.ceil(self._P / 2))
    refills_left = int(rl.max_refill_rounds) * self._P if rl.dynamic_sampling else 0
    kept: list[producer_lib.KeptGroup] = []
    pending: list[producer_lib.KeptGroup] = []
    rounds: list[dict] = []
    unrefilled = filtered = requeued = 0
    while len(kept) + unrefilled < self._P:
      item = self._next_item()
      if isinstance(item, StopIteration):
        if kept or pending:
          break
        raise StopIteration
      if isinstance(item, BaseException):
        version = engine_lib.nonfinite_logits_version(item)
        if version is not None:
          raise self._nonfinite_policy(version, "the engine refused to sample") from item
        raise RuntimeError("rollout failed") from item
      if isinstance(item, producer_lib.RoundEnd):
        rounds.append(item.stats)
        continue
      if self._version - item.launch_version > self._max_gap:
        # Queue time made it staler than admission allows: run it again.
        log.warning(
          "sample %s waited %d versions (more than %d) before training; generating it again",
          item.sample.id,
          self._version - item.launch_version,
          self._max_gap,
        )
        self._producer.requeue(item.sample.uid)
        requeued += 1
        continue
      if rl.dynamic_sampling and adv_lib.is_degenerate_group(item.group.rewards):
        # DAPO: a group whose rewards are all equal has no gradient; drop it
        # and let one more prompt through admission while the budget lasts.
        filtered += 1
        self._consumed.add(item.sample.uid)
        self._done_with([item])
        if refills_left > 0:
          refills_left -= 1
          self._producer.give_back(1)
        else:
          unrefilled += 1
        continue
      kept.append(item)
      pending.append(item)
      if len(pending) >= chunk:
        self._policy.add(self.sequences([k.group for k in pending]))
        pending = []
    if pending:
      self._policy.add(self.sequences([k.group for k in pending]))
    if not kept:
      raise RuntimeError(
        "dynamic sampling filtered every group of the step; raise rl.max_refill_rounds"
      )
    return kept, rounds, filtered, requeued

  def _response_records(self, kept, per_sequence, train) -> list[records.ResponseRecord]:
    rl = self._settings.rl
    normalizer = adv_lib.loss_normalizer(
      rl.loss_agg_mode, self._P * rl.responses_per_prompt, rl.max_new_tokens
    )
    return records.response_records(
      [k.group for k in kept],
      [k.launch_version for k in kept],
      per_sequence,
      normalizer or train["tokens"],
      self._version,
    )

  async def _observe(self, staleness: float, step: int) -> dict:
    return self._producer.admission.observe(staleness, step)

  def _version_gaps(self, kept) -> tuple[dict, dict]:
    """The version gap of every trained token against the version being
    updated: in full, and as admission sees it (`admission_gap`)."""
    tags, launches = [], []
    for k in kept:
      for c in k.group.completions:
        versions = async_control.token_versions(c, k.launch_version)
        tags += versions
        launches += [k.launch_version] * len(versions)
    trained = async_control.version_gap(np.asarray(tags), self._version)
    return trained, async_control.admission_gap(tags, launches, self._version)

  def _done_with(self, kept) -> None:
    self._loader.release([k.sample for k in kept])
    self._producer.done_with([k.sample.uid for k in kept])

  def fault_counts(self) -> dict:
    """Counted events of the run so far (faults, skips, reward failures, the backend's)."""
    out = {k: float(v) for k, v in self._producer.counts.items()}
    out["rollout/filtered_groups_total"] = float(self._filtered)
    out.update(self.faults.totals())
    out.update(self._rewards.metrics())
    out.update(self._rollout.metrics())
    return out

  def publish(self, new_version: bool = True) -> float:
    """Hands the weights to the rollout backend; returns seconds taken.

    `new_version=False` re-publishes the current version (the policy a run
    starts or resumes with).
    """
    from flax import nnx

    # An embedded engine gets its own buffers: the next update donates the
    # trainer's, while rollout goes on sampling from these. A fleet has read
    # the trainer's when the publish returns, or, deferred, still reads them:
    # this thread gathers a feed's items while it waits for rollouts
    # (`_next_item`), and the next update waits for the rest (`settle_reads`);
    # admission opens when the servers are done.
    t = time.perf_counter()
    self.settle_publish()
    params = self._policy.stage(self._version + int(new_version))
    if params is None:
      raise RuntimeError("the coordinator runs on the leader, which receives the staged weights")
    self._check_logits(params, self._version + int(new_version), new_version)
    self._version += int(new_version)
    self._version_steps[str(self._version)] = self._steps
    model = nnx.merge(self.graphdef, params)
    report = self._producer.call(self._rollout.publish(model, self._version))
    if report.pending is None:
      self._published(report)
      self._producer.set_version(self._version, self._steps)
    else:  # the servers load the written folder while training goes on
      if report.feed is not None:  # its consumer wakes the wait for rollouts
        report.feed.on_take = functools.partial(self._producer.out.put, _FEED_TOOK)
      version, steps = self._version, self._steps
      report.pending.add_done_callback(lambda _: self._producer.set_version(version, steps))
      self._deferred = report
    return time.perf_counter() - t

  def settle_reads(self) -> None:
    """Waits for a deferred publish that still reads the trainer's arrays
    (`PublishReport.reads_params`), which the next update donates: gathers
    the rest of a feed here, or waits for the whole publish."""
    self._gather_rest()
    deferred = self._deferred
    if deferred is not None and deferred.feed is None and deferred.reads_params:
      self.settle_publish()

  def _settle_reads_timed(self) -> dict[str, float]:
    """`settle_reads`, with how long it took (also the step's own gradient
    programs still running: the first gather's copy to the host queues
    behind them) and the share of a fed publish's gathers that ran while
    the step waited for rollouts anyway."""
    feed = self._deferred.feed if self._deferred is not None else None
    t = time.perf_counter()
    self.settle_reads()
    out = {"publish/update_wait_seconds": time.perf_counter() - t}
    if feed is not None:
      out["publish/overlapped_share"] = feed.pumped / max(feed.count, 1)
    return out

  def _gather_rest(self) -> None:
    """Gathers the items a fed publish has not had yet (none once all
    were); what is left to write or send then reads none of the trainer's
    arrays."""
    if self._deferred is not None and self._deferred.feed is not None:
      self._deferred.feed.finish(self._policy.announce_gathers)

  def settle_publish(self) -> None:
    """Waits for a deferred publish's servers to load it (see `publish`)."""
    self._gather_rest()
    deferred, self._deferred = self._deferred, None
    if deferred is not None and deferred.pending is not None:
      self._published(self._producer.call(_result(deferred.pending)))

  def _published(self, report: PublishReport) -> None:
    """What a publish reached: failures logged; too many unwritten raise."""
    if report.failed:
      log.warning("weight update %s failed on %s", report.version, report.failed)
    self._check_written(report)

  @staticmethod
  def _broken_by(steps: int | None, version: str) -> str:
    """Who made the policy of weight `version` non-finite (`steps`: RL steps it had)."""
    if steps is None:
      return f"weight version {version} is non-finite"
    if steps:
      return f"RL step {steps} made the policy non-finite"
    return "the policy the RL steps start from (initial, restored or warmed-up) is non-finite"

  def _check_logits(self, params, version: int, new_version: bool) -> None:
    """Refuses to publish a policy whose logits are non-finite.

    Every parameter is finite here (`apply_update` refuses the rest), but
    finite weights can still overflow the activations (weights of 1e8 after a
    huge step): one forward of a few tokens finds that before rollout samples
    from the policy and before the step is checkpointed.
    """
    if train_step.logits_finite(self.graphdef, params, train_step.probe_row(self.cfg)):
      return
    unsaved = (
      f" The run stops before checkpointing step {self._steps}: any checkpoint is of an"
      " earlier step."
      if new_version and self._steps
      else ""
    )
    raise train_step.NonFiniteError(
      f"{self._broken_by(self._steps, str(version))}: every parameter is finite but its"
      f" logits are not (NaN or infinite on a {train_step.PROBE_TOKENS}-token probe)."
      f" Weight version {version} was not published.{unsaved} Lower optim.lr or"
      " optim.max_grad_norm."
    )

  def _nonfinite_policy(self, version: str, symptom: str) -> train_step.NonFiniteError:
    """The error naming the step whose update gave weight `version` non-finite logits."""
    return train_step.NonFiniteError(
      f"{self._broken_by(self._version_steps.get(str(version)), version)}: rollout under"
      f" weight version {version} met non-finite logits ({symptom}). Checkpoints of that"
      " step or later, if any, hold those weights: resume from an earlier one with a lower"
      " optim.lr or optim.max_grad_norm."
    )

  def _check_written(self, report: PublishReport) -> None:
    """Counts publishes whose weights reached no server; too many in a row raise.

    The version still moves on: servers tag each token with the version they
    actually serve, so the staleness measures see the gap.
    """
    if report.path is not None or not report.failed:
      self._unwritten.ok()
      return
    if self._unwritten.fail():
      raise RuntimeError(
        f"{self._unwritten.in_a_row} weight publishes in a row reached no server"
        f" (last, version {report.version}: {report.failed[0]}); the fleet still serves"
        " an older policy. Free the disk under the run's weights folder and resume."
      )

  def sample(
    self, samples: Sequence[meta_lib.SampleMeta], responses: int, *, greedy: bool = False
  ) -> list[list[Completion]]:
    """`responses` completions per sample from the current rollout policy.

    Outside the training stream: no admission, no rewards, nothing trained.
    For evaluation, and for looking at a group by hand (notebooks/grpo.ipynb).
    """
    self.settle_publish()  # sampled from the latest version
    return self._producer.call(self._responses(samples, responses, greedy=greedy))

  def evaluate(self, samples: Sequence[meta_lib.SampleMeta]) -> dict[str, float]:
    """Held-out metrics of the rollout policy (rl/evaluation.py).

    `eval.samples_per_prompt` responses per prompt at the training temperature,
    and one greedy response each when `eval.greedy`, scored in the reward
    pool: correct (1) when the reward (`eval.reward`, else the run's) reaches
    rl.reward.correct_threshold. Prompts over the rollout's prompt budget are
    left out, counted in eval/skipped_too_long.
    """
    ev = self._settings.eval
    samples, skipped = self._within_budget(samples)
    sampled = self.sample(samples, int(ev.samples_per_prompt))
    scores = self._correct(samples, sampled)
    reasoning = [[reward_fns.reasons(c.text) for c in cs] for cs in sampled]
    greedy = greedy_reasoning = None
    if ev.greedy:
      firsts = self.sample(samples, 1, greedy=True)
      greedy = [s[0] for s in self._correct(samples, firsts)]
      greedy_reasoning = [reward_fns.reasons(cs[0].text) for cs in firsts]
    log.debug("eval: %s", [(cs[0].text[:40], s.answer) for s, cs in zip(samples[:3], sampled)])
    bands = [
      evaluation.length_band(len(sft.answer_ids(self._tokenizer, s.answer or "", s.solution)))
      for s in samples
    ]
    out = evaluation.summarize(
      scores,
      [s.difficulty for s in samples],
      greedy,
      [s.task for s in samples],
      bands,
      reasoning,
      greedy_reasoning,
    )
    out["eval/skipped_too_long"] = float(skipped)
    return out

  def _correct(
    self, samples: Sequence[meta_lib.SampleMeta], completions: Sequence[Sequence[Completion]]
  ) -> list[list[float]]:
    """Per prompt, 1.0 for each response whose evaluation reward is correct, else 0.0."""
    futures = [
      [
        self._rewards.submit(
          c.text,
          s.answer or "",
          fn=self._eval_reward,
          key=s.id,
          context=reward_spec.RewardContext.of(s),
        )
        for c in cs
      ]
      for s, cs in zip(samples, completions, strict=True)
    ]
    threshold = self._settings.rl.reward.correct_threshold
    return [[float(f.result().reward >= threshold) for f in fs] for fs in futures]

  def _within_budget(self, samples):
    """(the held-out samples whose prompts fit the prompt budget, how many did
    not); the backend would refuse those, as in training."""
    budget = config_rules.prompt_budget(self._settings, self.strategy)
    fits = [s for s in samples if len(self.prompt(s)) <= budget]
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

  # -- checkpointed state ----------------------------------------------------
  def get_state(self) -> tuple[dict, dict]:
    """(coordinator state, data state) for a checkpoint taken between steps."""
    snap = self._producer.snapshot(self._loader.get_state, self._consumed)
    data = snap.pop("loader")
    return {
      "version": self._version,
      "steps": self._steps,
      "updates": self._updates,
      "filtered": self._filtered,
      "faults": self.faults.get_state(),
      **snap,
    }, data

  def restore(self, state: dict, data: dict) -> None:
    """Resumes from a checkpoint (before `start`); the policy restored its train state.

    Args:
      state, data: what `get_state()` returned when the checkpoint was taken.
    """
    if self._started:
      raise RuntimeError("restore() after rollout started")
    self._version = int(state["version"])
    self._steps = int(state.get("steps", 0))
    per_step = int(self._settings.rl.updates_per_batch)  # a checkpoint from before "updates"
    self._updates = int(state.get("updates", self._steps * per_step))
    self._filtered = int(state.get("filtered", 0))
    self.faults.set_state(state.get("faults", {}))
    self._loader.set_state(data)
    if "batcher" in state:
      self._producer.restore(state, self._steps)
      self._consumed = set(int(u) for u in state["batcher"]["trained"])

  def close(self) -> None:
    """Stops rollout: the running round is cancelled and its requests aborted.

    The backend stays open: its owner closes it (after this).
    """
    try:
      if self._producer.alive:  # a dead loop would never finish the wait
        self.settle_publish()
    finally:
      self._producer.stop()

  def __enter__(self) -> Coordinator:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is not None and self._deferred is not None and self._deferred.feed is not None:
      # The other processes were told to stop: a gather would wait for them.
      self._deferred.feed.abandon()
      self._deferred = None
    self.close()


# Put on the rollout output queue when a deferred publish's consumer took an
# item: `_next_item` wakes to gather the next.
_FEED_TOOK = object()


async def _result(task: asyncio.Task):
  return await task
