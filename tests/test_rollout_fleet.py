"""A fleet of three real server processes, launched the way a run config asks.

The launch spec is the `rollout.backend = sglang` path with our server module
as the command (SGLang itself is not installed here). The last test kills a
server mid-batch, so it runs last.
"""

import asyncio
from collections import defaultdict

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config, vlm
from fluxjax.rollout import factory, protocol, publish
from fluxjax.rollout import fleet as fleet_lib
from helpers import SERVER_CONTEXT as CONTEXT
from helpers import server_env


@pytest.fixture(scope="module")
def launched():
  cfg = ml_collections.ConfigDict(
    {
      "backend": "sglang",
      "urls": [],
      "num_servers": 3,
      "launch_timeout_s": 180,
      "launch": [
        "python",
        "-m",
        "fluxjax.rollout.server",
        "--preset",
        "tiny",
        "--seed",
        "0",
        "--num-slots",
        "4",
        "--context-length",
        str(CONTEXT),
      ],
    }
  )
  # make_backend launches with the parent's environment; give the servers a
  # plain one-device CPU backend instead of the fake test mesh.
  import os

  saved = dict(os.environ)
  os.environ.update(server_env())
  try:
    fleet, servers = factory.make_backend(cfg)
  finally:
    os.environ.clear()
    os.environ.update(saved)
  assert isinstance(fleet, fleet_lib.Fleet) and len(servers.urls) == 3
  yield servers
  servers.stop()


def body(ids, max_new=4, seed=None):
  sp = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}
  if seed is not None:
    sp["sampling_seed"] = seed
  return {"input_ids": [int(i) for i in ids], "sampling_params": sp, "return_logprob": True}


def test_groups_stay_on_one_server_and_spread_over_the_fleet(launched):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 490, 6 + g) for g in range(6)]

  async def go():
    async with fleet_lib.Fleet(launched.urls) as fleet:
      bodies = [body(p, seed=k) for p in prompts for k in range(4)]
      # No explicit group: the prompt itself is the affinity key.
      return [c async for c in fleet.generate_many(bodies)]

  servers_of = defaultdict(set)
  for i, c in asyncio.run(go()):
    assert c.finish_type == "length", c
    servers_of[i // 4].add(c.server)
  assert all(len(s) == 1 for s in servers_of.values()), servers_of
  assert len(set().union(*servers_of.values())) > 1  # least-loaded spreads the groups


def test_publish_reaches_every_server(launched, tmp_path):
  # Random weights without create_model's many small init compilations.
  graphdef, state = nnx.split(vlm.abstract_model(config.preset("tiny")))
  rng = np.random.default_rng(3)
  state = jax.tree.map(lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state)
  model = nnx.merge(graphdef, state)

  async def go():
    async with fleet_lib.Fleet(launched.urls) as fleet:
      report = await publish.publish_to_fleet(fleet, model, str(tmp_path), 7, dtype="float32")
      versions = await fleet.refresh_versions()
      out = await fleet.generate(body([1, 2, 3]))
      return report, versions, out

  report, versions, out = asyncio.run(go())
  print("publish phases (s):", {k: round(v, 3) for k, v in report.seconds.items()})
  assert not report.failed and all(t >= 0 for t in report.seconds.values())
  assert set(versions.values()) == {"7"} and out.weight_version == "7"


def test_killed_server_mid_batch_every_request_completes(launched):
  rng = np.random.default_rng(1)
  n = 24

  async def go():
    async with fleet_lib.Fleet(launched.urls, health_interval_s=0.5) as fleet:
      bodies = [body(rng.integers(0, 490, 8), max_new=40) for _ in range(n)]
      tasks = [asyncio.create_task(fleet.generate(b)) for b in bodies]
      while not all(s.inflight for s in fleet.servers):
        await asyncio.sleep(0.01)
      await asyncio.sleep(0.1)  # mid-batch: tokens are being generated everywhere
      busiest = max(fleet.servers, key=lambda s: len(s.inflight))
      victim = busiest.url
      # Requests that already finished on the victim legitimately came from it;
      # the property is that every request still in flight completes elsewhere.
      pending = [not t.done() for t in tasks]
      launched.procs[launched.urls.index(victim)].kill()
      results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
      await fleet.check_health()
      return victim, results, pending, fleet.retries, [s.healthy for s in fleet.servers]

  victim, results, pending, retries, healthy = asyncio.run(go())
  assert len(results) == n and any(pending)
  for c, was_pending in zip(results, pending):
    assert not isinstance(c, Exception), c
    assert c.finish_type == "length" and len(c.output_ids) == 40
    if was_pending and c.server == victim:
      raise AssertionError(f"request pending at the kill finished on the killed server {c}")
  assert retries > 0
  assert healthy.count(False) == 1


def test_a_continued_response_through_the_fleet_equals_the_uninterrupted_one(launched):
  """The fleet continues a partial rollout from prompt + its tokens like the
  embedded engine: with a sampling seed, the same tokens."""
  ids = np.random.default_rng(5).integers(0, 490, 9)

  async def go():
    async with fleet_lib.Fleet(launched.urls) as fleet:
      whole = await fleet.generate(body(ids, max_new=10, seed=4), "g")
      head = await fleet.generate(body(ids, max_new=4, seed=4), "g")
      tail = await fleet.generate(
        protocol.continue_body(body(ids, max_new=10, seed=4), head.output_ids), "g"
      )
      return whole, head, tail

  whole, head, tail = asyncio.run(go())
  assert head.output_ids + tail.output_ids == whole.output_ids
  np.testing.assert_allclose(head.logprobs + tail.logprobs, whole.logprobs, atol=1e-4, rtol=0)
