"""Building blocks shared by the vision tower and the text decoder.

Every parameter carries logical axis names (fluxjax.sharding.axes) in its
`out_sharding` metadata; nothing here knows about mesh axes.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

Initializer = jax.nn.initializers.Initializer
_policies = jax.checkpoint_policies

# The name attention's output carries (models/attention/), for the policy
# that keeps it.
ATTENTION_OUT = "attention_out"

# What a scanned layer keeps for the backward pass (`ModelConfig.remat`, which
# checks the name); everything else is recomputed there. The projections'
# outputs are the dots without batch dimensions.
REMAT_POLICIES = {
  "none": None,  # keep everything: no recomputation, the most memory
  "full": _policies.nothing_saveable,  # recompute the whole layer
  "save_dots": _policies.dots_with_no_batch_dims_saveable,
  "save_dots_attention": _policies.save_from_both_policies(
    _policies.dots_with_no_batch_dims_saveable,
    _policies.save_only_these_names(ATTENTION_OUT),
  ),
}
_default_init = jax.nn.initializers.normal(stddev=0.02)


def param(
  rngs: nnx.Rngs,
  shape: Sequence[int],
  axes: Sequence[str | None],
  init: Initializer = _default_init,
  dtype=jnp.float32,
) -> nnx.Param:
  """A parameter annotated with logical axes."""
  if len(shape) != len(axes):
    raise ValueError(f"shape {tuple(shape)} and axes {tuple(axes)} differ in rank")
  return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(axes))


class Dense(nnx.Module):
  """y = x @ kernel (+ bias), with the kernel's input and output dims named.

  `in_shape`/`out_shape` may be tuples so that heads stay a separate named
  axis, e.g. kernel [embed, q_heads, head_dim].
  """

  def __init__(
    self,
    in_shape: Sequence[int] | int,
    out_shape: Sequence[int] | int,
    in_axes: Sequence[str | None],
    out_axes: Sequence[str | None],
    *,
    use_bias: bool,
    rngs: nnx.Rngs,
    dtype=jnp.float32,
  ):
    in_shape = (in_shape,) if isinstance(in_shape, int) else tuple(in_shape)
    out_shape = (out_shape,) if isinstance(out_shape, int) else tuple(out_shape)
    self.n_in = len(in_shape)
    self.kernel = param(rngs, in_shape + out_shape, tuple(in_axes) + tuple(out_axes), dtype=dtype)
    self.bias = (
      param(rngs, out_shape, out_axes, jax.nn.initializers.zeros, dtype) if use_bias else None
    )

  def __call__(self, x: jax.Array | np.ndarray) -> jax.Array:
    kernel = self.kernel[...].astype(x.dtype)
    y = jnp.tensordot(
      x, kernel, axes=(tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in)))
    )
    if self.bias is not None:
      y = y + self.bias[...].astype(x.dtype)
    return y


class RMSNorm(nnx.Module):
  """RMSNorm computed in fp32, scaled after casting back (as HF Qwen2 does)."""

  def __init__(self, dim: int, axis_name: str, *, eps: float, rngs: nnx.Rngs):
    del rngs  # initialized to ones
    self.eps = eps
    self.weight = nnx.Param(jnp.ones((dim,), jnp.float32), out_sharding=(axis_name,))

  def __call__(self, x: jax.Array) -> jax.Array:
    dtype = x.dtype
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return self.weight[...].astype(dtype) * x32.astype(dtype)


class SwiGLU(nnx.Module):
  """down(silu(gate(x)) * up(x)); the vision tower's version has biases."""

  def __init__(
    self, dim: int, hidden: int, dim_axis: str, hidden_axis: str, *, use_bias: bool, rngs: nnx.Rngs
  ):
    self.gate_proj = Dense(dim, hidden, (dim_axis,), (hidden_axis,), use_bias=use_bias, rngs=rngs)
    self.up_proj = Dense(dim, hidden, (dim_axis,), (hidden_axis,), use_bias=use_bias, rngs=rngs)
    self.down_proj = Dense(hidden, dim, (hidden_axis,), (dim_axis,), use_bias=use_bias, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: jax.Array) -> jax.Array:
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([-x2, x1], axis=-1)


def apply_rotary(x_BTNH: jax.Array, cos_BTH: jax.Array, sin_BTH: jax.Array) -> jax.Array:
  """Rotates q or k (heads on axis -2) in fp32 and casts back."""
  dtype = x_BTNH.dtype
  x = x_BTNH.astype(jnp.float32)
  cos, sin = cos_BTH[..., None, :], sin_BTH[..., None, :]
  return (x * cos + rotate_half(x) * sin).astype(dtype)


def inverse_frequencies(dim: int, theta: float) -> jax.Array:
  """1 / theta^(2i/dim) for i < dim/2, the standard RoPE frequencies."""
  return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def stacked(n: int, make, rngs: nnx.Rngs):
  """Creates `n` copies of a module with parameters stacked on a `layers` axis.

  The stack is applied with `scan_layers`, so a deep model compiles one layer.
  """
  from fluxjax.sharding import axes  # local: keeps layers importable on its own

  @nnx.split_rngs(splits=n)
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axes.LAYERS})
  def make_stack(rngs):
    return make(rngs)

  return make_stack(rngs)


def scan_layers(stack: nnx.Module, x: jax.Array, body, xs=None, *, remat: str = "none"):
  """Runs `body(layer, x, x_slice) -> x` over a stacked module with lax.scan.

  Args:
    stack: a module built by `stacked`.
    x: the carried activations.
    body: applies one layer; receives the merged layer module.
    xs: optional per-layer inputs (leading axis = layers), e.g. a flag per layer.
    remat: a `REMAT_POLICIES` name: which of each layer's activations the
      backward pass keeps; the rest it recomputes, saving memory
      proportional to depth.
  """
  graphdef, state = nnx.split(stack)

  def step(carry, inputs):
    layer_state, x_slice = inputs
    return body(nnx.merge(graphdef, layer_state), carry, x_slice), None

  if remat != "none":
    step = jax.checkpoint(step, policy=REMAT_POLICIES[remat])
  out, _ = jax.lax.scan(step, x, (state, xs))
  return out
