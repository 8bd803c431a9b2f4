"""The JSON rules every rollout endpoint shares, the generate and the weight-update ones.

Bodies are strict JSON objects (`decode_body`), values are typed as JSON Schema
types them (`is_json_int`, `json_equal`), and a malformed request raises
`ProtocolError`. Errors carry `{"error": {"message": ...}}` (`error_body`): 400
for a bad request (malformed JSON, a wrong type, a prompt over the context), as
SGLang answers; the server adds 404, 405, 408, 413, 500 and 503 in the same shape.
"""

from __future__ import annotations

import json
import math
from typing import Any


class ProtocolError(ValueError):
  """A malformed request; the server answers 400 with this message."""


def is_json_int(x: Any) -> bool:
  """A JSON integer (true and false are not numbers, as in JSON Schema)."""
  return isinstance(x, int) and not isinstance(x, bool)


def is_finite_json_number(x: Any) -> bool:
  """A JSON number that fits a float (NaN, infinities and 10**400 do not)."""
  if isinstance(x, bool) or not isinstance(x, (int, float)):
    return False
  try:
    return math.isfinite(float(x))
  except OverflowError:
    return False


def json_equal(a: Any, b: Any) -> bool:
  """Equality of two JSON values, their types kept apart as JSON Schema keeps
  them (false is not 0, 1.0 is 1)."""
  if isinstance(a, bool) != isinstance(b, bool):
    return False
  if isinstance(a, (int, float)) and isinstance(b, (int, float)):
    return a == b
  return type(a) is type(b) and a == b


def json_flag(value: Any, key: str) -> bool:
  """A boolean field: a JSON boolean, or null for false."""
  if value is None:
    return False
  if not isinstance(value, bool):
    raise ProtocolError(f"{key} must be a boolean, got {value!r}")
  return value


def _refuse_constant(name: str) -> Any:
  raise ProtocolError(f"the body is not valid JSON: {name} is not a JSON number")


def decode_body(raw: bytes) -> dict:
  """A request body as a JSON object; empty or `null` bodies count as {}
  (verl sends those).

  Strict JSON, as SGLang's orjson reads it: NaN and Infinity are refused, so
  is a nesting too deep to parse and text that is not UTF-8.

  Raises:
    ProtocolError: the body is not a JSON object.
  """
  if not raw.strip():
    return {}
  try:
    body = json.loads(raw, parse_constant=_refuse_constant)
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, int digits
    if isinstance(e, ProtocolError):
      raise
    raise ProtocolError(f"the body is not valid JSON: {e}") from None
  if body is None:
    return {}
  if not isinstance(body, dict):
    raise ProtocolError("the body must be a JSON object")
  return body


def error_body(message: str) -> dict:
  return {"error": {"message": message}}
