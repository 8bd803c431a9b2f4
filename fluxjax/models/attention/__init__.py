"""Attention over packed sequences, behind one backend switch (`model.attention_backend`).

Every backend takes the arguments of the `xla` reference (xla.py) and masks as it does:
segment ids and in-sequence positions decide visibility, never buffer indices. Built in:
`xla`, `xla_blocked` (blocked.py, any platform), `pallas_gpu` (pallas.py), `cudnn`
(cudnn.py) and `tokamax_gpu` (tokamax.py), each module saying what it needs; `auto` is
`default_backend`'s pick by platform and row length. docs/design.md, section 6, compares
them. GPU backends load on first use, so CPU-only users never import their lowerings;
cudnn and tokamax_gpu sort the buffer into contiguous segments first (layout.py) and
serve self-attention only. Other backends register with `register_backend`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.ad_checkpoint import checkpoint_name

from fluxjax.models.attention.blocked import blocked_attention
from fluxjax.models.attention.xla import decode_attention, segment_mask, xla_attention
from fluxjax.models.layers import ATTENTION_OUT

__all__ = [
  "attention",
  "decode_attention",
  "default_backend",
  "register_backend",
  "segment_mask",
  "xla_attention",
]

_BACKENDS: dict[str, Callable] = {"xla": xla_attention, "xla_blocked": blocked_attention}


def register_backend(name: str, fn: Callable) -> None:
  _BACKENDS[name] = fn


_GPU_BACKENDS = ("pallas_gpu", "cudnn", "tokamax_gpu")


def _builtin(name: str) -> Callable | None:
  if name == "pallas_gpu":
    from fluxjax.models.attention import pallas

    return pallas.pallas_attention
  if name == "cudnn":
    from fluxjax.models.attention import cudnn

    return cudnn.cudnn_attention
  if name == "tokamax_gpu":
    from fluxjax.models.attention import tokamax

    return tokamax.tokamax_attention
  return None


# Rows up to this many keys run the dense reference under `auto`: on a CPU
# blockwise is then under 2x faster per step and compiles 0.7 s slower (the
# tiny model: 512 keys 0.081 -> 0.043 s, 1024 keys 0.50 -> 0.20 s).
AUTO_DENSE_MAX_KEYS = 512


def default_backend(num_keys: int, platform: str | None = None) -> str:
  """What `auto` runs for rows of `num_keys` keys on `platform` (default:
  JAX's default backend).

  On GPUs the Pallas kernels: measured correct there (fp32 and bf16 parity
  with xla), with memory linear in the row, and the faster train step (7B
  shapes on an H200: 360 TFLOP/s against cudnn's 341 with the projections
  saved; bench/README.md). cudnn is faster on attention alone but bf16-only
  and 5-18x the memory; tokamax_gpu's untuned backward is 4-18x cudnn's.
  """
  platform = platform or jax.default_backend()
  if platform in ("gpu", "cuda"):
    return "pallas_gpu"
  if platform == "cpu" and num_keys > AUTO_DENSE_MAX_KEYS:
    return "xla_blocked"
  return "xla"


def attention(q_BTNH, k_BSKH, v_BSKH, *, backend: str = "auto", **kw) -> jax.Array:
  """Dispatches to the configured backend (see module docstring)."""
  if backend == "auto":
    backend = default_backend(k_BSKH.shape[1])
  if backend not in _BACKENDS and (fn := _builtin(backend)) is not None:
    register_backend(backend, fn)
  if backend not in _BACKENDS:
    known = sorted(set(_BACKENDS) | set(_GPU_BACKENDS) | {"auto"})
    raise ValueError(f"unknown attention backend {backend!r}; available: {known}")
  out = _BACKENDS[backend](q_BTNH, k_BSKH, v_BSKH, **kw)
  return checkpoint_name(out, ATTENTION_OUT)
