"""`python -m fluxjax.rollout.server` under abuse, as a real process on loopback.

Malformed and mistyped bodies, prompts over the context, bodies over the size
limit, unknown paths and methods, clients that stall or trickle, a thousand
connections at once, and schemathesis fuzzing every endpoint from the
server's own OpenAPI description. Throughout, the server keeps answering
/health, every request it accepted gets its whole answer, and every refusal
is SGLang's error body, {"error": {"message": ...}}.

One server (tiny preset, random weights, the default 64 MiB body limit) is
shared by the module; its body and idle timeouts are cut to seconds so that
the slow-client checks are quick.
"""

import asyncio
import dataclasses
import json
import resource
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import pytest
import schemathesis
from schemathesis import checks

from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import client as client_lib
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.rollout import launcher, openapi, protocol, sampling_params, server
from helpers import SERVER_CONTEXT, TINY_SERVER, generate_body, generate_request, server_env

CONTEXT = SERVER_CONTEXT
LIMIT = server.DEFAULT_MAX_REQUEST_BYTES
BODY_TIMEOUT = 1.5  # --body-timeout of the test server
IDLE_TIMEOUT = 10.0  # --idle-timeout: room to open a thousand connections and use each
READ_TIMEOUT = IDLE_TIMEOUT + 10.0  # a client's wait: past any close the server owes it
CONNECTIONS = 1000
# Open files the test process and the server each need for CONNECTIONS sockets.
FDS_NEEDED = CONNECTIONS + 256


def _raise_fd_limit(needed: int) -> int:
  """Raises the soft open-file limit towards `needed` (the hard limit caps
  it); server processes started afterwards inherit it. Returns the soft limit."""
  soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
  if soft < needed:
    soft = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
  return soft


@pytest.fixture(scope="module")
def fd_limit():
  return _raise_fd_limit(FDS_NEEDED)


@pytest.fixture(scope="module")
def url(fd_limit, tmp_path_factory):
  cmd = TINY_SERVER + [
    "--body-timeout",
    str(BODY_TIMEOUT),
    "--idle-timeout",
    str(IDLE_TIMEOUT),
  ]
  logs = str(tmp_path_factory.mktemp("logs"))
  launched = launcher.launch_servers(cmd, 1, env=server_env(), timeout_s=120, log_dir=logs)
  yield launched.urls[0]
  launched.stop()


def http(url, path, body=None, method=None, headers=None):
  """(status, parsed JSON or text, response headers) with urllib: the raw wire."""
  data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
  req = urllib.request.Request(
    url + path,
    data=data,
    method=method or ("POST" if data is not None else "GET"),
    headers={"Content-Type": "application/json", **(headers or {})},
  )
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      raw, status, got = r.read(), r.status, r.headers
  except urllib.error.HTTPError as e:
    raw, status, got = e.read(), e.code, e.headers
  try:
    return status, json.loads(raw) if raw else None, got
  except json.JSONDecodeError:
    return status, raw.decode(), got


def error_message(out) -> str:
  """The message of SGLang's error body (fails unless `out` has that shape)."""
  assert isinstance(out, dict) and set(out) == {"error"}, out
  assert isinstance(out["error"]["message"], str)
  return out["error"]["message"]


def assert_serving(url):
  """/health answers and a request runs to its full length."""
  assert http(url, "/health")[0] == 200
  status, out, _ = http(url, "/generate", generate_body([5, 6, 7], max_new=3))
  assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def prompt_ids(n, seed=0):
  return [int(i) for i in np.random.default_rng(seed).integers(0, 490, n)]


async def raw_exchange(url, chunks, until_closed=False) -> tuple[bytes, bytes, float]:
  """Writes `chunks` on a fresh connection, then reads the answer.

  Returns (status line and headers, body, seconds from the first write to
  the end of the answer or, with `until_closed`, to the server closing the
  connection; an answer-less close gives empty bytes).
  """
  parts = urlsplit(url)
  reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
  loop = asyncio.get_running_loop()
  start = loop.time()
  for chunk in chunks:
    writer.write(chunk)
    await writer.drain()
  try:
    if until_closed:
      head, _, body = (await asyncio.wait_for(reader.read(), READ_TIMEOUT)).partition(b"\r\n\r\n")
    else:
      head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT))[:-4]
      length = [
        v for k, _, v in (h.partition(b": ") for h in head.split(b"\r\n")) if k == b"Content-Length"
      ]
      body = await reader.readexactly(int(length[0]))
  except (ConnectionResetError, asyncio.IncompleteReadError):
    head, body = b"", b""
  elapsed = loop.time() - start
  writer.close()
  return head, body, elapsed


