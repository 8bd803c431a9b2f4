"""Supervised warm-up before GRPO: teach the answer format (and a first skill).

Entry points: `runs` (whether a run warms up), `warm_up` (the loop, steps -S..0 of the
run's metrics) and `Trainer` (its own AdamW over the RL path: `TrainSequence`s planned
by the run's strategy, one jitted step per plan layout, a token NLL). Why it exists,
its optimizer and its metrics are told in docs/training-loop.md, "The SFT warm-up".
"""

from __future__ import annotations

import dataclasses
import logging
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import jax
import numpy as np
from flax import nnx

from fluxjax import faults as faults_lib
from fluxjax import settings as settings_lib
from fluxjax.data import materializer as materializer_lib
from fluxjax.data import meta as meta_lib
from fluxjax.data import pipeline, visual_tasks
from fluxjax.models.inputs import SequenceInputs
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import train_step
from fluxjax.parallel.layout_steps import LayoutSteps
from fluxjax.planning.plan import Plan
from fluxjax.rl import checkpoint as checkpoint_lib
from fluxjax.rl import policy as policy_lib
from fluxjax.rl.requests import Requests

log = logging.getLogger(__name__)


def answer_ids(tokenizer: Tokenizer, answer: str, solution: str = "") -> list[int]:
  """Token ids of the target response, ending with the end-of-turn token."""
  return tokenizer.encode(visual_tasks.reference_response(answer, solution)) + [tokenizer.im_end_id]


def sft_sequence(prompt: SequenceInputs, answer: Sequence[int]) -> batch_lib.TrainSequence:
  """The prompt extended by the answer; only the answer tokens are trained."""
  seq = prompt.extend(answer)
  mask = np.zeros(len(seq), np.float32)
  mask[len(prompt) :] = 1.0
  return batch_lib.TrainSequence(
    inputs=seq,
    loss_mask_T=mask,
    advantages_T=mask.copy(),
    old_logprobs_T=np.zeros(len(seq), np.float32),
  )


def nll_loss(logp, entropy, mb: batch_lib.TrainBatch):
  """Per-token negative log-likelihood of the target (the step masks and averages)."""
  del mb  # every trained token has weight 1; the mask is applied by the step
  return -logp, {"entropy": entropy}


def runs(sft: settings_lib.SFT, total_steps: int) -> bool:
  """Whether a fresh run warms up: enabled, with steps, and RL steps to warm
  up for or a base to export."""
  return bool(sft.enabled and sft.steps and (total_steps > 0 or sft.export_dir))


def optimizer_config(optim: settings_lib.Optim, sft: settings_lib.SFT) -> settings_lib.Optim:
  """The RL `optim` with the warm-up's lr and schedule (clipping, betas shared)."""
  return dataclasses.replace(
    optim,
    lr=sft.lr,
    warmup_steps=sft.warmup_steps,
    total_steps=sft.steps,
    end_lr_frac=sft.end_lr_frac,
    weight_decay=0.0,
    lr_scale_steps=(),
    lr_scales=(),
  )


class Rollout(Protocol):
  """What the warm-up needs from the run's coordinator: prompts, publishing, the worker."""

  @property
  def requests(self) -> Requests:
    """The run's prompts, as rollout sees them, and its tokenizer."""
    ...

  @property
  def policy(self) -> policy_lib.WarmUpOps: ...

  @property
  def faults(self) -> faults_lib.Faults:
    """The run's fault streaks (the warm-up's refused steps count as the run's)."""
    ...

  def publish(self, new_version: bool = True) -> float:
    """Hands the current parameters to rollout as a policy version."""
    ...


def shows_reasoning(sample_id: str, chain_fraction: float) -> bool:
  """Whether the warm-up's reference response for this sample carries its
  reasoning: a stable draw per sample id, true for `chain_fraction` of them."""
  return zlib.crc32(sample_id.encode()) / 2**32 < chain_fraction


@dataclasses.dataclass(frozen=True)
class Guesses:
  """The warm-up's guessed direct answers (`sft.guess`): on a row of its
  tasks or at one of its levels, a direct answer is another training row's
  answer of the same task and level, a stable draw per sample. The model
  learns the answer's format and prior there, not the item; a shown
  reasoning still ends in the item's own answer.

  Attributes:
    answers: (task, level) -> the guessed rows' answers, in row order; a
      sample of any other task and level answers with its own.
  """

  answers: Mapping[tuple[str, str], tuple[str, ...]] = dataclasses.field(default_factory=dict)

  @classmethod
  def of(cls, rows: Sequence[dict], guess: settings_lib.Guess) -> Guesses:
    """The guesses `guess` asks for, drawn from `rows` (the warm-up's rows)."""
    answers: dict[tuple[str, str], list[str]] = {}
    for r in rows:
      key = (r.get("task") or "", r.get("difficulty") or "")
      if (key[0] in guess.tasks or key[1] in guess.levels) and r.get("answer") is not None:
        answers.setdefault(key, []).append(str(r["answer"]))
    return cls({k: tuple(v) for k, v in answers.items()})

  def direct_answer(self, s: meta_lib.SampleMeta) -> str:
    """What the warm-up teaches `s` to answer directly."""
    pool = self.answers.get((s.task, s.difficulty))
    return pool[zlib.crc32(f"guess/{s.id}".encode()) % len(pool)] if pool else s.answer or ""


