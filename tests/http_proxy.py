"""An HTTP proxy in front of a real server process, for tests whose server
must be asked or answer something a healthy fleet would not: a request
rewritten on its way in (a tensor name the model lacks, so the real server
refuses the bucket after receiving it), an answer rewritten on its way out
(a `dp_size` the server does not run).

  with Proxy(url, on_request=fn) as proxy:   # proxy.url in place of url
    ...

`on_request(path, body)` gets each request's JSON body (None when it has
none) and returns the body to forward, or `Hold(seconds)`: the request is
never forwarded and its answer is a 504 after that long (a server that
hangs). `on_response(path, body)` gets each JSON answer and returns the one
to give back. Both run on the proxy's own event loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Callable

import aiohttp
from aiohttp import web

from fluxjax.rollout.launcher import free_port


@dataclasses.dataclass(frozen=True)
class Hold:
  """What `on_request` returns for a request the server should hang on."""

  seconds: float


Hook = Callable[[str, dict | None], dict | Hold | None]


def _unchanged(path: str, body):
  del path
  return body


class Proxy:
  def __init__(self, upstream: str, on_request: Hook = _unchanged, on_response: Hook = _unchanged):
    self.upstream = upstream.rstrip("/")
    self.on_request, self.on_response = on_request, on_response
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self._loop = asyncio.new_event_loop()
    self._started = threading.Event()
    self._thread = threading.Thread(target=self._serve, name="test-proxy", daemon=True)

  def __enter__(self) -> Proxy:
    self._thread.start()
    if not self._started.wait(30):
      raise RuntimeError("the test proxy did not start")
    return self

  def __exit__(self, *exc) -> None:
    self._loop.call_soon_threadsafe(self._stop.set)
    self._thread.join(30)

  def _serve(self) -> None:
    asyncio.set_event_loop(self._loop)
    self._loop.run_until_complete(self._main())

  async def _main(self) -> None:
    self._stop = asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(timeout=timeout) as session:
      self._session = session
      app = web.Application(client_max_size=1 << 30)
      app.router.add_route("*", "/{tail:.*}", self._forward)
      runner = web.AppRunner(app)
      await runner.setup()
      await web.TCPSite(runner, "127.0.0.1", self.port).start()
      self._started.set()
      await self._stop.wait()
      await runner.cleanup()

  async def _forward(self, request: web.Request) -> web.Response:
    raw = await request.read()
    body = json.loads(raw) if raw else None
    body = self.on_request(request.path, body)
    if isinstance(body, Hold):
      await asyncio.sleep(body.seconds)
      return web.Response(status=504, text="held by the test proxy")
    data = json.dumps(body).encode() if body is not None else raw
    async with self._session.request(
      request.method,
      self.upstream + request.path_qs,
      data=data,
      headers={"Content-Type": request.content_type or "application/json"},
    ) as upstream:
      content = await upstream.read()
      if upstream.content_type == "application/json" and content:
        answer = self.on_response(request.path, json.loads(content))
        content = json.dumps(answer).encode()
      return web.Response(status=upstream.status, body=content, content_type=upstream.content_type)
