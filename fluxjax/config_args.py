"""Parsing of `--config=configs/x.py:arg` strings, big_vision style.

`parse_arg("variant=7b,fast", variant="tiny", fast=False)` returns a
ConfigDict with typed defaults; a bare name sets a boolean to True, and a bare
value of a known variant name selects it (`vlm.py:qwen25_vl_7b`).
"""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, lazy: bool = False, **spec) -> ml_collections.ConfigDict:
  """Parses "k1=v1,k2,..." into a ConfigDict with the types of `spec`'s defaults."""
  cfg = ml_collections.ConfigDict(spec)
  if not arg:
    return cfg
  for item in arg.split(","):
    if not item:
      continue
    key, eq, value = item.partition("=")
    if not eq:
      if key in spec and isinstance(spec[key], bool):
        cfg[key] = True
        continue
      if "variant" in spec:  # a bare name is the variant: vlm.py:qwen25_vl_7b
        cfg.variant = key
        continue
      raise ValueError(f"config arg {key!r} is not a boolean field of {sorted(spec)}")
    if key not in spec:
      if lazy:
        cfg[key] = value
        continue
      raise ValueError(f"unknown config arg {key!r}; known: {sorted(spec)}")
    default = spec[key]
    if isinstance(default, bool):
      cfg[key] = value.lower() in ("1", "true", "yes", "on")
    elif default is None:
      cfg[key] = value
    else:
      cfg[key] = type(default)(value)
  return cfg
