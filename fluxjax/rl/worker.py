"""The policy worker: a run's train state and every program that changes it.

A run splits into what decides and what computes. The coordinator (process 0, the leader)
decides; the `PolicyWorker` computes: it owns the train state, the stream trainer, the SFT
warm-up's trainer, the reference model and the checkpointer, and runs their jitted
programs on the global mesh. Its methods marked `op` are the ops, and `OPS` is their
table. How a multi-controller run leads its followers (`PolicyWorker.lead`, `serve`):
docs/design.md, section 3, "Multi-controller runs".
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast, overload

import jax
from flax import nnx

from fluxjax import settings as settings_lib
from fluxjax.data import materializer as materializer_lib
from fluxjax.models import hf_export
from fluxjax.models.config import ModelConfig
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import multihost, train_step
from fluxjax.parallel.strategies import Strategy
from fluxjax.parallel.stream_trainer import StreamTrainer
from fluxjax.rl import advantages as adv_lib
from fluxjax.rl import checkpoint as checkpoint_lib
from fluxjax.rl import losses, reference, sft
from fluxjax.rollout import factory, tensor_feed
from fluxjax.rollout import publish as publish_lib

log = logging.getLogger(__name__)

STOP, ABORT = "stop", "abort"  # the leader's last word to its followers: not ops

# (worker, a call's arguments) -> (the op its followers run, that op's arguments).
Message = Callable[..., tuple[str, tuple]]


@dataclasses.dataclass(frozen=True)
class Op:
  """A PolicyWorker method that every process runs, in the leader's order.

  Attributes:
    name: the method, which followers run under this name.
    message: what a leading worker sends for a call: by default the call's
      own arguments, bound in the method's order.
  """

  name: str
  message: Message


# The ops by name (`op`): what a leading worker sends, and what `serve` runs.
OPS: dict[str, Op] = {}

_Method = TypeVar("_Method", bound=Callable[..., Any])


@overload
def op(method: _Method) -> _Method: ...


@overload
def op(*, message: Message) -> Callable[[_Method], _Method]: ...


def op(method=None, *, message=None):
  """Method decorator: makes a PolicyWorker method an op (`OPS`). A leading
  worker sends each call to its followers, then runs it. `message` replaces
  what is sent (an argument only the leader has, or another op for the
  followers). An op calls no other op on the leader."""

  def register(body):
    signature = inspect.signature(body)

    def own_arguments(worker: PolicyWorker, *args, **kwargs) -> tuple[str, tuple]:
      bound = signature.bind(worker, *args, **kwargs)
      bound.apply_defaults()
      return body.__name__, bound.args[1:]

    spec = OPS[body.__name__] = Op(body.__name__, message or own_arguments)

    @functools.wraps(body)
    def run(worker: PolicyWorker, *args, **kwargs):
      if worker._channel is not None:
        name, sent = spec.message(worker, *args, **kwargs)
        worker._last_sent = worker._channel.send(name, *sent)
      return body(worker, *args, **kwargs)

    return cast(_Method, run)

  return register if method is None else register(method)


def _stage_message(worker: PolicyWorker, version: int | None = None) -> tuple[str, tuple]:
  """With a fleet, the followers' op is their part in publishing `version`
  (`PolicyWorker.publish_part`)."""
  if factory.in_process(worker.settings.rollout):
    return "stage", ()
  if version is None:
    raise ValueError("a fleet publish needs the version it publishes")
  return "publish_part", (version,)


def _sft_begin_message(
  worker: PolicyWorker, patch_source=None, step: int | None = None
) -> tuple[str, tuple]:
  """The leader's `patch_source` stays its own: followers read pixels from their own store."""
  del worker, patch_source
  return "sft_begin", (None, step)


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a restored checkpoint hands the coordinator (the train state stays in the worker).

  Attributes:
    step: the checkpoint's step.
    coordinator: the coordinator's JSON state.
    data: the loader's JSON state.
  """

  step: int
  coordinator: dict
  data: dict


class PolicyWorker:
  """One process's part of the policy.

  In a one-process run the coordinator calls the worker directly; in a multi-controller
  run every process has one, the leader's leading (`lead`) and the others in `serve`.
  Every op is issued from the main thread of each process: a program on the global mesh
  launched from another thread (the rollout loop) could interleave differently on
  different processes and deadlock their collectives.

  Args:
    settings: the run's settings.
    workdir: the run's work directory (checkpoints, the reference snapshot).
    cfg: the model configuration.
    mesh: the training mesh (global).
    strategy: the sharding strategy.
    graphdef, state, state_shardings: the policy's graph, its sharded
      TrainState and the state's shardings.
    tx: the optimizer.
    patch_source: the Materializer pixels are read from: the loader's store
      on the leader; on every other process a store of its own.
    owns_media: whether this worker evicts what it read after each update
      (its own store); the leader's loader releases the samples it handed out.
    rollout_shardings: {parameter path: sharding} of the rollout engine's
      copy, on the leader's devices (`stage`), or None for a copy on the
      training mesh.
  """

  def __init__(
    self,
    settings: settings_lib.Settings,
    workdir: str,
    *,
    cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    strategy: Strategy,
    graphdef: nnx.GraphDef,
    state: train_step.TrainState,
    state_shardings: train_step.TrainState,
    tx,
    patch_source: materializer_lib.Materializer,
    owns_media: bool = False,
    rollout_shardings=None,
  ):
    self.settings = settings
    self.workdir = workdir
    self._cfg = cfg
    self._mesh = mesh
    self._strategy = strategy
    self._graphdef = graphdef
    self._patch_source = patch_source
    self._owns_media = owns_media
    self._read: list = []  # MediaRefs read since the last update (owns_media)
    # A deferred publish's part whose gathers wait for the leader's word (`publish_gather`).
    self._publishing: tensor_feed.TensorFeed | None = None
    self._rollout_shardings = (
      None
      if rollout_shardings is None
      else nnx.from_flat_state(
        [(path, rollout_shardings[path]) for path, _ in nnx.to_flat_state(state.params)]
      )
    )
    responses_per_step = settings.rl.prompts_per_step * settings.rl.responses_per_prompt
    self._trainer = StreamTrainer(
      cfg,
      mesh,
      strategy,
      graphdef,
      state,
      state_shardings,
      tx,
      losses.make_loss_fn(settings.rl),
      patch_source=self._read_patches,
      temperature=settings.rl.temperature,
      updates_per_batch=settings.rl.updates_per_batch,
      loss_normalizer=adv_lib.loss_normalizer(
        settings.rl.loss_agg_mode, responses_per_step, settings.rl.max_new_tokens
      ),
      sequence_slots=responses_per_step if settings.coordinator.response_records else 0,
      check_state=train_step.checks_state(settings.optim),
    )
    self.ckpt = checkpoint_lib.Checkpointer(workdir, save_every=settings.checkpoint.every)
    self.rng = jax.random.key(settings.seed)
    self._sft: sft.Trainer | None = None
    self._sft_ckpt: checkpoint_lib.Checkpointer | None = None
    # Where a leading worker sends its ops (`lead`), and the number of the last one sent.
    self._channel: multihost.Channel | None = None
    self._last_sent = -1

  # -- read-only views -------------------------------------------------------
  @property
  def cfg(self) -> ModelConfig:
    return self._cfg

  @property
  def mesh(self) -> jax.sharding.Mesh:
    return self._mesh

  @property
  def strategy(self) -> Strategy:
    return self._strategy

  @property
  def graphdef(self) -> nnx.GraphDef:
    return self._graphdef

  @property
  def state(self) -> train_step.TrainState:
    """The train state (each update donates it: read it again after one)."""
    return self._trainer.state

  @property
  def state_shardings(self) -> train_step.TrainState:
    return self._trainer.state_shardings

  @property
  def patch_source(self) -> materializer_lib.Materializer:
    return self._patch_source

  def _read_patches(self, item):
    if self._owns_media:
      self._read.append(item)
    return self._patch_source(item)

  def _release_media(self) -> None:
    self._patch_source.release(self._read)
    self._read = []

  # -- leading (the leader of a multi-controller run) ------------------------
  def lead(self, channel: multihost.Channel) -> None:
    """Makes this worker the leader's: from now on each op is sent on
    `channel` to every follower's `serve`, then run here."""
    self._channel = channel

  def stop(self) -> None:
    """Ends every follower's `serve` (the run's last word to them)."""
    if self._channel is not None:
      self._channel.send(STOP)

  def abort(self, reason: str) -> None:
    """Ends every follower's `serve` with an error (the leader failed)."""
    if self._channel is not None:
      self._channel.send(ABORT, reason)

  # -- local (not ops: every process calls them itself, inside an op) --------
  def load_params(self, params: nnx.State) -> None:
    """Makes `params` the policy's parameters; optimizer state and step stay."""
    state = self._trainer.state
    self._trainer.load_state(train_step.TrainState(params, state.opt_state, state.step))

  def should_save(self, step: int) -> bool:
    return self.ckpt.should_save(step)

  def latest_step(self) -> int | None:
    """The latest complete checkpoint in the work directory."""
    return self.ckpt.latest_step()

  # -- ops -------------------------------------------------------------------
  @op
  def add(self, seqs: Sequence[batch_lib.TrainSequence]) -> None:
    """Adds a part's gradients (dispatched; returns before they finish)."""
    self._trainer.add(seqs)

  @op
  def apply(self) -> dict:
    """The batch's update(s); returns device metrics (replicated scalars)."""
    self._check_gathered()
    metrics = self._trainer.apply()
    self._release_media()
    if self._channel is not None:
      # The update is a collective every follower has joined: they have read
      # every op up to it.
      metrics = jax.block_until_ready(metrics)
      self._channel.forget_through(self._last_sent)
    return metrics

  def _check_gathered(self) -> None:
    """The update donates the arrays a deferred publish gathers from: the
    leader has announced every gather before it (`Publisher.settle_reads`)."""
    if self._publishing is not None:
      raise RuntimeError(
        f"the update came {self._publishing.remaining} gathers before the end of a deferred publish"
      )

  @op(message=_stage_message)
  def stage(self, version: int | None = None) -> nnx.State | None:
    """The parameters for the rollout backend.

    A fleet gets the trainer's own arrays (it is sent them before the next
    update). An embedded engine gets a copy with its own buffers: on the
    training mesh without `rollout_shardings`, otherwise placed on the
    leader's devices (in a multi-controller run gathered to the leader
    alone, a run of rows at a time, `multihost.gather_to_leader`; None on
    the other processes). `version` (what the copy is published as)
    matters only to a leading worker's followers (`_stage_message`).
    """
    del version
    params = self._trainer.state.params
    if not factory.in_process(self.settings.rollout):
      # A fleet publish has read them (one layer tensor at a time) before the
      # next update donates them, and keeps nothing: no copy.
      return params
    if self._rollout_shardings is None:
      return jax.tree.map(lambda x: x.copy(), params)
    if jax.process_count() == 1:
      return jax.device_put(params, self._rollout_shardings, may_alias=False)
    return multihost.gather_to_leader(params, self._rollout_shardings)

  @op
  def publish_part(self, version: int) -> None:
    """A follower's part in publishing weight `version` to a fleet.

    The collectives the leader's `Coordinator.publish` runs, in its order:
    the logits probe, then the publish's gathers, one layer tensor or run of
    rows at a time (`publish.take_part`), so no process holds the whole model.
    A policy the probe refuses is not published (the leader ends the run).
    Deferred, the gathers wait for the leader's `publish_gather` ops: its
    main thread runs them between the step's ops as its broadcast or writer
    takes the tensors (rollout/tensor_feed.py).
    """
    params = self.stage()
    if not train_step.logits_finite(self._graphdef, params, train_step.probe_row(self._cfg)):
      return
    model = nnx.merge(self._graphdef, params)
    root = publish_lib.weights_root(self.workdir)
    r = self.settings.rollout
    self._publishing = publish_lib.take_part(
      model, r.weight_sync, root, version, r.weight_deltas, r.defer_updates
    )

  @op
  def publish_gather(self, n: int) -> None:
    """Runs the next `n` gathers of the deferred publish in progress."""
    if self._publishing is None:
      raise RuntimeError("publish_gather with no deferred publish in progress")
    self._publishing.take(n)
    if not self._publishing.remaining:
      self._publishing = None

  def announce_gathers(self, n: int) -> None:
    """Has every follower run its next `n` gathers (`publish_gather`) of the
    deferred publish whose feed this process runs (`PublishReport.feed`);
    nothing when it leads no other."""
    if self._channel is not None:
      self._channel.send("publish_gather", n)

  @op
  def restore(self, step: int | None) -> Restored | None:
    """Loads checkpoint `step`'s train state (None: a fresh run, nothing to load)."""
    if step is None:
      return None
    first, train_state, self.rng, coord_state, data_state = self.ckpt.restore(
      checkpoint_lib.abstract_like(self._trainer.state), step=step
    )
    self._trainer.load_state(train_state)
    return Restored(first, coord_state, data_state)

  @op
  def save(self, step: int, coordinator: dict, data: dict, force: bool = False) -> bool:
    """Queues checkpoint `step` (every process writes its own shards)."""
    return self.ckpt.save(step, self._trainer.state, self.rng, coordinator, data, force=force)

  @op
  def set_reference(self, fresh: bool) -> None:
    """Loads (or, on a fresh run, copies) the KL term's reference model."""
    self._trainer.set_reference(
      reference.reference_params(
        self.settings,
        self.workdir,
        self._cfg,
        self._graphdef,
        self._trainer.state.params,
        self._trainer.state_shardings.params,
        fresh=fresh,
      )
    )

  @op(message=_sft_begin_message)
  def sft_begin(
    self, patch_source: Callable | None = None, step: int | None = None
  ) -> tuple[int, dict] | None:
    """Starts the warm-up's trainer (pixels from `patch_source`, default this
    worker's); with `sft.checkpoint_every`, from its checkpoint `step` (default:
    the latest) under workdir/sft. Returns that checkpoint's (step, data
    state), or None."""
    s = self.settings.sft
    self._sft = sft.Trainer(
      self, sft.optimizer_config(self.settings.optim, s), patch_source or self._read_patches
    )
    if not s.checkpoint_every:
      return None
    self._sft_ckpt = checkpoint_lib.Checkpointer(
      os.path.join(self.workdir, "sft"), max_to_keep=2, save_every=s.checkpoint_every
    )
    return self._sft.restore(self._sft_ckpt, step)

  @op
  def sft_save(self, step: int, data: dict) -> None:
    """Queues warm-up checkpoint `step` (with `data`, the loader's state)."""
    if self._sft is None or self._sft_ckpt is None:
      raise RuntimeError("sft_save() without a warm-up checkpointer (sft.checkpoint_every)")
    self._sft.save(self._sft_ckpt, step, data)

  @op
  def sft_train(self, seqs: Sequence[batch_lib.TrainSequence]) -> dict:
    """One warm-up step; returns its device metrics."""
    if self._sft is None:
      raise RuntimeError("sft_train() before sft_begin()")
    metrics = self._sft.train(seqs)
    if self._owns_media:
      self._release_media()
    return metrics

  @op
  def sft_finish(self, copy: bool = False) -> None:
    """Hands the warmed-up parameters to the policy (see `sft.Trainer.finish`)."""
    if self._sft is None:
      raise RuntimeError("sft_finish() before sft_begin()")
    self._sft.finish(copy=copy)

  @op
  def sft_end(self) -> None:
    """Drops the warm-up's trainer and its optimizer state (its checkpoints
    written first)."""
    self._sft = None
    if self._sft_ckpt is not None:
      self._sft_ckpt.close()
      self._sft_ckpt = None

  @op
  def export(self, path: str, files: dict[str, bytes], dtype: str = "float32") -> None:
    """Writes the policy's parameters as an HF folder at `path` in `dtype`,
    with `files` (tokenizer.json, ...) beside them; every process takes part."""
    model = nnx.merge(self._graphdef, self._trainer.state.params)
    hf_export.save_hf_checkpoint(model, path, dtype=dtype, extra_files=files)

  def close(self) -> None:
    """Waits for checkpoints being written, then closes the checkpointer."""
    self.ckpt.close()

  def __enter__(self) -> PolicyWorker:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc_type is not None and jax.process_count() > 1:
      # A checkpoint being written is finished by every process together;
      # after a failure the others may never join, and an incomplete one is
      # never picked up (Orbax renames it into place when complete).
      log.warning("not waiting for checkpoint writes after a failure")
      return
    self.close()


class LeaderFailed(RuntimeError):
  """The leader ended the run with an error; followers stop with it."""


def serve(worker: PolicyWorker, channel: multihost.Channel) -> int:
  """A follower's run: the leader's ops, in order, until it stops; returns ops run.

  Raises:
    LeaderFailed: the leader aborted the run.
  """
  done = 0
  while True:
    name, args = channel.recv()
    if name == STOP:
      log.info("the leader ended the run after %d ops", done)
      return done
    if name == ABORT:
      raise LeaderFailed(f"the leader failed: {args[0] if args else 'no reason given'}")
    if name not in OPS:
      raise ValueError(f"unknown op {name!r} from the leader")
    getattr(worker, name)(*args)
    done += 1
