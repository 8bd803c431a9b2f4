"""A fleet of rollout servers: routing, retries, health, weight versions.

`Fleet` implements `backend.RolloutBackend` over several servers: requests are fanned
out one response per HTTP call (n = 1, so each can be aborted by rid), and a new policy
version is published as a versioned HF folder under `weights_root` that every server
loads (rollout/publish.py). Routing, retries, health and the deviations from the Flux
design, and why, are told in docs/fleet.md, "A fleet".
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import socket
import tempfile
import time
import urllib.parse
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

import aiohttp

from fluxjax.models import config as config_lib
from fluxjax.rollout import protocol, sampling_params, weight_protocol
from fluxjax.rollout.backend import SlotStats
from fluxjax.rollout.client import RequestRejected, ServerUnavailable, SGLangClient
from fluxjax.rollout.launcher import free_port
from fluxjax.rollout.protocol import Completion, GenerateRequest

if TYPE_CHECKING:  # JAX model code: loaded by `publish` only
  from fluxjax.models import vlm
  from fluxjax.rollout.publish import PublishReport

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class ServerState:
  client: SGLangClient
  healthy: bool = True
  outstanding_tokens: int = 0
  # Generate calls in it, by rid (`tracked_call`): cancelled when it is taken out.
  inflight: dict = dataclasses.field(default_factory=dict)
  weight_version: str | None = None
  completed: int = 0
  # Its weights are not a whole published version (it missed a broadcast, or
  # failed part way through an update): kept out until a refit brings it one.
  awaiting_update: bool = False

  @property
  def url(self) -> str:
    return self.client.url


def _cost(request: GenerateRequest) -> int:
  prompt = len(request.input_ids or ()) or len(request.text or "") // 4 + 1
  return prompt + (
    request.sampling.max_new_tokens or sampling_params.SAMPLING_DEFAULTS["max_new_tokens"]
  )


async def tracked_call(calls: dict, client: SGLangClient, request: GenerateRequest) -> Completion:
  """`client`'s answer to `request`, the call kept in `calls` meanwhile;
  ServerUnavailable when the fleet cancels it there (`Fleet._take_out`),
  as the server it waits in holds weights of no one version."""
  call = asyncio.ensure_future(client.generate(request))
  calls[request.rid] = call
  try:
    return await call
  except asyncio.CancelledError:
    task = asyncio.current_task()
    if call.cancelled() and task is not None and not task.cancelling():
      raise ServerUnavailable(f"{client.url}: taken out while it held {request.rid}") from None
    raise
  finally:
    calls.pop(request.rid, None)


def prompt_key(request: GenerateRequest) -> str:
  """Default group key: the prompt ids/text and its media."""
  h = hashlib.sha1()
  for part in (request.input_ids, request.text, request.image_data, request.video_data):
    h.update(json.dumps(part).encode())
  return h.hexdigest()


class NoServerAvailable(ServerUnavailable):
  """Every server is down."""


@dataclasses.dataclass(frozen=True)
class ServedModel:
  """The trainer's model as a server must serve it.

  Attributes:
    name: "preset:NAME" or the checkpoint path (a server's `model_path`).
    shape: `config.shape_summary` of the trainer's model (whose HF
      architecture is `config.ARCHITECTURE`, as every preset's).
  """

  name: str
  shape: Mapping[str, int]

  @classmethod
  def of(cls, name: str, cfg: config_lib.ModelConfig) -> ServedModel:
    return cls(name, config_lib.shape_summary(cfg))

  def check(self, url: str, server_info: Mapping[str, Any], model_info: Mapping[str, Any]) -> None:
    """Raises ValueError if the server's /get_model_info reports another
    architecture (SGLang main and ours do) or its /get_server_info other
    sizes (ours does)."""
    archs = model_info.get("architectures")
    if isinstance(archs, list) and archs and config_lib.ARCHITECTURE not in archs:
      self._refuse(url, model_info.get("model_path"), f"architectures {archs}")
    theirs = server_info.get("model_shape")
    if not isinstance(theirs, Mapping):
      return  # not a fluxjax server: it does not say
    differ = {k: v for k, v in theirs.items() if k in self.shape and self.shape[k] != v}
    if differ:
      have = ", ".join(f"{k}={v} (trainer {self.shape[k]})" for k, v in differ.items())
      self._refuse(url, server_info.get("model_path"), have)

  def _refuse(self, url: str, their_path: Any, have: str) -> None:
    flag = (
      f"--preset {self.name.removeprefix('preset:')}"
      if self.name.startswith("preset:")
      else f"--model-path {self.name}"
    )
    raise ValueError(
      f"rollout server {url} serves another model ({their_path}: {have}) than the "
      f"trainer's ({self.name}). Start it with {flag}, or set --config.model.preset / "
      "--config.model.hf_path to its model"
    )


class Fleet:
  """Async client over several servers (docs/fleet.md, "A fleet").

  Args:
    urls: the servers.
    health_interval_s: seconds between background `/health` checks.
    request_timeout_s: one request's limit.
    max_attempts: tries of a request over the fleet (default: twice per server).
    weights_root: folder `publish` writes the versions into, which every
      server must be able to read (default: fluxjax_weights in the temp dir).
    weights_dtype: tensor dtype of the published checkpoints.
    weight_sync: how weights reach the servers: the name of a registered
      transport (`publish.WEIGHT_TRANSPORTS`).
    weight_deltas: with "disk", each folder also holds its changes from the
      previous one, which servers at that version (ours) load instead.
    defer_updates: `publish` returns at once; the trainer's main thread
      gathers the tensors (`PublishReport.feed`) and the write or broadcast
      and the servers' load run in `PublishReport.pending`.
    weight_bucket_bytes: with "distributed", the most bytes one update call
      carries (hf_export.byte_runs).
  """

  def __init__(
    self,
    urls: Sequence[str],
    *,
    health_interval_s: float = 2.0,
    request_timeout_s: float = 3600.0,
    max_attempts: int | None = None,
    weights_root: str | None = None,
    weights_dtype: str = weight_protocol.PUBLISHED_DTYPE,
    vision_limits: Mapping[str, int] | None = None,
    served_model: ServedModel | None = None,
    weight_sync: str = "disk",
    weight_deltas: bool = False,
    defer_updates: bool = False,
    weight_group_backend: str = "gloo",
    weight_group_address: str = "",
    weight_group_timeout_s: float = 600.0,
    weight_bucket_bytes: int = 512 * 2**20,
  ):
    self._session: aiohttp.ClientSession | None = None
    # The trainer's model and media preprocessing; a server that reports
    # others is refused on start (`check_server`).
    self.vision_limits = dict(vision_limits or {})
    self.served_model = served_model
    self.weights_root = weights_root or os.path.join(tempfile.gettempdir(), "fluxjax_weights")
    self.weights_dtype = weights_dtype
    from fluxjax.rollout import publish  # local: the checkpoint writer is JAX code

    publish.weight_transport(weight_sync)  # an unknown name fails here
    self.weight_sync = weight_sync
    self.weight_deltas = weight_deltas
    self.defer_updates = defer_updates
    self.weight_group_backend = weight_group_backend
    self.weight_group_address = weight_group_address
    self.weight_group_timeout_s = weight_group_timeout_s
    self.weight_bucket_bytes = weight_bucket_bytes
    self.weight_group = None  # publish.WeightGroup: the trainer's side, once made
    self.request_timeout_s = request_timeout_s
    self.servers = [self._server_state(u) for u in urls]
    self.affinity: dict[str, ServerState] = {}
    self.where: dict[str, ServerState] = {}  # rid -> server running it
    self.health_interval_s = health_interval_s
    self.max_attempts = max_attempts or 2 * len(self.servers)
    self._health_task: asyncio.Task | None = None
    self.retries = 0
    # (weight_version, model_path) of the last folder written and sent to the
    # servers; a rejoining server is refit to it.
    self.published: tuple[str, str] | None = None
    self.broadcast_version: str | None = None  # of the last broadcast update
    # Serializes weight updates and rejoins.
    self._control = asyncio.Lock()

  def metrics(self) -> dict[str, float]:
    """Fault counters for the metrics writer: retried requests, servers down."""
    down = sum(not s.healthy for s in self.servers)
    return {
      "fleet/retries": float(self.retries),
      "fleet/servers_down": float(down),
      "fleet/servers": float(len(self.servers)),
    }

  def slot_stats(self) -> SlotStats | None:
    """None: the servers' slots are not observable from here."""
    return None

  async def publish(self, model: vlm.Qwen25VL, version: int) -> PublishReport:
    """Publishes `model` as `version` by the `weight_sync` transport: a folder
    under weights_root, then pause -> update -> continue everywhere
    (publish.publish_to_fleet), or a broadcast (publish.publish_distributed).

    A write that fails (a full disk) is reported in `failed` with no server
    told anything: the fleet serves on with the previous version, and
    `published`, which rejoining servers are refit to, stays on it.
    """
    from fluxjax.rollout import publish  # local: the checkpoint writer is JAX code

    return await publish.weight_transport(self.weight_sync).publish(self, model, version)

  async def __aenter__(self) -> Self:
    await self.start()
    return self

  async def __aexit__(self, *exc) -> None:
    await self.close()

  def _server_state(self, url: str) -> ServerState:
    """A server's state; its client shares the fleet's session once started."""
    client = SGLangClient(url, timeout_s=self.request_timeout_s)
    if self._session is not None:
      client._session, client._own_session = self._session, False
    return ServerState(client)

  async def start(self) -> None:
    self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    for s in self.servers:
      s.client._session, s.client._own_session = self._session, False
    try:
      await asyncio.gather(*(self.check_server(s) for s in self.servers))
    except BaseException:
      await self._session.close()
      raise
    self._health_task = asyncio.create_task(self._health_loop())

  async def check_server(self, server: ServerState) -> None:
    """Refuses (ValueError naming the flags) a server that serves another
    model or preprocesses media otherwise than the trainer.

    fluxjax's server reports its sizes and limits in /get_server_info and its
    architecture in /get_model_info; SGLang's reports its architecture
    (main) and reads the rest from the checkpoint. An unreachable server is
    left to the health checks.
    """
    if not self.vision_limits and self.served_model is None:
      return
    try:
      info = await server.client.server_info()
      model_info = await server.client.model_info() if self.served_model is not None else {}
    except (ServerUnavailable, RequestRejected) as e:
      log.warning("rollout server %s: model and preprocessing not checked (%s)", server.url, e)
      return
    if self.served_model is not None:
      self.served_model.check(server.url, info, model_info)
    theirs = info.get("vision_limits") or {}
    differ = {
      k: v for k, v in theirs.items() if k in self.vision_limits and self.vision_limits[k] != v
    }
    if differ:
      flags = " ".join(f"{protocol.server_flag(k)} {self.vision_limits[k]}" for k in differ)
      have = ", ".join(f"{k}={v} (trainer {self.vision_limits[k]})" for k, v in differ.items())
      raise ValueError(
        f"rollout server {server.url} preprocesses media with {have}: its prompts' pad-token "
        f"counts would differ from the trainer's. Start it with {flags}, or set "
        "--config.data.vision.* to its values"
      )

  async def close(self) -> None:
    if self.weight_group is not None:  # the servers leave it, then this process
      members = [s for s in self.servers if s.client.url in self.weight_group.urls]
      name = weight_protocol.WEIGHT_GROUP_NAME
      await self.broadcast(lambda c: c.destroy_weights_update_group(name), members)
      self.weight_group.close()
      self.weight_group = None
    if self._health_task is not None:
      self._health_task.cancel()
      try:
        await self._health_task
      except asyncio.CancelledError:
        pass
    if self._session is not None:
      await self._session.close()

  # --- routing --------------------------------------------------------------------

  def _pick(self, group: str, exclude: set) -> ServerState:
    home = self.affinity.get(group)
    if home is not None and home.healthy and home not in exclude:
      return home
    candidates = [s for s in self.servers if s.healthy and s not in exclude]
    if not candidates:
      candidates = [s for s in self.servers if s.healthy]
    if not candidates:
      raise NoServerAvailable("no healthy rollout server")
    best = min(candidates, key=lambda s: (s.outstanding_tokens, len(s.inflight)))
    self.affinity[group] = best
    return best

  def _mark_down(self, server: ServerState, why: str) -> None:
    if server.healthy:
      log.warning("rollout server %s marked down: %s", server.url, why)
    server.healthy = False
    for g in [g for g, s in self.affinity.items() if s is server]:
      del self.affinity[g]

  async def generate(self, request: GenerateRequest, group: str | None = None) -> Completion:
    """Runs one request to completion, retrying on other servers if one fails.

    Raises:
      RequestRejected: the request is malformed (no retry).
      NoServerAvailable: every attempt failed.
    """
    group = group or prompt_key(request)
    rid = request.rid
    cost = _cost(request)
    tried: set = set()
    last: Exception | None = None
    for attempt in range(self.max_attempts):
      server = self._pick(group, tried)
      server.outstanding_tokens += cost
      self.where[rid] = server
      try:
        out = await tracked_call(server.inflight, server.client, request)
        server.weight_version = out.weight_version
        server.completed += 1
        return out
      except ServerUnavailable as e:
        last = e
        tried.add(server)
        self._mark_down(server, str(e))
        self.retries += 1
        if attempt + 1 < self.max_attempts:
          await asyncio.sleep(0.05 * attempt)
      finally:
        server.outstanding_tokens -= cost
        self.where.pop(rid, None)
    raise NoServerAvailable(f"request {rid} failed on every server: {last}")

  async def generate_many(
    self, requests: Sequence[GenerateRequest], groups: Sequence[str | None] | None = None
  ) -> AsyncIterator[tuple[int, Completion | Exception]]:
    """Yields (index, completion or error) as each request finishes."""
    groups = groups or [None] * len(requests)

    async def one(i):
      try:
        return i, await self.generate(requests[i], groups[i])
      except (RequestRejected, ServerUnavailable) as e:
        return i, e

    tasks = [asyncio.create_task(one(i)) for i in range(len(requests))]
    try:
      for fut in asyncio.as_completed(tasks):
        yield await fut
    finally:
      for t in tasks:
        t.cancel()

  async def abort(self, rid: str) -> None:
    server = self.where.get(rid)
    if server is not None:
      await server.client.abort(rid)

  async def abort_all(self) -> None:
    await self.broadcast(lambda c: c.abort(abort_all=True))

  # --- fleet-wide control ------------------------------------------------------------

  def weight_group_endpoint(self) -> tuple[str, int]:
    """(address, free port) where the servers reach this process's weight
    update group: the configured address, loopback when every server is on
    this host, else this host's name."""
    address = self.weight_group_address
    if not address:
      hosts = {urllib.parse.urlsplit(s.client.url).hostname for s in self.servers}
      address = "127.0.0.1" if hosts <= {"127.0.0.1", "localhost"} else socket.getfqdn()
    return address, free_port(address)

  async def broadcast_to(self, calls) -> list:
    """Runs each {server: fn(client)} concurrently; failures as in `broadcast`."""

    async def run(s, fn):
      try:
        return await fn(s.client)
      except (ServerUnavailable, RequestRejected) as e:
        self._mark_down(s, str(e))
        return e

    return await asyncio.gather(*(run(s, fn) for s, fn in calls.items()))

  async def broadcast(self, fn, servers: Sequence[ServerState] | None = None) -> list:
    """Runs `fn(client)` concurrently on `servers` (default: the healthy ones).

    A server that fails with ServerUnavailable, or whose request is refused
    (RequestRejected), is marked down; the exception is its result.
    """
    servers = [s for s in self.servers if s.healthy] if servers is None else servers
    return await self.broadcast_to(dict.fromkeys(servers, fn))

  async def update_weights(
    self, path: str, version: str, *, pause_mode: str = "abort"
  ) -> tuple[dict[str, float], list[str]]:
    """pause -> flush -> update_weights_from_disk -> continue on the healthy servers.

    In-flight requests return `abort` with their partial output (pause mode
    "abort"); requests sent meanwhile wait in the servers. A server that
    fails a phase is marked down and refit when it rejoins; one that failed
    the update itself stays paused until then (`_refit`).

    Returns:
      Seconds per phase (the slowest server counts) and the failures.
    """
    async with self._control:
      self.published, self.broadcast_version = (version, path), None
      return await self._refit(
        [s for s in self.servers if s.healthy], version, pause_mode, self._from_disk(path, version)
      )

  def _from_disk(self, path: str, version: str):
    return lambda targets: self.broadcast(
      lambda c: c.update_weights_from_disk(path, version), targets
    )

  async def update_weights_with(
    self, update, version: str, *, pause_mode: str = "abort"
  ) -> tuple[dict[str, float], list[str]]:
    """`update_weights` with another update phase: `update(servers)` returns one
    result (or exception) per server; a collective one (a broadcast to every
    server at once) takes them all together. Servers that missed an earlier
    update (`_rejoin` keeps them out) take part and are back once it lands."""
    async with self._control:
      self.published = None
      targets = [s for s in self.servers if s.healthy or s.awaiting_update]
      seconds, failed = await self._refit(targets, version, pause_mode, update)
      self.broadcast_version = version
      for s in targets:
        if s.awaiting_update and s.weight_version == version:
          s.awaiting_update, s.healthy = False, True
          log.info("rollout server %s is back at weight version %s", s.url, version)
      return seconds, failed

  async def _refit(
    self, servers: Sequence[ServerState], version: str, pause_mode: str, update
  ) -> tuple[dict[str, float], list[str]]:
    """The update sequence on `servers`; a phase runs on those that passed the
    ones before it. A version is served whole or not at all: a server that
    failed the update phase holds weights of no one version, so it is taken
    out, paused, until a refit brings it a whole one (`_take_out`); every
    other server is continued. Call under `_control`."""
    seconds: dict[str, float] = {}
    failed: dict[ServerState, str] = {}

    async def phase(name: str, fn, targets: Sequence[ServerState]) -> None:
      t = time.perf_counter()
      for s, r in zip(targets, await fn(targets)):
        if isinstance(r, Exception):
          failed.setdefault(s, str(r))
      seconds[name] = time.perf_counter() - t

    await phase("pause", lambda ts: self.broadcast(lambda c: c.pause(pause_mode), ts), servers)
    flushing = [s for s in servers if s not in failed]
    await phase("flush", lambda ts: self.broadcast(lambda c: c.flush_cache(), ts), flushing)
    updated = [s for s in servers if s not in failed]
    await phase("update", update, updated)
    mixed = [s for s in updated if s in failed]
    for s in mixed:
      await self._take_out(s, f"its weight update failed part way: {failed[s]}")
    resumed = [s for s in servers if s not in mixed]
    await phase("resume", lambda ts: self.broadcast(lambda c: c.resume(), ts), resumed)
    for s in servers:
      if s not in failed:
        s.weight_version = version
    return seconds, list(failed.values())

  async def _take_out(self, server: ServerState, why: str) -> None:
    """Keeps `server` out of generation, paused, until a refit brings it a
    whole version; the requests waiting in it go to other servers."""
    self._mark_down(server, why)
    server.awaiting_update = True
    for call in list(server.inflight.values()):
      call.cancel()

  async def _rejoin(self, server: ServerState) -> bool:
    """Refits a server that answers /health again to the published weights
    (a broadcast version: waits for the next broadcast unless it has it)."""
    if self.published is None and self.broadcast_version is None:
      return True
    async with self._control:  # the published version cannot move meanwhile
      version = self.published[0] if self.published else str(self.broadcast_version)
      try:
        current: str | None = await server.client.weight_version()
      except (ServerUnavailable, RequestRejected):
        current = None  # not readable (SGLang main dropped the endpoint): refit anyway
      if current == version:  # up to date, but a failed update may have left it paused
        results = await self.broadcast(lambda c: c.resume(), [server])
        failed = [str(r) for r in results if isinstance(r, Exception)]
      elif self.published is None:
        if not server.awaiting_update:
          log.info("rollout server %s serves %s: out until the next update", server.url, current)
        server.awaiting_update = True
        return False
      else:
        path = self.published[1]
        _, failed = await self._refit([server], version, "abort", self._from_disk(path, version))
        if not failed:
          log.info("rollout server %s refit to weight version %s", server.url, version)
    if failed:
      return False
    server.weight_version, server.awaiting_update = version, False
    return True

  async def check_health(self) -> list[bool]:
    """Checks /health everywhere; a server that answers again is refit, then back."""
    results = list(await asyncio.gather(*(s.client.health() for s in self.servers)))
    for i, (s, ok) in enumerate(zip(self.servers, results)):
      if not ok:
        self._mark_down(s, "health check failed")
      elif not s.healthy:
        results[i] = s.healthy = await self._rejoin(s)
        if s.healthy:
          log.info("rollout server %s is back", s.url)
    return results

  async def refresh_versions(self) -> dict[str, str | None]:
    """{url: weight version} of every server (None: not known, e.g. down since start)."""
    for s in self.servers:
      if s.healthy:
        try:
          s.weight_version = await s.client.weight_version()
        except ServerUnavailable as e:
          self._mark_down(s, str(e))
    return {s.url: s.weight_version for s in self.servers}

  async def _health_loop(self) -> None:
    while True:
      await asyncio.sleep(self.health_interval_s)
      try:
        await self.check_health()
      except Exception:
        log.exception("health check loop")
