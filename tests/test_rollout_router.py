"""The real SGLang router (sglang-router) in front of two fluxjax servers.

Generation goes through the router, which adds fields of SGLang's current
GenerateReqInput (model, background, no_logs, return_bytes, return_entropy,
...) to every request; weight updates go to each worker directly. The last
test kills a worker, so it runs last.
"""

import asyncio
import time

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config, vlm
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.rollout import launcher
from fluxjax.rollout import router as router_lib
from fluxjax.rollout.protocol import GenerateRequest
from helpers import TINY_SERVER, server_env
from helpers import generate_request as body

# A dead worker is dropped after one failed check a second apart.
ROUTER = [
  "python",
  "-m",
  "sglang_router.launch_router",
  "--policy",
  "cache_aware",
  "--health-check-interval-secs",
  "1",
  "--health-failure-threshold",
  "1",
  "--log-level",
  "warn",
]


@pytest.fixture(scope="module")
def routed(tmp_path_factory):
  logs = tmp_path_factory.mktemp("logs")
  servers = launcher.launch_servers(TINY_SERVER, 2, env=server_env(), timeout_s=180, log_dir=logs)
  try:
    servers.router = router_lib.launch_router(ROUTER, servers.urls, log_dir=str(logs))
    # Each process writes to its own file in the run's log folder.
    assert sorted(p.name for p in logs.iterdir()) == ["router0.log", "server0.log", "server1.log"]
    yield servers
  finally:
    servers.stop()


async def listed(fleet, count: int) -> list[str]:
  """The router's workers once it lists `count` (it adds each after its first
  health check, and its changes are queued jobs)."""
  for _ in range(100):
    urls = await fleet.refresh_workers()
    if len(urls) == count:
      return sorted(urls)
    await asyncio.sleep(0.1)
  raise AssertionError(f"the router never listed {count} workers: {urls}")


def test_the_fleet_reads_the_workers_from_the_router(routed):
  async def go():
    async with router_lib.RoutedFleet(routed.router.urls[0]) as fleet:
      await listed(fleet, 2)
      return sorted(s.url for s in fleet.servers)

  assert asyncio.run(go()) == sorted(routed.urls)


def test_single_and_batched_generate_through_the_router(routed):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, 490, 5 + i).tolist() for i in range(3)]

  # The router takes one sampling_params object for a whole batch (its
  # schema refuses SGLang's per-item list); greedy makes items comparable.
  greedy = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}

  async def go():
    async with router_lib.RoutedFleet(routed.router.urls[0]) as fleet:
      singles = [await fleet.generate(GenerateRequest.of(p, greedy)) for p in prompts]
      batch = {"input_ids": prompts, "sampling_params": greedy, "rid": "batch"}
      _, answers = await fleet.router.request("POST", "/generate", batch)
      return singles, answers

  singles, answers = asyncio.run(go())
  assert all(c.finish_type == "length" and len(c.output_ids) == 4 for c in singles)
  # SGLang's batch contract: a list in input order, rids "<rid>_<i>", each
  # item the tokens of its single request.
  assert isinstance(answers, list) and len(answers) == 3
  assert [a["meta_info"]["id"] for a in answers] == ["batch_0", "batch_1", "batch_2"]
  assert [a["output_ids"] for a in answers] == [c.output_ids for c in singles]


def test_a_publish_reaches_every_worker_and_generation_reports_it(routed, tmp_path):
  graphdef, state = nnx.split(vlm.abstract_model(config.preset("tiny")))
  rng = np.random.default_rng(3)
  state = jax.tree.map(lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state)
  model = nnx.merge(graphdef, state)

  async def go():
    fleet = router_lib.RoutedFleet(routed.router.urls[0], weights_root=str(tmp_path))
    async with fleet:
      fleet.weights_dtype = "float32"
      report = await fleet.publish(model, 5)
      versions = await fleet.refresh_versions()
      outs = [await fleet.generate(body([1, 2, 3 + i])) for i in range(6)]
      return report, versions, outs

  report, versions, outs = asyncio.run(go())
  assert not report.failed, report
  assert sorted(versions) == sorted(routed.urls) and set(versions.values()) == {"5"}
  assert {o.weight_version for o in outs} == {"5"}


def test_a_worker_the_fleet_has_down_is_out_of_the_router_until_it_is_back(routed, tmp_path):
  """The router readmits a worker by its own health check, whatever weights it
  serves; a worker the fleet marks down (it missed a publish) is taken out of
  the router, and added back once its rejoin has refit it."""
  graphdef, state = nnx.split(vlm.abstract_model(config.preset("tiny")))
  rng = np.random.default_rng(4)
  state = jax.tree.map(lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state)
  model = nnx.merge(graphdef, state)

  async def go():
    fleet = router_lib.RoutedFleet(
      routed.router.urls[0], weights_root=str(tmp_path), health_interval_s=600
    )
    async with fleet:
      await fleet.publish(model, 6)
      late = next(s for s in fleet.servers if s.url == routed.urls[1])
      fleet._mark_down(late, "test: down during the next publish")
      await fleet.route_healthy()
      alone = await listed(fleet, 1)
      missed = await fleet.publish(model, 7)  # the other worker only
      outs = [await fleet.generate(body([5, 6, 7 + i])) for i in range(4)]
      await fleet.check_health()  # answers again: refit to v7, then routed
      back = await listed(fleet, 2)
      return alone, missed, outs, back, late.weight_version, await fleet.refresh_versions()

  alone, missed, outs, back, late_version, versions = asyncio.run(go())
  assert alone == [routed.urls[0]] and not missed.failed
  assert {o.weight_version for o in outs} == {"7"}  # the router sent none to the late one
  assert back == sorted(routed.urls) and late_version == "7"
  assert set(versions.values()) == {"7"}


