"""Every strategy and sync mode on the fake 8-device mesh equals the single-device reference.

The reference computes each sequence alone (inputs.pack_row, one row, no plan,
no materializer, no sharding) and normalizes by the total trained tokens; the
strategies go through planner -> materializer -> FSDP-sharded params -> the
jitted accumulation. Batches mix text, images and a video.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import inputs, sharded, vlm
from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import random_batch, strategies, train_step
from fluxjax.sharding import mesh as mesh_lib
from helpers import PATCHES, TINY, adamw_config, make_strategy, mixed_batch

CFG = TINY


def reference(model, seqs, loss_fn=train_step.policy_gradient_loss):
  """Loss and gradients with every sequence alone in its own row, on one device.

  Rows are padded to one shape so a single compiled function serves them all.
  """
  graphdef, params = nnx.split(model, nnx.Param)
  total = sum(float(s.loss_mask_T[1:].sum()) for s in seqs)
  width = max(len(s) for s in seqs)
  patch_cap = max(4, max(s.inputs.num_patches for s in seqs))
  shift = lambda x: np.pad(np.concatenate([x[1:], [0]]), (0, width - len(x)))[None].astype(
    np.float32
  )

  @jax.jit
  def loss_sum_and_grads(params, mb):
    def loss(params):
      m = nnx.merge(graphdef, params)
      logp, ent = m.token_logprobs(mb.inputs, mb.targets, with_entropy=True)
      per_token, _ = loss_fn(logp, ent, mb)
      return (per_token * mb.loss_mask).sum()

    return jax.value_and_grad(loss)(params)

  loss_sum, grads = 0.0, None
  for s in seqs:
    row = inputs.pack_row([s.inputs], CFG, token_capacity=width, patch_capacity=patch_cap)
    targets = shift(s.inputs.tokens_T).astype(np.int32)
    mb = batch_lib.TrainBatch(
      row,
      targets,
      shift(s.loss_mask_T),
      shift(s.advantages_T),
      shift(s.old_logprobs_T),
      shift(np.zeros(len(s))),
      shift(s.old_logprobs_T),
    )
    part, g = loss_sum_and_grads(params, mb)
    loss_sum = loss_sum + part
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
  return loss_sum / total, jax.tree.map(lambda g: g / total, grads)


def sharded_run(strategy, seqs, seed=1, balance_vision=False, capture=None):
  mesh = mesh_lib.make_mesh(sp_axes=strategy.sp_axes())
  model = sharded.create_sharded_model(CFG, mesh, seed=seed, log_table=False)
  graphdef, params = nnx.split(model, nnx.Param)
  plan = strategy.plan([len(s) for s in seqs], mesh.size)
  plan.validate()
  host = batch_lib.materialize(plan, seqs, CFG, PATCHES, balance_vision=balance_vision)
  with jax.set_mesh(mesh):
    device_batch = batch_lib.to_device(host, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, params)
    accumulate = strategy.accumulate_fn(
      mesh, plan, graphdef, shardings, train_step.policy_gradient_loss
    )
    if capture is not None:
      capture["jaxpr"] = jax.make_jaxpr(accumulate)(params, device_batch)
    loss, grads, _ = jax.jit(accumulate)(params, device_batch)
  return plan, loss, grads, params


def assert_grads_close(got, want, rtol=1e-5):
  flat_got = dict(nnx.to_flat_state(got))
  for key, var in nnx.to_flat_state(want):
    a, b = np.asarray(flat_got[key].get_value()), np.asarray(var.get_value())
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err < rtol, f"{key}: relative gradient error {err:.2e}"


@pytest.fixture(scope="module")
def ref_model():
  return vlm.create_model(CFG, seed=1)


@pytest.fixture(scope="module")
def mixed_reference(ref_model):
  seqs = mixed_batch()
  return seqs, reference(ref_model, seqs)


@pytest.mark.parametrize(
  "name,sp",
  [
    ("packed_dp", 1),
    ("ulysses", 2),
    pytest.param("ulysses", 4, marks=pytest.mark.slow),
    pytest.param("ulysses", 8, marks=pytest.mark.slow),
  ],
)
def test_strategy_equals_single_device_reference(name, sp, mixed_reference, devices):
  seqs, (want_loss, want_grads) = mixed_reference
  plan, loss, grads, params = sharded_run(make_strategy(name, sp), seqs)
  assert plan.strategy == name
  if sp > 1:
    assert all(r.degree == sp for rows in plan.microbatches for r in rows)
  # Parameters really were FSDP-sharded over all 8 devices.
  sharded = [v.get_value().sharding for _, v in nnx.to_flat_state(params)]
  assert sum(not s.is_fully_replicated for s in sharded) > len(sharded) // 2
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  assert_grads_close(grads, want_grads)


@pytest.mark.slow
def test_sequence_longer_than_the_cap(ref_model, devices):
  seqs = mixed_batch(seed=3, long=True)
  long_len = len(seqs[-1])
  with pytest.raises(
    ValueError,
    match=rf"sequence {len(seqs) - 1} has {long_len} tokens > "
    r"packed_dp capacity 96",
  ):
    make_strategy("packed_dp").plan([len(s) for s in seqs], 8)
  want_loss, want_grads = reference(ref_model, seqs)
  _, loss, grads, _ = sharded_run(make_strategy("ulysses", 4), seqs)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  assert_grads_close(grads, want_grads)


def test_config_switches_strategy_and_rejects_bad_ones():
  assert make_strategy("packed_dp").name == "packed_dp"
  s = make_strategy("ulysses", 4)
  assert (s.name, s.sp, s.sp_axes()) == ("ulysses", 4, (("sp", 4),))
  with pytest.raises(ValueError, match=r"unknown sharding\.strategy 'flex'"):
    make_strategy("flex")
  with pytest.raises(ValueError, match="power of two"):
    make_strategy("ulysses", 3)
  with pytest.raises(ValueError, match="does not divide the 8 query heads"):
    make_strategy("ulysses", 16)
  # sharding.sp is the largest degree of the sequence-parallel strategies;
  # packed_dp keeps sequences whole, so a config can swap to it alone.
  assert make_strategy("packed_dp", 2).sp_axes() == (("sp", 1),)


@pytest.mark.slow
def test_train_step_shards_state_and_compiles_once_per_bucket(devices, mesh_for):
  strategy = make_strategy("ulysses", 2)
  mesh = mesh_for(strategy)
  model = sharded.create_sharded_model(CFG, mesh, seed=0, log_table=False)
  opt = adamw_config()
  tx = train_step.make_optimizer(opt)
  graphdef, state, state_shardings = train_step.create_train_state(model, tx, mesh)
  # Optimizer moments live exactly where their parameters do.
  param_specs = [x.sharding for x in jax.tree.leaves(state.params)]
  adam = state.opt_state[1][0]
  for moments in (adam.mu, adam.nu):
    assert [x.sharding for x in jax.tree.leaves(moments)] == param_specs
  traces = []
  # Batches of different sizes: the plan buckets their capacity into 48 or 96
  # tokens and their microbatch count into a power of two; the patch capacity
  # into 64 or 128.
  step = train_step.make_train_step(
    graphdef,
    tx,
    attention_fn=strategy.attention_fn(mesh),
    state_shardings=state_shardings,
    on_trace=lambda: traces.append(1),
  )
  bucketing = make_strategy("ulysses", 2, capacity=96, buckets=(48, 96))
  seen, losses = set(), []
  with jax.set_mesh(mesh):
    for seed, n in [(0, 4), (1, 8), (2, 3), (3, 8), (4, 2)]:
      seqs = mixed_batch(seed)[:n]
      plan = bucketing.plan([len(q) for q in seqs], mesh.size)
      patches = batch_lib.patch_capacity_for(plan, seqs, CFG, (64, 128))
      seen.add((plan.capacity, plan.num_microbatches, patches))
      host = batch_lib.materialize(plan, seqs, CFG, patches)
      state, metrics = step(state, batch_lib.to_device(host, mesh))
      losses.append(metrics["loss"])
    # Gradients of the step are pinned to the parameter shardings.
    _, grads, _ = jax.jit(
      lambda p, b: train_step.accumulate(
        graphdef,
        p,
        b,
        attention_fn=strategy.attention_fn(mesh),
        param_shardings=state_shardings.params,
      )
    )(state.params, batch_lib.to_device(host, mesh))
  assert len(seen) >= 2, seen
  assert len(traces) == len(seen), f"{len(traces)} traces for buckets {seen}"
  assert int(state.step) == 5
  assert [x.sharding for x in jax.tree.leaves(state.params)] == param_specs
  for g, p in zip(jax.tree.leaves(grads), param_specs):
    assert g.sharding.is_equivalent_to(p, g.ndim), (g.sharding.spec, p.spec)
  assert all(np.isfinite(float(x)) for x in losses)


class _HalfUlysses(strategies.Ulysses):
  """A strategy of one's own in one class: Ulysses over half the degree asked for."""

  name = "half_ulysses"

  def _plan(self, lengths, num_devices, buckets):
    halved = dataclasses.replace(self, sp=max(self.sp // 2, 1))
    return strategies.Ulysses._plan(halved, lengths, num_devices, buckets)


def test_a_strategy_of_ones_own_is_a_class_named_by_module_and_class():
  s = make_strategy(f"{__name__}:_HalfUlysses", 4)
  assert type(s) is _HalfUlysses and s.sp_axes() == (("sp", 4),)
  assert {r.degree for rows in s.plan([40, 50, 60], 8).microbatches for r in rows} == {2}
  assert set(strategies.STRATEGIES) == {"packed_dp", "ulysses", "flex_ulysses"}
  with pytest.raises(ValueError, match="is not a Strategy subclass"):
    make_strategy("fluxjax.parallel.strategies:resolve_sp", 4)
  with pytest.raises(ValueError, match="a name of its own"):
    strategies.register(_HalfUlysses.__mro__[1])  # "ulysses" is taken


def test_delayed_metrics_return_the_previous_step():
  delayed = train_step.DelayedMetrics()
  assert delayed.push(1, {"loss": jnp.array(1.5)}) is None
  step, values = delayed.push(2, {"loss": jnp.array(0.5)})
  assert step == 1 and values == {"loss": 1.5} and isinstance(values["loss"], float)
  assert delayed.flush() == (2, {"loss": 0.5})
  assert delayed.flush() is None


@pytest.mark.parametrize("long", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_flex_ulysses_equals_single_device_reference(long, mixed_reference, ref_model, devices):
  """Several degrees in one microbatch (levels 4/2/1 or 8/.../1), HSF all-to-alls."""
  if long:
    seqs = mixed_batch(seed=3, long=True)
    want_loss, want_grads = reference(ref_model, seqs)
  else:
    seqs, (want_loss, want_grads) = mixed_reference
  strategy = make_strategy("flex_ulysses", 8, capacity=64, buckets=(16, 32, 64))
  plan, loss, grads, _ = sharded_run(strategy, seqs)
  degrees = {r.degree for rows in plan.microbatches for r in rows if r.seqs}
  assert len(degrees) >= 2 and max(degrees) > 1, plan.describe()
  if long:  # the long sequence does not fit one device's capacity: it must be split
    longest = max(range(len(seqs)), key=lambda i: len(seqs[i]))
    assert len(seqs[longest]) > 64
    assert any(longest in r.seqs and r.degree > 1 for rows in plan.microbatches for r in rows)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  assert_grads_close(grads, want_grads)


@pytest.mark.parametrize(
  "name,sp", [("packed_dp", 1), pytest.param("flex_ulysses", 8, marks=pytest.mark.slow)]
)
def test_vision_balancing_equals_reference(name, sp, mixed_reference, devices):
  """Images and video frames spread by patch count; embeddings routed back."""
  seqs, (want_loss, want_grads) = mixed_reference
  capacity, buckets = (96, ()) if name == "packed_dp" else (64, (16, 32, 64))
  strategy = make_strategy(name, sp, capacity=capacity, buckets=buckets)
  plan = strategy.plan([len(s) for s in seqs], 8)
  plain = batch_lib.vision_route_stats(plan, seqs, CFG, balance=False)
  balanced = batch_lib.vision_route_stats(plan, seqs, CFG, balance=True)
  assert balanced["patch_max_over_mean"] < plain["patch_max_over_mean"]
  assert balanced["embeddings_moved"] > 0  # the gather route really is exercised
  # The video's frames land on different devices.
  units = batch_lib.vision_assignment(plan, seqs, CFG, balance=True)[0][0]
  video_devices = {d for d, us in units.items() for u in us if u.item.kind == "video"}
  assert len(video_devices) == 2
  _, loss, grads, _ = sharded_run(strategy, seqs, balance_vision=True)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  assert_grads_close(grads, want_grads)


def _collectives(jaxpr, inside_loop=False, found=None):
  """(primitive name, inside a while/scan body?) for every collective."""
  found = [] if found is None else found
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in (
      "all_gather",
      "psum_scatter",
      "reduce_scatter",
      "psum",
      "all_to_all",
      "psum_invariant",
      "all_reduce",
    ):
      found.append((name, inside_loop))
    loop = inside_loop or name in ("while", "scan")
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _collectives(sub.jaxpr, loop, found)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _collectives(sub, loop, found)
  return found


@pytest.mark.parametrize(
  "name,sp",
  [
    pytest.param("packed_dp", 1, marks=pytest.mark.slow),
    ("ulysses", 4),
    pytest.param("flex_ulysses", 8, marks=pytest.mark.slow),
  ],
)
def test_minibatch_sync_equals_reference(name, sp, mixed_reference, ref_model, devices):
  seqs, (want_loss, want_grads) = mixed_reference
  capacity, buckets = (
    (64, ()) if name == "packed_dp" else ((96, ()) if name == "ulysses" else (64, (16, 32, 64)))
  )
  strategy = make_strategy(name, sp, capacity=capacity, buckets=buckets, sync="minibatch")
  capture = {}
  _, loss, grads, _ = sharded_run(strategy, seqs, capture=capture)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  assert_grads_close(grads, want_grads)
  found = _collectives(capture["jaxpr"].jaxpr)
  gathers = [inside for n, inside in found if n == "all_gather"]
  scatters = [inside for n, inside in found if n in ("psum_scatter", "reduce_scatter")]
  # Parameters are gathered and their gradients reduce-scattered outside the
  # microbatch loop (in-loop scatters, if any, are activations: the transpose
  # of the cross-device vision gather).
  assert [g for g in gathers if not g] and [s for s in scatters if not s]
  if name == "packed_dp":
    # LB-Mini rows: each device loops over its own microbatches (a while loop
    # with a per-device trip count) with no collective inside.
    assert not any(inside for _, inside in found), found
    loops = [e for e in capture["jaxpr"].jaxpr.eqns if e.primitive.name == "shard_map"]
    body = loops[0].params["jaxpr"]
    assert any(e.primitive.name == "while" for e in body.eqns)


@pytest.mark.slow
def test_flex_minibatch_sync_with_vision_balancing_and_a_long_sequence(ref_model, devices):
  """All switches at once: levels, balanced vision, minibatch sync, over-capacity sequence."""
  seqs = mixed_batch(seed=3, long=True)
  want_loss, want_grads = reference(ref_model, seqs)
  cfg = ml_collections.ConfigDict(
    dict(
      strategy="flex_ulysses",
      sp=8,
      capacity=64,
      capacity_buckets=(16, 32, 64),
      sync="minibatch",
      balance_vision=True,
    )
  )
  strategy = strategies.get_strategy(cfg, CFG)
  plan, loss, grads, _ = sharded_run(strategy, seqs, balance_vision=True)
  assert max(len(s) for s in seqs) > 64
  assert batch_lib.vision_route_stats(plan, seqs, CFG, balance=True)["embeddings_moved"] > 0
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
  assert_grads_close(grads, want_grads)


def test_the_default_patch_ladder_reaches_a_video_past_any_fixed_top():
  # A device encodes a video whole where its first token sits: 73,728 patches
  # here, past the 65,536 a fixed ladder of nine doublings from 256 ends at.
  rng = np.random.default_rng(0)
  seqs = [random_batch.random_sequence(TINY, rng, 8, [("video", (2, 128, 288))])]
  plan = make_strategy("packed_dp", capacity=32768).plan([len(seqs[0])], 8)
  assert batch_lib.patch_capacity_for(plan, seqs, TINY) == 131072
  with pytest.raises(ValueError, match="73728 patches per device exceed the largest"):
    batch_lib.patch_capacity_for(plan, seqs, TINY, tuple(256 * 2**k for k in range(9)))
