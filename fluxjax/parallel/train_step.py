"""The jitted train step every strategy feeds: (state, batch) -> (state, metrics).

One pure function, jitted once with donated state and explicit shardings. It
scans the batch's microbatches, accumulating gradients; the loss of every token
is normalized by the global count of trained tokens (a sum over the whole,
sharded batch: XLA turns it into an all-reduce), so the update does not depend
on how the plan split the batch. The token-level loss is passed in (the RL code
supplies PPO/GRPO); `policy_gradient_loss` is the plain default.
Metrics stay on device: the caller fetches them a step late, never blocking.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from fluxjax import faults as faults_lib
from fluxjax import settings as settings_lib
from fluxjax.models import inputs as inputs_lib
from fluxjax.models import vlm
from fluxjax.parallel.batch import TrainBatch

log = logging.getLogger(__name__)

# loss_fn(logp_BT, entropy_BT, microbatch) -> (per-token loss [B, T], {name: per-token [B, T]})
LossFn = Callable[[jax.Array, jax.Array, TrainBatch], tuple[jax.Array, dict[str, jax.Array]]]


def policy_gradient_loss(logp, entropy, mb: TrainBatch):
  """-A * pi/pi_old per token: the unclipped importance-weighted policy gradient."""
  ratio = jnp.exp(logp - jax.lax.stop_gradient(mb.old_logprobs))
  return -mb.advantages * ratio, {"entropy": entropy, "ratio": ratio}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainState:
  params: nnx.State
  opt_state: optax.OptState
  step: jax.Array


# What an update must leave finite to apply (`optim.refuse_nonfinite`).
REFUSE_NONFINITE = ("state", "inputs")


def checks_state(optim: settings_lib.Optim) -> bool:
  """Whether `apply_update` checks the updated state too (`optim.refuse_nonfinite`)."""
  if optim.refuse_nonfinite not in REFUSE_NONFINITE:
    raise ValueError(
      f"optim.refuse_nonfinite must be one of {REFUSE_NONFINITE}, got {optim.refuse_nonfinite!r}"
    )
  return optim.refuse_nonfinite == "state"


def make_optimizer(optim: settings_lib.Optim) -> optax.GradientTransformation:
  """AdamW with global-norm clipping and `lr_schedule`'s learning rate."""
  return optax.chain(
    optax.clip_by_global_norm(optim.max_grad_norm),
    optax.adamw(
      lr_schedule(optim), b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay
    ),
  )


def lr_schedule(optim: settings_lib.Optim) -> optax.Schedule:
  """Updates done -> learning rate: warmup + cosine decay, times the
  piecewise-constant scales `lr_scales[i]` once `lr_scale_steps[i]` updates
  are done."""
  if len(optim.lr_scale_steps) != len(optim.lr_scales):
    raise ValueError(
      f"optim.lr_scale_steps {optim.lr_scale_steps} and optim.lr_scales {optim.lr_scales}: "
      "give one scale per step"
    )
  cosine = optax.warmup_cosine_decay_schedule(
    init_value=0.0,
    peak_value=optim.lr,
    warmup_steps=optim.warmup_steps,
    decay_steps=max(optim.total_steps, optim.warmup_steps + 1),
    end_value=optim.lr * optim.end_lr_frac,
  )
  scale = optax.piecewise_constant_schedule(
    1.0, dict(zip(optim.lr_scale_steps, optim.lr_scales, strict=True))
  )

  def schedule(count):
    return cosine(count) * scale(count)

  return schedule


def create_train_state(
  model: nnx.Module, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh
):
  """(graphdef, state, state shardings) for an already-sharded model.

  Optimizer moments are created from the sharded parameters, so they take the
  parameters' shardings; the shardings of the result are then pinned as the
  step's in/out shardings.
  """
  graphdef, params = nnx.split(model, nnx.Param)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  # Left to propagation, XLA may replicate the moments; pin them explicitly.
  opt_shardings = optax.tree_map_params(
    tx,
    lambda _, s: s,
    jax.eval_shape(tx.init, params),
    param_shardings,
    transform_non_params=lambda _: replicated,
  )
  with jax.set_mesh(mesh):
    opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
    step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  state = TrainState(params, opt_state, step)
  return graphdef, state, jax.tree.map(lambda x: x.sharding, state)