# --- malformed, mistyped, oversized ---------------------------------------------------


@pytest.mark.parametrize(
  "body, message",
  [
    (b'{"input_ids": [1, 2], "sampling_params": {"temperature": NaN}}', "NaN is not a JSON"),
    (b'{"input_ids": [1, 2], "sampling_params": {"top_p": Infinity}}', "Infinity is not a"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b'{"text": "\xff\xfe"}', "not valid JSON"),
    (b'["input_ids", [1, 2]]', "must be a JSON object"),
    ({"input_ids": [1, 2], "stream": "yes"}, "stream must be a boolean"),
    ({"input_ids": [1, 2], "return_logprob": 1}, "return_logprob must be a boolean"),
    ({"input_ids": [1, 2], "rid": 7}, "rid must be a non-empty string"),
    ({"input_ids": [1, True]}, "input_ids must hold token ids"),
    ({"input_ids": [1, 1 << 40]}, "input_ids must hold token ids"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": True}}, "temperature"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "4"}}, "max_new_tokens"),
    ({"input_ids": [1, 2], "sampling_params": {"top_k": 2.5}}, "top_k"),
    ({"input_ids": [1, 2], "sampling_params": {"stop": 3}}, "stop must be"),
    ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 3}}, "stop_token_ids"),
    ({"input_ids": [1, 2], "sampling_params": {"ignore_eos": "no"}}, "ignore_eos"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": -1}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"sampling_seed": 1 << 32}}, "sampling_seed"),
    ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"+3": 1.0}}}, "not a token id"),
    ({"input_ids": [1, 2], "sampling_params": {"n": True}}, "'n'=True is not supported"),
    ({"input_ids": [1, 2], "return_entropy": 0}, "return_entropy=0 is not supported"),
  ],
)
def test_malformed_or_mistyped_body_gets_400(url, body, message):
  """Each is refused before it reaches the engine: a seed past uint32, for
  one, used to fail the engine's step and abort every running request."""
  status, out, headers = http(url, "/generate", body)
  assert status == 400 and headers["Content-Type"].startswith("application/json")
  assert message in error_message(out)
  assert http(url, "/health")[0] == 200


def test_control_endpoints_refuse_wrong_types(url):
  cases = [
    ("/abort_request", {"rid": 5}, "rid must be a string"),
    ("/abort_request", {"abort_all": "yes"}, "abort_all must be a boolean"),
    ("/pause_generation", {"mode": ""}, "unknown pause mode"),
    ("/update_weight_version", {"new_version": 3}, "new_version"),
    ("/update_weight_version", b"{oops", "not valid JSON"),
  ]
  for path, body, message in cases:
    status, out, _ = http(url, path, body)
    assert status == 400 and message in error_message(out), (path, out)
  status, out, _ = http(url, "/update_weights_from_disk", {"model_path": "/x", "weight_version": 1})
  assert status == 400 and out["success"] is False and "weight_version" in out["message"]
  assert_serving(url)  # nothing was paused or aborted on the way


def test_weight_endpoints_refuse_a_bad_body_in_their_own_shape(url):
  """An endpoint whose refusal is SGLang's {success, message} (openapi.py)
  refuses a body that is not JSON in that shape too, not the generic error:
  a trainer reads `success` from every answer of these."""
  spec = openapi.build_spec(server.VERSION)
  shaped = [
    path
    for path, ops in spec["paths"].items()
    if "post" in ops
    and ops["post"]["responses"].get("400", {}).get("content", {}).get("application/json", {})
    == {"schema": {"$ref": "#/components/schemas/UpdateWeightsResult"}}
  ]
  assert "/destroy_weights_update_group" in shaped and len(shaped) >= 4, shaped
  for path in shaped:
    status, out, _ = http(url, path, b"\x00")
    assert status == 400 and out["success"] is False, (path, out)
    assert "not valid JSON" in out["message"], (path, out)
  assert_serving(url)


