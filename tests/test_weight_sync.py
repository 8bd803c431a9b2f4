"""The distributed weight update end to end: this process is rank 0 of a gloo
group, two real server processes on loopback receive bf16 tensors over it
(SGLang's init_weights_update_group + update_weights_from_distributed)."""

import asyncio
import time

import jax
import numpy as np
import pytest
from flax import nnx

import http_proxy
from fluxjax.models import config, hf_export, hf_load, vlm
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.rollout import launcher, protocol, publish, weight_group, weight_protocol
from helpers import TINY_SERVER, server_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
  cmd = [*TINY_SERVER, "--weight-group-timeout", "60"]
  logs = str(tmp_path_factory.mktemp("logs"))
  launched = launcher.launch_servers(cmd, 2, env=server_env(), timeout_s=300, log_dir=logs)
  yield launched
  launched.stop()


def random_model(seed: int) -> vlm.Qwen25VL:
  graphdef, state = nnx.split(vlm.abstract_model(config.preset("tiny")))
  rng = np.random.default_rng(seed)
  state = jax.tree.map(lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state)
  return nnx.merge(graphdef, state)


def sharded(model: vlm.Qwen25VL) -> vlm.Qwen25VL:
  """`model` with each parameter split over the 8 test devices along its last
  axis that divides by 8 (replicated when none does), as a trainer's are."""
  mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  graphdef, state = nnx.split(model)

  def place(x):
    axes = [a for a in range(1, x.ndim) if x.shape[a] % 8 == 0]
    spec = [None] * x.ndim
    if axes:
      spec[axes[-1]] = "d"
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))

  return nnx.merge(graphdef, jax.tree.map(place, state))


PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [40, 41, 42, 43, 44]]


async def _greedy(fleet) -> list[list[list[int]]]:
  """Each server's greedy tokens for PROMPTS."""
  out = []
  for s in fleet.servers:
    got = []
    for p in PROMPTS:
      c = await s.client.generate(
        protocol.GenerateRequest.of(p, {"max_new_tokens": 6, "temperature": 0.0})
      )
      got.append(c.output_ids)
    out.append(got)
  return out


def test_a_distributed_publish_serves_what_the_disk_path_serves(servers, tmp_path):
  """Both transports give the servers the same bf16 weights: greedy tokens
  agree on every server. The model goes in several buckets, one update call
  each. The group is made once and reused; a second model moves every server
  to it; closing the fleet takes the servers out of it."""
  first, second = random_model(3), random_model(4)
  layout = hf_load.hf_layout(first.cfg)
  bf16_bytes = sum(2 * int(np.prod(shape)) for _, shape in layout)
  bucket_bytes = bf16_bytes // 5
  sizes = [n for _, n in hf_export.tensor_bytes(first.cfg, "bfloat16")]
  want_buckets = len(hf_export.byte_runs(sizes, bucket_bytes))

  async def go():
    async with fleet_lib.Fleet(
      servers.urls,
      weights_root=str(tmp_path),
      weight_sync="distributed",
      weight_group_timeout_s=60,
      weight_bucket_bytes=bucket_bytes,
    ) as fleet:
      report = await fleet.publish(first, 5)
      group = fleet.weight_group
      versions = await fleet.refresh_versions()
      by_broadcast = await _greedy(fleet)
      again = await fleet.publish(second, 6)
      reused = fleet.weight_group is group
      moved = await _greedy(fleet)
      # The same first model through the disk path, in bf16.
      disk = await publish.publish_to_fleet(fleet, first, str(tmp_path), 7, dtype="bfloat16")
      by_disk = await _greedy(fleet)
      # Deferred, from arrays sharded over the 8 devices: the publish returns
      # at once and the broadcast reads them in its task.
      fleet.defer_updates = True
      deferred = await fleet.publish(sharded(first), 8)
      final = await deferred.pending
      by_deferred = await _greedy(fleet)
      return (
        report,
        versions,
        by_broadcast,
        again,
        reused,
        moved,
        disk,
        by_disk,
        (
          deferred,
          final,
          by_deferred,
        ),
      )

  report, versions, by_broadcast, again, reused, moved, disk, by_disk, late = asyncio.run(go())

  async def left():
    """Closing the fleet took every server out of the group."""
    async with fleet_lib.Fleet(servers.urls) as fleet:
      probe = weight_protocol.DistributedUpdate(
        ("x",), ("float32",), ((1,),), weight_protocol.WEIGHT_GROUP_NAME
      )
      for s in fleet.servers:
        with pytest.raises(Exception, match="no weight update group"):
          await s.client.update_weights_from_distributed(probe, 10)

  asyncio.run(left())
  assert not report.failed and not again.failed and not disk.failed, (report, again, disk)
  assert set(versions.values()) == {"5"} and report.path is None
  assert report.sent_bytes == again.sent_bytes == bf16_bytes
  assert report.buckets == again.buckets == want_buckets >= 5
  assert {"pause", "flush", "update", "resume", "join"} <= set(report.seconds)
  assert reused  # the same servers: no new rendezvous
  assert by_broadcast[0] == by_broadcast[1] == by_disk[0] == by_disk[1]
  assert moved[0] == moved[1] != by_broadcast[0]
  deferred, final, by_deferred = late
  assert deferred.reads_params and deferred.seconds == {} and deferred.sent_bytes == 0
  assert not final.failed and final.sent_bytes == bf16_bytes and final.pending is None
  assert by_deferred[0] == by_deferred[1] == by_broadcast[0]


