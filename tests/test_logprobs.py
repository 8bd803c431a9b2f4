"""Chunked target-token logprobs: equal to the naive path, never [T, V] in memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fluxjax.models import config as config_lib
from fluxjax.models import logprobs, vlm


def _inputs(b=2, t=37, d=24, v=1000, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  hidden = jax.random.normal(k1, (b, t, d), jnp.float32)
  head = jax.random.normal(k2, (d, v), jnp.float32) * 0.5
  targets = jax.random.randint(k3, (b, t), 0, v)
  return hidden, targets, head


@pytest.mark.parametrize("chunk", [1000, 256, 300, 7])  # divides V, does not, tiny
def test_chunked_equals_naive(chunk):
  hidden, targets, head = _inputs()
  lp, ent = logprobs.token_logprobs(hidden, targets, head, chunk=chunk, with_entropy=True)
  lp_ref, ent_ref = logprobs.naive_token_logprobs(hidden, targets, head, with_entropy=True)
  np.testing.assert_allclose(lp, lp_ref, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ent, ent_ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_temperature_divides_the_logits(temperature):
  """log softmax(logits / T): the sampler's logprobs at T, entropy of that distribution."""
  hidden, targets, head = _inputs(seed=2)
  lp, ent = logprobs.token_logprobs(
    hidden, targets, head, chunk=300, with_entropy=True, temperature=temperature
  )
  logits = jnp.einsum("btd,dv->btv", hidden, head)
  want_all = jax.nn.log_softmax(logits / temperature, axis=-1)
  want = jnp.take_along_axis(want_all, targets[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(lp, want, atol=1e-5, rtol=0)
  np.testing.assert_allclose(ent, -(jnp.exp(want_all) * want_all).sum(-1), atol=1e-4, rtol=0)
  assert (
    np.abs(np.asarray(lp) - np.asarray(logprobs.token_logprobs(hidden, targets, head))).max() > 1e-2
  )
  with pytest.raises(ValueError, match="temperature must be > 0"):
    logprobs.token_logprobs(hidden, targets, head, temperature=0.0)


def test_gradients_equal_naive():
  hidden, targets, head = _inputs(seed=1)
  weights = jax.random.normal(jax.random.key(9), targets.shape)

  def loss(fn, h, w):
    return (fn(h, targets, w) * weights).sum()

  chunked = lambda h, t, w: logprobs.token_logprobs(h, t, w, chunk=128)
  g = jax.grad(lambda h, w: loss(chunked, h, w), argnums=(0, 1))(hidden, head)
  g_ref = jax.grad(lambda h, w: loss(logprobs.naive_token_logprobs, h, w), argnums=(0, 1))(
    hidden, head
  )
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def _all_avals(jaxpr):
  """Every intermediate shape in a jaxpr, sub-jaxprs (scan, remat) included."""
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      yield var.aval
    for param in eqn.params.values():
      subs = param if isinstance(param, (list, tuple)) else [param]
      for sub in subs:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          yield from _all_avals(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          yield from _all_avals(sub)


def test_never_materializes_full_logits():
  """Forward and backward hold at most [N, chunk] logits, never [N, V]."""
  b, t, d, v, chunk = 2, 64, 16, 4096, 256
  hidden, targets, head = _inputs(b, t, d, v)

  def loss(h, w):
    return logprobs.token_logprobs(h, targets, w, chunk=chunk, with_entropy=True)[0].sum()

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(hidden, head).jaxpr
  sizes = [int(np.prod(a.shape)) for a in _all_avals(jaxpr) if hasattr(a, "shape")]
  assert max(sizes) < b * t * v // 4, f"largest intermediate {max(sizes)} ~ full logits"
  assert max(sizes) >= b * t * chunk  # the chunk itself is there: the check can see it
  # And the naive path does build it, so the check would catch a regression.
  naive = jax.make_jaxpr(jax.grad(lambda h: logprobs.naive_token_logprobs(h, targets, head).sum()))(
    hidden
  ).jaxpr
  assert max(int(np.prod(a.shape)) for a in _all_avals(naive)) >= b * t * v


def test_model_token_logprobs_match_full_logits():
  cfg = config_lib.preset("tiny", logprob_vocab_chunk=100)
  model = vlm.create_model(cfg, seed=3)
  t = 20
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 490, (2, t)).astype(np.int32)
  batch = vlm.PackedInputs(
    tokens,
    np.tile(np.arange(t), (3, 2, 1)).astype(np.int32),
    np.ones((2, t), np.int32),
    np.tile(np.arange(t), (2, 1)).astype(np.int32),
  )
  targets = np.roll(tokens, -1, axis=1)
  lp, ent = model.token_logprobs(batch, targets, with_entropy=True)
  full = jax.nn.log_softmax(model.logits(batch), axis=-1)
  np.testing.assert_allclose(
    lp, np.take_along_axis(full, targets[..., None], -1)[..., 0], atol=1e-5, rtol=0
  )
  np.testing.assert_allclose(ent, -(jnp.exp(full) * full).sum(-1), atol=1e-5, rtol=0)
