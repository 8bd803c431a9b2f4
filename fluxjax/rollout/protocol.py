"""The generate side of SGLang's native HTTP API that RL rollout uses.

Our client and our server both speak exactly this (docs/fleet.md, "The server's API"), so
the client works against a real SGLang fleet and is always tested against a real server.
Sampling parameters are in sampling_params.py, weight updates in weight_protocol.py;
bodies and errors follow json_body.py; every route is in openapi.ENDPOINTS.

  POST /generate       GenerateRequest -> Completion (or SSE chunks of it)
  POST /abort_request  (`parse_abort`), /pause_generation (`parse_pause`), /continue_generation
  GET|POST /flush_cache; GET /health, /get_model_info, /get_server_info, /get_load, ...
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from fluxjax.rollout.json_body import ProtocolError, is_json_int, json_equal, json_flag
from fluxjax.rollout.sampling_params import MAX_TOKEN_ID, SamplingParams

# Top-level GenerateReqInput fields (io_struct.py), in three kinds.
#
# Used by this server.
USED_FIELDS = {
  "text",
  "input_ids",
  "image_data",
  "video_data",
  "sampling_params",
  "rid",
  "return_logprob",
  "return_text_in_logprobs",
  "stream",
}
# Do not change what a generation returns: routing and prefix-cache hints,
# sessions' identity, logging, metrics, tracing, PD-disaggregation and
# multi-tokenizer plumbing, other models' tiling, and `model`, which
# sglang-router adds. Accepted with any value and ignored.
IGNORED_FIELDS = frozenset(
  {
    "model",
    "session_id",
    "modalities",
    "mm_hashes",
    "mm_content_hashes",
    "log_metrics",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "bootstrap_pair_key",
    "decode_tp_size",
    "routed_dp_rank",
    "data_parallel_rank",
    "disagg_prefill_dp_rank",
    "kv_router_hint",
    "routing_key",
    "conversation_id",
    "http_worker_ipc",
    "priority",
    "extra_key",
    "cache_salt",
    "no_logs",
    "custom_labels",
    "external_trace_header",
    "received_time",
    "need_wait_for_mm_inputs",
    "num_items_assigned",
    "encoder_urls",
    "max_dynamic_patch",
    "min_dynamic_patch",
    "image_max_dynamic_patch",
    "video_max_dynamic_patch",
  }
)
# Ask for something this server does not do when set: accepted at their
# default only (400 otherwise), so a request never silently gets less than it
# asked for. A per-item list of defaults (a batch) counts as the default;
# `default_equivalents` names the values that count as a field's default.
DEFAULT_ONLY_FIELDS: dict[str, Any] = {
  "input_embeds": None,
  "audio_data": None,
  "use_audio_in_video": False,
  "video_config": None,
  "logprob_start_len": -1,
  "top_logprobs_num": 0,
  "token_ids_logprob": None,
  "return_sampling_mask": False,
  "return_flat_raw_top_logprobs": False,
  "return_flat_raw_top_logprobs_b64": False,
  "return_hidden_states": False,
  "return_routed_experts": False,
  "routed_experts_start_len": 0,
  "return_indexer_topk": False,
  "return_entropy": False,
  "return_bytes": False,
  "return_prompt_token_ids": False,
  "session_params": None,
  "lora_path": None,
  "lora_id": None,
  "custom_logit_processor": None,
  "positional_embed_overrides": None,
  "background": False,
  "require_reasoning": False,
  "max_thinking_tokens": None,
  "images_config": None,
  "multi_item_delimiter_indices": None,
}
GENERATE_FIELDS = USED_FIELDS | IGNORED_FIELDS | set(DEFAULT_ONLY_FIELDS)


def default_equivalents(default: Any) -> list[Any]:
  """The values that count as a DEFAULT_ONLY field's default: the default, and
  for a null default `{}` too (an empty object asks for nothing), for a 0
  default null too. A list of these (one per batch item) counts as well."""
  if default is None:
    return [None, {}]
  if json_equal(default, 0):
    return [default, None]
  return [default]


def _is_default(value: Any, default: Any) -> bool:
  accepted = default_equivalents(default)
  if isinstance(value, list):
    return all(any(json_equal(v, a) for a in accepted) for v in value)
  return any(json_equal(value, a) for a in accepted)


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
  """One prompt's /generate request (a batch is several): what the RL side
  builds (`of`), the server parses (`parse_generate`) and the client sends
  (`to_body`).

  `requested_max_new_tokens` is max_new_tokens as the request gave it (None
  when absent or null): SGLang checks only an explicit limit against the
  context (`check_context_length`) and clips the default to what is left.
  """

  rid: str
  sampling: SamplingParams
  text: str | None = None
  input_ids: list[int] | None = None
  image_data: list[str] = dataclasses.field(default_factory=list)
  video_data: list[str] = dataclasses.field(default_factory=list)
  return_logprob: bool = False
  return_text_in_logprobs: bool = False
  stream: bool = False
  requested_max_new_tokens: int | None = None

  @classmethod
  def of(
    cls,
    input_ids: Sequence[int],
    sampling: dict[str, Any] | SamplingParams,
    *,
    rid: str | None = None,
    image_data: Sequence[str] = (),
    video_data: Sequence[str] = (),
    return_logprob: bool = True,
  ) -> GenerateRequest:
    """A token-id request as RL clients send it (slime's and AReaL's shape).

    Args:
      input_ids: the prompt, chat template and media pads expanded.
      sampling: SGLang's sampling_params (validated and normalized here, as
        the server would) or parameters already validated.
      rid: the request id; None draws one.
      image_data, video_data: media paths, URLs or data URIs.
      return_logprob: report the behaviour logprob of every output token.

    Raises:
      ProtocolError: the ids or the sampling parameters are invalid.
    """
    if isinstance(sampling, SamplingParams):
      params, requested = sampling, sampling.max_new_tokens
    else:
      params, requested = SamplingParams.from_dict(sampling), sampling.get("max_new_tokens")
    return cls(
      rid=rid or uuid.uuid4().hex,
      sampling=params,
      input_ids=_check_ids([int(i) for i in input_ids]),
      image_data=list(image_data),
      video_data=list(video_data),
      return_logprob=return_logprob,
      requested_max_new_tokens=requested,
    )

  def to_body(self) -> dict[str, Any]:
    """The JSON body that `parse_generate` reads back to this request."""
    params = self.sampling.to_dict()
    if self.requested_max_new_tokens is None and self.sampling.max_new_tokens is not None:
      del params["max_new_tokens"]  # absent: the server's default and its clipping
    body: dict[str, Any] = {
      "rid": self.rid,
      "sampling_params": params,
      "return_logprob": self.return_logprob,
      "stream": self.stream,
    }
    if self.text is not None:
      body["text"] = self.text
    if self.input_ids is not None:
      body["input_ids"] = list(self.input_ids)
    if self.image_data:
      body["image_data"] = list(self.image_data)
    if self.video_data:
      body["video_data"] = list(self.video_data)
    if self.return_text_in_logprobs:
      body["return_text_in_logprobs"] = True
    return body

  def continued(self, output_ids: Sequence[int]) -> GenerateRequest:
    """The request that resumes this one's response after `output_ids`.

    A partial rollout: the prompt becomes prompt + the tokens generated so
    far and max_new_tokens shrinks by as many, so the response ends where the
    uninterrupted one would. A seeded request keeps its seed: sampling is
    keyed by the token's position in the sequence (SGLang's and our engine's
    seeded sampler), so under the same weights the continuation draws the
    tokens the uninterrupted request would have drawn. Stop strings are
    matched on the continuation's own text only; a stop string that straddles
    the pause is not seen.

    Raises:
      ValueError: the request has no input_ids (a text prompt cannot be
        extended token-exactly), or `output_ids` already reach max_new_tokens.
    """
    if self.input_ids is None:
      raise ValueError("only an input_ids request can be continued from its partial output")
    n, limit = len(output_ids), self.sampling.max_new_tokens
    sampling, requested = self.sampling, self.requested_max_new_tokens
    if limit is not None:
      if n >= limit:
        raise ValueError(f"the partial output ({n} tokens) already reaches max_new_tokens {limit}")
      sampling = dataclasses.replace(sampling, max_new_tokens=limit - n)
      requested = limit - n
    return dataclasses.replace(
      self,
      input_ids=list(self.input_ids) + [int(i) for i in output_ids],
      sampling=sampling,
      requested_max_new_tokens=requested,
    )


@dataclasses.dataclass(frozen=True)
class Completion:
  """One response as /generate answers it: finished, aborted, or (a streamed
  chunk) still running.

  Attributes:
    rid: the request id.
    text: decoded output (stop string/token trimmed as the server does).
    output_ids: generated ids, the matched EOS included.
    logprobs: behaviour logprob per output id (None where the server sent
      null); empty unless the request asked for them.
    finish_reason: SGLang's dict, {"type": "stop"|"length"|"abort", ...};
      None while running.
    prompt_tokens: expanded prompt length.
    weight_version: the server's weight version when the response was built.
    token_versions: the weight version that sampled each output token, where
      the server reports it (fluxjax's servers; SGLang reports only
      `weight_version`).
    segments: requests this response was generated in (a paused response
      continued by later requests has several).
    server: URL of the server that produced it.
  """

  rid: str
  text: str
  output_ids: list[int]
  logprobs: list[float | None]
  finish_reason: dict | None
  prompt_tokens: int | None
  weight_version: str
  token_versions: list[str] | None = None
  segments: int = 1
  server: str = ""

  @property
  def finish_type(self) -> str | None:
    return None if self.finish_reason is None else self.finish_reason["type"]

  def versions(self, default: str | None = None) -> list[str]:
    """The weight version that sampled each output token: the reported ones,
    else every token gets `default` (the caller's version at launch: the
    oldest that can have sampled it) or, failing that, the final version."""
    if self.token_versions is not None:
      return list(self.token_versions)
    return [str(self.weight_version if default is None else default)] * len(self.output_ids)

  def pinned(self, default: str | None) -> Completion:
    """This completion with every token's version written out.

    A response may be paused and continued by later requests; each piece
    keeps the versions of its own tokens (`versions(default)` with the
    version its request was launched under).
    """
    return dataclasses.replace(self, token_versions=self.versions(default))

  def continued_by(self, rest: Completion, text: str) -> Completion:
    """This paused response followed by `rest`, its continuation.

    Tokens, behaviour logprobs and per-token versions are concatenated (both
    pieces pinned first); the finish reason, rid, server and final version are
    the continuation's, `prompt_tokens` stays the original prompt's.

    Args:
      rest: the completion of the request that resumed this one from prompt
        + these tokens (pinned).
      text: the whole response's text (decoded once: a character may straddle
        the pause).
    """
    return dataclasses.replace(
      rest,
      text=text,
      output_ids=self.output_ids + rest.output_ids,
      logprobs=self.logprobs + rest.logprobs,
      prompt_tokens=self.prompt_tokens,
      token_versions=self.versions() + rest.versions(),
      segments=self.segments + rest.segments,
    )

  def to_dict(self) -> dict[str, Any]:
    """A JSON-able dict (checkpointed partial responses); `from_dict` reads it."""
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Completion:
    unknown = sorted(set(d) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"a saved response with fields {unknown} this fluxjax does not know")
    return cls(**d)

  def to_body(self, return_logprob: bool, token_text: Callable[[int], str] | None = None) -> dict:
    """The /generate answer; `token_text` adds each output token's text to
    its logprob entry (return_text_in_logprobs)."""
    meta: dict[str, Any] = {
      "id": self.rid,
      "finish_reason": self.finish_reason,
      "prompt_tokens": self.prompt_tokens,
      "weight_version": self.weight_version,
      "total_retractions": 0,
      "completion_tokens": len(self.output_ids),
      "cached_tokens": 0,
    }
    if self.token_versions is not None:  # fluxjax's extension
      meta["output_token_weight_versions"] = list(self.token_versions)
    if self.segments != 1:
      meta["segments"] = self.segments
    if return_logprob:
      meta["input_token_logprobs"] = []
      meta["output_token_logprobs"] = [
        [lp, t, None if token_text is None else token_text(t)]
        for lp, t in zip(self.logprobs, self.output_ids)
      ]
    return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

  @classmethod
  def from_body(cls, body: dict, server: str) -> Completion:
    """A /generate answer from `server`, SGLang's or ours."""
    meta = body["meta_info"]
    ids = list(body["output_ids"])
    versions = meta.get("output_token_weight_versions")
    return cls(
      rid=meta["id"],
      text=body.get("text", ""),
      output_ids=ids,
      logprobs=[x[0] for x in meta.get("output_token_logprobs") or []],
      finish_reason=meta["finish_reason"],
      prompt_tokens=meta.get("prompt_tokens"),
      weight_version=str(meta.get("weight_version")),
      token_versions=None
      if versions is None or len(versions) != len(ids)
      else [str(v) for v in versions],
      segments=int(meta.get("segments", 1)),
      server=server,
    )