def test_an_update_the_server_cannot_use_is_refused_after_its_tensors_arrived(servers):
  """A name the model lacks: the server still receives the broadcast (every
  member must), answers 400, keeps its weights, and the group stays usable."""
  model = random_model(5)

  async def go():
    async with fleet_lib.Fleet(
      servers.urls[:1], weight_sync="distributed", weight_group_timeout_s=60
    ) as fleet:
      await fleet.publish(model, 8)
      before = await _greedy(fleet)
      bad = weight_protocol.DistributedUpdate(
        ("model.layers.0.no_such.weight",),
        ("float32",),
        ((3,),),
        weight_protocol.WEIGHT_GROUP_NAME,
        "9",
      )
      client = fleet.servers[0].client
      sending = asyncio.get_running_loop().run_in_executor(
        None, weight_group.send, fleet.weight_group.group, [np.ones(3, np.float32)]
      )
      with pytest.raises(Exception, match="not a parameter of the served model"):
        await client.update_weights_from_distributed(bad, 60)
      await sending
      version = await client.weight_version()
      after = await _greedy(fleet)
      report = await fleet.publish(model, 10)
      return before, version, after, report, await client.weight_version()

  before, version, after, report, final = asyncio.run(go())
  assert version == "8" and after == before
  assert not report.failed and final == "10"


def test_a_malformed_group_request_is_refused_before_any_rendezvous(servers):
  client_url = servers.urls[0]

  async def go():
    async with fleet_lib.Fleet([client_url]) as fleet:
      client = fleet.servers[0].client
      bad = weight_protocol.InitWeightsGroup("127.0.0.1", 1, 3, 2, "g", "gloo")  # rank >= world
      with pytest.raises(Exception, match="rank_offset"):
        await client.init_weights_update_group(bad, 10)
      with pytest.raises(Exception, match="no weight update group"):
        await client.update_weights_from_distributed(
          weight_protocol.DistributedUpdate(("x",), ("float32",), ((1,),), "missing"), 10
        )

  asyncio.run(go())


def test_a_server_that_missed_a_broadcast_stays_out_until_the_next_one(servers):
  """Down during a broadcast update (nothing on disk to refit it from), a
  server that answers /health again still serves the version before it: it
  is kept out of generation until the next broadcast, which takes it in and
  brings it straight to the newest version."""
  first, second, third = random_model(6), random_model(7), random_model(8)

  async def go():
    async with fleet_lib.Fleet(
      servers.urls, weight_sync="distributed", weight_group_timeout_s=60, health_interval_s=600
    ) as fleet:
      await fleet.publish(first, 11)
      late = fleet.servers[1]
      fleet._mark_down(late, "test: down during the next update")
      missed = await fleet.publish(second, 12)
      health = await fleet.check_health()
      served = await late.client.weight_version()
      kept_out = (late.healthy, late.awaiting_update)
      caught_up = await fleet.publish(third, 13)
      return missed, health, served, kept_out, caught_up, await fleet.refresh_versions(), late

  missed, health, served, kept_out, caught_up, versions, late = asyncio.run(go())
  assert not missed.failed and missed.sent_bytes > 0
  assert health == [True, False] and served == "11" and kept_out == (False, True)
  assert not caught_up.failed and set(versions.values()) == {"13"}
  assert late.healthy and not late.awaiting_update


