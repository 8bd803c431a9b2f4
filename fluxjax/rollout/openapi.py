"""The OpenAPI 3.1 description of `python -m fluxjax.rollout.server` (GET /openapi.json).

SGLang's FastAPI server serves its own description at the same path. This one is built
from the tables the server itself runs on, so the two cannot drift: the server registers
exactly the routes of `ENDPOINTS`, and `build_spec` describes their bodies from the
protocol modules' field lists and keys. A field or key added there without a schema here
fails `build_spec`, so no server starts with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fluxjax.rollout import protocol, sampling_params, weight_protocol

OPENAPI_VERSION = "3.1.0"
_JSON = "application/json"
_TEXT = "text/plain"


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """One path of the API.

  Attributes:
    path: the URL path.
    methods: the HTTP methods it answers (any other gets 405).
    handler: the name of the `RolloutServer` method that answers it.
    summary: what it does, one line.
    body: the JSON schema of its request body, or None when it reads none.
    responses: OpenAPI response objects by status code.
    body_required: whether the body must be sent (else an empty body is {}).
  """

  path: str
  methods: tuple[str, ...]
  handler: str
  summary: str
  body: dict[str, Any] | None
  responses: dict[str, dict[str, Any]]
  body_required: bool = False


def _ref(name: str) -> dict[str, Any]:
  return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
  return {"anyOf": [schema, {"type": "null"}]}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
  return {"description": description, "content": {_JSON: {"schema": schema}}}


def _text(description: str) -> dict[str, Any]:
  return {"description": description, "content": {_TEXT: {"schema": {"type": "string"}}}}


_ERROR_DESCRIPTIONS = {
  "400": "a malformed request: bad JSON, a wrong type or value, a prompt over the context",
  "408": "the request body did not arrive within the server's --body-timeout",
  "413": "the request body is larger than the server's --max-request-bytes",
  "500": "an internal error",
  "503": "the model is still loading (or failed to load)",
}


def _errors(*codes: str) -> dict[str, dict[str, Any]]:
  """Error responses in SGLang's shape, {"error": {"message": ...}}."""
  return {code: _json(_ERROR_DESCRIPTIONS[code], _ref("ErrorResponse")) for code in codes}


# Every route can answer these: the size limit is checked before routing to a
# handler, and an unexpected failure is reported, not dropped.
_ALWAYS = ("413", "500")
# Routes that need the model answer 503 while it loads.
_LOADED = (*_ALWAYS, "503")
# Routes that read a JSON body can also refuse it, or time out reading it.
_WITH_BODY = (*_LOADED, "400", "408")

_EMPTY_OK = {"200": {"description": "done (empty body)"}}


def _default_only(default: Any) -> dict[str, Any]:
  """A field accepted only at its default, or a list of defaults (a batch)."""
  accepted = {"enum": protocol.default_equivalents(default)}
  return {"anyOf": [accepted, {"type": "array", "items": accepted}]}


_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": sampling_params.MAX_TOKEN_ID}
_TOKEN_IDS = {"type": "array", "items": _TOKEN_ID, "minItems": 1}
_MEDIA = {
  "description": "a path, a data URI or raw base64 per item; a list per request in a batch",
  "anyOf": [
    {"type": "null"},
    {"type": "string"},
    {
      "type": "array",
      "items": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    },
  ],
}
_NULLABLE_FLAG = {"type": ["boolean", "null"]}

