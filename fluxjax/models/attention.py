"""Attention over packed sequences, behind one backend switch.

Every backend takes the same arguments and masks the same way as the `xla`
reference (`fluxjax.models.attention_xla`): segment ids and in-sequence
positions decide visibility, never buffer indices. Built in:
  xla         the reference; any platform.
  pallas_gpu  packed-segment flash attention in Pallas/Triton
              (`fluxjax.models.attention_pallas`), loaded on first use so
              CPU-only users never import the Triton lowering.
Other backends register with `register_backend`. cuDNN flash through
`jax.nn.dot_product_attention` ignores segment ids and must not be used for
packed sequences.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from fluxjax.models.attention_xla import segment_mask, xla_attention

__all__ = ["attention", "register_backend", "segment_mask", "xla_attention"]

_BACKENDS: dict[str, Callable] = {"xla": xla_attention}


def register_backend(name: str, fn: Callable) -> None:
  _BACKENDS[name] = fn


def _builtin(name: str) -> Callable | None:
  if name == "pallas_gpu":
    from fluxjax.models import attention_pallas

    return attention_pallas.pallas_attention
  return None


def attention(q_BTNH, k_BSKH, v_BSKH, *, backend: str = "xla", **kw) -> jax.Array:
  """Dispatches to the configured backend (see module docstring)."""
  if backend not in _BACKENDS and (fn := _builtin(backend)) is not None:
    register_backend(backend, fn)
  if backend not in _BACKENDS:
    raise ValueError(
      f"unknown attention backend {backend!r}; available: {sorted(set(_BACKENDS) | {'pallas_gpu'})}"
    )
  return _BACKENDS[backend](q_BTNH, k_BSKH, v_BSKH, **kw)
