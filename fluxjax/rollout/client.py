"""Async client for one server speaking SGLang's native API (ours or SGLang's).

Errors are split by what the caller should do about them:
  RequestRejected  the server answered 400: the request is bad, do not retry;
  ServerUnavailable  connection refused/reset, timeout, 5xx: try another server;
  NonFiniteLogits  the served weights are broken (the abort that says so is
                   read here, once, into the typed error).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from fluxjax.rollout.protocol import Completion, GenerateRequest, NonFiniteLogits
from fluxjax.rollout.weight_protocol import DistributedUpdate, InitWeightsGroup


class RequestRejected(ValueError):
  """HTTP 4xx (but 408 and 429): this request cannot succeed on any server of
  the fleet (malformed, too large, over the context); the server's message."""


class ServerUnavailable(ConnectionError):
  """The server is down, unreachable, overloaded (408, 429) or failed (5xx)."""


def _raise_for_status(where: str, status: int, data: Any, raw: str) -> None:
  """The client's reading of a refusal; 404 is left to the caller (an optional route)."""
  if status in (408, 429) or status >= 500:
    raise ServerUnavailable(f"{where}: HTTP {status}: {raw[:200]}")
  if 400 <= status < 500 and status != 404:
    msg = data.get("error", {}).get("message", raw) if isinstance(data, dict) else raw
    raise RequestRejected(f"{where}: HTTP {status}: {msg}")


_CONNECTION_ERRORS = (
  aiohttp.ClientConnectionError,
  aiohttp.ClientPayloadError,
  asyncio.TimeoutError,
  ConnectionError,
)

# Bodies above this ask "Expect: 100-continue" first: a server refusing the
# size (413) answers before the body is sent, so the refusal reads as this
# request's failure rather than a connection the server cut mid-upload.
EXPECT_CONTINUE_BYTES = 1 << 20


def _json_request(body: Any) -> dict[str, Any]:
  """aiohttp request arguments for a JSON body."""
  if body is None:
    return {}
  payload = json.dumps(body).encode()
  return {
    "data": payload,
    "headers": {"Content-Type": "application/json"},
    "expect100": len(payload) > EXPECT_CONTINUE_BYTES,
  }


def _unless_refused(completion: Completion) -> Completion:
  """`completion`, unless it is a refusal for non-finite logits: that is raised."""
  refusal = NonFiniteLogits.of(completion)
  if refusal is not None:
    raise refusal
  return completion