# Fields this server uses; the description of the rest follows from
# IGNORED_FIELDS and DEFAULT_ONLY_FIELDS.
_USED_FIELD_SCHEMAS: dict[str, dict[str, Any]] = {
  "text": {
    "description": "the prompt, or a list of prompts (a batch); no chat template is applied",
    "anyOf": [
      {"type": "null"},
      {"type": "string"},
      {"type": "array", "items": {"type": "string"}, "minItems": 1},
    ],
  },
  "input_ids": {
    "description": "the prompt's token ids, or a list of them (a batch)",
    "anyOf": [
      {"type": "null"},
      _TOKEN_IDS,
      {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
    ],
  },
  "image_data": _MEDIA,
  "video_data": _MEDIA,
  "sampling_params": {
    "description": "one object, or one per batch item",
    "anyOf": [
      {"type": "null"},
      _ref("SamplingParams"),
      {"type": "array", "items": _nullable(_ref("SamplingParams")), "minItems": 1},
    ],
  },
  "rid": {
    "description": "request id (a batch's string rid becomes rid_0, rid_1, ...)",
    "anyOf": [
      {"type": "null"},
      {"type": "string", "minLength": 1},
      {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1},
    ],
  },
  "return_logprob": {
    "description": "return output_token_logprobs in meta_info (one flag, or one per item)",
    "anyOf": [{"type": ["boolean", "null"]}, {"type": "array", "items": _NULLABLE_FLAG}],
  },
  "return_text_in_logprobs": _NULLABLE_FLAG,
  "stream": {
    "description": "answer as server-sent events of cumulative chunks (one prompt only)",
    "type": ["boolean", "null"],
  },
}


def _sampling_key_schema(key: str, default: Any) -> dict[str, Any]:
  """The schema of one SamplingParams key, as SamplingParams.from_dict checks it."""
  if key in sampling_params.BOOL_SAMPLING_KEYS:
    return {"type": "boolean"}
  special: dict[str, dict[str, Any]] = {
    "max_new_tokens": {
      "description": "null: up to the context; an explicit value must fit the context",
      "type": ["integer", "null"],
      "minimum": 0,
    },
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "anyOf": [{"const": -1}, {"minimum": 1}]},
    "stop": {
      "anyOf": [
        {"type": "null"},
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}},
      ]
    },
    "stop_token_ids": _nullable({"type": "array", "items": _TOKEN_ID}),
    "logit_bias": _nullable(
      {
        "type": "object",
        "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {"type": "number"},
      }
    ),
    "stream_interval": {"type": ["integer", "null"], "minimum": 1},
    "sampling_seed": {
      "type": ["integer", "null"],
      "minimum": 0,
      "maximum": sampling_params.SEED_LIMIT - 1,
    },
  }
  if key in special:
    return special[key]
  if key in sampling_params.UNSUPPORTED_SAMPLING_KEYS:
    return {"description": "not supported: accepted at its default only", "enum": [default]}
  raise AssertionError(f"sampling parameter {key!r} has no schema")


def _sampling_params_schema() -> dict[str, Any]:
  return {
    "type": "object",
    "description": "SGLang's SamplingParams; an unknown key is an error, as in SGLang",
    "properties": {
      key: _sampling_key_schema(key, default)
      for key, default in sampling_params.SAMPLING_DEFAULTS.items()
    },
    "additionalProperties": False,
  }


def _generate_request_schema() -> dict[str, Any]:
  missing = protocol.USED_FIELDS ^ set(_USED_FIELD_SCHEMAS)
  if missing:
    raise AssertionError(f"used /generate fields without a schema, or stale: {sorted(missing)}")
  properties: dict[str, Any] = {name: _USED_FIELD_SCHEMAS[name] for name in protocol.USED_FIELDS}
  for name in protocol.IGNORED_FIELDS:
    properties[name] = {"description": "accepted with any value and ignored"}
  for name, default in protocol.DEFAULT_ONLY_FIELDS.items():
    properties[name] = {
      "description": f"not supported: accepted at its default ({default!r}) only",
      **_default_only(default),
    }
  present = {"not": {"type": "null"}}
  return {
    "type": "object",
    "description": (
      "SGLang's GenerateReqInput: every field is accepted; unknown fields are ignored"
    ),
    "properties": dict(sorted(properties.items())),
    # Exactly one prompt: text or input_ids (null counts as absent).
    "oneOf": [
      {"required": ["text"], "properties": {"text": present}},
      {"required": ["input_ids"], "properties": {"input_ids": present}},
    ],
    "additionalProperties": True,
  }


_FINISH_REASON = {
  "anyOf": [
    {"type": "null"},
    {
      "type": "object",
      "required": ["type"],
      "properties": {"type": {"enum": ["stop", "length", "abort"]}},
    },
  ]
}

