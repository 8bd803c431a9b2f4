"""Target-token log-probabilities without materializing [T, V] logits.

With V ~ 152k a [T, V] fp32 logits array is ~600 KB per token: 20 GB for a 32k
sequence. We scan over vocabulary chunks keeping an online logsumexp (running
max, sum of exponentials and, for the entropy, the exp-weighted logit sum), and
take the target logit with a gather of the target columns. The scan body is
rematerialized, so the backward pass also holds one [T, C] chunk at a time.

Shapes: N tokens (flattened), D width, V vocabulary, C chunk.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _chunk_stats(hidden_ND, head_DV, chunk: int, inv_temperature: float = 1.0):
  """Online (max, sum exp, sum exp*logit) over vocabulary chunks of logits / T."""
  n = hidden_ND.shape[0]
  vocab = head_DV.shape[1]
  chunk = min(chunk, vocab)
  num_chunks = -(-vocab // chunk)

  @jax.checkpoint
  def step(carry, i):
    m, s, zs = carry
    # The last chunk is slid back to stay in bounds; columns already seen by an
    # earlier chunk are masked out rather than padded (no copy of the head).
    start = jnp.minimum(i * chunk, vocab - chunk)
    cols = jax.lax.dynamic_slice_in_dim(head_DV, start, chunk, axis=1)
    z = jnp.dot(
      hidden_ND, cols.astype(hidden_ND.dtype), preferred_element_type=jnp.float32
    )  # [N, C]
    if inv_temperature != 1.0:
      z = z * inv_temperature
    fresh = (start + jnp.arange(chunk)) >= i * chunk
    z = jnp.where(fresh[None, :], z, -jnp.inf)
    m_new = jnp.maximum(m, z.max(axis=1))
    scale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    s = s * scale + e.sum(axis=1)
    zs = zs * scale + jnp.where(fresh[None, :], e * z, 0.0).sum(axis=1)
    return (m_new, s, zs), None

  init = (
    jnp.full((n,), -jnp.inf, jnp.float32),
    jnp.zeros((n,), jnp.float32),
    jnp.zeros((n,), jnp.float32),
  )
  (m, s, zs), _ = jax.lax.scan(step, init, jnp.arange(num_chunks))
  return m, s, zs


def token_logprobs(
  hidden_BTD: jax.Array,
  targets_BT: jax.Array,
  head_DV: jax.Array,
  *,
  chunk: int = 8192,
  with_entropy: bool = False,
  temperature: float = 1.0,
):
  """log p(target) per token, optionally with the entropy of each distribution.

  p = softmax(logits / temperature): at the temperature a response was
  sampled with, these are the logprobs the sampler reported for it.

  Args:
    hidden_BTD: final hidden states (after the final norm).
    targets_BT: int target ids (any value for positions the caller masks out).
    head_DV: the LM head, [D, V] (the transposed embedding when tied).
    chunk: vocabulary chunk size; memory is O(N * chunk).
    with_entropy: also return the entropy [B, T] (same pass, no extra matmul).
    temperature: divides the logits (> 0; 1 is the model's own distribution).

  Returns:
    logp_BT float32, or (logp_BT, entropy_BT).
  """
  b, t, d = hidden_BTD.shape
  hidden = hidden_BTD.reshape(b * t, d)
  targets = targets_BT.reshape(b * t)
  if temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  inv_t = 1.0 / temperature
  m, s, zs = _chunk_stats(hidden, head_DV, chunk, inv_t)
  lse = m + jnp.log(s)
  target_cols_ND = jnp.take(head_DV, targets, axis=1).T.astype(hidden.dtype)
  target_logit = jnp.einsum("nd,nd->n", hidden, target_cols_ND, preferred_element_type=jnp.float32)
  if inv_t != 1.0:
    target_logit = target_logit * inv_t
  logp = (target_logit - lse).reshape(b, t)
  if not with_entropy:
    return logp
  entropy = (lse - zs / s).reshape(b, t)
  return logp, entropy


def naive_token_logprobs(
  hidden_BTD, targets_BT, head_DV, with_entropy: bool = False, temperature: float = 1.0
):
  """The [T, V] reference, for tests and tiny models only."""
  logits = jnp.einsum(
    "btd,dv->btv", hidden_BTD, head_DV.astype(hidden_BTD.dtype), preferred_element_type=jnp.float32
  )
  logits = logits / temperature
  logp_all = jax.nn.log_softmax(logits, axis=-1)
  logp = jnp.take_along_axis(logp_all, targets_BT[..., None], axis=-1)[..., 0]
  if not with_entropy:
    return logp
  return logp, -(jnp.exp(logp_all) * logp_all).sum(-1)
