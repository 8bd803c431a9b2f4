"""Attention over packed sequences, behind one backend switch.

Every backend takes the same arguments and masks the same way as the `xla`
reference (`fluxjax.models.attention_xla`): segment ids and in-sequence
positions decide visibility, never buffer indices. Built in:
  xla         the reference; any platform.
  pallas_gpu  packed-segment flash attention in Pallas/Triton
              (`fluxjax.models.attention_pallas`).
  cudnn       cuDNN's fused flash attention in its packed (THD) layout
              (`fluxjax.models.attention_cudnn`); Hopper or newer.
  tokamax_gpu tokamax's Mosaic GPU flash kernel with per-query key ranges
              (`fluxjax.models.attention_tokamax`); needs `tokamax`.
GPU backends load on first use, so CPU-only users never import their
lowerings. The cudnn and tokamax_gpu backends sort the buffer into contiguous
segments first (`fluxjax.models.attention_layout`) and serve self-attention
only. Other backends register with `register_backend`.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from fluxjax.models.attention_xla import segment_mask, xla_attention

__all__ = ["attention", "register_backend", "segment_mask", "xla_attention"]

_BACKENDS: dict[str, Callable] = {"xla": xla_attention}


def register_backend(name: str, fn: Callable) -> None:
  _BACKENDS[name] = fn


_GPU_BACKENDS = ("pallas_gpu", "cudnn", "tokamax_gpu")


def _builtin(name: str) -> Callable | None:
  if name == "pallas_gpu":
    from fluxjax.models import attention_pallas

    return attention_pallas.pallas_attention
  if name == "cudnn":
    from fluxjax.models import attention_cudnn

    return attention_cudnn.cudnn_attention
  if name == "tokamax_gpu":
    from fluxjax.models import attention_tokamax

    return attention_tokamax.tokamax_attention
  return None


def attention(q_BTNH, k_BSKH, v_BSKH, *, backend: str = "xla", **kw) -> jax.Array:
  """Dispatches to the configured backend (see module docstring)."""
  if backend not in _BACKENDS and (fn := _builtin(backend)) is not None:
    register_backend(backend, fn)
  if backend not in _BACKENDS:
    known = sorted(set(_BACKENDS) | set(_GPU_BACKENDS))
    raise ValueError(f"unknown attention backend {backend!r}; available: {known}")
  return _BACKENDS[backend](q_BTNH, k_BSKH, v_BSKH, **kw)