_GENERATE_RESPONSE = {
  "type": "object",
  "required": ["text", "output_ids", "meta_info"],
  "properties": {
    "text": {"type": "string"},
    "output_ids": {"type": "array", "items": {"type": "integer"}},
    "meta_info": {
      "type": "object",
      "required": ["id", "finish_reason", "prompt_tokens", "completion_tokens"],
      "properties": {
        "id": {"type": "string"},
        "finish_reason": _FINISH_REASON,
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "cached_tokens": {"type": "integer"},
        "weight_version": {"type": "string"},
        "output_token_weight_versions": {"type": "array", "items": {"type": "string"}},
        "output_token_logprobs": {
          "type": "array",
          "items": {
            "type": "array",
            "prefixItems": [
              {"type": ["number", "null"]},
              {"type": "integer"},
              {"type": ["string", "null"]},
            ],
          },
        },
        "e2e_latency": {"type": "number"},
      },
    },
  },
}


def _schemas() -> dict[str, Any]:
  return {
    "ErrorResponse": {
      "type": "object",
      "required": ["error"],
      "properties": {
        "error": {
          "type": "object",
          "required": ["message"],
          "properties": {"message": {"type": "string"}},
        }
      },
    },
    "SamplingParams": _sampling_params_schema(),
    "GenerateReqInput": _generate_request_schema(),
    "GenerateResponse": _GENERATE_RESPONSE,
    "UpdateWeightsResult": {
      "type": "object",
      "required": ["success", "message"],
      "properties": {
        "success": {"type": "boolean"},
        "message": {"type": "string"},
        "num_paused_requests": {"type": "integer"},
      },
    },
    "StatusMessage": {
      "type": "object",
      "required": ["message"],
      "properties": {"message": {"type": "string"}, "status": {"type": "string"}},
    },
  }


_MODEL_INFO = {
  "type": "object",
  "required": ["model_path", "is_generation", "weight_version"],
  "properties": {
    "model_path": {"type": "string"},
    "is_generation": {"type": "boolean"},
    "weight_version": {"type": "string"},
    "has_image_understanding": {"type": "boolean"},
  },
}
_SERVER_INFO = {
  "type": "object",
  "required": ["context_length", "max_running_requests", "weight_version"],
  "properties": {
    "context_length": {"type": "integer"},
    "max_running_requests": {"type": "integer"},
    "max_total_num_tokens": {"type": "integer"},
    "weight_version": {"type": "string"},
    "version": {"type": "string"},
    "vision_limits": {
      "type": "object",
      "description": "fluxjax's server only: its media preprocessing limits",
      "additionalProperties": {"type": "integer"},
    },
    "weight_deltas_applied": {
      "type": "integer",
      "minimum": 0,
      "description": "fluxjax's server only: disk updates it read as a sparse delta",
    },
    "min_decode_step_ms": {
      "type": "number",
      "minimum": 0,
      "description": "fluxjax's server only: the emulated floor under each decode step "
      "(--min-decode-step-ms, benchmarks; 0 off)",
    },
  },
}
_LOAD = {
  "type": "object",
  "required": ["num_reqs", "num_running_reqs", "num_waiting_reqs", "num_tokens"],
  "properties": {
    k: {"type": "integer", "minimum": 0}
    for k in ("num_reqs", "num_running_reqs", "num_waiting_reqs", "num_tokens")
  },
}
_WEIGHT_VERSION = {
  "type": "object",
  "required": ["weight_version"],
  "properties": {"weight_version": {"type": "string"}},
}


