"""Remat policies: every one gives the reference gradients and recomputes
what it says it does."""

import jax
import numpy as np
import pytest
from flax import nnx

from fluxjax.models import config as config_lib
from fluxjax.models import layers, vlm


def _dot_count(jaxpr) -> int:
  """dot_general equations in a jaxpr, sub-jaxprs (scan, remat) included."""
  n = 0
  for eqn in jaxpr.eqns:
    n += eqn.primitive.name == "dot_general"
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if hasattr(sub, "eqns"):
          n += _dot_count(sub)
        elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
          n += _dot_count(sub.jaxpr)
  return n


def _text_batch(cfg):
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.text.vocab_size, size=(2, 12))
  mask = np.ones_like(tokens)
  positions = np.broadcast_to(np.arange(12), (3, 2, 12))
  return vlm.padded_inputs(tokens, mask, positions)


def _grads_and_dots(remat: str):
  cfg = config_lib.preset("tiny").replace(remat=remat, attention_backend="xla")
  model = vlm.create_model(cfg, seed=0)
  batch = _text_batch(cfg)

  def loss(model):
    return (model(batch).astype("float32") ** 2).mean()

  grads = nnx.grad(loss)(model)
  jaxpr = jax.make_jaxpr(lambda m: nnx.grad(loss)(m))(model).jaxpr
  return jax.tree.leaves(nnx.state(grads)), _dot_count(jaxpr)


def test_every_policy_gives_the_reference_gradients_and_recomputes_less_than_full():
  reference, dots = {}, {}
  for policy in layers.REMAT_POLICIES:
    grads, dots[policy] = _grads_and_dots(policy)
    reference.setdefault("none", grads)
    for got, want in zip(grads, reference["none"], strict=True):
      np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-7, err_msg=policy)
  # Saving the projections recomputes only attention's own dots; full
  # recomputes every forward dot; none recomputes nothing.
  assert dots["none"] < dots["save_dots"] < dots["full"], dots
  assert dots["save_dots_attention"] < dots["save_dots"], dots  # attention output kept


def test_an_unknown_policy_is_refused_by_name():
  with pytest.raises(ValueError, match=r"model.remat 'dots'.*save_dots"):
    config_lib.preset("tiny").replace(remat="dots")