def _as_list(x) -> list:
  if x is None:
    return []
  return list(x) if isinstance(x, list) else [x]


def _per_item(body: dict, key: str, n: int, default: Any) -> list:
  """A batch field as one value per item: a list of n, or one value for all."""
  value = body.get(key, default)
  if isinstance(value, list):
    if len(value) != n:
      raise ProtocolError(f"{key} has {len(value)} entries for a batch of {n}")
    return value
  return [value] * n


def _media_per_item(body: dict, key: str, n: int, batched: bool) -> list[list[str]]:
  """image_data / video_data as a list of media per request (SGLang's shapes)."""
  raw = body.get(key)
  if not batched:
    per = [_as_list(raw)]
  elif raw is None or raw == []:
    per = [[] for _ in range(n)]
  elif not isinstance(raw, list):
    per = [[raw] for _ in range(n)]  # one item for every request
  else:
    if len(raw) != n:
      raise ProtocolError(f"{key} has {len(raw)} entries for a batch of {n}")
    per = [_as_list(x) for x in raw]
  for items in per:
    if not all(isinstance(x, str) for x in items):
      raise ProtocolError(f"{key} items must be strings (path, URL, data URI or base64)")
  return per


def _check_ids(ids: Any) -> list[int]:
  if not isinstance(ids, list) or not ids:
    raise ProtocolError("input_ids must be a non-empty list of ints")
  if not all(is_json_int(i) and 0 <= i <= MAX_TOKEN_ID for i in ids):
    raise ProtocolError(f"input_ids must hold token ids (ints in [0, {MAX_TOKEN_ID}])")
  return ids