def loss_and_metrics(
  params,
  graphdef,
  mb: TrainBatch,
  total_tokens,
  loss_fn: LossFn,
  attention_fn,
  vision_gather_fn=None,
  *,
  temperature: float = 1.0,
):
  """Σ loss / total_tokens of one microbatch, and metric sums.

  The policy's logprobs (and entropy) are of softmax(logits / temperature):
  at the sampling temperature they match the behaviour logprobs the rollout
  engine reported, so on-policy importance weights are 1.
  """
  model = nnx.merge(graphdef, params)
  logp, entropy = model.token_logprobs(
    mb.inputs,
    mb.targets,
    attention_fn=attention_fn,
    vision_gather_fn=vision_gather_fn,
    with_entropy=True,
    temperature=temperature,
  )
  per_token, extras = loss_fn(logp, entropy, mb)
  mask = mb.loss_mask
  sums: dict[str, jax.Array | dict[str, jax.Array]] = {
    k: (v * mask).sum() for k, v in extras.items()
  }
  sums["tokens"] = mask.sum()
  if mb.sequence_slots:
    sums[PER_SEQUENCE] = sequence_sums({**extras, "tokens": 1.0}, mask, mb)
  return (per_token * mask).sum() / total_tokens, sums


# The key of the per-sequence sums among a step's metric sums and metrics.
PER_SEQUENCE = "per_sequence"


def sequence_sums(values: dict, mask, mb: TrainBatch) -> dict[str, jax.Array]:
  """{name: [sequence_slots] sum of value x mask over each sequence's tokens}.

  Every sequence lies in one microbatch, so these add over microbatches,
  devices and a stream trainer's parts as the scalar sums do.
  """
  assert mb.sequence_ids is not None, "sequence_slots without sequence_ids"
  ids = mb.sequence_ids.reshape(-1)
  slots = mb.sequence_slots + 1  # id 0: padding, dropped below

  def one(v):
    weighted = (jnp.broadcast_to(v, mask.shape) * mask).reshape(-1)
    return jax.ops.segment_sum(weighted, ids, num_segments=slots)[1:]

  return {k: one(v) for k, v in values.items()}


def token_logprobs(
  graphdef, params, batch: TrainBatch, attention_fn=None, *, temperature: float = 1.0
) -> jax.Array:
  """log p(target) of every token of every microbatch, [M, D, C]; a forward only.

  The reference model's pass for the KL term: no gradient flows, so nothing is
  kept for a backward pass and the microbatches run one after another.
  """
  params = jax.lax.stop_gradient(params)

  def one(mb: TrainBatch):
    model = nnx.merge(graphdef, params)
    return model.token_logprobs(
      mb.inputs, mb.targets, attention_fn=attention_fn, temperature=temperature
    )

  return jax.lax.map(one, batch)


def batch_total(batch: TrainBatch) -> jax.Array:
  """The loss normalizer: the batch's summed loss weights (at least 1)."""
  return jnp.maximum(batch.loss_mask.sum(), 1.0)


def accumulate(
  graphdef,
  params,
  batch: TrainBatch,
  loss_fn: LossFn = policy_gradient_loss,
  attention_fn=None,
  param_shardings=None,
  total=None,
  *,
  temperature: float = 1.0,
):
  """Loss, gradients and metric sums over all microbatches (no update).

  With `param_shardings`, the gradient accumulator is pinned to them: each
  microbatch's gradients are reduce-scattered into the FSDP shards instead of
  being held whole. `total` is the token count the loss is normalized by
  (default: this batch's); the stream trainer passes 1 and divides once the
  whole batch is in.
  """
  total = batch_total(batch) if total is None else total
  grad_fn = jax.value_and_grad(loss_and_metrics, has_aux=True)
  pin = (
    (lambda g: jax.lax.with_sharding_constraint(g, param_shardings))
    if param_shardings is not None
    else (lambda g: g)
  )

  def micro(grads, mb):
    (loss, sums), g = grad_fn(
      params, graphdef, mb, total, loss_fn, attention_fn, temperature=temperature
    )
    return pin(jax.tree.map(jnp.add, grads, g)), (loss, sums)

  zeros = pin(jax.tree.map(jnp.zeros_like, params))
  grads, (losses, sums) = jax.lax.scan(micro, zeros, batch)
  return losses.sum(), grads, jax.tree.map(lambda x: x.sum(axis=0), sums)