def _generation_endpoints() -> tuple[Endpoint, ...]:
  """/generate and the scheduling controls around it."""
  generate_ok = {
    "description": "the answer (a list in input order for a batch), or its SSE stream",
    "content": {
      _JSON: {
        "schema": {
          "anyOf": [
            _ref("GenerateResponse"),
            {"type": "array", "items": _ref("GenerateResponse")},
          ]
        }
      },
      "text/event-stream": {"schema": {"type": "string"}},
    },
  }
  status_ok = _json("done", _ref("StatusMessage"))
  return (
    Endpoint(
      "/generate",
      ("POST", "PUT"),
      "generate",
      "generate for one prompt or a batch (SGLang's native /generate)",
      _ref("GenerateReqInput"),
      {"200": generate_ok, **_errors(*_WITH_BODY)},
      body_required=True,
    ),
    Endpoint(
      "/abort_request",
      ("POST",),
      "abort_request",
      "abort a request by rid, or all of them",
      {
        "type": ["object", "null"],
        "properties": {"rid": {"type": ["string", "null"]}, "abort_all": _NULLABLE_FLAG},
      },
      {**_EMPTY_OK, **_errors(*_WITH_BODY)},
    ),
    Endpoint(
      "/pause_generation",
      ("POST",),
      "pause_generation",
      "stop scheduling; new /generate requests wait until /continue_generation",
      {
        "type": ["object", "null"],
        "properties": {"mode": {"enum": [*protocol.PAUSE_MODES, None]}},
      },
      {"200": status_ok, **_errors(*_WITH_BODY)},
    ),
    Endpoint(
      "/continue_generation",
      ("POST",),
      "continue_generation",
      "resume after /pause_generation",
      None,
      {"200": status_ok, **_errors(*_LOADED)},
    ),
    Endpoint(
      "/flush_cache",
      ("GET", "POST"),
      "flush_cache",
      "flush the (prefix) cache; refused while requests are in flight",
      None,
      {
        "200": _text("flushed"),
        "400": _text("requests are in flight"),
        **_errors(*_LOADED),
      },
    ),
  )


def _weights_result(done: str, refused: str) -> dict[str, dict[str, Any]]:
  """The answers of a weight-changing endpoint: SGLang's {success, message}
  with 200 when done, 400 when refused (the served weights unchanged)."""
  return {
    "200": _json(done, _ref("UpdateWeightsResult")),
    "400": _json(refused, _ref("UpdateWeightsResult")),
    **_errors("408", *_LOADED),
  }


def _weight_endpoints() -> tuple[Endpoint, ...]:
  """Loading, renaming and reading the served weights."""
  return (
    Endpoint(
      "/update_weights_from_disk",
      ("POST",),
      "update_weights_from_disk",
      "load an HF checkpoint folder of the served architecture",
      {
        "type": "object",
        "required": ["model_path"],
        "properties": {
          "model_path": {"type": "string"},
          "load_format": {"enum": list(weight_protocol.DISK_LOAD_FORMATS)},
          "flush_cache": _NULLABLE_FLAG,
          "abort_all_requests": _NULLABLE_FLAG,
          "weight_version": {"type": ["string", "null"]},
        },
      },
      _weights_result("loaded", "not loaded; the served weights are unchanged"),
      body_required=True,
    ),
    Endpoint(
      "/update_weight_version",
      ("POST",),
      "update_weight_version",
      "rename the served weight version",
      {
        "type": "object",
        "required": ["new_version"],
        "properties": {
          "new_version": {"type": "string"},
          "abort_all_requests": _NULLABLE_FLAG,
        },
      },
      {
        "200": _json("renamed", _ref("UpdateWeightsResult")),
        **_errors(*_WITH_BODY),
      },
      body_required=True,
    ),
    Endpoint(
      "/get_weight_version",
      ("GET",),
      "get_weight_version",
      "the served weight version",
      None,
      {"200": _json("version", _WEIGHT_VERSION), **_errors(*_LOADED)},
    ),
  )