class SGLangClient:
  """Calls one server. Shares the caller's aiohttp session when given."""

  def __init__(
    self, url: str, session: aiohttp.ClientSession | None = None, timeout_s: float = 3600.0
  ):
    self.url = url.rstrip("/")
    self._session = session
    self._own_session = session is None
    self.timeout = aiohttp.ClientTimeout(total=timeout_s)

  async def session(self) -> aiohttp.ClientSession:
    if self._session is None or self._session.closed:
      self._session = aiohttp.ClientSession()
      self._own_session = True
    return self._session

  async def close(self) -> None:
    if self._own_session and self._session is not None:
      await self._session.close()

  async def request(
    self, method: str, path: str, body: Any = None, timeout_s: float | None = None
  ) -> tuple[int, Any]:
    """(status, parsed JSON or text). Raises ServerUnavailable / RequestRejected."""
    session = await self.session()
    timeout = self.timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
    try:
      async with session.request(
        method, self.url + path, timeout=timeout, **_json_request(body)
      ) as r:
        raw = await r.text()
        status = r.status
    except _CONNECTION_ERRORS as e:
      raise ServerUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}") from e
    try:
      data = json.loads(raw) if raw else None
    except json.JSONDecodeError:
      data = raw
    _raise_for_status(self.url + path, status, data, raw)
    return status, data

  async def generate(self, request: GenerateRequest) -> Completion:
    status, data = await self.request("POST", "/generate", {**request.to_body(), "stream": False})
    if status != 200:
      raise RequestRejected(f"{self.url}/generate: HTTP {status}")
    return _unless_refused(Completion.from_body(data, self.url))

  async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[Completion]:
    """Yields SGLang's cumulative SSE chunks (the last has a finish_reason).

    Raises:
      ServerUnavailable: the server reported an error mid-stream.
      NonFiniteLogits: the served weights gave non-finite logits for it.
    """
    session = await self.session()
    body = {**request.to_body(), "stream": True}
    try:
      async with session.post(
        self.url + "/generate", timeout=self.timeout, **_json_request(body)
      ) as r:
        if r.status != 200:
          raw = await r.text()
          try:
            data = json.loads(raw)
          except json.JSONDecodeError:
            data = raw
          _raise_for_status(self.url + "/generate", r.status, data, raw)
          raise RequestRejected(f"{self.url}/generate: HTTP {r.status}")
        async for line in r.content:
          line = line.strip()
          if not line.startswith(b"data:"):
            continue
          payload = line[5:].strip()
          if payload == b"[DONE]":
            return
          chunk = json.loads(payload)
          if "error" in chunk:
            raise ServerUnavailable(f"{self.url}/generate: {chunk['error'].get('message')}")
          yield _unless_refused(Completion.from_body(chunk, self.url))
    except _CONNECTION_ERRORS as e:
      raise ServerUnavailable(f"{self.url}/generate: {type(e).__name__}: {e}") from e

  async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
    await self.request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

  async def pause(self, mode: str = "abort") -> None:
    await self.request("POST", "/pause_generation", {"mode": mode})

  async def resume(self) -> None:
    await self.request("POST", "/continue_generation", {})

  async def flush_cache(self, retries: int = 50, delay_s: float = 0.1) -> None:
    """Retries while the server is busy (slime's loop)."""
    for _ in range(retries):
      try:
        await self.request("POST", "/flush_cache", {})
        return
      except RequestRejected:
        await asyncio.sleep(delay_s)
    raise ServerUnavailable(f"{self.url}: flush_cache kept failing")

  async def update_weights_from_disk(
    self, model_path: str, weight_version: str | None = None, abort_all_requests: bool = False
  ) -> dict:
    _, data = await self.request(
      "POST",
      "/update_weights_from_disk",
      {
        "model_path": model_path,
        "load_format": None,
        "flush_cache": True,
        "abort_all_requests": abort_all_requests,
        "weight_version": None if weight_version is None else str(weight_version),
      },
    )
    if not data.get("success"):
      raise RequestRejected(f"{self.url}: {data.get('message')}")
    return data

  async def _weights_call(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
    _, data = await self.request("POST", path, body, timeout_s=timeout_s)
    if not isinstance(data, dict) or not data.get("success"):
      raise RequestRejected(f"{self.url}{path}: {data}")
    return data

  async def init_weights_update_group(self, req: InitWeightsGroup, timeout_s: float) -> dict:
    """Joins the server to the trainer's group; returns once every member joined."""
    return await self._weights_call("/init_weights_update_group", req.to_body(), timeout_s)

  async def update_weights_from_distributed(self, req: DistributedUpdate, timeout_s: float) -> dict:
    """Announces the tensors the trainer broadcasts next; returns once they are served."""
    return await self._weights_call("/update_weights_from_distributed", req.to_body(), timeout_s)

  async def destroy_weights_update_group(self, group_name: str) -> dict:
    return await self._weights_call("/destroy_weights_update_group", {"group_name": group_name})

  async def health(self, timeout_s: float = 5.0) -> bool:
    try:
      status, _ = await self.request("GET", "/health", timeout_s=timeout_s)
      return status == 200
    except (ServerUnavailable, RequestRejected):
      return False

  async def server_info(self) -> dict:
    return (await self.request("GET", "/get_server_info"))[1]

  async def model_info(self) -> dict:
    return (await self.request("GET", "/get_model_info"))[1]

  async def weight_version(self) -> str:
    """The served weight version (SGLang main reads it from /model_info only)."""
    status, data = await self.request("GET", "/get_weight_version")
    if status == 404:
      status, data = await self.request("GET", "/model_info")
    if not isinstance(data, dict) or "weight_version" not in data:
      raise RequestRejected(f"{self.url}: no weight_version in the answer (HTTP {status})")
    return str(data["weight_version"])