def make_train_step(
  graphdef,
  tx: optax.GradientTransformation,
  loss_fn: LossFn = policy_gradient_loss,
  attention_fn=None,
  *,
  state_shardings=None,
  batch_shardings=None,
  accumulate_fn=None,
  on_trace: Callable[[], None] | None = None,
  check_state: bool = True,
):
  """Builds the jitted step.

  Args:
    graphdef: the model's NNX graph definition (static).
    tx: the optax optimizer.
    loss_fn: token-level loss (see LossFn).
    attention_fn: the strategy's text attention (None = row-local).
    state_shardings, batch_shardings: explicit in/out shardings.
    accumulate_fn: (params, batch) -> (loss, grads, sums), e.g. a strategy's
      minibatch-sync accumulation; default: `accumulate` with `attention_fn`.
    on_trace: called each time the step is traced (tests count compilations).
    check_state: `apply_update`'s.
  """

  def step(state: TrainState, batch: TrainBatch):
    if on_trace is not None:
      on_trace()
    if accumulate_fn is not None:
      loss, grads, sums = accumulate_fn(state.params, batch)
    else:
      param_shardings = state_shardings.params if state_shardings is not None else None
      loss, grads, sums = accumulate(
        graphdef, state.params, batch, loss_fn, attention_fn, param_shardings
      )
    return apply_update(tx, state, loss, grads, sums, check_state)

  shardings = state_shardings is not None
  return jax.jit(
    step,
    donate_argnums=(0,),
    in_shardings=(state_shardings, batch_shardings) if shardings else None,
    out_shardings=(state_shardings, None) if shardings else None,
  )


def all_finite(tree) -> jax.Array:
  """Whether every floating-point element of `tree` is finite: a bool scalar.

  One sum of `x * 0` per leaf on its own shards (an all-reduce of a scalar
  each when sharded), never a gather; integer leaves (step counts) are
  skipped. Every finite element adds 0, any inf or NaN makes the sum NaN.
  (`isfinite(x).all()` compiles slower on XLA:CPU; `max(abs(x))` misses a
  NaN there, its vectorized max does not propagate it.)
  """
  sums = [
    jnp.sum(x * 0, dtype=jnp.float32)
    for x in jax.tree.leaves(tree)
    if jnp.issubdtype(jnp.result_type(x), jnp.floating)
  ]
  return jnp.isfinite(jnp.stack(sums).sum()) if sums else jnp.bool_(True)


def apply_update(
  tx: optax.GradientTransformation, state: TrainState, loss, grads, sums, check_state: bool = True
):
  """One optimizer update from normalized gradients; metrics are token means
  (per-sequence sums, when the batch has sequence slots, stay sums).

  A step whose loss or gradient norm is not finite, or whose update leaves a
  parameter or optimizer moment non-finite (a finite gradient times a huge
  learning rate, a second moment that overflows), changes nothing: the
  parameters, the optimizer state and the step count stay as they were, and
  `nonfinite` is 1 in the metrics (`nonfinite_state` also 1 when the update's
  result was the cause). One NaN must not reach the parameters, the rollout
  engine or a checkpoint; the caller decides how many such steps in a row end
  the run (`NonFiniteGuard`). The checks are reductions on device; a
  conditional then returns the new or the old state (an elementwise select
  over the whole state compiles 2-3x slower on XLA:CPU).

  The state check holds the new parameters and moments beside the old until
  they are known finite: one more copy of them in device memory. With
  `check_state` False only the loss and gradient norm decide, before the
  update, which then applies in place. From a finite state, clipped finite
  gradients keep AdamW's moments finite; only a learning rate near the
  float32 range can still overflow a parameter, and the publisher's check
  of the logits stops such a policy before it is served.
  """
  grad_norm = optax.tree.norm(grads)
  inputs_finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def updated():
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return optax.apply_updates(state.params, updates), opt_state

  def unchanged():
    return state.params, state.opt_state

  if check_state:
    params, opt_state = updated()
    state_finite = all_finite((params, opt_state))
    finite = inputs_finite & state_finite
    params, opt_state = jax.lax.cond(finite, lambda: (params, opt_state), unchanged)
  else:
    state_finite, finite = jnp.bool_(True), inputs_finite
    params, opt_state = jax.lax.cond(finite, updated, unchanged)
  sums = dict(sums)
  per_sequence = sums.pop(PER_SEQUENCE, None)
  tokens = jnp.maximum(sums.pop("tokens"), 1.0)
  metrics = {
    "loss": loss,
    "grad_norm": grad_norm,
    "tokens": tokens,
    "nonfinite": 1.0 - finite.astype(jnp.float32),
    "nonfinite_state": (inputs_finite & ~state_finite).astype(jnp.float32),
    **{k: v / tokens for k, v in sums.items()},
  }
  if per_sequence is not None:  # left as sums: each sequence's "tokens" divides its own
    metrics[PER_SEQUENCE] = per_sequence
  new_state = TrainState(params, opt_state, state.step + finite.astype(state.step.dtype))
  return new_state, metrics