def _rids(rid: Any, n: int, batched: bool) -> list[str]:
  """One rid per request: given, derived from a batch's string rid, or new."""
  if rid is None:
    return [uuid.uuid4().hex for _ in range(n)]
  if isinstance(rid, str) and rid:
    return [f"{rid}_{i}" for i in range(n)] if batched else [rid]
  if batched and isinstance(rid, list):
    if len(rid) != n:
      raise ProtocolError(f"rid has {len(rid)} entries for a batch of {n}")
    if all(isinstance(r, str) and r for r in rid):
      return rid
  raise ProtocolError("rid must be a non-empty string, or one per batch item")


def parse_generate(body: Any) -> tuple[list[GenerateRequest], bool]:
  """Validates a /generate body, single or batched, as SGLang normalizes it.

  A batch is `text` as a list or `input_ids` as a list of lists; per-item
  fields (rid, sampling_params, image_data, video_data, return_logprob) are
  then a list of that length or one value for every item, a string rid
  becomes `f"{rid}_{i}"`, and the answers come back in input order.

  Unknown fields are ignored, as SGLang's request binding ignores them;
  `unknown_fields` names them so the server can log them. A known field of
  the wrong JSON type is an error.

  Returns:
    (requests, batched).

  Raises:
    ProtocolError: with a message naming the offending field.
  """
  if not isinstance(body, dict):
    raise ProtocolError("the /generate body must be a JSON object")
  for key, default in DEFAULT_ONLY_FIELDS.items():
    if key in body and not _is_default(body[key], default):
      raise ProtocolError(
        f"{key}={body[key]!r} is not supported by this server (only the default {default!r})"
      )
  given = [k for k in ("text", "input_ids") if body.get(k) is not None]
  if len(given) != 1:
    raise ProtocolError(f"give exactly one of text / input_ids / input_embeds, got {given}")
  text, ids = body.get("text"), body.get("input_ids")
  if text is not None:
    batched = isinstance(text, list)
    texts = text if batched else [text]
    if not all(isinstance(t, str) for t in texts):
      raise ProtocolError("text must be a string or a list of strings")
    prompts: list[tuple[str | None, list[int] | None]] = [(t, None) for t in texts]
  else:
    batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    prompts = [(None, _check_ids(x)) for x in (ids if batched and ids else [ids])]
  n = len(prompts)
  if n == 0:
    raise ProtocolError("the batch is empty")
  stream = json_flag(body.get("stream"), "stream")
  if stream and batched:
    raise ProtocolError("streaming a batched /generate is not supported; stream one per prompt")
  rids = _rids(body.get("rid"), n, batched)
  if len(set(rids)) != n:
    raise ProtocolError(f"duplicate rids in the batch: {sorted(rids)}")
  sampling = body.get("sampling_params")
  samplings = (
    _per_item(body, "sampling_params", n, None)
    if batched and isinstance(sampling, list)
    else [sampling] * n
  )
  logprobs = [json_flag(x, "return_logprob") for x in _per_item(body, "return_logprob", n, False)]
  text_in_logprobs = json_flag(body.get("return_text_in_logprobs"), "return_text_in_logprobs")
  images = _media_per_item(body, "image_data", n, batched)
  videos = _media_per_item(body, "video_data", n, batched)
  params = [SamplingParams.from_dict(s) for s in samplings]  # each a dict or None from here
  return [
    GenerateRequest(
      rid=rids[i],
      sampling=params[i],
      text=prompts[i][0],
      input_ids=prompts[i][1],
      image_data=images[i],
      video_data=videos[i],
      return_logprob=logprobs[i],
      return_text_in_logprobs=text_in_logprobs,
      stream=stream,
      requested_max_new_tokens=(samplings[i] or {}).get("max_new_tokens"),
    )
    for i in range(n)
  ], batched


