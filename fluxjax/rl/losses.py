"""PPO/GRPO token loss with decoupled importance correction and KL to a reference.

`make_loss_fn(settings.rl)` returns the `LossFn` the train step calls per
microbatch (fluxjax/parallel/train_step.py): `loss_fn(logp_BT, entropy_BT, mb) ->
(per_token_loss_BT, {name: per-token metric [B, T]})`. The step multiplies
both by `mb.loss_mask` and divides by the global sum of the mask, so every
term here is per token and unaggregated (the aggregation modes live in the mask's
weights: rl/advantages.py, `aggregation_weights`). The loss, its terms and its
metrics are told in `make_loss_fn`.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from fluxjax import settings as settings_lib
from fluxjax.parallel.batch import TrainBatch
from fluxjax.parallel.train_step import LossFn

KL_ESTIMATORS = ("k1", "k3")
IS_MODES = ("truncate", "mask", "off")
PROX_SOURCES = ("trainer", "batch")
# Bin edges of the per-token histogram of the raw weight pi_t / mu (the
# trainer's policy against the behaviour, before any cap or mask): the bins
# are logged as shares of the trained tokens.
IS_WEIGHT_EDGES = (0.5, 0.8, 0.95, 1.05, 1.25, 2.0)


def is_weight_bins(edges: tuple[float, ...] = IS_WEIGHT_EDGES) -> list[tuple[str, float, float]]:
  """(metric name, low, high) of each histogram bin: w in [low, high)."""
  bins = [(f"is_weight_lt_{edges[0]:g}", 0.0, edges[0])]
  bins += [(f"is_weight_{lo:g}_{hi:g}", lo, hi) for lo, hi in itertools.pairwise(edges)]
  return bins + [(f"is_weight_ge_{edges[-1]:g}", edges[-1], float("inf"))]


def is_weight_histogram(log_w: ArrayLike) -> dict[str, jax.Array]:
  """Per token, 1.0 in the bin its raw weight exp(log_w) falls in (`is_weight_bins`)."""
  w = jnp.exp(jnp.clip(jnp.asarray(log_w), -20.0, 20.0))
  return {k: ((w >= lo) & (w < hi)).astype(w.dtype) for k, lo, hi in is_weight_bins()}


def behaviour_drift(
  trainer_logp: ArrayLike, old_logp: ArrayLike, cap: float
) -> dict[str, jax.Array]:
  """Per token, how far the trainer's policy has moved from the behaviour mu
  that sampled the token (no gradient): `behaviour_kl`, k3 of KL(mu || pi_t)
  with r = pi_t / mu, r - 1 - log r; `behaviour_w` and `behaviour_w_sq`, r
  truncated at `cap` (uncapped if cap <= 0) and its square; and r's histogram."""
  log_r = jax.lax.stop_gradient(jnp.asarray(trainer_logp) - jnp.asarray(old_logp))
  r, _ = importance_weights(trainer_logp, old_logp, cap, "truncate")
  return {
    "behaviour_kl": jnp.exp(log_r) - log_r - 1.0,
    "behaviour_w": r,
    "behaviour_w_sq": r * r,
    **is_weight_histogram(log_r),
  }


