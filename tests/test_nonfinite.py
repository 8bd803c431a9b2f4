"""Non-finite numbers anywhere stop the run cleanly, naming the step that made them.

* the train step refuses an update whose result is non-finite (a finite
  gradient times a huge learning rate) exactly as one with a non-finite
  gradient: state bitwise unchanged, sharded or not;
* finite but huge weights (1e8) give NaN logits: the coordinator's probe
  refuses to publish them, naming the RL step;
* the engine samples nothing from non-finite logits and says so, in process
  and over HTTP (the client raises the typed error again), and a response
  whose logprobs are null or absent is an error naming why;
* the main job at lr 1e8 stops with an error naming the step, before that
  step's weights are published or checkpointed.
"""

import asyncio
import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fluxjax import faults
from fluxjax.models import config, inputs
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import train_step
from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import loop, metrics, reward_pool, trajectories
from fluxjax.rollout import backend as backend_lib
from fluxjax.rollout import embedded, sampling_params
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout.client import SGLangClient
from fluxjax.rollout.protocol import GenerateRequest, NonFiniteLogits
from fluxjax.settings import Settings
from helpers import ScriptedRollout, completion, make_strategy, tiny_run_config


def _flat(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_an_update_that_makes_parameters_nonfinite_is_refused_under_sharding(devices):
  mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
  shard = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  params = {"w": jax.device_put(jnp.ones((8, 4), jnp.float32), shard)}
  grads = {"w": jax.device_put(jnp.full((8, 4), 10.0, jnp.float32), shard)}
  sums = {"tokens": jnp.float32(4.0)}

  def update(lr):
    tx = optax.sgd(lr, momentum=0.9)
    state = train_step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    step = jax.jit(lambda s, g: train_step.apply_update(tx, s, jnp.float32(0.5), g, sums))
    return state, *step(state, grads)

  # A finite step applies.
  state, new, m = update(1e-3)
  assert float(m["nonfinite"]) == 0.0 and int(new.step) == 1
  np.testing.assert_allclose(np.asarray(new.params["w"]), 1.0 - 1e-2)
  # 1 - 1e38 * 10 overflows to -inf though the loss and gradient are finite.
  state, new, m = update(1e38)
  assert np.isfinite(float(m["loss"])) and np.isfinite(float(m["grad_norm"]))
  assert float(m["nonfinite"]) == 1.0 and float(m["nonfinite_state"]) == 1.0
  before, after = _flat(state), _flat(new)
  assert len(after) == len(before)
  assert all(np.array_equal(a, b) for a, b in zip(after, before))
  assert new.params["w"].sharding.is_equivalent_to(shard, 2)
  # The host's guard names the cause.
  guard = train_step.NonFiniteGuard(faults.Streak("nonfinite_steps", limit=1))
  with pytest.raises(train_step.NonFiniteError, match="made a parameter or optimizer moment"):
    guard.observe(3, jax.device_get(m))


def test_an_update_checked_on_its_inputs_only_applies_in_place():
  # optim.refuse_nonfinite = "inputs": no copy of the state beside the old
  # (XLA's memory analysis), non-finite gradients still refused, and the
  # one case it leaves to the publisher, an overflowing learning rate, applies.
  sums = {"tokens": jnp.float32(4.0)}

  def compiled(lr, check_state, start=1.0):
    params = {"w": jnp.full((1 << 20,), start, jnp.float32)}  # 4 MiB; 12 with AdamW's moments
    tx = optax.adamw(lr)
    state = train_step.TrainState(params, tx.init(params), jnp.zeros((), jnp.int32))
    step = jax.jit(
      lambda s, g: train_step.apply_update(tx, s, jnp.float32(0.5), g, sums, check_state),
      donate_argnums=0,
    )
    return state, step.lower(state, params).compile()

  state_bytes = 3 * (4 << 20)
  temps = {c: compiled(1e-3, c)[1].memory_analysis().temp_size_in_bytes for c in (True, False)}
  assert temps[True] >= state_bytes and temps[False] < (1 << 20), temps
  for grad, lr, start, applied in (
    (jnp.nan, 1e-3, 1.0, False),
    (1.0, 1e-3, 1.0, True),
    (-1.0, 1e38, 3e38, True),  # finite inputs: it applies, and 3e38 + 1e38 overflows
  ):
    grads = {"w": jnp.full((1 << 20,), grad, jnp.float32)}
    state, step = compiled(lr, False, start)
    before = np.asarray(state.params["w"]).copy()
    new, m = step(state, grads)
    assert float(m["nonfinite"]) == (0.0 if applied else 1.0) and int(new.step) == int(applied)
    assert np.array_equal(np.asarray(new.params["w"]), before) != applied
  assert not np.isfinite(np.asarray(new.params["w"])).all()
  with pytest.raises(ValueError, match=r"optim\.refuse_nonfinite must be one of"):
    train_step.checks_state(
      dataclasses.replace(Settings.of(tiny_run_config(2)).optim, refuse_nonfinite="all")
    )


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model


def _huge(model):
  """The model after one Adam step at lr 1e8: every weight about +-1e8, all finite."""
  graphdef, state = nnx.split(model)
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda x: x + 1e8 * np.sign(rng.standard_normal(x.shape)), state)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  return nnx.merge(graphdef, state)