class NonFiniteError(RuntimeError):
  """The run met non-finite numbers it must not go on with.

  Too many refused updates in a row (`NonFiniteGuard`), or a policy whose
  logits are non-finite though its parameters are finite (the coordinator's
  check before a publish, or the rollout engine's refusal).
  """


def _refusal_cause(metrics: dict[str, float]) -> str:
  if metrics.get("nonfinite_state", 0.0):
    return "its update made a parameter or optimizer moment non-finite"
  return "non-finite loss or gradient norm"


class NonFiniteGuard:
  """Counts skipped (non-finite) updates; too many in a row stop the run.

  `apply_update` already refused each such update on device; this is the
  host's policy over them: log the batch's sample ids, count them on
  `streak` (fluxjax/faults.py), and raise `NonFiniteError` when its limit
  of refusals in a row is reached.
  """

  def __init__(self, streak: faults_lib.Streak, what: str = "update"):
    self.streak, self.what = streak, what

  def observe(self, step: int, metrics: dict[str, float], ids: Sequence[str] = ()) -> None:
    """Counts step's refusal, if any; raises after too many in a row."""
    if not metrics.get("nonfinite", 0.0):
      self.streak.ok()
      return
    stop = self.streak.fail()
    log.error(
      "%s %d skipped: loss %s, grad norm %s (%s; %d in a row); its samples: %s",
      self.what,
      step,
      metrics.get("loss"),
      metrics.get("grad_norm"),
      _refusal_cause(metrics),
      self.streak.in_a_row,
      ", ".join(ids) or "-",
    )
    if stop:
      raise NonFiniteError(
        f"{self.streak.in_a_row} {self.what}s in a row were refused as non-finite"
        f" (last: step {step}, {_refusal_cause(metrics)}); none was applied, so the"
        " parameters and the last checkpoint are those of the last finite step."
        f" Samples of the last one: {', '.join(ids) or '-'}"
      )


PROBE_TOKENS = 16


