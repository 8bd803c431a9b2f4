"""Supervised warm-up before GRPO: teach the answer format (and a first skill).

A randomly initialized model never emits `<answer>x</answer>`, so every GRPO
reward is 0 and every advantage is 0: RL has no signal. The warm-up trains on
train-set prompts with their reference answers as the response, formatted the
way `rewards.accuracy_with_format` scores full marks
(`<answer>{answer}</answer>` followed by `<|im_end|>`, the token that ends a
Qwen assistant turn and a stop token of the rollout engine).

It uses the RL path end to end: `TrainSequence`s (the prompt from
`sequence_from_chat`, exactly as the coordinator builds it, extended with the
answer tokens; loss mask and advantage 1 on the answer tokens only) planned by
the run's strategy, materialized with pixels from a worker store, and one
jitted step per plan layout from `strategy.accumulate_fn` with a token NLL.

Optimizer: the warm-up has its own AdamW (`config.sft`: lr, warmup, cosine to
`end_lr_frac`) and its own moments. Afterwards the RL train state gets the
warmed-up parameters with its optimizer state untouched, i.e. still fresh:
SFT moments are scaled to NLL gradients, which are orders of magnitude larger
and point elsewhere than policy gradients, and the RL warmup/cosine schedule
counts its own steps, so it starts at RL step 1 rather than part-way through.

Metrics: the warm-up occupies steps -S..0 of the run's metrics (S =
`config.sft.steps`): held-out accuracy before it at step -S, `sft/loss` of SFT
step k at step k - S, held-out accuracy every `sft.eval_every` SFT steps (each
snapshot is published to the rollout engine as a policy version), and the
loop's own evaluation at step 0 is the accuracy after it, where GRPO starts.
`fluxjax.plot` shades the x < 0 region.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from fluxjax.parallel import train_step
from fluxjax.data import materializer as materializer_lib
from fluxjax.data import meta as meta_lib
from fluxjax.data import pipeline
from fluxjax.models.inputs import SequenceInputs
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rl import stream_trainer
from fluxjax.parallel import batch as batch_lib


def response_text(answer: str) -> str:
  """The response that `accuracy_with_format` gives 1.0 for this answer."""
  return f"<answer>{answer}</answer>"


def answer_ids(tokenizer: Tokenizer, answer: str) -> list[int]:
  """Token ids of the target response, ending with the end-of-turn token."""
  return tokenizer.encode(response_text(answer)) + [tokenizer.im_end_id]


def sft_sequence(prompt: SequenceInputs, answer: Sequence[int]) -> batch_lib.TrainSequence:
  """The prompt extended by the answer; only the answer tokens are trained."""
  seq = prompt.extend(answer)
  mask = np.zeros(len(seq), np.float32)
  mask[len(prompt):] = 1.0
  return batch_lib.TrainSequence(inputs=seq, loss_mask_T=mask, advantages_T=mask.copy(),
                                 old_logprobs_T=np.zeros(len(seq), np.float32))


def nll_loss(logp, entropy, mb: batch_lib.TrainBatch):
  """Per-token negative log-likelihood of the target (the step masks and averages)."""
  del mb  # every trained token has weight 1; the mask is applied by the step
  return -logp, {"entropy": entropy}


def runs(config) -> bool:
  """Whether a fresh run warms up (enabled, with steps, and RL steps to warm up for)."""
  return bool(config.sft.enabled and config.sft.steps and config.total_steps > 0)


def optimizer_config(config):
  """config.optim with the warm-up's lr and schedule (clipping, betas shared)."""
  optim = config.optim.copy_and_resolve_references()
  s = config.sft
  optim.lr, optim.warmup_steps = s.lr, s.warmup_steps
  optim.total_steps, optim.end_lr_frac = s.steps, s.end_lr_frac
  optim.weight_decay = 0.0
  return optim