def kl_penalty(logp: ArrayLike, ref_logp: ArrayLike, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi || pi_ref) from tokens sampled from pi.

  k1 = log(pi / ref) is unbiased but signed and noisy; k3 = r - 1 - log r with
  r = ref / pi is unbiased, non-negative and lower-variance (Schulman 2020).
  """
  log_ratio = jnp.asarray(ref_logp) - jnp.asarray(logp)
  if estimator == "k1":
    return -log_ratio
  if estimator == "k3":
    return jnp.exp(log_ratio) - log_ratio - 1.0
  raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def importance_weights(
  prox_logp: ArrayLike, old_logp: ArrayLike, cap: float, mode: str = "truncate"
) -> tuple[jax.Array, jax.Array]:
  """Decoupled weight pi_prox / mu per token (no gradient), and where it hit the cap.

  Returns:
    (w, truncated): w capped ("truncate") or zeroed ("mask") above `cap`,
    or 1 everywhere ("off": no correction); truncated is 1.0 where the raw
    weight exceeded the cap (0 when off).
  """
  if mode not in IS_MODES:
    raise ValueError(f"is_mode must be one of {IS_MODES}, got {mode!r}")
  w = jnp.exp(jax.lax.stop_gradient(jnp.asarray(prox_logp) - jnp.asarray(old_logp)))
  if mode == "off":
    return jnp.ones_like(w), jnp.zeros_like(w)
  if cap <= 0:
    return w, jnp.zeros_like(w)
  over = w > cap
  w = jnp.where(over, cap if mode == "truncate" else 0.0, w)
  return w, over.astype(w.dtype)


def make_loss_fn(rl: settings_lib.RL) -> LossFn:
  """The PPO-clip / GRPO token loss for the train step.

  Per token, with pi = current policy (logp, differentiated), pi_prox = the
  trainer's policy before this update (`prox_logprobs`), mu = the behaviour
  policy that sampled the token (`old_logprobs`, from the rollout engine),
  pi_ref = the reference (`ref_logprobs`) and A the advantage:

    ratio = exp(logp - prox)                                   PPO ratio
    w     = sg(min(exp(prox - old), is_cap))                   decoupled IS
    pg    = w * max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high))
    pg    = min(pg, -A * w * clip_c)      where A < 0, if clip_c > 0 (dual clip)
    kl    = k1: logp - ref
            k3: exp(ref - logp) - (ref - logp) - 1             (Schulman's k3)
    loss  = pg + kl_coef * kl - entropy_coef * entropy

  Decoupled PPO (Hilton et al. 2022; AReaL `use_decoupled_loss`): the trust
  region is taken around pi_prox, which the trainer controls, while w corrects
  for the tokens having been sampled from mu (an older or numerically different
  engine policy). Truncating w at is_cap (veRL/Tunix truncated IS) bounds the
  variance a very stale token can add. With `is_mode = "mask"` tokens whose
  weight exceeds the cap are dropped instead (AReaL's rejection); `"off"` sets
  w = 1, the uncorrected control.

  Where pi_prox comes from (`prox`): "trainer" (default) is the trainer's
  policy before the batch's first update. With one update per batch
  (`updates_per_batch = 1`) that is sg(logp), the policy being differentiated:
  AReaL's extra forward pass is not needed, the ratio is 1 where the gradient
  is taken (nothing is clipped), and w = pi_current / mu carries all of the
  staleness. With several updates the stream trainer fills `prox_logprobs`
  with a forward of that policy, so later updates are clipped around it
  (PPO epochs). "batch" reads `prox_logprobs` from the batch; when a sequence
  carries none, `materialize` sets prox = old, so w = 1 and this is standard
  PPO-clip against the behaviour policy.

  Config: the `rl` section of configs/vlm.py, where every field is written out
  with its meaning and its only default. The loss reads clip_low, clip_high,
  clip_c, kl_coef, kl_estimator, kl_clamp, is_cap, is_mode, prox, updates_per_batch and
  entropy_coef; the coordinator, the reference and the reward scheduler read
  the rest.

  Metrics (per token, averaged by the step over trained tokens): pg_loss,
  ratio, clipfrac (the clipped branch was taken), is_weight (the weight the
  loss applied), is_truncated, entropy, kl when kl_coef > 0, and the staleness
  signal, how far the trainer's policy pi_t has moved from mu whatever the
  correction does with it: behaviour_kl (k3 estimate of KL(mu || pi_t)),
  behaviour_w and behaviour_w_sq (min(pi_t / mu, is_cap) and its square,
  whose moments give the weight variance the staleness controller uses), and
  the histogram of the raw weight pi_t / mu (`is_weight_bins`: 1 in a token's
  bin, so the step's average is the share of trained tokens in each bin).
  pi_t is pi_prox under prox = "trainer"; under "batch" the batch's prox may
  be mu itself (coupled PPO), so pi_t is the policy being differentiated,
  the trainer's own at the batch's first update.

  Args:
    rl: the `rl` config section (configs/vlm.py); every field it reads must be set.

  Returns:
    loss_fn(logp_BT, entropy_BT, mb) -> (per-token loss, per-token metrics).
  """
  clip_low, clip_high, clip_c = rl.clip_low, rl.clip_high, rl.clip_c
  kl_coef, estimator, kl_clamp = rl.kl_coef, rl.kl_estimator, rl.kl_clamp
  is_cap, is_mode = rl.is_cap, rl.is_mode
  entropy_coef = rl.entropy_coef
  prox_source = rl.prox
  if prox_source not in PROX_SOURCES:
    raise ValueError(f"rl.prox must be one of {PROX_SOURCES}, got {prox_source!r}")
  # One update per batch: the policy being differentiated is pi_prox itself.
  prox_is_logp = prox_source == "trainer" and rl.updates_per_batch == 1
  if estimator not in KL_ESTIMATORS:
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
  if is_mode not in IS_MODES:
    raise ValueError(f"is_mode must be one of {IS_MODES}, got {is_mode!r}")
  if not (0 <= clip_low < 1 and clip_high >= 0):
    raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
  if clip_c and clip_c <= 1:
    raise ValueError(f"clip_c must exceed 1 (or be 0 to disable), got {clip_c}")

  def loss_fn(logp_BT: jax.Array, entropy_BT: jax.Array, mb: TrainBatch):
    adv_BT = mb.advantages
    prox_BT = jax.lax.stop_gradient(logp_BT if prox_is_logp else mb.prox_logprobs)
    w_BT, truncated_BT = importance_weights(prox_BT, mb.old_logprobs, is_cap, is_mode)
    # Clamp the exponent: padding and masked tokens may hold arbitrary logp
    # differences, and an inf there would turn 0 * inf into NaN gradients.
    ratio_BT = jnp.exp(jnp.clip(logp_BT - prox_BT, -20.0, 20.0))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - clip_low, 1.0 + clip_high)
    pg_BT = jnp.maximum(unclipped_BT, clipped_BT)
    clipfrac_BT = (clipped_BT > unclipped_BT).astype(pg_BT.dtype)
    if clip_c:
      # Dual clip: for A < 0 a huge ratio would make the loss unbounded.
      dual_BT = jnp.minimum(pg_BT, -adv_BT * clip_c)
      clipfrac_BT = jnp.where((adv_BT < 0) & (dual_BT < pg_BT), 1.0, clipfrac_BT)
      pg_BT = jnp.where(adv_BT < 0, dual_BT, pg_BT)
    pg_BT = w_BT * pg_BT
    loss_BT = pg_BT
    extras = {
      "pg_loss": pg_BT,
      "ratio": ratio_BT,
      "clipfrac": clipfrac_BT,
      "is_weight": w_BT,
      "is_truncated": truncated_BT,
      "entropy": entropy_BT,
      **behaviour_drift(prox_BT if prox_source == "trainer" else logp_BT, mb.old_logprobs, is_cap),
    }
    if kl_coef:
      kl_BT = kl_penalty(logp_BT, jax.lax.stop_gradient(mb.ref_logprobs), estimator)
      if kl_clamp > 0:
        kl_BT = jnp.clip(kl_BT, -kl_clamp, kl_clamp)
      loss_BT = loss_BT + kl_coef * kl_BT
      extras["kl"] = kl_BT
    if entropy_coef:
      loss_BT = loss_BT - entropy_coef * entropy_BT
    return loss_BT, jax.tree.map(jax.lax.stop_gradient, extras)

  return loss_fn
