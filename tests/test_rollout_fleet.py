"""A fleet of three real server processes, launched the way a run config asks.

The launch spec is the `rollout.backend = sglang` path with our server module
as the command (SGLang itself is not installed here). The last test kills a
server mid-batch, so it runs last.
"""

import asyncio
import dataclasses
import os
from collections import defaultdict

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax import config_args
from fluxjax.models import config, vlm
from fluxjax.rollout import factory, launcher, publish
from fluxjax.rollout import fleet as fleet_lib
from helpers import TINY_SERVER, server_env
from helpers import generate_request as body


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
  cfg = config_args.load_config(arg="tiny").rollout
  cfg.backend, cfg.num_servers, cfg.launch_timeout_s = "sglang", 3, 180
  cfg.launch = tuple(TINY_SERVER)
  # make_backend launches with the parent's environment; give the servers a
  # plain one-device CPU backend instead of the fake test mesh.
  import os

  saved = dict(os.environ)
  os.environ.update(server_env())
  try:
    logs = str(tmp_path_factory.mktemp("servers"))
    fleet, servers = factory.make_backend(cfg, factory.BackendInputs(log_dir=logs))
  finally:
    os.environ.clear()
    os.environ.update(saved)
  assert isinstance(fleet, fleet_lib.Fleet) and len(servers.urls) == 3
  yield servers
  servers.stop()


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


def random_model(seed: int) -> vlm.Qwen25VL:
  """Random tiny weights without create_model's many small init compilations."""
  graphdef, state = nnx.split(vlm.abstract_model(config.preset("tiny")))
  rng = np.random.default_rng(seed)
  state = jax.tree.map(lambda x: np.asarray(0.05 * rng.standard_normal(x.shape), x.dtype), state)
  return nnx.merge(graphdef, state)


def test_launched_servers_get_glibc_malloc_on_huge_pages(launched):
  """Each launched process runs with launcher.MALLOC_TUNABLES; a setting the
  caller made is kept and a hugetlb choice of its own is not overridden."""
  for proc in launched.procs:
    with open(f"/proc/{proc.pid}/environ", "rb") as f:
      environ = f.read().split(b"\0")
    assert f"GLIBC_TUNABLES={launcher.MALLOC_TUNABLES}".encode() in environ
  env = launcher.server_process_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
  assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{launcher.MALLOC_TUNABLES}"
  own = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
  assert launcher.server_process_env(own) == own


def test_publish_reaches_every_server(launched, tmp_path):
  """Every server serves the published version; the version before it is
  kept on disk, older ones are removed."""
  model = random_model(3)
  (tmp_path / "v5").mkdir()  # an older publish

  async def go():
    async with fleet_lib.Fleet(launched.urls) as fleet:
      await publish.publish_to_fleet(fleet, model, str(tmp_path), 6, dtype="float32")
      report = await publish.publish_to_fleet(fleet, model, str(tmp_path), 7, dtype="float32")
      versions = await fleet.refresh_versions()
      out = await fleet.generate(body([1, 2, 3]))
      return report, versions, out

  report, versions, out = asyncio.run(go())
  print("publish phases (s):", {k: round(v, 3) for k, v in report.seconds.items()})
  assert not report.failed and all(t >= 0 for t in report.seconds.values())
  assert set(versions.values()) == {"7"} and out.weight_version == "7"
  assert sorted(os.listdir(tmp_path)) == ["v6", "v7"]


