"""Per-slot sampling inside the jitted decode step.

Every slot carries its own temperature, top-p, top-k, seed and step counter as
arrays, so one compiled step serves any mix of requests. Entry points: `sample`
(SGLang's sampler semantics and seeded randomness, told in its docstring),
`apply_logit_bias`, `finite_rows`.

Shapes: S slots, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def _truncate(scaled_SV, top_p_S, top_k_S):
  """Masks logits outside each slot's top-k and top-p nucleus (sort-based)."""
  vocab = scaled_SV.shape[-1]
  sorted_SV = -jnp.sort(-scaled_SV, axis=-1)  # descending
  k_S = jnp.clip(top_k_S, 1, vocab)
  kth_S = jnp.take_along_axis(sorted_SV, (k_S - 1)[:, None], axis=-1)[:, 0]
  probs_SV = jax.nn.softmax(sorted_SV, axis=-1)
  # A sorted entry stays if the mass before it is < top_p (the first always stays).
  before_SV = jnp.cumsum(probs_SV, axis=-1) - probs_SV
  keep_SV = (before_SV < top_p_S[:, None]) & (jnp.arange(vocab)[None] < k_S[:, None])
  last_S = jnp.sum(keep_SV, axis=-1) - 1
  cut_S = jnp.take_along_axis(sorted_SV, last_S[:, None], axis=-1)[:, 0]
  threshold_S = jnp.maximum(kth_S, cut_S)
  return jnp.where(scaled_SV >= threshold_S[:, None], scaled_SV, _NEG_INF)


def finite_rows(logits_SV: jax.Array) -> jax.Array:
  """bool [S]: whether every logit of each slot is finite.

  The engine samples from no other row: softmax over a NaN or an infinity is
  NaN, and argmax picks an arbitrary token from it.
  """
  return jnp.isfinite(logits_SV).all(axis=-1)


def apply_logit_bias(logits_SV: jax.Array, bias_ids_SK: jax.Array, bias_SK: jax.Array):
  """Adds each slot's (id, bias) pairs to its logits (bias 0 pairs are no-ops).

  Logit bias (SGLang's logit_bias): up to K (token id, bias) pairs per slot are
  added to the logits before temperature; padding pairs carry bias 0. The
  returned logprob is under the biased distribution, the one sampled from.
  """
  rows_S1 = jnp.arange(logits_SV.shape[0])[:, None]
  return logits_SV.at[rows_S1, bias_ids_SK].add(bias_SK)


def sample(
  logits_SV: jax.Array,
  temperature_S: jax.Array,
  top_p_S: jax.Array,
  top_k_S: jax.Array,
  seed_S: jax.Array,
  position_S: jax.Array,
):
  """Samples one token per slot.

  Semantics follow SGLang's sampler (`python/sglang/srt/layers/sampler.py`):
    * temperature < 1e-6 is greedy: temperature 1 and top-k 1 (the rewrite in
      SGLang's `SamplingParams`), applied by the caller (sampling_params.py);
    * the returned logprob is that of the sampled token under
      log_softmax(logits / temperature), i.e. after temperature and *before*
      top-p/top-k truncation. With temperature 1 and no truncation this is the
      model's distribution, which is what the trainer recomputes.

  Randomness: the key of the token sampled at position n of the sequence
  (prompt included) is fold_in(key(seed), n), as SGLang's seeded sampler hashes
  (seed, position). So a request with a given `sampling_seed` produces the same
  tokens whatever else is batched with it, and a paused response continued from
  prompt + its partial tokens (`GenerateRequest.continued`, rollout/protocol.py) draws what
  the uninterrupted one would have.

  Args:
    logits_SV: fp32 logits.
    temperature_S: > 0 (greedy requests come as temperature 1, top-k 1).
    top_p_S: in (0, 1].
    top_k_S: >= 1; any value >= V means no top-k.
    seed_S: uint32 per-request seeds.
    position_S: int position of the sampled token in its sequence (the
      fold-in counter).

  Returns:
    (tokens_S int32, logprobs_S fp32): logprob under softmax(logits / T).
  """
  vocab = logits_SV.shape[-1]
  scaled_SV = logits_SV / temperature_S[:, None]
  logp_SV = jax.nn.log_softmax(scaled_SV, axis=-1)
  needs_truncation = jnp.any((top_p_S < 1.0) | ((top_k_S > 1) & (top_k_S < vocab)))
  # The sort costs O(V log V) per slot; skip it when no slot truncates.
  masked_SV = jax.lax.cond(
    needs_truncation, _truncate, lambda x, *_: x, scaled_SV, top_p_S, top_k_S
  )
  keys = jax.vmap(lambda s, n: jax.random.fold_in(jax.random.key(s), n))(seed_S, position_S)
  gumbel_SV = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,), jnp.float32))(keys)
  sampled_S = jnp.argmax(masked_SV + gumbel_SV, axis=-1)
  greedy_S = jnp.argmax(logits_SV, axis=-1)
  tokens_S = jnp.where(top_k_S == 1, greedy_S, sampled_S).astype(jnp.int32)
  logprobs_S = jnp.take_along_axis(logp_SV, tokens_S[:, None], axis=-1)[:, 0]
  return tokens_S, logprobs_S