def check_context_length(
  input_tokens: int, max_new_tokens: int | None, context_length: int
) -> None:
  """Refuses a prompt the context cannot hold, in SGLang's words.

  As SGLang's tokenizer manager (`_validate_one_request`): a prompt of
  `context_length` tokens or more is refused; so is an explicit
  max_new_tokens that, added to the prompt, exceeds the context. Without one
  (absent or null) nothing more is checked: the default 128, or "up to the
  context", is clipped to the context that is left, as SGLang's scheduler
  clips it.

  Raises:
    ProtocolError: with both counts and the limit.
  """
  if input_tokens >= context_length:
    raise ProtocolError(
      f"The input ({input_tokens} tokens) is longer than the model's context length "
      f"({context_length} tokens)."
    )
  if max_new_tokens is not None and input_tokens + max_new_tokens > context_length:
    raise ProtocolError(
      "Requested token count exceeds the model's maximum context length of "
      f"{context_length} tokens. You requested a total of {input_tokens + max_new_tokens} "
      f"tokens: {input_tokens} tokens from the input messages and {max_new_tokens} tokens "
      "for the completion. Please reduce the number of tokens in the input messages or the "
      "completion to fit within the limit."
    )


def parse_abort(body: dict) -> tuple[str | None, bool]:
  """(rid, abort_all) of an /abort_request body (SGLang's AbortReq).

  The body: {"rid": str, "abort_all": bool}.
  """
  rid = body.get("rid")
  if rid is not None and not isinstance(rid, str):
    raise ProtocolError(f"rid must be a string, got {rid!r}")
  return rid, json_flag(body.get("abort_all"), "abort_all")