class Trainer:
  """Jitted NLL steps on the run's mesh and strategy, from the run's parameters.

  Args:
    coord: the run's Coordinator (model config, tokenizer, mesh, strategy,
      graphdef, train state); not modified until `finish`.
    config: the run config (its `optim` and `sft` sections).
    patch_source: MediaRef -> patches (a Materializer over the store the
      media were decoded into).
  """

  def __init__(self, coord, config, patch_source: Callable | None = None):
    self.coord = coord
    self.patch_source = patch_source
    self.tx = train_step.make_optimizer(optimizer_config(config))
    # A copy: the step donates its state, and the run's parameters must stay
    # valid (the rollout engine may hold them) until `finish` replaces them.
    params = jax.tree.map(lambda x: x.copy(), coord.state.params)
    _, self.state, self.shardings = train_step.create_train_state(
        nnx.merge(coord.graphdef, params), self.tx, coord.mesh)
    self._steps = {}

  def sequences(self, samples: Sequence[meta_lib.SampleMeta]) -> list[batch_lib.TrainSequence]:
    c = self.coord
    return [sft_sequence(c.prompt(s), answer_ids(c.tokenizer, s.answer or "")) for s in samples]

  def _step_fn(self, plan):
    key = (plan.level_layout(), plan.num_microbatches)
    if key not in self._steps:
      c = self.coord
      accumulate = c.strategy.accumulate_fn(c.mesh, plan, c.graphdef, self.shardings.params,
                                            nll_loss)
      self._steps[key] = train_step.make_train_step(
          c.graphdef, self.tx, state_shardings=self.shardings, accumulate_fn=accumulate)
    return self._steps[key]

  def batch(self, seqs: Sequence[batch_lib.TrainSequence]):
    """(plan, host TrainBatch) for these sequences."""
    c = self.coord
    plan = c.strategy.plan([len(s) for s in seqs], c.mesh.size)
    host = batch_lib.materialize(plan, seqs, c.cfg, stream_trainer.PATCH_BUCKETS,
                                 patch_source=self.patch_source,
                                 balance_vision=c.strategy.balance_vision)
    return plan, host

  def train(self, seqs: Sequence[batch_lib.TrainSequence]) -> dict:
    """One update; returns its device metrics (loss = mean NLL per answer token)."""
    plan, host = self.batch(seqs)
    step = self._step_fn(plan)
    with jax.set_mesh(self.coord.mesh):
      self.state, metrics = step(self.state, batch_lib.to_device(host, self.coord.mesh))
    return metrics

  def finish(self, copy: bool = False) -> None:
    """Hands the warmed-up parameters to the RL state (fresh RL optimizer state).

    `copy=True` hands over a copy (a snapshot mid-warm-up, e.g. to evaluate
    it): the next step donates the warm-up's own parameters.
    """
    c = self.coord
    if int(c.state.step) != 0:
      raise RuntimeError("the SFT warm-up runs before the first RL step only")
    params = jax.tree.map(lambda x: x.copy(), self.state.params) if copy else self.state.params
    c.state = train_step.TrainState(params, c.state.opt_state, c.state.step)


def warm_up(coord, config, train_path: str, proc, writer,
            evaluate: Callable[[], float]) -> dict[str, float]:
  """Runs the warm-up (see the module docstring); returns a summary.

  Args:
    coord: the run's Coordinator; its state and rollout engine get the
      warmed-up weights (a new policy version).
    config: the run config.
    train_path: the training manifest (the warm-up samples its prompts).
    proc: the vision processor config.
    writer: the run's MetricWriter.
    evaluate: held-out accuracy of the rollout engine's current policy.
  """
  s = config.sft
  first = -int(s.steps)
  summary = {"eval/accuracy": evaluate()}
  writer.write(first, summary)
  logging.info("SFT warm-up: %d steps of %d samples, lr %g; accuracy before %.3f",
               s.steps, s.batch_size, s.lr, summary["eval/accuracy"])
  # Its own loader, store and Materializer rather than coord.patch_source:
  # releasing warm-up media from the RL loader's store would evict the RL
  # batches that loader has already prefetched (the same files).
  loader = pipeline.ShadowLoader(train_path, s.batch_size, proc,
                                 num_workers=max(1, config.data.num_workers),
                                 seed=config.seed + 1)
  source = materializer_lib.Materializer(loader.store, loader.pool)
  trainer = Trainer(coord, config, source)
  delayed = train_step.DelayedMetrics()
  t0 = time.perf_counter()
  losses = []

  def record(done):
    if done is not None:
      k, m = done
      losses.append(m["loss"])
      writer.write(first + k, {"sft/loss": m["loss"], "sft/grad_norm": m["grad_norm"],
                               "sft/tokens": m["tokens"]})
      if k == 1 or k % 10 == 0 or k == s.steps:
        logging.info("SFT step %d/%d | loss %.4g", k, s.steps, m["loss"])

  try:
    for k in range(1, s.steps + 1):
      samples = loader.next_batch()
      metrics = trainer.train(trainer.sequences(samples))
      loader.release(samples)  # the store's copies of this batch's media
      record(delayed.push(k, metrics))
      if s.eval_every and k % s.eval_every == 0 and k < s.steps:
        trainer.finish(copy=True)  # the loop evaluates the final one at step 0
        coord.publish()
        writer.write(first + k, {"eval/accuracy": evaluate()})
    record(delayed.flush())
  finally:
    loader.close()
  trainer.finish()
  coord.publish()  # rollouts now sample from the warmed-up policy
  seconds = time.perf_counter() - t0
  writer.write(0, {"sft/seconds": seconds})
  logging.info("SFT warm-up done in %.1f s: loss %.4g -> %.4g", seconds,
               losses[0] if losses else float("nan"), losses[-1] if losses else float("nan"))
  return {"sft/seconds": seconds, "sft/loss_first": losses[0] if losses else float("nan"),
          "sft/loss_last": losses[-1] if losses else float("nan"), **summary}