def test_a_bucket_refused_by_one_server_leaves_no_server_serving_a_mix(servers):
  """One of two servers refuses the third bucket of a broadcast, when the
  other already holds two new buckets. Every answer given during and after
  that publish is, token for token, what one complete version gives, under
  that version's number: the server that refused is taken out, not resumed,
  until the next broadcast; the other receives the whole version."""
  old, new = random_model(21), random_model(22)
  layout = hf_load.hf_layout(old.cfg)
  bucket_bytes = sum(2 * int(np.prod(shape)) for _, shape in layout) // 6
  proxied = {"armed": False, "buckets": 0}

  def refuse_third(path: str, body):
    """The third bucket's first tensor renamed to one the model lacks: the
    real server receives the bucket's tensors, then refuses it (400)."""
    if path == "/update_weights_from_distributed" and body is not None and proxied["armed"]:
      proxied["buckets"] += 1
      if proxied["buckets"] == 3:
        body = {**body, "names": ["model.layers.0.no_such.weight", *body["names"][1:]]}
    return body

  async def answers(fleet, n: int) -> list[tuple[int, protocol.Completion]]:
    sampling = {"max_new_tokens": 6, "temperature": 0.0}
    asked = [i % len(PROMPTS) for i in range(n)]
    got = await asyncio.gather(
      *(fleet.generate(protocol.GenerateRequest.of(PROMPTS[i], sampling)) for i in asked)
    )
    return list(zip(asked, got))

  async def go(proxy_url: str):
    async with fleet_lib.Fleet(
      [servers.urls[0], proxy_url],
      weight_sync="distributed",
      weight_group_timeout_s=60,
      weight_bucket_bytes=bucket_bytes,
      health_interval_s=600,
    ) as fleet:
      await fleet.publish(old, 31)
      reference = {"31": (await _greedy(fleet))[0]}
      proxied["armed"] = True
      during = asyncio.ensure_future(answers(fleet, 24))
      refused = await fleet.publish(new, 32)
      proxied["armed"] = False
      served = [*await during, *await answers(fleet, 12)]
      taken_out = (fleet.servers[1].healthy, fleet.servers[1].awaiting_update)
      again = await fleet.publish(new, 33)
      reference["32"] = (await _greedy(fleet))[0]
      return refused, served, taken_out, again, reference, await fleet.refresh_versions()

  with http_proxy.Proxy(servers.urls[1], on_request=refuse_third) as proxy:
    refused, served, taken_out, again, reference, versions = asyncio.run(go(proxy.url))
  assert proxied["buckets"] >= 3 and refused.buckets >= 5, refused
  assert any("no_such" in f for f in refused.failed), refused.failed
  assert reference["31"] != reference["32"]
  for prompt, c in served:
    assert c.weight_version in reference, c.weight_version
    assert c.output_ids == reference[c.weight_version][prompt], (c.weight_version, c.server)
  assert taken_out == (False, True)
  assert not again.failed and set(versions.values()) == {"33"}
  assert {c.weight_version for _, c in served} >= {"32"}  # the other server took all of it


def test_a_server_with_data_parallel_replicas_is_refused(servers):
  """dp_size 2: the replicas would join the update group under the same
  ranks, so the broadcast is refused with the cause, not attempted."""

  def two_replicas(path: str, body):
    if path in ("/get_server_info", "/server_info") and isinstance(body, dict):
      body = {**body, "dp_size": 2}
    return body

  async def go(url: str):
    async with fleet_lib.Fleet([url], weight_sync="distributed", weight_group_timeout_s=60) as f:
      await f.publish(random_model(23), 40)

  with (
    http_proxy.Proxy(servers.urls[0], on_response=two_replicas) as proxy,
    pytest.raises(publish.UnsupportedServer, match="dp_size=2"),
  ):
    asyncio.run(go(proxy.url))


def test_a_weight_sync_that_hangs_is_cut_at_its_timeout_naming_server_and_stage(servers):
  """A server that never answers its second bucket (nor joins its
  broadcast): the publish ends at the sync's timeout with that server and
  stage named, instead of waiting on the server. The broadcast it left
  broken holds the other server too: both are out, paused, until a refit
  brings them a whole version; neither serves a mix."""
  model = random_model(24)
  layout = hf_load.hf_layout(model.cfg)
  bucket_bytes = sum(2 * int(np.prod(shape)) for _, shape in layout) // 4
  proxied = {"armed": False, "buckets": 0}

  def hang_on_second(path: str, body):
    if path == "/update_weights_from_distributed" and body is not None and proxied["armed"]:
      proxied["buckets"] += 1
      if proxied["buckets"] == 2:
        return http_proxy.Hold(60)
    return body

  async def go(proxy_url: str):
    async with fleet_lib.Fleet(
      [servers.urls[0], proxy_url],
      weight_sync="distributed",
      weight_group_timeout_s=15,
      weight_bucket_bytes=bucket_bytes,
      health_interval_s=600,
    ) as fleet:
      await fleet.publish(random_model(25), 50)
      proxied["armed"] = True
      t = time.perf_counter()
      hung = await fleet.publish(model, 51)
      seconds = time.perf_counter() - t
      return hung, seconds, [(s.healthy, s.awaiting_update) for s in fleet.servers]

  with http_proxy.Proxy(servers.urls[1], on_request=hang_on_second) as proxy:
    hung, seconds, states = asyncio.run(go(proxy.url))
  assert seconds < 50, seconds  # cut at the sync's timeout, not at the held request's 60 s
  assert any(f.startswith("bucket 2 of") and proxy.url in f for f in hung.failed), hung.failed
  assert states == [(False, True), (False, True)]