def test_unknown_path_is_404_and_wrong_method_405_in_json(url):
  status, out, _ = http(url, "/v1/no_such_endpoint")
  assert status == 404 and "/v1/no_such_endpoint is not an endpoint" in error_message(out)
  status, out, headers = http(url, "/generate", method="DELETE")
  assert status == 405 and headers["Allow"] == "POST,PUT"
  assert "DELETE is not allowed on /generate" in error_message(out)
  status, out, headers = http(url, "/health", {}, method="POST")
  assert status == 405 and headers["Allow"] == "GET" and error_message(out)


def test_openapi_describes_exactly_the_served_routes(url):
  """GET /openapi.json is the module's description; every described path
  answers exactly the described methods (a method it lacks gets 405 with
  the path's Allow list, so no handler runs), and /generate's body lists
  every field of SGLang's GenerateReqInput that protocol.py knows."""
  status, spec, _ = http(url, "/openapi.json")
  assert status == 200 and spec == json.loads(json.dumps(openapi.build_spec(server.VERSION)))
  for path, operations in spec["paths"].items():
    status, _, headers = http(url, path, method="PATCH")
    assert status == 405, path
    assert set(headers["Allow"].split(",")) == {m.upper() for m in operations}, path
  fields = spec["components"]["schemas"]["GenerateReqInput"]["properties"]
  assert set(fields) == protocol.GENERATE_FIELDS
  sampling = spec["components"]["schemas"]["SamplingParams"]["properties"]
  assert set(sampling) == set(sampling_params.SAMPLING_DEFAULTS)


def test_body_over_the_limit_is_413_before_it_is_read(url):
  """The default limit (64 MiB) on the wire: a declared size over it is
  refused from the headers alone (also before `100 Continue`), a chunked
  body as it crosses it, and a body of exactly the limit is taken."""

  async def go():
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
    declared = await raw_exchange(url, [head + b"Content-Length: %d\r\n\r\n" % (LIMIT + 1)])
    expect = await raw_exchange(
      url, [head + b"Content-Length: %d\r\nExpect: 100-continue\r\n\r\n" % (LIMIT + 1)]
    )
    piece = b"x" * (1 << 20)
    chunked = [head + b"Transfer-Encoding: chunked\r\n\r\n"]
    chunked += [b"%x\r\n%s\r\n" % (len(piece), piece)] * (LIMIT // len(piece) + 1)
    streamed = await raw_exchange(url, [*chunked, b"0\r\n\r\n"])
    return declared, expect, streamed

  declared, expect, streamed = asyncio.run(go())
  for head, body, _ in (declared, expect, streamed):
    assert head.startswith(b"HTTP/1.1 413 "), head  # no "100 Continue" first
    assert b"application/json" in head
    assert f"limit of {LIMIT} bytes" in error_message(json.loads(body))
  assert f"({LIMIT + 1} bytes)" in error_message(json.loads(declared[1]))
  # A body of exactly the limit: padding in a field the server ignores.
  small = {**generate_body([1, 2], max_new=1), "model": ""}
  padded = {**small, "model": "x" * (LIMIT - len(json.dumps(small)))}
  data = json.dumps(padded).encode()
  assert len(data) == LIMIT
  status, out, _ = http(url, "/generate", data)
  assert status == 200 and out["meta_info"]["completion_tokens"] == 1
  assert_serving(url)


# --- the context -----------------------------------------------------------------------


def test_prompt_plus_max_new_tokens_over_the_context_is_400_with_the_numbers(url):
  """SGLang's check and words (tokenizer_manager._validate_one_request): an
  explicit max_new_tokens must fit beside the prompt; absent or null, it is
  clipped to the context left."""
  ids = prompt_ids(CONTEXT - 6)
  status, out, _ = http(url, "/generate", generate_body(ids, max_new=7))
  assert status == 400
  assert error_message(out) == (
    f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. "
    f"You requested a total of {CONTEXT + 1} tokens: {CONTEXT - 6} tokens from the input "
    "messages and 7 tokens for the completion. Please reduce the number of tokens in the "
    "input messages or the completion to fit within the limit."
  )
  # Exactly the context: runs to its full length.
  status, out, _ = http(url, "/generate", generate_body(ids, max_new=6))
  assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
  # No max_new_tokens (SGLang's default 128), or null: clipped to the 6 left.
  for sampling in ({"ignore_eos": True}, {"ignore_eos": True, "max_new_tokens": None}):
    status, out, _ = http(url, "/generate", {"input_ids": ids, "sampling_params": sampling})
    assert status == 200 and out["meta_info"]["completion_tokens"] == 6, sampling
  # A prompt of the whole context leaves nothing to generate.
  status, out, _ = http(url, "/generate", generate_body(prompt_ids(CONTEXT), max_new=1))
  assert status == 400 and error_message(out) == (
    f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens)."
  )
  # A text prompt counts its tokens; one item over the context refuses the batch.
  text = "how many red circles? " * 20
  n = len(Tokenizer.default().encode(text))
  body = {"text": ["short", text], "sampling_params": {"max_new_tokens": CONTEXT - n + 1}}
  status, out, _ = http(url, "/generate", body)
  assert status == 400
  assert f"{n} tokens from the input messages and {CONTEXT - n + 1} tokens" in error_message(out)
  assert http(url, "/get_load")[1]["num_reqs"] == 0


