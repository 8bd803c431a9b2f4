"""`python -m fluxjax.rollout.server`: the embedded engine behind SGLang's HTTP API.

  python -m fluxjax.rollout.server --model-path DIR --port N
  python -m fluxjax.rollout.server --preset tiny --seed S --port N   # random weights

The HTTP side is aiohttp on the main thread's event loop; the engine steps in a
background thread and reports tokens back through `call_soon_threadsafe`. The routes
are those of openapi.ENDPOINTS; what the server accepts and refuses is told in
docs/fleet.md, "The server's API".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import threading
import time
import uuid

import aiohttp
import jax
from aiohttp import web
from flax import nnx

from fluxjax.models import config as config_lib
from fluxjax.models import decode, hf_load, processor, vlm
from fluxjax.models import tokenizer as tokenizer_lib
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout import (
  json_body,
  media_cache,
  openapi,
  prompt,
  protocol,
  sampling_params,
  weight_group,
  weight_protocol,
)
from fluxjax.rollout.json_body import ProtocolError

log = logging.getLogger("fluxjax.rollout.server")
VERSION = "fluxjax-0.1"
DEFAULT_MAX_REQUEST_BYTES = 64 << 20
# Pending connections the kernel queues before accept (capped by
# net.core.somaxconn): a thousand clients connecting at once wait, none is
# refused or left to retry its SYN a second later.
LISTEN_BACKLOG = 2048
MAX_UNKNOWN_LOGGED = 64


def _error(message: str, status: int = 400, headers: dict | None = None) -> web.Response:
  return web.json_response(json_body.error_body(message), status=status, headers=headers)


def _update_result(success: bool, message: str, **extra) -> web.Response:
  """A weight endpoint's answer, SGLang's shape (400 when it failed)."""
  body = {"success": success, "message": message, **extra}
  return web.json_response(body, status=200 if success else 400)


def _load_draining(engine: engine_lib.Engine, named, tensors, version: str) -> None:
  """engine.load_hf_tensors(named); on a refusal the rest of the broadcast is
  still received (every member of the group must take part) before it raises."""
  try:
    engine.load_hf_tensors(named, version)
  except (ValueError, KeyError):
    for _ in tensors:
      pass
    raise


class RolloutServer:
  """Routes and state of one server process."""

  def __init__(self, args: argparse.Namespace):
    self.args = args
    self.engine: engine_lib.Engine | None = None
    self.tokenizer: Tokenizer | None = None
    self.load_error: str | None = None
    # Set while generation runs; /generate waits on it, so requests that arrive
    # during a pause are held in the HTTP layer, as SGLang's tokenizer manager
    # holds them, and /flush_cache sees an idle engine.
    self._unpaused = asyncio.Event()
    self._unpaused.set()
    self._unknown_logged: set[str] = set()
    self._weight_groups: dict[str, object] = {}  # group name -> torch process group
    self._group_devices: dict[str, str] = {}  # group name -> where its tensors arrive
    limits = {k: getattr(args, k) for k in VISION_LIMITS if getattr(args, k) is not None}
    # The trainer must preprocess with the same limits (pad counts must agree).
    self.proc_cfg = processor.VisionProcessorConfig(**limits)
    self.media = media_cache.MediaCache()
    self.openapi_spec = openapi.build_spec(VERSION)
    self.app = web.Application(
      client_max_size=args.max_request_bytes, middlewares=[self._errors_as_json]
    )
    routes = [
      (m, ep.path, getattr(self, ep.handler)) for ep in openapi.ENDPOINTS for m in ep.methods
    ]
    for method, path, handler in [*routes, ("GET", "/openapi.json", self.openapi_json)]:
      self.app.router.add_route(method, path, handler, expect_handler=self._expect_continue)

  # --- the HTTP layer -------------------------------------------------------------

  @web.middleware
  async def _errors_as_json(self, request: web.Request, handler) -> web.StreamResponse:
    """Answers every refusal in SGLang's error shape (aiohttp's own 404, 405
    and 413 are plain text), and an unexpected failure as a JSON 500."""
    limit = self.args.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
      return _error(_too_large(request.content_length, limit), 413)
    try:
      return await handler(request)
    except ProtocolError as e:
      return _error(str(e))
    except web.HTTPException as e:
      if e.status < 400:
        raise
      if isinstance(e, web.HTTPNotFound):
        message = f"{request.path} is not an endpoint of this server (see GET /openapi.json)"
      elif isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        message = f"{request.method} is not allowed on {request.path}; use {allowed}"
      elif isinstance(e, web.HTTPRequestEntityTooLarge):
        message = _too_large(None, limit)
      else:
        message = e.text or e.reason
      allow = {"Allow": e.headers["Allow"]} if "Allow" in e.headers else None
      return _error(message, e.status, allow)
    except ConnectionError:
      raise  # the client went away: nobody to answer
    except Exception as e:
      log.exception("%s %s failed", request.method, request.path)
      return _error(f"internal error: {type(e).__name__}: {e}", 500)

  async def _expect_continue(self, request: web.Request) -> web.Response | None:
    """Answers `Expect: 100-continue`: 413 for a body over the limit before
    the client sends a byte of it, else "go on" (aiohttp's default)."""
    limit = self.args.max_request_bytes
    if request.content_length is not None and request.content_length > limit:
      return _error(_too_large(request.content_length, limit), 413)
    if request.version != aiohttp.HttpVersion11:
      return None
    expect = request.headers.get("Expect", "")
    if expect.lower() != "100-continue":
      return _error(f"unknown Expect: {expect}", 417)
    await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.writer.output_size = 0  # the answer's own size starts after this line
    return None

  async def _json_body(self, request: web.Request) -> dict:
    """The request's JSON object body, read within --body-timeout."""
    timeout = self.args.body_timeout
    try:
      raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
      raise web.HTTPRequestTimeout(
        text=f"the request body did not arrive within {timeout:g} s (--body-timeout)"
      ) from None
    return json_body.decode_body(raw)

  async def openapi_json(self, request: web.Request) -> web.Response:
    return web.json_response(self.openapi_spec)

  # --- start-up -------------------------------------------------------------------

  def load(self) -> None:
    """Builds the model and engine, then warms up (runs in a thread)."""
    try:
      a = self.args
      overrides = {"dtype": a.dtype, "param_dtype": a.dtype, "decode_attention": a.decode_attention}
      tokenizer = tokenizer_lib.resolve(a.tokenizer_path, a.model_path)
      base = (
        config_lib.load_hf_config(a.model_path, **overrides)
        if a.model_path
        else config_lib.preset(a.preset, **overrides)
      )
      cfg = config_lib.with_tokenizer_ids(
        base,
        tokenizer.model_token_ids(),
        tokenizer.vocab_size,
        from_checkpoint=bool(a.model_path),
      )
      if a.model_path:
        model = hf_load.load_hf_checkpoint(a.model_path, cfg)
      else:
        model = vlm.create_model(cfg, a.seed)
        # Committed to one device like a loaded checkpoint, so that a later
        # update_weights_from_disk reuses the compiled steps.
        graphdef, state = nnx.split(model)
        model = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
      engine = engine_lib.Engine(
        model,
        tokenizer,
        num_slots=a.num_slots,
        capacity=a.context_length,
        num_continuous_decode_steps=a.num_continuous_decode_steps,
        min_decode_step_s=a.min_decode_step_ms / 1000,
        seed=a.seed,
        weight_version=a.weight_version,
      )
      engine.start()
      # Warm-up compiles the smallest prefill bucket and the decode step.
      warm = engine_lib.EngineRequest(
        "warmup-" + uuid.uuid4().hex,
        _text_sequence([tokenizer.im_start_id], model.cfg),
        sampling_params.SamplingParams(max_new_tokens=2, top_k=1),
      )
      engine.submit(warm)
      warm.done.wait()
      self.tokenizer, self.engine = tokenizer, engine
      log.info("ready: %s slots x %s tokens", a.num_slots, a.context_length)
    except Exception as e:
      log.exception("model load failed")
      self.load_error = f"{type(e).__name__}: {e}"

  def _ready(self) -> engine_lib.Engine:
    if self.engine is None:
      raise web.HTTPServiceUnavailable(text=self.load_error or "the model is loading")
    return self.engine

  def _tokenizer(self) -> Tokenizer:
    """The loaded tokenizer (set with the engine; 503 while loading)."""
    self._ready()
    assert self.tokenizer is not None, "the tokenizer loads with the engine"
    return self.tokenizer

  # --- generation -----------------------------------------------------------------

  async def generate(self, request: web.Request) -> web.StreamResponse:
    """One prompt, or a batch (answered as a list in input order)."""
    engine = self._ready()
    loop = asyncio.get_running_loop()
    body = await self._json_body(request)
    reqs, batched = protocol.parse_generate(body)
    self._log_unknown(body)
    for req in reqs:  # given ids (vision pads included) are refused before any media decode
      if req.input_ids is not None:
        protocol.check_context_length(
          len(req.input_ids), req.requested_max_new_tokens, engine.capacity
        )
    seqs = [await loop.run_in_executor(None, self._build_sequence, req, engine) for req in reqs]
    for req, seq in zip(reqs, seqs):
      protocol.check_context_length(len(seq), req.requested_max_new_tokens, engine.capacity)
    events: asyncio.Queue = asyncio.Queue()

    def on_event(_: engine_lib.EngineRequest) -> None:  # called on the engine's thread
      loop.call_soon_threadsafe(events.put_nowait, None)

    ereqs = [
      engine_lib.EngineRequest(
        req.rid, seq, req.sampling, return_logprob=req.return_logprob, on_event=on_event
      )
      for req, seq in zip(reqs, seqs)
    ]
    await self._unpaused.wait()
    submitted: list[engine_lib.EngineRequest] = []
    try:
      try:
        for ereq in ereqs:
          submitted.append(engine.submit(ereq))
      except ProtocolError as e:
        return _error(str(e))
      if not batched and reqs[0].stream:
        return await self._stream(request, ereqs[0], events, reqs[0])
      while any(e.finish_reason is None for e in ereqs):
        await events.get()
      answers = [self._response(e, r) for e, r in zip(ereqs, reqs)]
      return web.json_response(answers if batched else answers[0])
    finally:
      # A client that went away (cancelled handler), or a batch refused part
      # way, aborts what it submitted, as in SGLang.
      for ereq in submitted:
        if ereq.finish_reason is None:
          engine.abort(ereq.rid, message="Abort: client disconnected")

  def _build_sequence(self, req: protocol.GenerateRequest, engine: engine_lib.Engine):
    """The request's model inputs. Whatever fails in building them (a media
    decoder's own exception included) is this request's fault, a 400: a 5xx
    would make a fleet mark the server down and retry the request elsewhere."""
    try:
      return prompt.build_sequence(
        req, self._tokenizer(), engine.cfg, self.proc_cfg, cache=self.media
      )
    except ProtocolError:
      raise
    except Exception as e:
      log.warning("request %s: cannot build its prompt", req.rid, exc_info=True)
      raise ProtocolError(f"cannot build the prompt: {type(e).__name__}: {e}") from e

  def _log_unknown(self, body: dict) -> None:
    """Logs each top-level field GenerateReqInput lacks, once (they are
    ignored); after MAX_UNKNOWN_LOGGED names no more, so that clients sending
    ever new names cannot grow the set or flood the log."""
    for key in protocol.unknown_fields(body):
      if key not in self._unknown_logged and len(self._unknown_logged) < MAX_UNKNOWN_LOGGED:
        self._unknown_logged.add(key)
        log.warning("ignoring /generate field %r: not a field of SGLang's GenerateReqInput", key)

  def _response(self, ereq, req) -> dict:
    """The /generate answer (also each streamed chunk, cumulative)."""
    tokenizer = self._tokenizer()
    out = engine_lib.response(ereq, tokenizer, self._ready().weight_version)
    token_text = (lambda t: tokenizer.decode([t])) if req.return_text_in_logprobs else None
    body = out.to_body(req.return_logprob, token_text)
    if out.finish_reason is not None:
      now = time.time()
      body["meta_info"].update(e2e_latency=now - ereq.created, response_sent_to_client_ts=now)
    return body

  async def _stream(self, request, ereq, events, req) -> web.StreamResponse:
    """SSE: cumulative chunks `data: {...}\\n\\n`, then `data: [DONE]`."""
    resp = web.StreamResponse(
      headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    sent = -1
    try:
      while True:
        await events.get()
        while not events.empty():  # coalesce: chunks are cumulative anyway
          events.get_nowait()
        done = ereq.finish_reason is not None
        if len(ereq.output_ids) != sent or done:
          sent = len(ereq.output_ids)
          chunk = self._response(ereq, req)
          await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if done:
          break
    except ConnectionError:
      raise
    except Exception as e:  # the headers are out: report it in the stream, as SGLang does
      log.exception("streaming %s failed", ereq.rid)
      error = json_body.error_body(f"{type(e).__name__}: {e}")
      await resp.write(f"data: {json.dumps(error)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp

  # --- control --------------------------------------------------------------------

  async def abort_request(self, request: web.Request) -> web.Response:
    engine = self._ready()
    rid, abort_all = protocol.parse_abort(await self._json_body(request))
    engine.abort(rid, abort_all=abort_all)
    return web.Response(status=200)

  async def pause_generation(self, request: web.Request) -> web.Response:
    engine = self._ready()
    mode = protocol.parse_pause(await self._json_body(request))
    self._unpaused.clear()
    await asyncio.get_running_loop().run_in_executor(None, engine.pause, mode)
    return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

  async def continue_generation(self, request: web.Request) -> web.Response:
    self._ready().resume()
    self._unpaused.set()
    return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

  async def flush_cache(self, request: web.Request) -> web.Response:
    # No prefix cache is kept across requests, so flushing is a no-op once idle;
    # the busy check keeps SGLang's contract (400 while requests are in flight).
    if not self._ready().idle():
      return web.Response(status=400, text="Cache not flushed: there are pending requests.")
    return web.Response(status=200, text="Cache flushed.")

  async def update_weights_from_disk(self, request: web.Request) -> web.Response:
    engine = self._ready()
    try:
      path, version, abort_all = weight_protocol.parse_update_weights(
        await self._json_body(request)
      )
      if abort_all:
        engine.abort(abort_all=True, message="Abort: weight update")
      version = engine.weight_version if version is None else version
      await asyncio.get_running_loop().run_in_executor(
        None, engine.load_weights_from_disk, path, version
      )
    except (ProtocolError, OSError, ValueError, KeyError) as e:
      return _update_result(False, f"Failed to update weights: {e}", num_paused_requests=0)
    return _update_result(True, "Succeeded to update model weights.", num_paused_requests=0)

  async def init_weights_update_group(self, request: web.Request) -> web.Response:
    """Joins the trainer's group (rank `rank_offset`: this server has one GPU);
    answers once every member has joined, or the rendezvous timed out."""
    self._ready()
    try:
      req = weight_protocol.parse_init_weights_group(await self._json_body(request))
      old = self._weight_groups.pop(req.group_name, None)
      if old is not None:  # a restarted trainer makes its group anew
        log.warning("weight update group %r replaced by a new one", req.group_name)
        weight_group.destroy_group(old)
      group = await asyncio.get_running_loop().run_in_executor(
        None,
        weight_group.init_group,
        req.backend,
        req.master_address,
        req.master_port,
        req.world_size,
        req.rank_offset,
        req.group_name,
        self.args.weight_group_timeout,
      )
    except (ProtocolError, ImportError, RuntimeError, ValueError, OSError) as e:
      return _update_result(False, f"Failed to initialize custom process group: {e}.")
    self._weight_groups[req.group_name] = group
    self._group_devices[req.group_name] = weight_group.tensor_device(req.backend)
    return _update_result(True, "Succeeded to initialize custom process group.")

  async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
    """Receives the tensors the trainer broadcasts and swaps them in, all or
    nothing; a bad name or shape is refused after its tensors were received
    (the broadcast must complete for every member of the group)."""
    engine = self._ready()
    try:
      req = weight_protocol.parse_distributed_update(await self._json_body(request))
      group = self._weight_groups.get(req.group_name)
      if group is None:
        raise ProtocolError(f"no weight update group {req.group_name!r}; init it first")
      if req.abort_all_requests:
        engine.abort(abort_all=True, message="Abort: weight update")
      version = engine.weight_version if req.weight_version is None else req.weight_version
      device = self._group_devices[req.group_name]
      tensors = weight_group.prefetched(
        weight_group.receive(group, req.dtypes, req.shapes, device=device)
      )
      named = zip(req.names, tensors, strict=True)
      await asyncio.get_running_loop().run_in_executor(
        None, _load_draining, engine, named, tensors, version
      )
    except (ProtocolError, ValueError, KeyError, RuntimeError) as e:
      return _update_result(False, f"Failed to update weights: {e}")
    return _update_result(True, "Succeeded to update parameter online.")

  async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
    self._ready()
    try:
      name = weight_protocol.parse_group_name(await self._json_body(request))
    except ProtocolError as e:
      return _update_result(False, f"Failed to destroy custom process group: {e}")
    group = self._weight_groups.pop(name, None)
    if group is None:
      return _update_result(False, "The group to be destroyed does not exist.")
    weight_group.destroy_group(group)
    return _update_result(True, "Succeeded to destroy custom process group.")

  async def update_weight_version(self, request: web.Request) -> web.Response:
    engine = self._ready()
    version, abort_all = weight_protocol.parse_update_weight_version(await self._json_body(request))
    if abort_all:
      engine.abort(abort_all=True)
    engine.weight_version = version
    return web.json_response({"success": True, "message": "ok"})

  # --- info -----------------------------------------------------------------------

  async def health(self, request: web.Request) -> web.Response:
    if self.engine is None:
      return web.Response(status=503, text=self.load_error or "loading")
    return web.Response(status=200)

  async def health_generate(self, request: web.Request) -> web.Response:
    engine = self._ready()
    ereq = engine_lib.EngineRequest(
      "health-" + uuid.uuid4().hex,
      _text_sequence([self._tokenizer().im_start_id], engine.cfg),
      sampling_params.SamplingParams(max_new_tokens=1, top_k=1),
    )
    engine.submit(ereq)
    ok = await asyncio.get_running_loop().run_in_executor(None, ereq.done.wait, 20.0)
    if not ok or ereq.finish_reason is None or ereq.finish_reason["type"] == "abort":
      engine.abort(ereq.rid)
      return web.Response(status=503, text="generation failed")
    return web.Response(status=200)

  async def model_info(self, request: web.Request) -> web.Response:
    engine = self._ready()
    return web.json_response(
      {
        "model_path": self.args.model_path or f"preset:{self.args.preset}",
        "tokenizer_path": self.args.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
        "has_image_understanding": True,
        "has_audio_understanding": False,
        "model_type": "qwen2_5_vl",
        "architectures": [config_lib.ARCHITECTURE],
      }
    )

  async def server_info(self, request: web.Request) -> web.Response:
    engine = self._ready()
    a = self.args
    return web.json_response(
      {
        "model_path": a.model_path or f"preset:{a.preset}",
        "tp_size": 1,
        "dp_size": 1,
        "weight_version": engine.weight_version,
        "version": VERSION,
        "max_total_num_tokens": engine.num_slots * engine.capacity,
        "context_length": engine.capacity,
        "max_running_requests": engine.num_slots,
        "random_seed": a.seed,
        "dtype": a.dtype,
        "port": a.port,
        "host": a.host,
        # fluxjax's own: the model's sizes and how it preprocesses media (a
        # fleet checks both against the trainer's on start).
        "model_shape": config_lib.shape_summary(engine.cfg),
        "vision_limits": {k: getattr(self.proc_cfg, k) for k in VISION_LIMITS},
        "weight_deltas_applied": engine.deltas_applied,
        "min_decode_step_ms": engine.min_decode_step_s * 1000,
      }
    )

  async def get_weight_version(self, request: web.Request) -> web.Response:
    return web.json_response({"weight_version": self._ready().weight_version})

  async def get_load(self, request: web.Request) -> web.Response:
    return web.json_response(self._ready().load())


def _too_large(size: int | None, limit: int) -> str:
  got = "" if size is None else f" ({size} bytes)"
  return f"the request body{got} exceeds this server's limit of {limit} bytes (--max-request-bytes)"


def _text_sequence(ids, cfg):
  from fluxjax.models import inputs  # local: only for warm-up/health prompts

  return inputs.sequence_from_tokens(ids, [], cfg)


# The VisionProcessorConfig fields a flag sets (a run's data.vision section).
VISION_LIMITS = (
  "image_min_pixels",
  "image_max_pixels",
  "video_min_pixels",
  "video_max_pixels",
  "video_max_frames",
)


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model-path", default=None, help="HF checkpoint folder")
  p.add_argument(
    "--preset", default="tiny", help="random weights of this preset when no --model-path is given"
  )
  p.add_argument(
    "--tokenizer-path",
    default=None,
    help="tokenizer.json (default: the checkpoint's, else the shipped synthetic one)",
  )
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=30000)
  p.add_argument("--seed", "--random-seed", type=int, default=0, dest="seed")
  p.add_argument("--num-slots", type=int, default=8, help="concurrent sequences")
  p.add_argument(
    "--context-length",
    type=int,
    default=512,
    help="tokens per slot, the most one request may use: its prompt plus an explicit "
    "max_new_tokens must fit (400 otherwise, as SGLang)",
  )
  p.add_argument(
    "--num-continuous-decode-steps",
    type=int,
    default=1,
    help="decode steps per jitted call, as SGLang's flag: the dispatch and the fetch of "
    "the tokens are paid once per call; a request that stops inside a call holds its "
    "slot to the call's end",
  )
  p.add_argument(
    "--min-decode-step-ms",
    type=float,
    default=0.0,
    help="benchmarks only: each decode step lasts at least this long, as on a "
    "memory-bound accelerator whose step reads every weight whatever the batch, "
    "so that a call's cost does not fall with the slots it runs (default 0: off)",
  )
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument(
    "--decode-attention",
    default="xla",
    choices=decode.DECODE_ATTENTION,
    help="decode steps' attention: the xla reference or pallas_gpu (models/decode.py)",
  )
  p.add_argument("--weight-version", default="default")
  p.add_argument(
    "--max-request-bytes",
    type=int,
    default=DEFAULT_MAX_REQUEST_BYTES,
    help="largest request body taken, in bytes; a larger one gets 413 (default 64 MiB: "
    "images and videos travel base64-encoded in the JSON, 4/3 of their size, so this holds "
    "about 48 MiB of media, a batch of full-HD frames or a short clip; aiohttp's own 1 MiB "
    "would refuse a single photo, and SGLang's uvicorn sets no limit at all)",
  )
  p.add_argument(
    "--body-timeout",
    type=float,
    default=60.0,
    help="seconds a request body may take to arrive once its headers are in; a slower one "
    "gets 408 and its connection is closed after as long again (default 60: 64 MiB at "
    "100 Mbit/s takes about 5 s)",
  )
  p.add_argument(
    "--idle-timeout",
    type=float,
    default=75.0,
    help="seconds a connection may stay open without a complete request, unfinished "
    "headers included, before it is closed (aiohttp's keep-alive timeout; default 75, "
    "longer than the 15 s a client such as aiohttp keeps an idle connection)",
  )
  p.add_argument(
    "--weight-group-timeout",
    type=float,
    default=600.0,
    help="seconds a weight update group waits for its members to join, and a broadcast "
    "for its tensors (/init_weights_update_group, /update_weights_from_distributed)",
  )
  p.add_argument("--log-level", default="warning")
  for key in VISION_LIMITS:
    p.add_argument(
      protocol.server_flag(key),
      type=int,
      default=None,
      help="vision preprocessing limit (default: processor.VisionProcessorConfig's)",
    )
  args = p.parse_args(argv)
  try:
    engine_lib.check_decode_steps(args.num_continuous_decode_steps, "--num-continuous-decode-steps")
    engine_lib.check_min_decode_step(args.min_decode_step_ms, "--min-decode-step-ms")
  except ValueError as e:
    p.error(str(e))
  return args


async def serve(args: argparse.Namespace) -> None:
  server = RolloutServer(args)
  runner = web.AppRunner(
    server.app,
    handler_cancellation=True,
    access_log=None,
    keepalive_timeout=args.idle_timeout,
    # How long the rest of a refused (413) or late (408) body is read and
    # dropped, so the client sees the answer, before the connection closes.
    lingering_time=args.body_timeout,
  )
  await runner.setup()
  await web.TCPSite(runner, args.host, args.port, backlog=LISTEN_BACKLOG).start()
  threading.Thread(target=server.load, name="model-load", daemon=True).start()
  await asyncio.Event().wait()


def main(argv=None) -> None:
  args = parse_args(argv)
  logging.basicConfig(
    level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
  )
  asyncio.run(serve(args))


if __name__ == "__main__":
  main()