def parse_pause(body: dict) -> str:
  """The mode of a /pause_generation body (default "abort", as SGLang's).

  The body: {"mode": "abort" | "in_place" | "retract"} (`PAUSE_MODES`); /continue_generation
  takes {}.
  """
  mode = body.get("mode")
  mode = "abort" if mode is None else mode
  check_pause_mode(mode)
  return mode


def unknown_fields(body: dict) -> list[str]:
  """Top-level fields of a /generate body that GenerateReqInput does not have."""
  return sorted(set(body) - GENERATE_FIELDS)


# --- finish reasons (schedule_batch.py FINISH_* classes) ---------------------------


def finish_stop_token(token_id: int) -> dict:
  return {"type": "stop", "matched": int(token_id)}


def finish_stop_str(s: str) -> dict:
  return {"type": "stop", "matched": s}


def finish_length(limit: int) -> dict:
  return {"type": "length", "length": int(limit)}


def finish_abort(message: str = "Abort") -> dict:
  return {"type": "abort", "message": message, "status_code": None, "err_type": None}


class NonFiniteLogits(RuntimeError):
  """The served weights gave non-finite logits for a request: nothing was sampled.

  The engine raises it in process; over HTTP its fields travel in the
  request's abort (`finish_reason`) and the client raises it again (`of`).

  Attributes:
    rid: the request.
    weight_version: the weights that gave them.
    token: the index of the output token that was to be sampled.
  """

  ERR_TYPE = "NonFiniteLogits"  # the abort's `err_type`

  def __init__(self, rid: str, weight_version: str, token: int):
    super().__init__(
      f"non-finite logits from weight version {weight_version} for request {rid!r}"
      f" (output token {token}): the engine samples nothing from them, so those"
      " weights are unusable"
    )
    self.rid, self.weight_version, self.token = rid, weight_version, token

  def finish_reason(self) -> dict:
    """The abort a request refused for it finishes with, its fields beside the message."""
    reason = finish_abort(str(self))
    reason.update(err_type=self.ERR_TYPE, weight_version=self.weight_version, token=self.token)
    return reason

  @classmethod
  def of(cls, completion: Completion) -> NonFiniteLogits | None:
    """The refusal a completion's abort carries (`finish_reason`), else None."""
    reason = completion.finish_reason or {}
    if reason.get("type") != "abort" or reason.get("err_type") != cls.ERR_TYPE:
      return None
    return cls(completion.rid, str(reason["weight_version"]), int(reason["token"]))

  @classmethod
  def among_causes(cls, error: BaseException | None) -> NonFiniteLogits | None:
    """The refusal in `error` or its chain of causes (a failed round wraps it), else None."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
      if isinstance(error, cls):
        return error
      seen.add(id(error))
      error = error.__cause__ or error.__context__
    return None


ABORT_WAITING = "Abort in waiting queue"

PAUSE_MODES = ("abort", "in_place", "retract")


def check_pause_mode(mode: str) -> None:
  """Raises ProtocolError unless `mode` is one of SGLang's pause modes."""
  if mode not in PAUSE_MODES:
    raise ProtocolError(f"unknown pause mode {mode!r}; use abort, in_place or retract")


def output_text(
  output_ids: Sequence[int],
  finish_reason: dict | None,
  sampling: SamplingParams,
  decode: Callable[..., str],
) -> str:
  """`text` as SGLang returns it: the output decoded, the matched stop trimmed.

  Args:
    output_ids: the generated ids, the matched stop token included.
    finish_reason: the finish reason dict, or None while still running.
    sampling: the request's sampling parameters (stop trimming, special tokens).
    decode: a tokenizer's `decode(ids, skip_special_tokens=...)`.
  """
  reason = finish_reason or {}
  stopped = reason.get("type") == "stop" and not sampling.no_stop_trim
  ids = list(output_ids)
  if stopped and isinstance(reason.get("matched"), int):
    ids = ids[:-1]
  text = decode(ids, skip_special_tokens=sampling.skip_special_tokens)
  if stopped and isinstance(reason.get("matched"), str):
    cut = text.find(reason["matched"])
    text = text[:cut] if cut >= 0 else text
  return text


def server_flag(key: str) -> str:
  """The `fluxjax.rollout.server` flag of a vision limit (a `data.vision` key)."""
  return "--" + key.replace("_", "-")