def test_fleet_takes_a_context_overflow_as_that_request_s_failure(url):
  """The trainer's client raises RequestRejected for the 400 and the 413 (no
  retry, the server stays in the fleet) and the next request is served."""

  async def go():
    async with fleet_lib.Fleet([url]) as fleet:
      with pytest.raises(client_lib.RequestRejected, match="exceeds the model's maximum context"):
        await fleet.generate(generate_request(prompt_ids(CONTEXT - 2), max_new=3))
      with pytest.raises(client_lib.RequestRejected, match="HTTP 413"):
        # A long string: json.dumps of it does not hold the loop for seconds.
        request = generate_request([1, 2], max_new=2)
        await fleet.generate(dataclasses.replace(request, text="x" * LIMIT))
      served = await fleet.generate(generate_request([1, 2], max_new=2))
      return fleet.metrics(), served

  metrics, served = asyncio.run(go())
  assert metrics["fleet/servers_down"] == 0 and metrics["fleet/retries"] == 0
  assert served.finish_reason == {"type": "length", "length": 2}


# --- slow clients and many clients ----------------------------------------------------


def test_stalled_and_trickling_clients_get_408_and_are_dropped_without_blocking_others(url):
  async def trickle(writer, stop):
    while not stop.is_set():
      writer.write(b" ")
      await asyncio.sleep(0.1)

  async def go():
    head = b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n"
    loop = asyncio.get_running_loop()
    stalled = asyncio.create_task(raw_exchange(url, [head + b'{"input_ids"'], until_closed=True))
    # Headers that never finish: no request to answer, the connection is closed.
    unfinished = asyncio.create_task(
      raw_exchange(url, [b"POST /generate HTTP/1.1\r\nHost: t"], until_closed=True)
    )
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(head)
    stop = asyncio.Event()
    dripping = asyncio.create_task(trickle(writer, stop))
    start = loop.time()
    async with aiohttp.ClientSession() as session:
      async with session.get(url + "/health") as r:
        health = r.status
      async with session.post(url + "/generate", json=generate_body([1, 2, 3], 4)) as r:
        generated = (r.status, (await r.json())["meta_info"]["completion_tokens"])
    served_in = loop.time() - start
    trickled = await asyncio.wait_for(reader.read(), READ_TIMEOUT)
    trickled_closed = loop.time() - start
    stop.set()
    await dripping
    writer.close()
    return (
      health,
      generated,
      served_in,
      await stalled,
      await unfinished,
      (
        trickled,
        trickled_closed,
      ),
    )

  health, generated, served_in, stalled, unfinished, trickled = asyncio.run(go())
  assert health == 200 and generated == (200, 4) and served_in < BODY_TIMEOUT
  head, body, closed = stalled
  assert head.startswith(b"HTTP/1.1 408 ")
  assert "--body-timeout" in error_message(json.loads(body))
  # Answered at BODY_TIMEOUT, the rest of its body waited for as long again.
  assert BODY_TIMEOUT <= closed < 2 * BODY_TIMEOUT + 1.0
  raw, closed = trickled
  assert raw.startswith(b"HTTP/1.1 408 ") and BODY_TIMEOUT <= closed < 2 * BODY_TIMEOUT + 1.0
  head, body, closed = unfinished
  assert head == b"" and IDLE_TIMEOUT - 0.5 <= closed < IDLE_TIMEOUT + 1.0
  assert_serving(url)


