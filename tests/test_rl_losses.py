"""PPO clip, decoupled importance weights and KL against hand-computed values."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fluxjax import config_args
from fluxjax.parallel.batch import TrainBatch
from fluxjax.rl import losses


def _batch(adv, prox, old, ref=None):
  f = lambda x: jnp.asarray([x], jnp.float32)
  n = len(adv)
  return TrainBatch(
    inputs=None,
    targets=None,
    loss_mask=jnp.ones((1, n)),
    advantages=f(adv),
    old_logprobs=f(old),
    ref_logprobs=f(ref if ref is not None else [0.0] * n),
    prox_logprobs=f(prox),
  )


def _cfg(**overrides):
  cfg = config_args.load_config(arg="tiny").rl
  # These tests give pi_prox explicitly: with several updates per batch the
  # trainer's pi_prox is read from the batch (the stream trainer fills it).
  cfg.prox, cfg.updates_per_batch = "trainer", 2
  cfg.update(overrides)
  return cfg


# Six tokens, prox logprob -1 everywhere, clip_low 0.2, clip_high 0.28, is_cap 2:
#   t  A   ratio = exp(logp - prox)  w = exp(prox - old)
#   0  1   1.1                       1
#   1  1   1.5                       1
#   2 -1   0.5                       1
#   3 -1   1.5                       1
#   4  2   1.0                       3 -> truncated to 2
#   5  2   1.0                       1.5
ADV = [1.0, 1.0, -1.0, -1.0, 2.0, 2.0]
RATIO = [1.1, 1.5, 0.5, 1.5, 1.0, 1.0]
W_RAW = [1.0, 1.0, 1.0, 1.0, 3.0, 1.5]
PROX = [-1.0] * 6
LOGP = [-1.0 + math.log(r) for r in RATIO]
OLD = [-1.0 - math.log(w) for w in W_RAW]


def _run(cfg, logp=LOGP, entropy=None, ref=None):
  loss_fn = losses.make_loss_fn(cfg)
  mb = _batch(ADV, PROX, OLD, ref)
  logp = jnp.asarray([logp], jnp.float32)
  ent = jnp.asarray([entropy if entropy is not None else [0.0] * len(ADV)], jnp.float32)
  return loss_fn(logp, ent, mb)


def test_clip_surrogate_and_importance_weights():
  loss, m = _run(_cfg())
  # pg = w * max(-A r, -A clip(r, 0.8, 1.28)):
  #   t0: max(-1.1, -1.1)        = -1.1   (inside the trust region)
  #   t1: max(-1.5, -1.28)       = -1.28  (clipped above)
  #   t2: max(0.5, 0.8)          =  0.8   (clipped below, A < 0)
  #   t3: max(1.5, 1.28)         =  1.5   (A < 0 and ratio high: not clipped)
  #   t4: 2 * max(-2, -2)        = -4.0   (w = min(3, 2) = 2)
  #   t5: 1.5 * max(-2, -2)      = -3.0
  np.testing.assert_allclose(loss[0], [-1.1, -1.28, 0.8, 1.5, -4.0, -3.0], rtol=1e-5)
  np.testing.assert_allclose(m["clipfrac"][0], [0, 1, 1, 0, 0, 0])
  np.testing.assert_allclose(m["ratio"][0], RATIO, rtol=1e-5)
  np.testing.assert_allclose(m["is_weight"][0], [1, 1, 1, 1, 2, 1.5], rtol=1e-5)
  np.testing.assert_allclose(m["is_truncated"][0], [0, 0, 0, 0, 1, 0])
  # The staleness signal's weights: here the same truncated weights.
  np.testing.assert_allclose(m["behaviour_w"][0], [1, 1, 1, 1, 2, 1.5], rtol=1e-5)
  np.testing.assert_allclose(m["behaviour_w_sq"][0], [1, 1, 1, 1, 4, 2.25], rtol=1e-5)
  # k3 of KL(mu || prox) with r = w_raw: r - 1 - ln r;
  #   t4: 3 - 1 - 1.0986123 = 0.9013877; t5: 1.5 - 1 - 0.4054651 = 0.0945349.
  np.testing.assert_allclose(m["behaviour_kl"][0], [0, 0, 0, 0, 0.9013877, 0.0945349], atol=1e-6)
  assert "kl" not in m  # kl_coef = 0: no reference needed


def test_raw_weight_histogram_whatever_the_mode():
  # W_RAW: four tokens at 1, one at 3 (truncated or masked), one at 1.5.
  want = {"is_weight_0.95_1.05": [1, 1, 1, 1, 0, 0], "is_weight_1.25_2": [0, 0, 0, 0, 0, 1]}
  want["is_weight_ge_2"] = [0, 0, 0, 0, 1, 0]
  names = [name for name, _, _ in losses.is_weight_bins()]
  for mode in losses.IS_MODES:
    _, m = _run(_cfg(is_mode=mode))
    for name in names:
      np.testing.assert_array_equal(m[name][0], want.get(name, [0] * 6), err_msg=(mode, name))
  # One value inside each bin lands in that bin alone, bins in order.
  inside = [0.3, 0.6, 0.9, 1.0, 1.1, 1.5, 4.0]
  hist = losses.is_weight_histogram(jnp.log(jnp.asarray(inside)))
  np.testing.assert_array_equal(np.stack([hist[n] for n in names]), np.eye(len(names)))


def test_clip_gradient_is_zero_where_clipped():
  loss_fn = losses.make_loss_fn(_cfg())
  mb = _batch(ADV, PROX, OLD)
  grad = jax.grad(lambda lp: loss_fn(lp, jnp.zeros_like(lp), mb)[0].sum())(
    jnp.asarray([LOGP], jnp.float32)
  )
  # d pg / d logp = -w A r on the unclipped branch, 0 on the clipped one:
  #   t0: -1.1; t1: 0 (clipped); t2: 0 (clipped); t3: +1.5; t4: -2*2*1 = -4; t5: -1.5*2 = -3.
  np.testing.assert_allclose(grad[0], [-1.1, 0.0, 0.0, 1.5, -4.0, -3.0], rtol=1e-5)


def test_importance_weight_has_no_gradient():
  loss_fn = losses.make_loss_fn(_cfg())

  def f(prox):
    mb = _batch(ADV, [0.0] * 6, OLD)
    mb.prox_logprobs = prox
    return loss_fn(jnp.asarray([LOGP]), jnp.zeros((1, 6)), mb)[0].sum()

  np.testing.assert_array_equal(jax.grad(f)(jnp.asarray([PROX], jnp.float32)), 0.0)


def test_staleness_signal_whatever_the_correction():
  """behaviour_kl and behaviour_w measure the trainer's drift from mu in every
  mode: masked or uncorrected weights, and coupled PPO (prox = "batch" with
  the batch's prox = mu, w = 1), where pi_t is the policy being differentiated."""
  r = np.asarray(W_RAW)
  k3 = r - 1 - np.log(r)
  for mode in losses.IS_MODES:
    _, m = _run(_cfg(is_mode=mode))
    np.testing.assert_allclose(m["behaviour_w"][0], np.minimum(r, 2.0), rtol=1e-5, err_msg=mode)
    np.testing.assert_allclose(m["behaviour_kl"][0], k3, atol=1e-6, err_msg=mode)
  loss_fn = losses.make_loss_fn(_cfg(prox="batch", updates_per_batch=1))
  _, m = loss_fn(jnp.asarray([LOGP]), jnp.zeros((1, 6)), _batch(ADV, OLD, OLD))
  np.testing.assert_allclose(m["is_weight"][0], 1.0)
  r_t = np.exp(np.asarray(LOGP) - np.asarray(OLD))  # ratio * w_raw
  np.testing.assert_allclose(m["behaviour_w"][0], np.minimum(r_t, 2.0), rtol=1e-5)
  np.testing.assert_allclose(m["behaviour_kl"][0], r_t - 1 - np.log(r_t), rtol=1e-5, atol=1e-6)


def test_is_mask_and_off_modes_and_no_cap():
  loss, m = _run(_cfg(is_mode="mask"))
  # Token 4's weight 3 exceeds the cap 2: it is dropped (w = 0), not truncated.
  np.testing.assert_allclose(loss[0], [-1.1, -1.28, 0.8, 1.5, 0.0, -3.0], rtol=1e-5)
  # Off: w = 1 everywhere, the stale tokens 4 and 5 weigh as fresh ones; the
  # behaviour KL still reports how stale they are.
  loss, m = _run(_cfg(is_mode="off"))
  np.testing.assert_allclose(loss[0], [-1.1, -1.28, 0.8, 1.5, -2.0, -2.0], rtol=1e-5)
  np.testing.assert_allclose(m["is_weight"][0], 1.0)
  np.testing.assert_allclose(m["is_truncated"][0], 0.0)
  assert float(m["behaviour_kl"][0][4]) > 0.9
  loss, m = _run(_cfg(is_cap=0.0))
  # No cap: t4 = 3 * -2 = -6.
  np.testing.assert_allclose(loss[0][4], -6.0, rtol=1e-5)
  np.testing.assert_allclose(m["is_truncated"][0], 0.0)


def test_symmetric_clip_and_dual_clip():
  loss, _ = _run(_cfg(clip_high=0.2))
  # t1 now clips at 1.2: max(-1.5, -1.2) = -1.2.
  np.testing.assert_allclose(loss[0][1], -1.2, rtol=1e-5)
  loss, m = _run(
    _cfg(clip_c=3.0), logp=[LOGP[0], LOGP[1], LOGP[2], -1.0 + math.log(5.0), LOGP[4], LOGP[5]]
  )
  # t3: A = -1, ratio 5: max(5, 1.28) = 5, dual clip min(5, -A * 3) = 3.
  np.testing.assert_allclose(loss[0][3], 3.0, rtol=1e-5)
  assert m["clipfrac"][0][3] == 1.0


@pytest.mark.parametrize(
  "estimator,want_kl,want_grad",
  [
    # logp = -1, ref = -2 (t0) and logp = -2, ref = -1 (t1):
    # k1 = logp - ref = (1, -1); d/dlogp = 1.
    ("k1", [1.0, -1.0], [1.0, 1.0]),
    # k3 = e^(ref - logp) - (ref - logp) - 1:
    #   t0: e^-1 + 1 - 1 = 0.3678794;  t1: e^1 - 1 - 1 = 0.7182818.
    # d/dlogp = 1 - e^(ref - logp): t0: 1 - 0.3678794 = 0.6321206; t1: 1 - e = -1.7182818.
    ("k3", [0.3678794, 0.7182818], [0.6321206, -1.7182818]),
  ],
)
def test_kl_estimators(estimator, want_kl, want_grad):
  cfg = _cfg(kl_coef=0.1, kl_estimator=estimator)
  loss_fn = losses.make_loss_fn(cfg)
  # A = 0 isolates the KL term.
  mb = _batch([0.0, 0.0], [-1.0, -2.0], [-1.0, -2.0], ref=[-2.0, -1.0])
  logp = jnp.asarray([[-1.0, -2.0]])
  loss, m = loss_fn(logp, jnp.zeros((1, 2)), mb)
  np.testing.assert_allclose(m["kl"][0], want_kl, rtol=1e-5)
  np.testing.assert_allclose(loss[0], 0.1 * np.asarray(want_kl), rtol=1e-5)
  grad = jax.grad(lambda lp: loss_fn(lp, jnp.zeros((1, 2)), mb)[0].sum())(logp)
  np.testing.assert_allclose(grad[0], 0.1 * np.asarray(want_grad), rtol=1e-5)


def test_kl_clamp():
  cfg = _cfg(kl_coef=1.0, kl_estimator="k1", kl_clamp=10.0)
  mb = _batch([0.0], [-1.0], [-1.0], ref=[-30.0])
  # k1 = -1 - (-30) = 29, clamped to 10.
  _, m = losses.make_loss_fn(cfg)(jnp.asarray([[-1.0]]), jnp.zeros((1, 1)), mb)
  np.testing.assert_allclose(m["kl"][0], [10.0])


def test_entropy_bonus_and_metric():
  ent = [0.5, 1.0, 0.0, 0.0, 2.0, 0.0]
  base, _ = _run(_cfg())
  loss, m = _run(_cfg(entropy_coef=0.01), entropy=ent)
  np.testing.assert_allclose(m["entropy"][0], ent)
  # loss = pg - 0.01 * entropy: t0: -1.1 - 0.005; t4: -4 - 0.02.
  np.testing.assert_allclose(loss[0] - base[0], [-0.005, -0.01, 0, 0, -0.02, 0], atol=1e-6)


def test_jits_and_rejects_bad_config():
  loss_fn = jax.jit(losses.make_loss_fn(_cfg(kl_coef=0.05)))
  loss, m = loss_fn(jnp.asarray([LOGP]), jnp.zeros((1, 6)), _batch(ADV, PROX, OLD, [-1.0] * 6))
  assert loss.shape == (1, 6) and all(v.shape == (1, 6) for v in m.values())
  for bad in ({"kl_estimator": "k2"}, {"is_mode": "clip"}, {"clip_low": 1.0}, {"clip_c": 0.5}):
    with pytest.raises(ValueError):
      losses.make_loss_fn(_cfg(**bad))


def test_trainer_prox_takes_the_current_policy():
  """prox = "trainer": ratio 1 at the current policy, w = pi / mu (truncated)."""
  logp = jnp.array([[-1.0, -0.5, -2.0]])
  old = jnp.array([[-1.2, -0.5, -3.0]])
  mb = _batch([1.0, -1.0, 1.0], [-9.0, -9.0, -9.0], [-1.2, -0.5, -3.0])  # batch prox ignored
  loss, extras = losses.make_loss_fn(_cfg(updates_per_batch=1))(logp, jnp.zeros_like(logp), mb)
  w = np.minimum(np.exp(np.asarray(logp - old)), 2.0)
  np.testing.assert_allclose(extras["ratio"], 1.0)
  np.testing.assert_allclose(extras["is_weight"], w, rtol=1e-6)
  np.testing.assert_allclose(extras["behaviour_w"], w, rtol=1e-6)
  np.testing.assert_allclose(loss, -np.asarray(mb.advantages) * w, rtol=1e-6)
  with pytest.raises(ValueError, match=r"rl\.prox"):
    losses.make_loss_fn(_cfg(prox="nope"))


@pytest.mark.parametrize("field", ["clip_c", "kl_clamp", "is_mode", "prox"])
def test_settings_come_only_from_the_config_section(field):
  """The config file holds the only defaults: a field missing from the section
  is an error, not a silent default of the loss's own."""
  cfg = _cfg()
  del cfg[field]
  with pytest.raises((AttributeError, KeyError), match=field):
    losses.make_loss_fn(cfg)
