"""The stream trainer's update equals the synchronous step's (1e-6).

The same mixed batch (text, images, a video) is trained once by the jitted
synchronous step on the whole batch and once by the stream trainer fed in
three uneven parts, each planned and materialized on its own, with the RL loss
(decoupled importance weights, clipping) and FSDP-sharded state on the fake
8-device mesh. The optimizer is SGD with momentum, whose update is linear in
the gradient: Adam's first step is g / (|g| + eps), which turns a 1e-8
summation-order difference in a near-zero gradient entry into a different
sign, so it cannot show equality of the gradients at 1e-6.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from flax import nnx

from fluxjax import config_args
from fluxjax.models import inputs, sharded, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import train_step
from fluxjax.parallel.stream_trainer import StreamTrainer
from fluxjax.rl import losses, trajectories
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout import sampling_params
from helpers import PATCHES, completion, make_strategy, mixed_batch
from helpers import TINY as CFG

OPT = ml_collections.ConfigDict(
  dict(
    lr=1e-2,
    warmup_steps=0,
    total_steps=10,
    end_lr_frac=1.0,
    max_grad_norm=1e9,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.0,
    lr_scale_steps=(),
    lr_scales=(),
  )
)
SGD = optax.sgd(0.5, momentum=0.9)


def _fresh_state(mesh, tx):
  model = sharded.create_sharded_model(CFG, mesh, seed=4, log_table=False)
  return train_step.create_train_state(model, tx, mesh)


def _fresh_trainer(strategy, mesh, tx, loss_fn, **kwargs) -> StreamTrainer:
  """A stream trainer over a fresh train state (each update donates it)."""
  graphdef, state, shardings = _fresh_state(mesh, tx)
  return StreamTrainer(
    CFG, mesh, strategy, graphdef, state, shardings, tx, loss_fn, patch_buckets=(PATCHES,),
    **kwargs,
  )  # fmt: skip


def _flat(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _synchronous_step(strategy, mesh, tx, loss_fn, seqs):
  """(state, metrics) of the jitted step on the whole batch from a fresh state."""
  graphdef, state, shardings = _fresh_state(mesh, tx)
  plan = strategy.plan([len(s) for s in seqs], mesh.size)
  host = batch_lib.materialize(plan, seqs, CFG, PATCHES)
  step = train_step.make_train_step(
    graphdef,
    tx,
    state_shardings=shardings,
    accumulate_fn=strategy.accumulate_fn(mesh, plan, graphdef, shardings.params, loss_fn),
  )
  with jax.set_mesh(mesh):
    out = step(state, batch_lib.to_device(host, mesh))
  # Finish the synchronous step before the stream trainer dispatches its own
  # collective programs: two interleaved 8-device CPU programs can stall
  # XLA:CPU's collective rendezvous (docs/testing.md).
  return jax.block_until_ready(out)


@pytest.mark.parametrize(
  "name,sp,sync",
  [("packed_dp", 1, "layer"), pytest.param("ulysses", 2, "minibatch", marks=pytest.mark.slow)],
)
def test_stream_update_equals_synchronous_update(name, sp, sync, devices, mesh_for):
  strategy = make_strategy(name, sp, capacity=128, sync=sync)
  mesh = mesh_for(strategy)
  tx = SGD
  loss_fn = losses.make_loss_fn(config_args.load_config(arg="tiny").rl)
  seqs = mixed_batch(seed=5)
  # Behaviour logprobs near the policy's, so importance weights are not all capped.
  for s in seqs:
    s.old_logprobs_T = np.full(len(s), -6.2, np.float32)

  want_state, want = _synchronous_step(strategy, mesh, tx, loss_fn, seqs)

  trainer = _fresh_trainer(strategy, mesh, tx, loss_fn)
  for part in (seqs[:2], seqs[2:3], seqs[3:]):
    trainer.add(part)
  got = trainer.apply()
  assert not trainer.pending and int(got["parts"]) == 3 and int(got["sequences"]) == len(seqs)

  for k in ("loss", "tokens", "grad_norm", "is_weight", "clipfrac", "entropy"):
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-6, err_msg=k)
  assert 0.0 < float(want["is_weight"]) < 2.0  # the weights are really exercised
  # After SGD's first step its momentum trace is the gradient itself: compare
  # it per tensor by norm (as the strategy equality tests do), then the params.
  for a, b in zip(_flat(trainer.state.opt_state), _flat(want_state.opt_state)):
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < 1e-6, f"relative gradient error {err:.2e}"
  for a, b in zip(_flat(trainer.state.params), _flat(want_state.params)):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
  # The updated state keeps the FSDP shardings.
  assert [x.sharding for x in jax.tree.leaves(trainer.state.params)] == jax.tree.leaves(
    trainer.state_shardings.params
  )
  assert float(got["nonfinite"]) == 0.0

  # One NaN advantage makes the loss and gradients NaN: the same programs
  # then change nothing (parameters, optimizer state, step) and say so.
  before = _flat(trainer.state)
  seqs[1].advantages_T = seqs[1].advantages_T.copy()
  seqs[1].advantages_T[-1] = np.nan
  for part in (seqs[:2], seqs[2:3], seqs[3:]):
    trainer.add(part)
  refused = jax.device_get(trainer.apply())
  assert float(refused["nonfinite"]) == 1.0 and not np.isfinite(refused["loss"])
  after = _flat(trainer.state)
  assert len(after) == len(before)
  assert all(np.array_equal(a, b) for a, b in zip(after, before))


def test_two_parts_make_the_same_update_in_either_order(devices, mesh_for):
  """Bit for bit: a step's groups reach the trainer in the order they finish,
  which timing decides, and a resumed synchronous run must repeat an
  uninterrupted one (bench/kill_resume.py). While XLA folded the add into the
  parts' gradients, the embedding's and the LM head's differed in the last
  bits between the two orders."""
  strategy = make_strategy("packed_dp", capacity=128)
  mesh = mesh_for(strategy)
  loss_fn = losses.make_loss_fn(config_args.load_config(arg="tiny").rl)
  seqs = mixed_batch(seed=5)
  for s in seqs:
    s.old_logprobs_T = np.full(len(s), -6.2, np.float32)
  trainer = _fresh_trainer(strategy, mesh, SGD, loss_fn)
  start = jax.tree.map(jnp.copy, trainer.state)  # each update donates the state
  states = []
  for parts in ((seqs[:2], seqs[2:]), (seqs[2:], seqs[:2])):
    trainer.load_state(jax.tree.map(jnp.copy, start))
    for part in parts:
      trainer.add(part)
    trainer.apply()
    states.append(_flat(trainer.state))
  assert all(np.array_equal(a, b) for a, b in zip(*states))


def _single_device_logprobs(model, seqs):
  """log p(token t | tokens < t) of each sequence alone on one device (0 at t = 0).

  Each sequence is its own row, padded to one shape, so one program serves all.
  """
  tokens = max(len(s) for s in seqs)
  patches = max(max(s.inputs.num_patches for s in seqs), 4)
  logprobs = nnx.jit(lambda m, row, targets: m.token_logprobs(row, targets))
  out = []
  for seq in seqs:
    n = len(seq)
    row = inputs.pack_row([seq.inputs], CFG, token_capacity=tokens, patch_capacity=patches)
    targets = np.zeros((1, tokens), np.int32)
    targets[0, : n - 1] = seq.inputs.tokens_T[1:]
    logp = np.asarray(logprobs(model, row, targets))[0]
    out.append(np.concatenate([[0.0], logp[: n - 1]]).astype(np.float32))
  return out


@pytest.mark.slow
@pytest.mark.parametrize("name,sp,sync", [("ulysses", 2, "minibatch")])
def test_stream_reference_kl_equals_update_with_single_device_reference(
  name, sp, sync, devices, mesh_for
):
  """The reference forward inside `add` gives the KL update of host-computed logprobs.

  The reference is another model (seed 1); its logprobs are computed once per
  sequence on one device and given to the synchronous step in the batch, and
  computed by the stream trainer from the sharded reference parameters under
  the strategy's layout. Tolerance 1e-5: the two forwards differ by sharding
  (the strategy equality tests' bound).
  """
  strategy = make_strategy(name, sp, capacity=128, sync=sync)
  mesh = mesh_for(strategy)
  tx = SGD
  rl = config_args.load_config(arg="tiny").rl
  rl.kl_coef, rl.kl_estimator = 0.5, "k3"
  loss_fn = losses.make_loss_fn(rl)
  seqs = mixed_batch(seed=6)
  ref_model = vlm.create_model(CFG, seed=1)
  for s, ref_logprobs_T in zip(seqs, _single_device_logprobs(ref_model, seqs)):
    s.old_logprobs_T = np.full(len(s), -6.2, np.float32)
    s.ref_logprobs_T = ref_logprobs_T

  want_state, want = _synchronous_step(strategy, mesh, tx, loss_fn, seqs)

  for s in seqs:  # the stream trainer must compute them itself
    s.ref_logprobs_T = None
  sharded_ref = sharded.create_sharded_model(CFG, mesh, seed=1, log_table=False)
  trainer = _fresh_trainer(
    strategy, mesh, tx, loss_fn, ref_params=nnx.state(sharded_ref, nnx.Param)
  )
  for part in (seqs[:3], seqs[3:]):
    trainer.add(part)
  got = trainer.apply()

  assert float(want["kl"]) > 0.01  # the term is really exercised
  for k in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5, err_msg=k)
  for a, b in zip(_flat(trainer.state.opt_state), _flat(want_state.opt_state)):
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < 1e-5, f"relative gradient error {err:.2e}"


@pytest.mark.parametrize(
  "name,sp,sync",
  [("packed_dp", 1, "layer"), pytest.param("ulysses", 2, "minibatch", marks=pytest.mark.slow)],
)
def test_per_sequence_sums_follow_each_sequence_through_parts(name, sp, sync, devices, mesh_for):
  """Each sequence's sums land in its own slot, in the order the parts added them.

  Against each sequence computed alone on one device: its summed loss weight
  and its behaviour KL (k3 of pi / mu over its trained tokens, pi the policy
  before the update). Slots past the batch's sequences stay 0; the slots add
  up to the step's token means times its tokens.
  """
  strategy = make_strategy(name, sp, capacity=128, sync=sync)
  mesh = mesh_for(strategy)
  loss_fn = losses.make_loss_fn(config_args.load_config(arg="tiny").rl)
  seqs = mixed_batch(seed=5)
  rng = np.random.default_rng(0)
  for s in seqs:  # per-token behaviour logprobs, so each sequence's KL differs
    s.old_logprobs_T = rng.uniform(-7.0, -5.5, len(s)).astype(np.float32)
  slots = len(seqs) + 2
  trainer = _fresh_trainer(strategy, mesh, SGD, loss_fn, sequence_slots=slots)
  for part in (seqs[:2], seqs[2:3], seqs[3:]):
    trainer.add(part)
  got = jax.device_get(trainer.apply())
  per_seq = got[train_step.PER_SEQUENCE]

  n = len(seqs)
  weights = np.array([s.loss_mask_T[1:].sum() for s in seqs])
  np.testing.assert_allclose(per_seq["tokens"][:n], weights, rtol=1e-6)
  logp = _single_device_logprobs(vlm.create_model(CFG, seed=4), seqs)
  want_kl = []
  for s, lp in zip(seqs, logp):
    log_w = (lp - s.old_logprobs_T)[1:]
    want_kl.append((s.loss_mask_T[1:] * (np.exp(log_w) - log_w - 1.0)).sum())
  assert len(set(np.round(want_kl, 3))) == n  # a misplaced slot would show
  np.testing.assert_allclose(per_seq["behaviour_kl"][:n], want_kl, rtol=1e-4)
  for k, v in per_seq.items():
    assert np.all(v[n:] == 0.0), k
    want = float(got["tokens"]) if k == "tokens" else float(got[k]) * float(got["tokens"])
    np.testing.assert_allclose(v.sum(), want, rtol=1e-5, err_msg=k)


def test_more_sequences_than_slots_is_an_error():
  seqs = mixed_batch(seed=5)
  plan = make_strategy("packed_dp", capacity=128).plan([len(s) for s in seqs], 8)
  with pytest.raises(ValueError, match=r"exceed its 4 sequence slots"):
    batch_lib.materialize(plan, seqs, CFG, PATCHES, first_sequence=1, sequence_slots=4)


def test_apply_without_parts_is_an_error(devices, mesh_for):
  strategy = make_strategy("packed_dp", capacity=128)
  mesh = mesh_for(strategy)
  tx = train_step.make_optimizer(OPT)
  trainer = _fresh_trainer(strategy, mesh, tx, train_step.policy_gradient_loss)
  with pytest.raises(RuntimeError, match="nothing added"):
    trainer.apply()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7])
def test_on_policy_importance_weights_are_one_at_the_sampling_temperature(
  temperature, devices, mesh_for
):
  """Responses the engine samples at T, trained by the stream trainer at T: pi / mu = 1.

  The engine reports log softmax(logits / T); the trainer must score the same
  distribution, or every importance weight (and the staleness signal) is off.
  T = 0.7: at T = 1 a missing or doubled temperature would go unseen.
  """
  strategy = make_strategy("packed_dp", capacity=128)
  mesh = mesh_for(strategy)
  # The same parameters on one device serve the engine.
  engine = engine_lib.Engine(
    vlm.create_model(CFG, seed=4), Tokenizer.default(), num_slots=4, capacity=64, seed=0
  )
  rng = np.random.default_rng(3)
  groups = []
  for g in range(2):
    prompt = inputs.sequence_from_tokens(rng.integers(0, 490, 9 + g).tolist(), [], CFG)
    reqs = [
      engine_lib.EngineRequest(
        f"t{g}{j}",
        prompt,
        sampling_params.SamplingParams.from_dict(
          {"max_new_tokens": 6, "temperature": temperature, "sampling_seed": 11 + 2 * g + j}
        ),
      )
      for j in range(2)
    ]
    engine.generate(reqs)
    completions = [completion(r.output_ids, r.output_logprobs) for r in reqs]
    groups.append(trajectories.Group(f"g{g}", prompt, completions, [1.0, 0.0]))
  seqs = [s for g in groups for s in trajectories.group_sequences(g)]
  loss_fn = losses.make_loss_fn(config_args.load_config(arg="tiny").rl)

  def weights(trainer_temperature):
    trainer = _fresh_trainer(strategy, mesh, SGD, loss_fn, temperature=trainer_temperature)
    trainer.add(seqs)
    m = jax.device_get(trainer.apply())
    return float(m["behaviour_w"]), float(m["behaviour_w_sq"] - m["behaviour_w"] ** 2)

  mean, var = weights(temperature)
  # var is E[w^2] - E[w]^2 of float32 metrics: at w = 1 it resolves steps of
  # one float32 ulp (1.2e-7), so 4 ulps is "zero"; a temperature mismatch
  # moves single log-weights by more than 1e-2 (checked below).
  assert abs(mean - 1.0) < 1e-4 and var < 4 * float(np.finfo(np.float32).eps), (mean, var)
  if temperature != 1.0:  # the model's own distribution (T = 1) is not the behaviour one
    model = vlm.create_model(CFG, seed=4)
    s = seqs[0]
    targets = np.concatenate([s.inputs.tokens_T[1:], [0]])[None]
    at_one = np.asarray(model.token_logprobs(inputs.pack_row([s.inputs], CFG), targets))[0]
    response = s.loss_mask_T[1:] > 0
    assert np.abs(at_one[:-1][response] - s.old_logprobs_T[1:][response]).max() > 1e-2


@pytest.mark.slow
def test_several_updates_per_batch_clip_around_the_first_policy(devices, mesh_for):
  """PPO epochs: later updates pass over the stored parts, clipped around pi_prox.

  With one update the ratio is 1 and nothing is clipped; with three the
  policy moves between updates, so ratios leave 1 and the clip acts. pi_prox
  stays the policy before the first update: the decoupled weight
  w = pi_prox / mu, averaged over the updates, equals the one-update value.
  """
  strategy = make_strategy("packed_dp", capacity=128)
  mesh = mesh_for(strategy)
  seqs = mixed_batch(seed=5)
  for s in seqs:
    s.old_logprobs_T = np.full(len(s), -6.2, np.float32)

  def train(updates):
    rl = config_args.load_config(arg="tiny").rl
    rl.updates_per_batch = updates
    trainer = _fresh_trainer(
      strategy, mesh, SGD, losses.make_loss_fn(rl), updates_per_batch=updates
    )
    for part in (seqs[:2], seqs[2:]):
      trainer.add(part)
    metrics = jax.device_get(trainer.apply())
    return metrics, _flat(trainer.state.params)

  one, params_one = train(1)
  three, params_three = train(3)
  assert int(one["updates"]) == 1 and int(three["updates"]) == 3
  assert float(one["clipfrac"]) == 0.0 and float(one["ratio"]) == pytest.approx(1.0, abs=1e-6)
  assert float(three["clipfrac"]) > 0.01
  assert abs(float(three["ratio"]) - 1.0) > 1e-3
  np.testing.assert_allclose(float(three["is_weight"]), float(one["is_weight"]), rtol=1e-5)
  assert max(np.abs(a - b).max() for a, b in zip(params_one, params_three)) > 1e-4
  with pytest.raises(ValueError, match="updates_per_batch must be >= 1"):
    StreamTrainer(CFG, mesh, strategy, None, None, None, SGD, None, updates_per_batch=0)


def test_apply_divides_by_a_constant_normalizer_or_the_batch_weights():
  # The summed gradient of a part is divided by the batch's summed loss
  # weights (token-mean and the weighted modes) or by a constant
  # (token-sum-norm): the same sums give steps 1/tokens and 1/normalizer.
  tx = optax.sgd(1.0)
  grads = {"w": jnp.full((3,), 12.0)}
  sums = {"tokens": jnp.float32(4.0), "entropy": jnp.float32(8.0)}

  def step(normalizer):
    params = {"w": jnp.zeros((3,))}
    state = train_step.TrainState(params, tx.init(params), jnp.int32(0))
    apply = train_step.make_stream_apply(tx, None, normalizer)
    return apply(state, (jnp.float32(24.0), grads, sums))

  state, m = step(None)
  np.testing.assert_allclose(state.params["w"], -3.0)
  assert float(m["loss"]) == 6.0 and float(m["entropy"]) == 2.0  # token means
  state, m = step(48.0)
  np.testing.assert_allclose(state.params["w"], -0.25)
  assert float(m["loss"]) == 0.5 and float(m["entropy"]) == 2.0
