"""A fleet behind the SGLang router: generation through it, control to each worker.

  python -m sglang_router.launch_router --worker-urls URL... --policy cache_aware

The router (`sglang-router`, sgl-model-gateway) places each /generate on a worker by its
policy (cache_aware keeps shared prefixes, a GRPO group's prompt, on one worker), retries
and health-checks the workers. It does not pause, flush or update weights, so
`RoutedFleet` sends those to every worker directly, as slime and AReaL do (docs/fleet.md,
"The router"); `launch_router` starts one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Sequence

from fluxjax.rollout import weight_protocol
from fluxjax.rollout.client import RequestRejected, ServerUnavailable, SGLangClient
from fluxjax.rollout.fleet import Fleet, NoServerAvailable, ServerState, tracked_call
from fluxjax.rollout.launcher import LaunchedServers, free_port, launch_servers
from fluxjax.rollout.protocol import Completion, GenerateRequest

log = logging.getLogger(__name__)


class RoutedFleet(Fleet):
  """Generation through an SGLang router; weight updates to its workers.

  A `Fleet` (the same `RolloutBackend`): weight updates, abort_all, health, rejoin refits
  and metrics work on the workers; only `generate` and `abort` differ. The worker list is
  the router's `GET /workers`, refreshed at every health check (`refresh_workers`). The
  router readmits a worker on its own health check, whatever weights it serves, so a
  worker the fleet marks down is taken out of the router (`DELETE /workers/{id}`,
  `_park`) and added back (`POST /workers`, `_unpark`) only once the fleet has it back:
  refit to the published folder, or brought in by the next broadcast update.

  Args:
    router_url: the router.
    max_attempts: tries of one request through the router. A worker killed
      mid-request fails it with a 5xx; the retry, from scratch under a new
      rid, goes wherever the router then places it, with a growing pause
      (0.1 s doubling up to 2 s) so its health check can drop the worker.
    workers_timeout_s: how long `start` waits for the router to list a
      worker (a router adds the workers it was started with only after their
      first health check).
    other arguments: as `Fleet`.
  """

  def __init__(
    self,
    router_url: str,
    *,
    health_interval_s: float = 2.0,
    request_timeout_s: float = 3600.0,
    max_attempts: int = 12,
    weights_root: str | None = None,
    weights_dtype: str = weight_protocol.PUBLISHED_DTYPE,
    workers_timeout_s: float = 60.0,
    **weight_sync,
  ):
    super().__init__(
      [],
      health_interval_s=health_interval_s,
      request_timeout_s=request_timeout_s,
      max_attempts=max_attempts,
      weights_root=weights_root,
      weights_dtype=weights_dtype,
      **weight_sync,
    )
    self.router = SGLangClient(router_url, timeout_s=request_timeout_s)
    self._attempt_rid: dict[str, str] = {}  # rid -> rid of its current attempt
    self._routed_calls: dict = {}  # attempt rid -> its call through the router
    self.workers_timeout_s = workers_timeout_s
    self._worker_ids: dict[str, str] = {}  # url -> the router's id of the worker
    self._parked: dict[str, ServerState] = {}  # taken out of the router by the fleet
    self._checked = False  # the workers listed at the start passed `check_server`

  async def start(self) -> None:
    await super().start()
    self.router._session, self.router._own_session = self._session, False
    deadline = time.monotonic() + self.workers_timeout_s
    while not await self.refresh_workers():
      if time.monotonic() > deadline:
        raise NoServerAvailable(
          f"the router at {self.router.url} listed no workers within {self.workers_timeout_s:g} s"
        )
      await asyncio.sleep(0.2)
    try:
      await asyncio.gather(*(self.check_server(s) for s in self.servers))
    except BaseException:
      await self.close()
      raise
    self._checked = True

  async def refresh_workers(self) -> list[str]:
    """Reads the router's worker list; new workers join, removed ones leave."""
    _, data = await self.router.request("GET", "/workers")
    workers = data.get("workers", []) if isinstance(data, dict) else []
    regular = [w for w in workers if w.get("worker_type", "regular") == "regular"]
    urls = [w["url"] for w in regular]
    self._worker_ids = {w["url"]: w["id"] for w in regular if "id" in w}
    known = {s.url: s for s in self.servers}
    for url in set(known) - set(urls) - set(self._parked):
      log.warning("rollout worker %s left the router", url)
    parked = [s for url, s in self._parked.items() if url not in urls]
    self.servers = [known.get(u) or self._server_state(u) for u in urls] + parked
    if self._checked:  # a worker added since the start is checked as it joins
      for s in [s for s in self.servers if s.url not in known]:
        await self._admit(s)
    return urls

  async def _admit(self, server: ServerState) -> None:
    """Keeps a worker that joined the router after the start only if it
    serves the trainer's model and preprocessing; takes it out otherwise."""
    try:
      await self.check_server(server)
    except ValueError as e:
      log.error("rollout worker %s refused: %s", server.url, e)
      self.servers.remove(server)
      worker_id = self._worker_ids.get(server.url)
      if worker_id is None:
        return
      try:
        await self.router.request("DELETE", f"/workers/{worker_id}")
      except (ServerUnavailable, RequestRejected) as e:
        log.warning("router %s: worker %s not removed: %s", self.router.url, server.url, e)

  async def _park(self, server: ServerState) -> None:
    """Takes a worker the fleet marked down out of the router."""
    worker_id = self._worker_ids.get(server.url)
    if worker_id is not None:
      try:
        await self.router.request("DELETE", f"/workers/{worker_id}")
      except (ServerUnavailable, RequestRejected) as e:
        log.warning("router %s: worker %s not removed: %s", self.router.url, server.url, e)
        return
    self._parked[server.url] = server

  async def _unpark(self, server: ServerState) -> None:
    """Adds a worker the fleet has back (up to date) to the router again."""
    try:
      await self.router.request("POST", "/workers", {"url": server.url})
    except (ServerUnavailable, RequestRejected) as e:
      log.warning("router %s: worker %s not added back: %s", self.router.url, server.url, e)
      return
    del self._parked[server.url]

  async def generate(self, request: GenerateRequest, group: str | None = None) -> Completion:
    """Runs one request through the router, retrying on 5xx and lost connections.

    `group` is not sent: the router's policy places requests.

    Raises:
      RequestRejected: the request is malformed (no retry).
      NoServerAvailable: every attempt failed.
    """
    del group
    rid = request.rid
    last: Exception | None = None
    try:
      for attempt in range(self.max_attempts):
        # A fresh rid per attempt: a worker the router lost touch with may
        # still hold the previous one.
        current = rid if attempt == 0 else f"{rid}-retry{attempt}"
        self._attempt_rid[rid] = current
        try:
          attempt_request = dataclasses.replace(request, rid=current)
          return await tracked_call(self._routed_calls, self.router, attempt_request)
        except ServerUnavailable as e:
          last = e
          self.retries += 1
          await asyncio.sleep(min(2.0, 0.1 * 2**attempt))
    finally:
      self._attempt_rid.pop(rid, None)
    raise NoServerAvailable(f"request {rid} failed through the router {self.router.url}: {last}")

  async def _take_out(self, server: ServerState, why: str) -> None:
    """Out of the router too, at once; as the router does not say which
    worker holds which request, every request through it is sent again (a
    take-out comes while every worker is paused, so none has made progress
    since its pause returned the partial outputs)."""
    await super()._take_out(server, why)
    await self._park(server)
    for call in list(self._routed_calls.values()):
      call.cancel()

  async def abort(self, rid: str) -> None:
    """Aborts `rid` on every worker (the router does not say which holds it)."""
    current = self._attempt_rid.get(rid, rid)
    await self.broadcast(lambda c: c.abort(current))

  async def check_health(self) -> list[bool]:
    try:
      await self.refresh_workers()
    except (ServerUnavailable, RequestRejected) as e:
      log.warning("router %s: worker list not readable: %s", self.router.url, e)
    results = await super().check_health()
    await self.route_healthy()
    return results

  async def route_healthy(self) -> None:
    """The router lists the workers the fleet has up, not the others."""
    for s in list(self.servers):
      if not s.healthy and s.url not in self._parked:
        await self._park(s)
      elif s.healthy and s.url in self._parked:
        await self._unpark(s)

  def metrics(self) -> dict[str, float]:
    return {**super().metrics(), "fleet/routed": 1.0}


def launch_router(
  cmd: Sequence[str],
  worker_urls: Sequence[str],
  *,
  host: str = "127.0.0.1",
  timeout_s: float = 120.0,
  log_dir: str | None = None,
) -> LaunchedServers:
  """Starts `cmd --worker-urls URL... --host H --port P` and waits for /health.

  `cmd` is e.g. ["python", "-m", "sglang_router.launch_router", "--policy",
  "cache_aware"]. Unless it names one, the router's Prometheus exporter gets
  a free port (its fixed default would collide with a second router).
  """
  cmd = list(cmd)
  if "--prometheus-port" not in cmd:
    cmd += ["--prometheus-port", str(free_port(host))]
  return launch_servers(
    [*cmd, "--worker-urls", *worker_urls],
    1,
    host=host,
    timeout_s=timeout_s,
    log_dir=log_dir,
    log_name="router",
  )