def sequences(
  samples: Sequence[meta_lib.SampleMeta],
  rollout: Rollout,
  chain_fraction: settings_lib.ChainFraction | None = None,
  guesses: Guesses = Guesses(),
) -> list[batch_lib.TrainSequence]:
  """The warm-up sequences of `samples`: each prompt as rollout sees it, then its
  reference response: its reasoning and answer for the `chain_fraction` of its
  level (default all), else a direct answer (`guesses`: the item's own, or a
  guess)."""
  tok = rollout.requests.tokenizer

  def response(s: meta_lib.SampleMeta) -> list[int]:
    shown = chain_fraction is None or shows_reasoning(s.id, chain_fraction.at(s.difficulty))
    if shown and s.solution:
      return answer_ids(tok, s.answer or "", s.solution)
    return answer_ids(tok, guesses.direct_answer(s))

  return [sft_sequence(rollout.requests.prompt(s), response(s)) for s in samples]


def warm_up_rows(rows: Sequence[dict], levels: Sequence[str]) -> list[dict]:
  """The training rows the warm-up teaches: those whose difficulty is in
  `levels` (all when empty); rows without a difficulty label always.

  Raises:
    ValueError: if no row is left.
  """
  kept = [r for r in rows if not levels or not r.get("difficulty") or r["difficulty"] in levels]
  if not kept:
    raise ValueError(
      f"no training row has a difficulty in sft.levels={tuple(levels)}; change --config.sft.levels"
    )
  return kept


class Trainer:
  """Jitted NLL steps on the run's mesh and strategy, from the run's parameters.

  Args:
    policy: the run's policy worker; not modified until `finish`.
    optim: the warm-up's optimizer settings (`optimizer_config`).
    patch_source: MediaRef -> patches (a Materializer over the store the
      media were decoded into).
  """

  def __init__(
    self,
    policy: policy_lib.PolicyState,
    optim: settings_lib.Optim,
    patch_source: Callable | None = None,
  ):
    self.policy = policy
    self.tx = train_step.make_optimizer(optim)
    self._check_state = train_step.checks_state(optim)
    # A copy: the step donates its state, and the run's parameters must stay
    # valid (the rollout engine may hold them) until `finish` replaces them.
    params = jax.tree.map(lambda x: x.copy(), policy.state.params)
    _, self.state, self.shardings = train_step.create_train_state(
      nnx.merge(policy.graphdef, params), self.tx, policy.mesh
    )
    self._layouts = LayoutSteps(
      policy.cfg, policy.mesh, policy.strategy, self._compile_step, patch_source=patch_source
    )

  def _compile_step(self, plan: Plan, batch: batch_lib.TrainBatch):
    del batch  # the step's shardings come from the state and the plan
    p = self.policy
    accumulate = p.strategy.accumulate_fn(p.mesh, plan, p.graphdef, self.shardings.params, nll_loss)
    return train_step.make_train_step(
      p.graphdef,
      self.tx,
      state_shardings=self.shardings,
      accumulate_fn=accumulate,
      check_state=self._check_state,
    )

  def batch(self, seqs: Sequence[batch_lib.TrainSequence]):
    """(plan, host TrainBatch) for these sequences."""
    return self._layouts.prepare(seqs)

  def train(self, seqs: Sequence[batch_lib.TrainSequence]) -> dict:
    """One update; returns its device metrics (loss = mean NLL per answer token)."""
    placed = self._layouts.place(seqs)
    with jax.set_mesh(self.policy.mesh):
      self.state, metrics = placed.step(self.state, placed.batch)
    return metrics

  def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, data: dict) -> None:
    """Queues warm-up checkpoint `step`: parameters, optimizer state, `data`."""
    ckpt.save(step, self.state, jax.random.key(0), {}, data, force=True)

  def restore(
    self, ckpt: checkpoint_lib.Checkpointer, step: int | None = None
  ) -> tuple[int, dict] | None:
    """Loads warm-up checkpoint `step` (default: the latest); returns its
    (step, data state), or None where there is none."""
    if ckpt.latest_step() is None:
      return None
    step, self.state, _, _, data = ckpt.restore(checkpoint_lib.abstract_like(self.state), step)
    return step, data

  def finish(self, copy: bool = False) -> None:
    """Hands the warmed-up parameters to the RL state (fresh RL optimizer state).

    `copy=True` hands over a copy (a snapshot mid-warm-up, e.g. to evaluate
    it): the next step donates the warm-up's own parameters.
    """
    if int(self.policy.state.step) != 0:
      raise RuntimeError("the SFT warm-up runs before the first RL step only")
    params = jax.tree.map(lambda x: x.copy(), self.state.params) if copy else self.state.params
    self.policy.load_params(params)


