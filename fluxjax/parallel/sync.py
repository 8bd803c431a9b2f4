"""ODC's minibatch-level sync, expressed in SPMD.

With per-layer sync (the default, `sharding.sync = "layer"`) the partitioner all-gathers
each layer's parameters in every microbatch and reduce-scatters its gradients, so every
device waits for the slowest at every layer of every microbatch. With `sharding.sync =
"minibatch"`, `make_accumulate` runs everything inside one `shard_map`. The gradients
equal the per-layer path's: only where the communication sits changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fluxjax.parallel import batch as batch_lib
from fluxjax.parallel import train_step
from fluxjax.sharding import mesh as mesh_lib

P = jax.sharding.PartitionSpec


def _dims(spec: P):
  """(dim, axes tuple) for each sharded dimension of a spec."""
  for dim, axes in enumerate(spec):
    if axes is not None:
      yield dim, axes if isinstance(axes, tuple) else (axes,)


def gather_params(x: jax.Array, spec: P) -> jax.Array:
  for dim, axes in _dims(spec):
    x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
  return x


def reduce_grads(g: jax.Array, spec: P, batch_axes: tuple[str, ...]) -> jax.Array:
  """Sum over every device: reduce-scatter along the FSDP dims, psum the rest."""
  used = set()
  for dim, axes in _dims(spec):
    g = jax.lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
    used.update(axes)
  rest = tuple(a for a in batch_axes if a not in used)
  return jax.lax.psum(g, rest) if rest else g


def make_accumulate(
  graphdef,
  mesh: jax.sharding.Mesh,
  param_shardings,
  loss_fn,
  local_attention_fn=None,
  independent_rows: bool = True,
  local_vision: bool = True,
  merge_unit: int = 4,
  temperature: float = 1.0,
):
  """An `accumulate(params, batch, total=None) -> (loss, grads, sums)`, minibatch sync.

  Inside one `shard_map`:
    1. parameters are all-gathered once, for the whole minibatch;
    2. each device loops over its own microbatches. When rows are independent (degree 1:
       packed_dp, LB-Mini) the trip count is the device's own and the loop holds no
       collective at all; Ulysses groups keep their all-to-alls, which only the group's
       members take part in;
    3. gradients are reduce-scattered once into their FSDP shards (and summed over data
       replicas).

  Args:
    graphdef: the model's graph definition.
    mesh: the training mesh.
    param_shardings: the parameters' NamedShardings (FSDP).
    loss_fn: the token-level loss (train_step.LossFn).
    local_attention_fn: the strategy's attention for code already inside
      shard_map (None: row-local attention).
    independent_rows: every row has degree 1, so each device may stop after
      its own last microbatch.
    local_vision: every merged vision embedding is used on the device that
      encoded it (no cross-device route); otherwise they are all-gathered.
    merge_unit: patches per merged vision token (the model's 2x2 merger: 4).
    temperature: the policy's logprobs are of softmax(logits / temperature).
  """

  batch_axes = mesh_lib.batch_axes(mesh)
  param_specs = jax.tree.map(lambda s: s.spec, param_shardings)

  def per_device(params, batch, total):
    full = jax.tree.map(gather_params, params, param_specs)
    grad_fn = jax.value_and_grad(train_step.loss_and_metrics, has_aux=True)
    # vision_index addresses all devices' merged embeddings, device-major.
    merged_per_device = batch.inputs.vision.patches_BNP.shape[2] // merge_unit
    if local_vision:
      me = jax.lax.axis_index(batch_axes)
      rebase = lambda idx: idx - me * merged_per_device
      gather = None
    else:
      rebase = lambda idx: idx
      gather = lambda merged: jax.lax.all_gather(merged, batch_axes, axis=0, tiled=True)

    def one(m):
      mb = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, m, 0, keepdims=False), batch)
      inputs = dataclasses.replace(mb.inputs, vision_index_BT=rebase(mb.inputs.vision_index_BT))
      mb = dataclasses.replace(mb, inputs=inputs)
      (loss, sums), g = grad_fn(
        full, graphdef, mb, total, loss_fn, local_attention_fn, gather, temperature=temperature
      )
      return loss, g, sums

    zeros = jax.tree.map(jnp.zeros_like, full)
    _, _, sums0 = jax.eval_shape(one, 0)
    init = (jnp.zeros(()), zeros, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums0))

    def add(acc, m):
      loss, g, sums = one(m)
      return jax.tree.map(jnp.add, acc, (loss, g, sums))

    if independent_rows:
      # This device's own microbatch count: its rows are front-loaded.
      used = (batch.inputs.segment_ids_BT != 0).any(axis=(1, 2))
      count = jnp.max(jnp.where(used, jnp.arange(used.shape[0]) + 1, 0))
      _, acc = jax.lax.while_loop(
        lambda c: c[0] < count, lambda c: (c[0] + 1, add(c[1], c[0])), (0, init)
      )
    else:
      acc = jax.lax.fori_loop(0, batch.targets.shape[0], lambda m, a: add(a, m), init)
    loss, grads, sums = acc
    grads = jax.tree.map(lambda g, s: reduce_grads(g, s, batch_axes), grads, param_specs)
    loss = jax.lax.psum(loss, batch_axes)
    sums = jax.tree.map(lambda x: jax.lax.psum(x, batch_axes), sums)
    return loss, grads, sums

  def accumulate(params, batch: batch_lib.TrainBatch, total=None):
    total = train_step.batch_total(batch) if total is None else jnp.asarray(total, jnp.float32)
    batch_specs = jax.tree.map(lambda s: s.spec, batch_lib.batch_shardings(batch, mesh))
    # check_vma=False: inside, every value is per-device by construction and all
    # communication is the explicit gather/reduce above; the varying-axes type
    # check would otherwise reject the model's scans (constant-initialized
    # carries meet per-device outputs).
    fn = jax.shard_map(
      per_device,
      mesh=mesh,
      in_specs=(param_specs, batch_specs, P()),
      out_specs=(P(), param_specs, P()),
      check_vma=False,
    )
    return fn(params, batch, total)

  return accumulate
