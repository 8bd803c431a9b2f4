"""Parsing of `--config=configs/x.py:arg` strings, big_vision style.

`parse_arg("variant=7b,fast", variant="tiny", fast=False)` returns a
ConfigDict with typed defaults; a bare name sets a boolean to True, and a bare
value of a known variant name selects it (`vlm.py:qwen25_vl_7b`).
"""

from __future__ import annotations

import importlib.util
import json
import os

import ml_collections


def parse_arg(arg: str | None, lazy: bool = False, **spec) -> ml_collections.ConfigDict:
  """Parses "k1=v1,k2,..." into a ConfigDict with the types of `spec`'s defaults."""
  parsed = ml_collections.ConfigDict(spec)
  if not arg:
    return parsed
  for item in arg.split(","):
    if not item:
      continue
    key, eq, value = item.partition("=")
    if not eq:
      if key in spec and isinstance(spec[key], bool):
        parsed[key] = True
        continue
      if "variant" in spec:  # a bare name is the variant: vlm.py:qwen25_vl_7b
        parsed.variant = key
        continue
      raise ValueError(f"config arg {key!r} is not a boolean field of {sorted(spec)}")
    if key not in spec:
      if lazy:
        parsed[key] = value
        continue
      raise ValueError(f"unknown config arg {key!r}; known: {sorted(spec)}")
    default = spec[key]
    if isinstance(default, bool):
      parsed[key] = value.lower() in ("1", "true", "yes", "on")
    elif default is None:
      parsed[key] = value
    else:
      parsed[key] = type(default)(value)
  return parsed


# The default run's config file: the one place the defaults of every section live.
DEFAULT_CONFIG = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "vlm.py"
)


# The committed base the tiny post-training job starts from, which
# configs/pretrain.py writes (an HF folder with its card.json).
TINY_BASE = os.path.join(
  os.path.dirname(os.path.abspath(__file__)), "models", "assets", "base_tiny"
)


def load_config(path: str = DEFAULT_CONFIG, arg: str | None = None) -> ml_collections.ConfigDict:
  """`get_config(arg)` of a config file: what `--config=path:arg` gives train.py,
  for notebooks, tests and benches that build a run without flags (e.g. the
  default `rl` section: `load_config().rl`)."""
  spec = importlib.util.spec_from_file_location(
    f"fluxjax_config_{os.path.splitext(os.path.basename(path))[0]}", path
  )
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot load config file {path!r}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


def load_saved(path: str) -> tuple[ml_collections.ConfigDict, list[str]]:
  """A run's saved config (its work directory's config.json) over today's
  defaults of its variant, and notes on where the two differ in shape.

  A field the saved config lacks (added since the run) takes today's
  default; a saved field today's config has no more is dropped. Each is one
  note ("rl.reward.weights: not in the saved config, default ()").
  """
  with open(path) as f:
    saved = json.load(f)
  config = load_config(DEFAULT_CONFIG, str(saved.get("variant", "tiny")))
  notes: list[str] = []
  _overlay(config, saved, "", notes)
  return config, notes


def _overlay(config: ml_collections.ConfigDict, saved: dict, where: str, notes: list[str]) -> None:
  for key in sorted(set(config.keys()) - set(saved)):
    notes.append(f"{where}{key}: not in the saved config, default {config[key]!r}")
  for key, value in saved.items():
    if key not in config:
      notes.append(f"{where}{key}: saved, but no longer a setting; dropped")
    elif isinstance(config[key], ml_collections.ConfigDict) and isinstance(value, dict):
      _overlay(config[key], value, f"{where}{key}.", notes)
    else:
      if isinstance(config[key], tuple) and isinstance(value, list):
        value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
      with config.ignore_type():
        config[key] = value


def differences(path: str, config: ml_collections.ConfigDict) -> list[str]:
  """ "field: saved -> now" for each setting where `config` differs from the
  config a run saved at `path` (its config.json), in dotted-name order."""
  with open(path) as f:
    saved = _flat(json.load(f))
  now = _flat(json.loads(config.to_json_best_effort()))
  return [
    f"{k}: {saved.get(k, '(none)')!r} -> {now.get(k, '(none)')!r}"
    for k in sorted(set(saved) | set(now))
    if saved.get(k, "(none)") != now.get(k, "(none)")
  ]


def _flat(d: dict, where: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{where}{k}."))
    else:
      out[f"{where}{k}"] = v
  return out


def check_command_line(argv: list[str], default: str = DEFAULT_CONFIG) -> str | None:
  """A one-line reason why `--config=...` and its `--config.a.b=v` overrides
  in `argv` cannot make a config, or None.

  Loads the config file with its arg (an unknown variant or modifier is the
  file's own ValueError) and checks that each override names a field,
  suggesting the closest one.
  """
  import difflib

  spec = default
  overrides = []
  args = list(argv[1:])
  for i, a in enumerate(args):
    if a.startswith("--config="):
      spec = a.partition("=")[2]
    elif a == "--config" and i + 1 < len(args):  # absl's "--config PATH" form
      spec = args[i + 1]
    elif a.startswith("--config."):
      overrides.append(a[len("--config.") :].partition("=")[0])
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    return f"--config={spec}: no config file {path}"
  try:
    config = load_config(path, arg or None)
  except ValueError as e:
    return f"--config={spec}: {e}"
  known = sorted(_flat(json.loads(config.to_json_best_effort())))
  for name in overrides:
    if name not in known and not any(k.startswith(name + ".") for k in known):
      section, _, leaf = name.rpartition(".")
      siblings = [k.rpartition(".")[2] for k in known if k.rpartition(".")[0] == section]
      close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
      where = f"{section}." if section else ""
      hint = f"; did you mean --config.{where}{close[0]}?" if close else ""
      return f"--config.{name}: no such setting in {os.path.basename(path)}{hint}"
  return None


def describe(path: str = DEFAULT_CONFIG) -> str:
  """The variants and modifiers a config file declares (for --help), from its
  `VARIANTS` and `MODIFIERS` tables where it has them."""
  spec = importlib.util.spec_from_file_location("fluxjax_config_help", path)
  if spec is None or spec.loader is None:
    return ""
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  parts = []
  if hasattr(module, "VARIANTS"):
    parts.append("variants: " + ", ".join(module.VARIANTS))
  if hasattr(module, "MODIFIERS"):
    parts.append("modifiers: " + "; ".join(f"{k} ({v})" for k, v in module.MODIFIERS.items()))
  return ". ".join(parts)