def test_finite_but_huge_weights_give_nonfinite_logits_and_the_probe_sees_it(model):
  row = train_step.probe_row(model.cfg)
  for m, finite in ((model, True), (_huge(model), False)):
    graphdef, params = nnx.split(m, nnx.Param)
    assert train_step.logits_finite(graphdef, params, row) is finite


def _seq(cfg, n=6):
  return inputs.sequence_from_tokens(np.arange(5, 5 + n), [], cfg)


@pytest.mark.parametrize("steps", [1, 4])
def test_the_engine_refuses_nonfinite_logits(model, steps):
  tok = Tokenizer.default()
  # One slot: every request below runs in it, after the refused ones.
  eng = engine_lib.Engine(
    model,
    tok,
    num_slots=1,
    capacity=64,
    prefill_buckets=(16, 64),
    num_continuous_decode_steps=steps,
  )
  sp = sampling_params.SamplingParams.from_dict(
    {"max_new_tokens": 20, "temperature": 1.0, "ignore_eos": True}
  )
  nan = jax.tree.map(lambda x: np.full(x.shape, np.nan, x.dtype), nnx.split(model)[1])

  # NaN weights swapped in mid-request: the tokens before stay, the first
  # the next decode call samples is refused (past the prompt's prefill
  # bucket of 16). Output token 0 comes from the prefill and calls start at
  # tokens 1, 1 + steps, ...: the swap after 12 tokens refuses token 12 at
  # one step per call, token 13 at four (the call that sampled 9-12 ends).
  def swap_after_twelve(req):
    if len(req.output_ids) == 12 and req.finish_reason is None:
      eng.update_params(nan, "v-nan")

  req = engine_lib.EngineRequest("r-decode", _seq(model.cfg), sp, on_event=swap_after_twelve)
  with pytest.raises(NonFiniteLogits, match="weight version v-nan") as refused:
    eng.generate([req])
  first_refused = 1 + steps * -(-11 // steps)
  assert refused.value.rid == "r-decode" and refused.value.token == first_refused
  assert len(req.output_ids) == first_refused and np.isfinite(req.output_logprobs).all()
  out = engine_lib.response(req, tok, eng.weight_version)
  assert out.finish_type == "abort" and "non-finite logits" in out.finish_reason["message"]
  # The abort carries the refusal's fields, which the HTTP client raises again.
  again = NonFiniteLogits.of(out)
  assert (again.rid, again.weight_version, again.token) == ("r-decode", "v-nan", first_refused)
  # Finite weights of 1e8: the prompt's padded prefill gives NaN logits, refused.
  eng.update_params(nnx.split(_huge(model))[1], "v-huge")
  with pytest.raises(NonFiniteLogits, match="'r-prefill' \\(output token 0\\)"):
    eng.generate([engine_lib.EngineRequest("r-prefill", _seq(model.cfg), sp)])
  # Good weights again: the slot serves in full (no NaN left in its cache).
  eng.update_params(nnx.split(model)[1], "v-good")
  (ok,) = eng.generate([engine_lib.EngineRequest("r-ok", _seq(model.cfg), sp)])
  assert ok.error is None and len(ok.output_ids) == 20


def test_the_embedded_backend_raises_the_refusal(model):
  tok = Tokenizer.default()
  rollout = embedded.EmbeddedRollout(_huge(model), tok, num_slots=2, context_length=64)
  rollout.engine.weight_version = "7"
  request = GenerateRequest.of([5, 6, 7, 8], {"max_new_tokens": 4}, rid="r1")
  try:
    with pytest.raises(NonFiniteLogits, match="weight version 7") as refused:
      asyncio.run(rollout.generate(request))
  finally:
    asyncio.run(rollout.close())
  try:
    raise RuntimeError("rollout round failed") from refused.value
  except RuntimeError as chained:
    assert NonFiniteLogits.among_causes(chained) is refused.value
  assert NonFiniteLogits.among_causes(RuntimeError("an unrelated failure")) is None


def test_the_http_client_raises_the_refusal_its_server_answered():
  """A server's engine refused the request: its answer is an abort carrying
  the refusal's fields, which the client reads once into the typed error; an
  abort for another reason (a pause) stays a completion."""
  refusal = NonFiniteLogits("r1", "7", 2)
  answer = completion([5, 6], [-1.0, -2.0], version="7")
  client = SGLangClient("http://127.0.0.1:1")

  def answering(finish_reason):
    body = dataclasses.replace(answer, rid="r1", finish_reason=finish_reason).to_body(True)

    async def request(method, path, body_sent=None, timeout_s=None):
      return 200, json.loads(json.dumps(body))

    client.request = request

  request = GenerateRequest.of([5, 6, 7, 8], {"max_new_tokens": 4}, rid="r1")
  answering(refusal.finish_reason())
  with pytest.raises(NonFiniteLogits, match="weight version 7") as e:
    asyncio.run(client.generate(request))
  assert (e.value.rid, e.value.weight_version, e.value.token) == ("r1", "7", 2)
  answering({"type": "abort", "message": str(refusal), "status_code": None, "err_type": None})
  assert asyncio.run(client.generate(request)).finish_type == "abort"


def test_a_response_without_logprobs_names_why():
  prompt = inputs.sequence_from_tokens([5, 6], [], config.preset("tiny"))

  def error(c):
    with pytest.raises(trajectories.MissingLogprobs) as e:
      trajectories.group_sequences(trajectories.Group("s", prompt, [c], [1.0]))
    return e.value

  nulls = error(completion([1, 2, 3], [-1.0, None, None], version="5"))
  assert nulls.nonfinite and nulls.versions == ["5"]
  assert "2 of its 3 tokens (first at token 1)" in str(nulls)
  assert "weight version(s) 5" in str(nulls) and "non-finite logits" in str(nulls)
  absent = error(completion([1, 2], []))
  assert not absent.nonfinite and "return_logprob" in str(absent)
  short = error(completion([1, 2], [-1.0]))
  assert not short.nonfinite and "1 for 2 tokens" in str(short)


class _Policy:
  """What publishing reads of the policy worker: its graph and staged weights."""

  def __init__(self, model):
    self.cfg = model.cfg
    self.graphdef, self.params = nnx.split(model, nnx.Param)
    self.strategy = make_strategy("packed_dp", capacity=256)

  def stage(self, version=None):
    return self.params


class _NoData:
  store = pool = None

  def next_batch(self):
    return []

  def release(self, samples):
    pass

  def get_state(self):
    return {}

  def set_state(self, state):
    pass


def test_the_coordinator_publishes_no_nonfinite_policy_and_names_its_step(model):
  cfg = tiny_run_config(8)
  policy = _Policy(model)
  backend = ScriptedRollout()
  with (
    backend_lib.LoopThread() as thread,
    thread.running(backend),
    reward_pool.RewardScheduler(1, "constant") as scheduler,
    coordinator_lib.Coordinator(
      Settings.of(cfg), Tokenizer.default(), policy, _NoData(), backend, scheduler, thread=thread
    ) as c,
  ):
    c.restore({"version": 3, "steps": 4}, {})
    c.publish(new_version=False)
    assert [v for _, v in backend.published] == [3]
    # A response sampled by version 3 with null logprobs: the error names step 4.
    group = trajectories.Group(
      "s", _seq(model.cfg, 2), [completion([1, 2], [None, -1.0], version="3")], [1.0]
    )
    with pytest.raises(train_step.NonFiniteError, match="RL step 4 made the policy non-finite"):
      c.sequences([group])
    # Weights with NaN logits are not published; the version stays.
    policy.params = nnx.split(_huge(model), nnx.Param)[1]
    with pytest.raises(train_step.NonFiniteError, match="RL step 4 made the policy non-finite"):
      c.publish()
    assert [v for _, v in backend.published] == [3] and c.version == 3


@pytest.mark.slow
def test_a_huge_learning_rate_stops_the_run_at_the_step_that_broke_the_policy(
  tmp_path, monkeypatch
):
  """The main job at lr 1e8, max_grad_norm 1e30: the first update with a
  gradient leaves weights of about 1e8, finite, whose logits are NaN. The run
  stops in that step with an error naming it; its weights reach neither the
  engine nor a checkpoint."""
  published = []
  publish = embedded.EmbeddedRollout.publish

  async def recording_publish(self, model, version):
    published.append(version)
    return await publish(self, model, version)

  monkeypatch.setattr(embedded.EmbeddedRollout, "publish", recording_publish)
  c = tiny_run_config(8)
  c.optim.lr, c.optim.max_grad_norm = 1e8, 1e30
  c.eval.every, c.eval.greedy = 0, False
  c.rl.prompts_per_step, c.rl.responses_per_prompt = 2, 4
  c.data.synth_train = 16
  c.rl.reward.fn = "fault_rewards:signal_unless_numeric"  # a gradient without SFT
  workdir = str(tmp_path / "run")
  with pytest.raises(train_step.NonFiniteError, match=r"RL step (\d+) made the policy") as e:
    loop.run(c, workdir)
  bad = int(re.search(r"RL step (\d+)", str(e.value)).group(1))
  assert "was not published" in str(e.value)
  # Steps before it completed (checkpoint.every = 1, the last 3 kept); nothing
  # of it or later was recorded or checkpointed.
  records = [json.loads(line) for line in open(os.path.join(workdir, metrics.JSONL))]
  assert max(r["step"] for r in records) == bad - 1
  steps = {int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit()}
  assert steps == set(range(max(1, bad - 3), bad))
  # Version 0 at the start and one per earlier step (each with finite logits).
  assert published == list(range(bad))