def probe_row(cfg) -> vlm.PackedInputs:
  """A fixed text row for `logits_finite`: PROBE_TOKENS // 2 tokens, then padding.

  Padded like a prompt in the rollout engine's prefill bucket or a sequence in
  a training row: masked positions take part in the attention's matmuls, and
  in a broken model their non-finite values reach the real tokens' logits
  through them (0 * inf), as they do in the engine.
  """
  ids = np.arange(1, PROBE_TOKENS // 2 + 1) % cfg.text.vocab_size
  seq = inputs_lib.sequence_from_tokens(ids, [], cfg)
  return inputs_lib.pack_row([seq], cfg, token_capacity=PROBE_TOKENS)


@functools.partial(jax.jit, static_argnums=0)
def _logits_finite(graphdef, params, row: vlm.PackedInputs) -> jax.Array:
  return jnp.isfinite(nnx.merge(graphdef, params).logits(row)).all()


def logits_finite(graphdef, params, row: vlm.PackedInputs) -> bool:
  """Whether the policy `params` gives finite logits over `row` (see `probe_row`).

  Finite parameters can still be broken: weights of 1e8 after a huge step
  overflow the activations, and the logits are NaN. One forward of a few
  tokens finds that before the weights are published or checkpointed. Every
  position counts, padding included: a healthy model's are finite too.
  """
  sharding = jax.tree.leaves(params)[0].sharding
  if isinstance(sharding, jax.sharding.NamedSharding):  # its mesh may span processes
    replicated = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    row = jax.device_put(row, replicated)
  return bool(_logits_finite(graphdef, params, row))


def make_stream_add(
  accumulate_fn,
  param_shardings,
  ref_logprobs_fn=None,
  ref_logprobs_sharding=None,
):
  """`add(params, acc, part, ref_params=None, prox_params=None) -> (acc, part)`.

  One part of a batch, unnormalized.

  A stream trainer sums loss, gradients and metric sums of each part with the
  loss normalized by 1 (`accumulate_fn(params, part, 1.0)`), and divides by
  the whole batch's token weight once, in `make_stream_apply`. Over the same
  sequences this equals `make_train_step` up to float summation order.

  Args:
    accumulate_fn: (params, batch, total) -> (loss, grads, sums), a strategy's
      `accumulate_fn` for the part's plan.
    param_shardings: the parameters' shardings; gradients are pinned to them.
    ref_logprobs_fn: (ref_params, batch) -> [M, D, C] logprobs (a strategy's
      `logprobs_fn`): with `ref_params` given, the part's `ref_logprobs` are
      computed in the same program, before the policy's pass.
    ref_logprobs_sharding: where those logprobs live (the batch's layout).

  Returns:
    The jitted `add`. With `prox_params` given it also sets the part's
    `prox_logprobs` to their logprobs (the same forward as the reference's):
    the policy before the batch's first update, which later updates of the
    batch clip around. It returns the part as trained, reference and prox
    logprobs filled, so such updates pass over it again without recomputing
    them.
  """

  def logprobs(p, part):
    out = ref_logprobs_fn(p, part)
    if ref_logprobs_sharding is not None:
      out = jax.lax.with_sharding_constraint(out, ref_logprobs_sharding)
    return out

  def add(params, acc, part: TrainBatch, ref_params=None, prox_params=None):
    if ref_params is not None:
      part = dataclasses.replace(part, ref_logprobs=logprobs(ref_params, part))
    if prox_params is not None:
      part = dataclasses.replace(part, prox_logprobs=logprobs(prox_params, part))
    loss, grads, sums = accumulate_fn(params, part, jnp.float32(1.0))
    grads = jax.lax.with_sharding_constraint(grads, param_shardings)
    # The part's sums whole before they meet the accumulator. Otherwise XLA
    # folds the add into their computation (the embedding's and the LM
    # head's gradients then sum onto the accumulator), so two parts added in
    # either order round differently and a step's update depends on which
    # group finished first. With more than two parts the order still decides
    # how the sum associates.
    part_sums = jax.lax.optimization_barrier((loss, grads, sums))
    return jax.tree.map(jnp.add, acc, part_sums), part

  return jax.jit(add, donate_argnums=(1,))


def make_stream_apply(
  tx: optax.GradientTransformation,
  state_shardings,
  normalizer: float | None = None,
  check_state: bool = True,
):
  """`apply(state, acc) -> (state, metrics)`: normalize the sums and update once.

  The loss and gradients are divided by `normalizer`, or by the batch's
  summed loss weights when it is None; metrics stay token means.
  """

  def apply(state: TrainState, acc):
    loss, grads, sums = acc
    weights = jnp.maximum(sums["tokens"], 1.0)
    divisor = weights if normalizer is None else jnp.float32(normalizer)
    grads = jax.tree.map(lambda g: g / divisor, grads)
    return apply_update(tx, state, loss / divisor, grads, sums, check_state)

  # Only the state is donated: the accumulator has no output of its shapes left
  # to alias once the state takes the parameter-shaped ones.
  return jax.jit(apply, donate_argnums=(0,), out_shardings=(state_shardings, None))


class DelayedMetrics:
  """Fetches each step's metrics only after the next step has been dispatched.

  `float(loss)` right after a step would block the host until the device
  finishes, stalling dispatch of the next step; reading one step late keeps
  the device queue full (nanodo, MaxText do the same).
  """

  def __init__(self) -> None:
    self._pending: tuple[int, dict] | None = None

  def push(self, step: int, metrics: dict) -> tuple[int, dict[str, float]] | None:
    """Queues this step's device metrics; returns the previous step's, on host."""
    previous, self._pending = self._pending, (step, metrics)
    return None if previous is None else self._fetch(previous)

  def flush(self) -> tuple[int, dict[str, float]] | None:
    previous, self._pending = self._pending, None
    return None if previous is None else self._fetch(previous)

  @staticmethod
  def _fetch(item):
    step, metrics = item
    return step, {k: float(v) for k, v in jax.device_get(metrics).items()}