def test_workers_behind_the_router_are_checked_against_the_trainer(routed):
  """A routed fleet checks the router's workers on start as a plain fleet
  does: the trainer's model passes, another one is refused by name."""

  async def start(model):
    async with router_lib.RoutedFleet(routed.router.urls[0], served_model=model) as fleet:
      return len(fleet.servers)

  tiny = fleet_lib.ServedModel.of("preset:tiny", config.preset("tiny"))
  assert asyncio.run(start(tiny)) == 2
  other = fleet_lib.ServedModel.of("preset:7b", config.preset("7b"))
  with pytest.raises(ValueError, match=r"serves another model .* Start it with --preset 7b"):
    asyncio.run(start(other))


def test_a_worker_added_later_that_preprocesses_otherwise_is_taken_out(routed, tmp_path):
  """A worker added to the router after the start is checked as it joins:
  one that preprocesses media otherwise leaves the fleet and the router."""

  async def limits():
    async with router_lib.RoutedFleet(routed.router.urls[0], health_interval_s=3600) as fleet:
      return (await fleet.servers[0].client.server_info())["vision_limits"]

  theirs = asyncio.run(limits())
  frames = str(theirs["video_max_frames"] + 1)
  other = launcher.launch_servers(
    [*TINY_SERVER, "--video-max-frames", frames],
    1,
    env=server_env(),
    timeout_s=180,
    log_dir=str(tmp_path),
  )

  async def go():
    async with router_lib.RoutedFleet(
      routed.router.urls[0], vision_limits=theirs, health_interval_s=3600
    ) as fleet:
      await fleet.router.request("POST", "/workers", {"url": other.urls[0]})
      seen = False
      for _ in range(100):  # the router adds it after its first health check
        if seen := other.urls[0] in await fleet.refresh_workers():
          break
        await asyncio.sleep(0.1)
      mine = [s.url for s in fleet.servers]
      return seen, mine, await listed(fleet, 2)

  try:
    seen, mine, routed_now = asyncio.run(go())
  finally:
    other.stop()
  assert seen and sorted(mine) == sorted(routed.urls)  # listed, then refused
  assert routed_now == sorted(routed.urls)  # and the router no longer lists it


def test_a_router_that_lists_no_worker_is_waited_for_then_named(tmp_path):
  """A router adds the workers it was started with only once they answer; the
  fleet waits `workers_timeout_s` for one, then names the router and the wait."""
  port = launcher.free_port("127.0.0.1")  # nothing listens there
  router = router_lib.launch_router(ROUTER, [f"http://127.0.0.1:{port}"], log_dir=str(tmp_path))
  try:

    async def go():
      async with router_lib.RoutedFleet(router.urls[0], workers_timeout_s=2.0):
        pass

    started = time.monotonic()
    with pytest.raises(fleet_lib.NoServerAvailable, match="listed no workers within 2 s"):
      asyncio.run(go())
    assert time.monotonic() - started >= 2.0
  finally:
    router.stop()


def test_a_worker_killed_mid_round_loses_no_request(routed):
  """Requests in flight on the killed worker are retried; each completes,
  whole, on a live worker, and the fleet sees the worker down."""
  rng = np.random.default_rng(1)
  n, max_new = 24, 40

  async def go():
    async with router_lib.RoutedFleet(routed.router.urls[0], health_interval_s=3600) as fleet:
      bodies = [body(rng.integers(0, 490, 8), max_new=max_new) for _ in range(n)]
      tasks = [asyncio.create_task(fleet.generate(b)) for b in bodies]
      victim = routed.procs[0]
      state = next(s for s in fleet.servers if s.url == routed.urls[0])
      # Kill once the victim is decoding (its load is visible on /get_load).
      while True:
        _, load = await state.client.request("GET", "/get_load")
        if load["num_running_reqs"] > 0:
          break
        await asyncio.sleep(0.01)
      pending = sum(not t.done() for t in tasks)
      victim.kill()
      outs = await asyncio.wait_for(asyncio.gather(*tasks), 180)
      await fleet.check_health()
      return pending, outs, fleet.metrics()

  pending, outs, metrics = asyncio.run(go())
  # The router retries a request whose worker died (or the fleet does, on a
  # 5xx: fleet/retries); either way every request ends whole.
  assert pending > 0 and metrics["fleet/servers_down"] == 1.0, metrics
  for out in outs:
    assert out.finish_type == "length" and len(out.output_ids) == max_new, out