def test_a_deferred_publish_returns_before_the_folder_is_written(launched, tmp_path):
  """`defer`: the publish returns at once, before any tensor is gathered;
  the trainer's thread gathers them (`feed`, here from an executor) while a
  thread writes them; the folder appears only once the last is gathered
  and written, and the pending task then loads it everywhere (the servers
  serve the previous version until then); its report is the final one."""
  model = random_model(4)

  async def go():
    loop = asyncio.get_running_loop()
    async with fleet_lib.Fleet(launched.urls) as fleet:
      await publish.publish_to_fleet(fleet, model, str(tmp_path), 1, dtype="float32")
      early = await publish.publish_to_fleet(
        fleet, model, str(tmp_path), 2, dtype="float32", defer=True
      )
      before = (sorted(os.listdir(tmp_path)), early.feed.remaining, await fleet.refresh_versions())
      await loop.run_in_executor(None, early.feed.finish, lambda n: None)
      final = await early.pending
      return early, before, final, await fleet.refresh_versions()

  early, before, final, after = asyncio.run(go())
  assert early.seconds == {} and not early.failed and early.path is None and early.reads_params
  folders, remaining, during = before
  assert [f for f in folders if not f.startswith(".")] == ["v1"]  # v2 not yet in place
  assert remaining == early.feed.count > 0 and early.feed.remaining == 0
  assert set(during.values()) == {"1"} and set(after.values()) == {"2"}
  assert final.path == str(tmp_path / "v2") and os.path.isdir(final.path)
  assert {"write", "pause", "update", "resume"} <= set(final.seconds) and not final.failed
  assert final.pending is None


def test_publish_mid_round_continues_every_response_under_the_new_weights(launched, tmp_path):
  """The pause aborts in-flight responses; their continuations, sent at once
  as partial-rollout recycling does, wait in the paused servers instead of
  blocking the flush, and finish under the published version."""
  model = random_model(4)
  rng = np.random.default_rng(6)
  n, max_new, prompt_len = 12, 200, 8

  async def to_the_end(fleet, b):
    out = await fleet.generate(b)
    while out.finish_type == "abort":
      rest = await fleet.generate(b.continued(out.output_ids))
      out = out.pinned(None).continued_by(rest.pinned(None), "")
    return out

  # Random weights sample the vision placeholder ids, which cannot be sent
  # back without their media; a trained policy does not.
  cfg = config.preset("tiny")
  no_placeholders = ((cfg.image_token_id, -100.0), (cfg.video_token_id, -100.0))

  def long_body():
    b = body(rng.integers(0, 490, prompt_len), max_new=max_new)
    sampling = dataclasses.replace(b.sampling, logit_bias=no_placeholders)
    return dataclasses.replace(b, sampling=sampling)

  async def decoding(fleet) -> bool:
    """Whether all n requests reached the servers and those running decoded a
    token each on average (/get_load's num_tokens counts their prompts too)."""
    loads = [(await s.client.request("GET", "/get_load"))[1] for s in fleet.servers]
    running = sum(x["num_running_reqs"] for x in loads)
    decoded = sum(x["num_tokens"] for x in loads) - running * prompt_len
    return sum(x["num_reqs"] for x in loads) == n and running > 0 and decoded >= running

  async def go():
    async with fleet_lib.Fleet(launched.urls) as fleet:
      before = await fleet.refresh_versions()
      tasks = [asyncio.create_task(to_the_end(fleet, long_body())) for _ in range(n)]
      # Prefilled and decoding: on a loaded machine prefill may take a while.
      while not await decoding(fleet):
        await asyncio.sleep(0.01)
      seconds, failed = await fleet.update_weights(path, "8")
      outs = await asyncio.wait_for(asyncio.gather(*tasks), 120)
      return before, seconds, failed, outs, [s.healthy for s in fleet.servers]

  path = publish.write_checkpoint(model, str(tmp_path), 8, dtype="float32")
  before, seconds, failed, outs, healthy = asyncio.run(go())
  assert not failed and all(healthy), failed
  assert set(seconds) == {"pause", "flush", "update", "resume"}
  old = set(before.values())
  assert "8" not in old
  paused = 0
  for out in outs:
    assert out.finish_type == "length" and len(out.output_ids) == max_new
    versions = out.versions()
    assert set(versions) <= old | {"8"}, versions
    # Tokens keep the version that sampled them: old ones first, then "8".
    assert versions == sorted(versions, key=lambda v: v == "8")
    if out.segments > 1:  # aborted by the pause, then continued
      assert versions[-1] == "8", versions
      paused += versions[0] != "8"
  assert paused > 0  # the publish did interrupt responses mid-decode