def test_a_thousand_connections_at_once_lose_no_accepted_request(url, fd_limit):
  """CONNECTIONS clients connect at once, while /generate requests run and
  bad requests arrive; then each sends /health on its open connection. Every
  /health answers 200, every /generate gets its whole answer, and nothing is
  left running afterwards."""
  if fd_limit < FDS_NEEDED:
    pytest.skip(f"the hard open-file limit ({fd_limit}) is below the {FDS_NEEDED} needed")
  parts = urlsplit(url)
  bodies = [generate_body(prompt_ids(5 + i, seed=i), max_new=12, seed=i) for i in range(8)]

  async def health_on(conn, opened_at: float) -> tuple[float, bytes]:
    """(seconds from opening to the request sent, status line; b"" if closed)."""
    reader, writer = conn
    writer.write(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    sent_after = asyncio.get_running_loop().time() - opened_at
    try:
      head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
      head = b""
    writer.close()
    return sent_after, head.split(b"\r\n")[0]

  async def go():
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:

      async def post(body):
        async with session.post(url + "/generate", json=body) as r:
          return r.status, await r.json()

      generating = [asyncio.create_task(post(b)) for b in bodies]
      refused = [asyncio.create_task(post({"input_ids": [1], "stream": "x"})) for _ in range(4)]
      start = loop.time()
      conns = await asyncio.gather(
        *(asyncio.open_connection(parts.hostname, parts.port) for _ in range(CONNECTIONS))
      )
      opened_in = loop.time() - start
      answers = await asyncio.gather(*(health_on(c, start) for c in conns))
      return opened_in, answers, await asyncio.gather(*generating), await asyncio.gather(*refused)

  opened_in, answers, generated, refused = asyncio.run(go())
  # The server may close a connection left idle for IDLE_TIMEOUT; the test
  # itself must use every connection well before that.
  slowest = max(sent_after for sent_after, _ in answers)
  assert slowest < IDLE_TIMEOUT - 1.0, (
    f"this machine took {opened_in:.1f} s to open {CONNECTIONS} connections and "
    f"{slowest:.1f} s to send on each, too close to the server's {IDLE_TIMEOUT} s idle timeout"
  )
  assert [status for _, status in answers] == [b"HTTP/1.1 200 OK"] * CONNECTIONS
  for (status, out), body in zip(generated, bodies):
    assert status == 200 and out["meta_info"]["finish_reason"] == {"type": "length", "length": 12}
    assert out["meta_info"]["prompt_tokens"] == len(body["input_ids"])
    assert len(out["output_ids"]) == len(out["meta_info"]["output_token_logprobs"]) == 12
  assert all(status == 400 for status, _ in refused)
  assert http(url, "/get_load")[1] == {
    "num_reqs": 0,
    "num_running_reqs": 0,
    "num_waiting_reqs": 0,
    "num_tokens": 0,
  }
  assert_serving(url)


# --- schemathesis ----------------------------------------------------------------------


# The document the server serves (test_openapi_is_served pins the two equal),
# loaded at collection so schemathesis parametrizes through pytest's own
# mechanism; its lazy `from_fixture` rewrites pytest's private node ids, which
# pytest 9.2 removed. Fuzzed a bounded amount: explicit examples and 25
# generated requests per operation (valid and invalid), derandomized so CI
# repeats the same requests, no example database written.
api_schema = schemathesis.openapi.from_dict(openapi.build_spec(server.VERSION))
api_schema.config.generation.update(max_examples=25, deterministic=True, database="none")
api_schema.config.phases.update(phases=["examples", "fuzzing"])
# Pausing holds every later /generate until /continue_generation, and joining
# a weight update group waits for its members until the group's timeout:
# fuzzed, each would stall the run (test_rollout_server.py covers pause and
# continue, test_weight_sync.py the group).
fuzzed = api_schema.exclude(path="/pause_generation").exclude(path="/init_weights_update_group")


@fuzzed.parametrize()
def test_schemathesis_no_server_error_and_answers_conform(case, url):
  """No 5xx, status codes, content types and bodies as described, and a
  request outside the schema refused with 4xx. Requests inside it may still
  be refused (a token id past the vocabulary, a prompt over the context):
  the schema cannot say so, hence no positive_data_acceptance check."""
  case.call_and_validate(base_url=url, excluded_checks=[checks.positive_data_acceptance])


def test_server_serves_after_fuzzing(url):
  assert_serving(url)
  assert http(url, "/get_load")[1]["num_reqs"] == 0
