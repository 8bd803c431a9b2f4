"""SGLang's sampling parameters (its sampling_params.py): keys, defaults and checks.

`SamplingParams.from_dict` validates and normalizes a request's sampling_params
as SGLang does; keys this server's sampler does not implement are accepted at
their defaults only. The sampler that applies them is sampling.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fluxjax.rollout.json_body import ProtocolError, is_finite_json_number, is_json_int, json_equal

# The keys and their defaults. An unknown key is an error, as in SGLang (it
# builds SamplingParams(**dict)).
SAMPLING_DEFAULTS: dict[str, Any] = {
  "max_new_tokens": 128,
  "temperature": 1.0,
  "top_p": 1.0,
  "top_k": -1,
  "min_p": 0.0,
  "frequency_penalty": 0.0,
  "presence_penalty": 0.0,
  "repetition_penalty": 1.0,
  "min_new_tokens": 0,
  "stop": None,
  "stop_token_ids": None,
  "stop_regex": None,
  "ignore_eos": False,
  "skip_special_tokens": True,
  "spaces_between_special_tokens": True,
  "no_stop_trim": False,
  "n": 1,
  "json_schema": None,
  "regex": None,
  "ebnf": None,
  "structural_tag": None,
  "logit_bias": None,
  "custom_params": None,
  "stream_interval": None,
  "sampling_seed": None,
}
# Known keys our engine does not implement: accepted only at their defaults, so
# a request never silently gets different sampling than it asked for.
UNSUPPORTED_SAMPLING_KEYS = (
  "min_p",
  "frequency_penalty",
  "presence_penalty",
  "repetition_penalty",
  "min_new_tokens",
  "stop_regex",
  "n",
  "json_schema",
  "regex",
  "ebnf",
  "structural_tag",
  "custom_params",
)
# Sampling keys that must be JSON booleans (SGLang's SamplingParams types).
BOOL_SAMPLING_KEYS = (
  "ignore_eos",
  "skip_special_tokens",
  "spaces_between_special_tokens",
  "no_stop_trim",
)
GREEDY_EPS = 1e-6
TOP_K_ALL = 1 << 30  # SGLang stores top_k = -1 as 1 << 30
# Token ids are int32 on the way to the model; larger ones are refused before
# they reach numpy (the vocabulary check follows in the engine).
MAX_TOKEN_ID = (1 << 31) - 1
# The engine's seeded sampler keys each slot with a uint32 seed.
SEED_LIMIT = 1 << 32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """Validated sampling parameters, after SGLang's normalization."""

  max_new_tokens: int | None = 128
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = TOP_K_ALL
  stop: tuple[str, ...] = ()
  stop_token_ids: tuple[int, ...] = ()
  ignore_eos: bool = False
  skip_special_tokens: bool = True
  no_stop_trim: bool = False
  sampling_seed: int | None = None
  # (token id, bias) pairs added to the logits before temperature, as
  # SGLang's logit_bias {str(token_id): bias}; the sampled token's logprob is
  # under the biased distribution (the one it was drawn from).
  logit_bias: tuple[tuple[int, float], ...] = ()

  @property
  def greedy(self) -> bool:
    return self.top_k == 1

  @classmethod
  def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
    d = {} if d is None else d
    if not isinstance(d, dict):
      raise ProtocolError(f"sampling_params must be an object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(SAMPLING_DEFAULTS))
    if unknown:
      raise ProtocolError(
        f"unknown sampling parameter(s) {unknown}; SGLang accepts {sorted(SAMPLING_DEFAULTS)}"
      )
    p = {**SAMPLING_DEFAULTS, **d}
    for key in UNSUPPORTED_SAMPLING_KEYS:
      if not json_equal(p[key], SAMPLING_DEFAULTS[key]):
        raise ProtocolError(
          f"sampling parameter {key!r}={p[key]!r} is not supported by "
          f"this server (only the default {SAMPLING_DEFAULTS[key]!r})"
        )
    for key in BOOL_SAMPLING_KEYS:
      if not isinstance(p[key], bool):
        raise ProtocolError(f"sampling parameter {key!r} must be a boolean, got {p[key]!r}")
    max_new = p["max_new_tokens"]
    if max_new is not None and (not is_json_int(max_new) or max_new < 0):
      raise ProtocolError(f"max_new_tokens must be a non-negative int or null, got {max_new!r}")
    temperature, top_p, top_k = p["temperature"], p["top_p"], p["top_k"]
    if not is_finite_json_number(temperature) or temperature < 0:
      raise ProtocolError(f"temperature must be a number >= 0, got {temperature!r}")
    if not is_finite_json_number(top_p) or not 0 < top_p <= 1:
      raise ProtocolError(f"top_p must be in (0, 1], got {top_p!r}")
    if not is_json_int(top_k) or (top_k != -1 and top_k < 1):
      raise ProtocolError(f"top_k must be -1 (all) or >= 1, got {top_k!r}")
    top_k = TOP_K_ALL if top_k == -1 else top_k
    if temperature < GREEDY_EPS:  # SGLang's greedy rewrite
      temperature, top_k = 1.0, 1
    stop = p["stop"]
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
      raise ProtocolError(f"stop must be a non-empty string or a list of them, got {p['stop']!r}")
    stop_ids = () if p["stop_token_ids"] is None else p["stop_token_ids"]
    if not isinstance(stop_ids, (list, tuple)) or not all(
      is_json_int(i) and 0 <= i <= MAX_TOKEN_ID for i in stop_ids
    ):
      raise ProtocolError(f"stop_token_ids must be a list of token ids, got {stop_ids!r}")
    interval = p["stream_interval"]
    if interval is not None and (not is_json_int(interval) or interval < 1):
      raise ProtocolError(f"stream_interval must be a positive int or null, got {interval!r}")
    seed = p["sampling_seed"]
    if seed is not None and (not is_json_int(seed) or not 0 <= seed < SEED_LIMIT):
      raise ProtocolError(f"sampling_seed must be an int in [0, 2**32), got {seed!r}")
    bias = _logit_bias(p["logit_bias"])
    return cls(
      max_new_tokens=max_new,
      temperature=float(temperature),
      top_p=float(top_p),
      top_k=int(top_k),
      stop=tuple(stop),
      stop_token_ids=tuple(stop_ids),
      ignore_eos=p["ignore_eos"],
      skip_special_tokens=p["skip_special_tokens"],
      no_stop_trim=p["no_stop_trim"],
      sampling_seed=seed,
      logit_bias=bias,
    )

  def to_dict(self) -> dict[str, Any]:
    """SGLang's sampling_params for these values (`from_dict` reads it back
    to equal parameters): the fields at their defaults are left out."""
    d: dict[str, Any] = {
      "max_new_tokens": self.max_new_tokens,
      "temperature": self.temperature,
      "top_p": self.top_p,
      "top_k": -1 if self.top_k == TOP_K_ALL else self.top_k,
    }
    if self.stop:
      d["stop"] = list(self.stop)
    if self.stop_token_ids:
      d["stop_token_ids"] = list(self.stop_token_ids)
    for key in BOOL_SAMPLING_KEYS:
      if key != "spaces_between_special_tokens" and getattr(self, key) != SAMPLING_DEFAULTS[key]:
        d[key] = getattr(self, key)
    if self.sampling_seed is not None:
      d["sampling_seed"] = self.sampling_seed
    if self.logit_bias:
      d["logit_bias"] = {str(i): b for i, b in self.logit_bias}
    return d


def _logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
  """SGLang's logit_bias {str(token_id): bias} as sorted (id, bias) pairs."""
  if raw is None:
    return ()
  if not isinstance(raw, dict):
    raise ProtocolError(f"logit_bias must map token ids to floats, got {type(raw).__name__}")
  out = []
  for key, value in raw.items():
    if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
      raise ProtocolError(f"logit_bias key {key!r} is not a token id")
    if not is_finite_json_number(value):
      raise ProtocolError(f"logit_bias[{key!r}] must be a number, got {value!r}")
    out.append((int(key), float(value)))
  return tuple(sorted(out))