def test_a_server_that_missed_a_publish_is_refit_when_it_rejoins(launched, tmp_path):
  model = random_model(5)

  async def go():
    async with fleet_lib.Fleet(launched.urls, health_interval_s=3600) as fleet:
      missed = fleet.servers[0]
      missed.healthy = False  # down during the publish, as after a failed health check
      report = await publish.publish_to_fleet(fleet, model, str(tmp_path), 9, dtype="float32")
      stale = await missed.client.weight_version()
      await fleet.check_health()
      return report, stale, await fleet.refresh_versions(), missed.healthy

  report, stale, versions, back = asyncio.run(go())
  assert not report.failed and stale != "9"
  assert back and set(versions.values()) == {"9"}, versions


def test_a_server_that_preprocesses_otherwise_is_refused_on_start(launched):
  """The servers report their vision limits; a fleet given the trainer's refuses
  a mismatch on start, naming the server flag, and accepts equal ones."""

  async def limits():
    async with fleet_lib.Fleet(launched.urls[:1]) as fleet:
      return (await fleet.servers[0].client.server_info())["vision_limits"]

  async def start(vision):
    async with fleet_lib.Fleet(launched.urls[:1], vision_limits=vision):
      pass

  theirs = asyncio.run(limits())
  assert theirs["video_max_frames"] > 0
  asyncio.run(start(theirs))
  other = {**theirs, "video_max_frames": theirs["video_max_frames"] + 1}
  with pytest.raises(ValueError, match="--video-max-frames") as refused:
    asyncio.run(start(other))
  assert "pad-token counts" in str(refused.value)


def test_a_server_that_serves_another_model_is_refused_on_start(launched):
  """The servers report their model's sizes; a fleet given the trainer's
  model refuses another one on start, naming the flag that serves it."""

  async def start(model):
    async with fleet_lib.Fleet(launched.urls[:1], served_model=model):
      pass

  tiny, small = config.preset("tiny"), config.preset("3b")
  asyncio.run(start(fleet_lib.ServedModel.of("preset:tiny", tiny)))
  with pytest.raises(ValueError, match="Start it with --preset 3b") as refused:
    asyncio.run(start(fleet_lib.ServedModel.of("preset:3b", small)))
  assert "hidden_size=" in str(refused.value) and "preset:tiny" in str(refused.value)
  path = fleet_lib.ServedModel.of("/ckpt/qwen-3b", small)
  with pytest.raises(ValueError, match="Start it with --model-path /ckpt/qwen-3b"):
    asyncio.run(start(path))


def test_an_sglang_server_of_another_architecture_is_refused():
  """SGLang reports no sizes but (main) its architectures in /get_model_info:
  a text-only model behind the fleet is refused by name; no report, no check."""
  ours = fleet_lib.ServedModel.of("/ckpt/qwen-vl", config.preset("7b"))
  text_only = {"model_path": "/ckpt/qwen2-7b", "architectures": ["Qwen2ForCausalLM"]}
  with pytest.raises(ValueError, match=r"Qwen2ForCausalLM.*--model-path /ckpt/qwen-vl"):
    ours.check("http://sglang:30000", {"model_path": "/ckpt/qwen2-7b"}, text_only)
  ours.check("http://sglang:30000", {}, {"architectures": [config.ARCHITECTURE]})
  ours.check("http://sglang:30000", {}, {})  # SGLang 0.5.x says neither


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
      pending = [not t.done() for t in tasks]
      launched.procs[launched.urls.index(victim)].kill()
      results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
      await fleet.check_health()
      return results, pending, fleet.retries, [s.healthy for s in fleet.servers]

  results, pending, retries, healthy = asyncio.run(go())
  assert len(results) == n and any(pending)
  for c in results:
    assert not isinstance(c, Exception), c
    assert c.finish_type == "length" and len(c.output_ids) == 40
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
      tail = await fleet.generate(body(ids, max_new=10, seed=4).continued(head.output_ids), "g")
      return whole, head, tail

  whole, head, tail = asyncio.run(go())
  assert head.output_ids + tail.output_ids == whole.output_ids
  np.testing.assert_allclose(head.logprobs + tail.logprobs, whole.logprobs, atol=1e-4, rtol=0)