def _begin(policy, source, loader, writer, first: int, evaluate) -> tuple[int, dict]:
  """Starts the warm-up's trainer: (SFT steps done, the accuracy before it).
  A fresh one is evaluated first; a killed one goes on after its checkpoint,
  with the loader where it was and the later records dropped."""
  resumed = policy.sft_begin(source)
  if resumed is None:
    summary = evaluate()
    writer.write(first, summary)
    return 0, summary
  done, data = resumed
  loader.set_state(data)
  writer.drop_after(first + done)
  return done, {}


def warm_up(
  coord: Rollout,
  settings: settings_lib.Settings,
  train_rows: Sequence[dict],
  proc,
  writer,
  evaluate: Callable[[], dict[str, float]],
  stop: Callable[[], bool] = lambda: False,
) -> dict[str, float]:
  """Runs the warm-up (docs/training-loop.md, "The SFT warm-up"); returns a summary.

  With `sft.checkpoint_every`, once `stop()` (a SIGTERM, rl/preemption.py)
  the warm-up ends after the step in progress with a checkpoint of it, and
  the summary holds only `sft/stopped_after` (the run's step it stopped
  after); without, a stop takes effect after the first RL step.

  Args:
    coord: the run's Coordinator; its policy worker trains (every process
      runs the warm-up's ops) and its rollout engine gets the warmed-up
      weights (a new policy version).
    settings: the run's settings.
    train_rows: the run's training rows (the warm-up samples its prompts).
    proc: the vision processor config.
    writer: the run's MetricWriter.
    evaluate: held-out metrics of the rollout engine's current policy
      (`Coordinator.evaluate`).
  """
  sft = settings.sft
  first = -sft.steps
  # Its own loader, store and Materializer rather than coord.patch_source:
  # releasing warm-up media from the RL loader's store would evict the RL
  # batches that loader has already prefetched (the same files).
  rows = warm_up_rows(train_rows, sft.levels)
  loader = pipeline.ShadowLoader(
    rows,
    sft.batch_size,
    proc,
    num_workers=max(1, settings.data.num_workers),
    seed=settings.seed + 1,
    limits=settings.data.limits,
  )
  source = materializer_lib.Materializer(loader.store, loader.pool)
  guesses = Guesses.of(rows, sft.guess)
  policy = coord.policy
  done, summary = _begin(policy, source, loader, writer, first, evaluate)
  log.info(
    "SFT warm-up: %d steps of %d samples (levels %s), lr %g; %s",
    sft.steps,
    sft.batch_size,
    ", ".join(sft.levels) or "all",
    sft.lr,
    f"resumed after step {done}" if done else f"accuracy before {summary['eval/accuracy']:.3f}",
  )
  delayed = train_step.DelayedMetrics()
  guard = train_step.NonFiniteGuard(coord.faults.streak("nonfinite_steps"), "SFT step")
  batch_ids: dict[int, list[str]] = {}  # until the step's metrics are read, a step late
  t0 = time.perf_counter()
  losses = []

  def record(done):
    if done is not None:
      k, m = done
      guard.observe(k, m, batch_ids.pop(k))
      losses.append(m["loss"])
      writer.write(
        first + k,
        {
          "sft/loss": m["loss"],
          "sft/grad_norm": m["grad_norm"],
          "sft/tokens": m["tokens"],
          "sft/nonfinite": m["nonfinite"],
        },
      )
      if k == 1 or k % 10 == 0 or k == sft.steps:
        log.info("SFT step %d/%d | loss %.4g", k, sft.steps, m["loss"])

  try:
    for k in range(done + 1, sft.steps + 1):
      samples = loader.next_batch()
      batch_ids[k] = [x.id for x in samples]
      metrics = policy.sft_train(sequences(samples, coord, sft.chain_fraction, guesses))
      loader.release(samples)  # the store's copies of this batch's media
      record(delayed.push(k, metrics))
      stopping = bool(sft.checkpoint_every and stop() and k < sft.steps)
      if sft.checkpoint_every and (k % sft.checkpoint_every == 0 or stopping) and k < sft.steps:
        record(delayed.flush())  # its records are on disk before the checkpoint
        policy.sft_save(k, loader.get_state())
      if stopping:
        policy.sft_end()  # the checkpoint is written
        log.warning("preempted: the warm-up stopped after step %d, checkpointed", k)
        return {"sft/stopped_after": float(first + k)}
      if sft.eval_every and k % sft.eval_every == 0 and k < sft.steps:
        policy.sft_finish(copy=True)  # the loop evaluates the final one at step 0
        coord.publish()
        writer.write(first + k, evaluate())
    record(delayed.flush())
  finally:
    loader.close()
  policy.sft_finish()
  policy.sft_end()
  coord.publish()  # rollouts now sample from the warmed-up policy
  seconds = time.perf_counter() - t0
  writer.write(0, {"sft/seconds": seconds})
  log.info(
    "SFT warm-up done in %.1f s: loss %.4g -> %.4g",
    seconds,
    losses[0] if losses else float("nan"),
    losses[-1] if losses else float("nan"),
  )
  return {
    "sft/seconds": seconds,
    "sft/loss_first": losses[0] if losses else float("nan"),
    "sft/loss_last": losses[-1] if losses else float("nan"),
    **summary,
  }