def _weight_group_endpoints() -> tuple[Endpoint, ...]:
  """SGLang's distributed weight update: the tensors follow over torch.distributed."""
  return (
    Endpoint(
      "/init_weights_update_group",
      ("POST",),
      "init_weights_update_group",
      "join the trainer's weight update group (torch.distributed; waits for every member)",
      {
        "type": "object",
        "required": ["master_address", "master_port", "rank_offset", "world_size", "group_name"],
        "properties": {
          "master_address": {"type": "string", "minLength": 1},
          "master_port": {"type": "integer", "minimum": 1, "maximum": 65535},
          "rank_offset": {"type": "integer", "minimum": 1},
          "world_size": {"type": "integer", "minimum": 2},
          "group_name": {"type": "string", "minLength": 1},
          "backend": {"enum": list(weight_protocol.WEIGHT_GROUP_BACKENDS)},
        },
      },
      _weights_result("joined", "not joined"),
      body_required=True,
    ),
    Endpoint(
      "/update_weights_from_distributed",
      ("POST",),
      "update_weights_from_distributed",
      "receive the named tensors the trainer then broadcasts, and serve them",
      {
        "type": "object",
        "required": ["names", "dtypes", "shapes", "group_name"],
        "properties": {
          "names": {"type": "array", "items": {"type": "string", "minLength": 1}},
          "dtypes": {"type": "array", "items": {"enum": list(weight_protocol.WEIGHT_DTYPES)}},
          "shapes": {
            "type": "array",
            "items": {"type": "array", "items": {"type": "integer", "minimum": 0}},
          },
          "group_name": {"type": "string", "minLength": 1},
          "weight_version": {"type": ["string", "null"]},
          "flush_cache": _NULLABLE_FLAG,
          "abort_all_requests": _NULLABLE_FLAG,
          "load_format": {"type": "null"},
        },
      },
      _weights_result("loaded", "not loaded; the served weights are unchanged"),
      body_required=True,
    ),
    Endpoint(
      "/destroy_weights_update_group",
      ("POST",),
      "destroy_weights_update_group",
      "leave a weight update group",
      {
        "type": "object",
        "required": ["group_name"],
        "properties": {"group_name": {"type": "string", "minLength": 1}},
      },
      _weights_result("left", "no such group"),
      body_required=True,
    ),
  )


def _status_endpoints() -> tuple[Endpoint, ...]:
  """Health probes and the GET-only state reads (each under both its names)."""
  reads = [
    (("/get_model_info", "/model_info"), "model_info", "the served model", "model", _MODEL_INFO),
    (
      ("/get_server_info", "/server_info"),
      "server_info",
      "the server's limits and state",
      "server",
      _SERVER_INFO,
    ),
    (("/get_load", "/v1/loads"), "get_load", "requests running and waiting", "load", _LOAD),
  ]
  return (
    Endpoint(
      "/health",
      ("GET",),
      "health",
      "200 once the model is loaded and warmed up",
      None,
      {**_EMPTY_OK, "503": _text("loading, or the load failed"), **_errors(*_ALWAYS)},
    ),
    Endpoint(
      "/health_generate",
      ("GET",),
      "health_generate",
      "200 if a one-token generation finishes",
      None,
      {**_EMPTY_OK, **_errors(*_LOADED)},
    ),
    *(
      Endpoint(
        path, ("GET",), name, summary, None, {"200": _json(what, schema), **_errors(*_LOADED)}
      )
      for paths, name, summary, what, schema in reads
      for path in paths
    ),
  )


def _endpoints() -> tuple[Endpoint, ...]:
  return (
    _generation_endpoints() + _weight_endpoints() + _weight_group_endpoints() + _status_endpoints()
  )


ENDPOINTS: tuple[Endpoint, ...] = _endpoints()


def build_spec(server_version: str) -> dict[str, Any]:
  """The OpenAPI document: every endpoint of `ENDPOINTS`, request and responses.

  The /generate body is described from protocol.py's field lists (USED_FIELDS,
  IGNORED_FIELDS, DEFAULT_ONLY_FIELDS) and sampling_params.py's keys (SAMPLING_DEFAULTS),
  and the weight group's backends and dtypes from weight_protocol.py. The schemas say
  what this server accepts, which is what schemathesis holds it to: a value outside them
  is answered 4xx, never 5xx. Some requests inside them are still refused with 400 for
  reasons a schema cannot state (a token id past the vocabulary, a prompt over the
  context, media that do not decode).
  """
  paths: dict[str, Any] = {}
  for ep in ENDPOINTS:
    for method in ep.methods:
      operation: dict[str, Any] = {
        "operationId": f"{method.lower()}{ep.path.replace('/', '_')}",
        "summary": ep.summary,
        "responses": ep.responses,
      }
      if ep.body is not None:
        operation["requestBody"] = {
          "required": ep.body_required,
          "content": {_JSON: {"schema": ep.body}},
        }
      paths.setdefault(ep.path, {})[method.lower()] = operation
  return {
    "openapi": OPENAPI_VERSION,
    "info": {
      "title": "fluxjax rollout server (SGLang native API)",
      "version": server_version,
      "description": __doc__,
    },
    "paths": paths,
    "components": {"schemas": _schemas()},
  }
