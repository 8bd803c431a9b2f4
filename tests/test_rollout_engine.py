"""The embedded engine in-process: against a plain decode loop and the trainer.

The reference loop re-runs the full (training) forward over the growing
sequence each step and takes the argmax: no cache, no slots, no buckets.
Behaviour logprobs are checked against `Qwen25VL.token_logprobs` over
`pack_row([prompt.extend(response)])`, exactly what the trainer computes.
"""

import numpy as np
import pytest

from fluxjax.models import config, inputs, processor, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout import json_body, protocol, sampling_params
from helpers import reference_greedy, trainer_logprobs

LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_model):
  return tiny_model


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.default()


@pytest.fixture(scope="module")
def engine(model, tok):
  return engine_lib.Engine(
    model, tok, num_slots=4, capacity=96, seed=0, prefill_buckets=(16, 32, 96)
  )


def text_seq(cfg, n, seed):
  ids = np.random.default_rng(seed).integers(0, 490, n)
  return inputs.sequence_from_tokens(ids, [], cfg)


def params(**kw):
  return sampling_params.SamplingParams.from_dict(kw)


def run(engine, seqs, sp, prefix):
  reqs = [engine_lib.EngineRequest(f"{prefix}{i}", s, sp) for i, s in enumerate(seqs)]
  return engine.generate(reqs)


def test_greedy_equals_reference_loop_with_slots_joining_and_leaving(model, engine):
  # Five prompts of different lengths (two buckets) over four slots, with
  # different limits so that requests leave and join between steps.
  seqs = [text_seq(model.cfg, n, i) for i, n in enumerate((5, 12, 20, 3, 30))]
  reqs = [
    engine_lib.EngineRequest(f"g{i}", s, params(max_new_tokens=3 + i, temperature=0))
    for i, s in enumerate(seqs)
  ]
  engine.generate(reqs)
  for i, (r, s) in enumerate(zip(reqs, seqs)):
    assert r.finish_reason == {"type": "length", "length": 3 + i}
    assert r.output_ids == reference_greedy(model, s, 3 + i)


def test_behaviour_logprobs_equal_trainer_logprobs(model, engine):
  seqs = [text_seq(model.cfg, n, 10 + n) for n in (7, 18)]
  sp = params(max_new_tokens=8, temperature=1.0, sampling_seed=5)
  for r, s in zip(run(engine, seqs, sp, "lp"), seqs):
    np.testing.assert_allclose(
      r.output_logprobs, trainer_logprobs(model, s, r.output_ids), atol=LOGPROB_TOL, rtol=0
    )


def test_seeded_sampling_is_reproducible(model, engine):
  seq = text_seq(model.cfg, 9, 3)
  a = run(engine, [seq, seq], params(max_new_tokens=8, sampling_seed=7), "sa")
  b = run(engine, [seq], params(max_new_tokens=8, sampling_seed=7), "sb")
  c = run(engine, [seq], params(max_new_tokens=8, sampling_seed=8), "sc")
  assert a[0].output_ids == a[1].output_ids == b[0].output_ids
  assert c[0].output_ids != a[0].output_ids


def test_top_k_and_top_p_keep_samples_in_the_nucleus(model, engine):
  seq = text_seq(model.cfg, 9, 4)
  logits = np.asarray(model.logits(inputs.pack_row([seq], model.cfg)))[0, -1]
  order = np.argsort(-logits)
  outs = run(engine, [seq] * 4, params(max_new_tokens=1, top_k=3), "tk")
  assert all(r.output_ids[0] in order[:3] for r in outs)
  # top_p tiny: only the argmax survives.
  outs = run(engine, [seq] * 2, params(max_new_tokens=1, top_p=1e-6), "tp")
  assert all(r.output_ids[0] == order[0] for r in outs)


def test_stop_token_and_stop_string(model, engine, tok):
  seq = text_seq(model.cfg, 11, 5)
  full = reference_greedy(model, seq, 6)
  (r,) = run(engine, [seq], params(max_new_tokens=6, temperature=0, stop_token_ids=[full[2]]), "st")
  first = full.index(full[2])
  assert r.output_ids == full[: first + 1]
  assert r.finish_reason == {"type": "stop", "matched": full[2]}
  stop = next(tok.decode([t]) for t in full[1:] if tok.decode([t]).strip())
  (r,) = run(engine, [seq], params(max_new_tokens=6, temperature=0, stop=[stop]), "ss")
  assert r.finish_reason == {"type": "stop", "matched": stop}
  assert stop not in r.finished_text
  assert tok.decode(r.output_ids).startswith(r.finished_text)


def test_image_and_video_prompt_equals_reference(model, engine, tok):
  pcfg = processor.VisionProcessorConfig(video_min_pixels=56 * 56, image_min_pixels=56 * 56)
  rng = np.random.default_rng(0)
  img = processor.preprocess_image(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8), pcfg)
  vid = processor.preprocess_video(
    rng.integers(0, 255, (4, 56, 56, 3), dtype=np.uint8), pcfg, fps=2.0
  )
  messages = [
    {
      "role": "user",
      "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "video"}],
    }
  ]
  seq = inputs.sequence_from_chat(messages, [img, vid], tok, model.cfg)
  assert seq.mrope_delta != 0  # decode positions must continue from the delta
  (r,) = run(engine, [seq], params(max_new_tokens=4, temperature=0), "mm")
  assert r.output_ids == reference_greedy(model, seq, 4)
  np.testing.assert_allclose(
    r.output_logprobs, trainer_logprobs(model, seq, r.output_ids), atol=LOGPROB_TOL, rtol=0
  )


def test_abort_returns_partial_output(model, engine):
  seq = text_seq(model.cfg, 6, 6)
  req = engine.submit(engine_lib.EngineRequest("ab", seq, params(max_new_tokens=50)))
  waiting = engine.submit(engine_lib.EngineRequest("ab-wait", seq, params(max_new_tokens=5)))
  engine.abort("ab-wait")
  for _ in range(3):
    engine.step()
  engine.abort("ab")
  engine.step()
  assert req.finish_reason["type"] == "abort" and 0 < len(req.output_ids) < 50
  assert len(req.output_logprobs) == len(req.output_ids)
  assert waiting.finish_reason["message"] == protocol.ABORT_WAITING
  assert engine.idle()


def test_prompt_longer_than_context_is_rejected(model, engine):
  with pytest.raises(json_body.ProtocolError, match="longer than"):
    engine.submit(engine_lib.EngineRequest("long", text_seq(model.cfg, 96, 0), params()))
  # max_new_tokens is clipped to the context that is left.
  (r,) = run(engine, [text_seq(model.cfg, 90, 1)], params(max_new_tokens=50, temperature=0), "clip")
  assert r.finish_reason == {"type": "length", "length": 6}


def test_update_params_swaps_weights(model, engine, tok):
  seq = text_seq(model.cfg, 8, 8)
  sp = params(max_new_tokens=5, temperature=0)
  before = run(engine, [seq], sp, "w0")[0].output_ids
  other = vlm.create_model(model.cfg, seed=1)
  engine.update_params(other, "v1")
  try:
    after = run(engine, [seq], sp, "w1")[0]
    assert after.output_ids == reference_greedy(other, seq, 5) != before
    assert engine_lib.response(after, tok, engine.weight_version).weight_version == "v1"
  finally:
    engine.update_params(model, "default")


def test_embedded_backend_from_config_and_in_process_publish(model, tok):
  import asyncio

  from fluxjax import config_args
  from fluxjax.rollout import backend as backend_lib
  from fluxjax.rollout import factory, publish

  cfg = config_args.load_config(arg="tiny").rollout
  cfg.backend, cfg.num_slots, cfg.context_length = "embedded", 4, 96
  cfg.num_continuous_decode_steps = 2
  backend, launched = factory.make_backend(cfg, factory.BackendInputs(model=model, tokenizer=tok))
  assert launched is None and backend.engine.num_continuous_decode_steps == 2
  assert isinstance(backend, backend_lib.RolloutBackend)
  ids = [int(i) for i in text_seq(model.cfg, 8, 9).tokens_T]
  body = protocol.GenerateRequest.of(ids, {"max_new_tokens": 4, "temperature": 0})

  async def go():
    async with backend:
      slots0 = backend.slot_stats()
      before = await backend.generate(body)
      slots1 = backend.slot_stats()
      report = publish.publish_in_process([backend], vlm.create_model(model.cfg, seed=2), 5)
      after = await backend.generate(body)
      with pytest.raises(json_body.ProtocolError, match="unknown sampling"):
        protocol.GenerateRequest.of(ids, {"seed": 1})  # refused where it is built
      # The protocol's publish: the original weights back, as version 6.
      restored = await backend.publish(model, 6)
      again = await backend.generate(body)
      return before, report, after, (slots0, slots1), restored, again

  before, report, after, slots, restored, again = asyncio.run(go())
  seq = inputs.sequence_from_tokens(ids, [], model.cfg)
  assert before.output_ids == reference_greedy(model, seq, 4)
  assert before.weight_version == "default" and after.weight_version == "5"
  assert "swap" in report.seconds and after.output_ids != before.output_ids
  assert restored.version == "6" and not restored.failed
  assert again.output_ids == before.output_ids and again.weight_version == "6"
  # The engine's slot counters: a response's first token comes from the
  # prefill, each later one from a decode step, run two to a call.
  assert slots[0].num_slots == 4
  assert slots[1].decode_steps - slots[0].decode_steps == 2 * -(-(len(before.output_ids) - 1) // 2)
  assert backend.metrics() == {}
  cfg.backend = "vllm"
  with pytest.raises(ValueError, match=r"unknown rollout.backend 'vllm'; choose one of \["):
    factory.make_backend(cfg)


def test_continued_response_equals_the_uninterrupted_one(model, tok, tmp_path):
  """A partial rollout resumed from prompt + its tokens (GenerateRequest.continued)
  on an image + text prompt draws the seeded tokens the uninterrupted request
  draws: sampling is keyed by sequence position, and the continuation's
  M-RoPE positions after the image equal the decode loop's."""
  import asyncio

  from PIL import Image

  from fluxjax.rollout.embedded import EmbeddedRollout

  path = str(tmp_path / "img.png")
  rng = np.random.default_rng(3)
  Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(path)
  pcfg = processor.VisionProcessorConfig(image_min_pixels=56 * 56)
  img = processor.preprocess_image(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8), pcfg)
  messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}]
  seq = inputs.sequence_from_chat(messages, [img], tok, model.cfg)
  assert seq.mrope_delta != 0

  def body(max_new):
    return protocol.GenerateRequest.of(
      seq.tokens_T.tolist(),
      {"max_new_tokens": max_new, "sampling_seed": 11, "ignore_eos": True},
      image_data=[path],
    )

  backend = EmbeddedRollout(model, tok, num_slots=4, context_length=192, proc_cfg=pcfg)

  async def go():
    async with backend:
      whole = await backend.generate(body(12))
      head = await backend.generate(body(5))
      tail = await backend.generate(body(12).continued(head.output_ids))
      return whole, head, tail

  whole, head, tail = asyncio.run(go())
  assert len(tail.output_ids) == 7 and tail.prompt_tokens == len(seq) + 5
  joined = head.continued_by(tail, tok.decode(head.output_ids + tail.output_ids))
  assert joined.output_ids == whole.output_ids
  np.testing.assert_allclose(joined.logprobs, whole.logprobs, atol=LOGPROB_TOL, rtol=0)
  assert joined.text == whole.text and joined.prompt_tokens == len(seq)
  with pytest.raises(ValueError, match="already reaches"):
    body(5).continued(head.output_ids)


def test_logit_bias_bans_and_forces_tokens(model, engine):
  """SGLang's logit_bias: -100 keeps a token out, +100 forces it (its logprob
  then ~0: the logprob is under the biased distribution it was drawn from)."""
  seq = text_seq(model.cfg, 7, 21)
  (free,) = run(engine, [seq], params(max_new_tokens=6, temperature=0), "lb0")
  banned = {str(t): -100.0 for t in set(free.output_ids)}
  (ban,) = run(engine, [seq], params(max_new_tokens=6, temperature=0, logit_bias=banned), "lb1")
  assert not set(ban.output_ids) & set(free.output_ids)
  sp = params(max_new_tokens=5, sampling_seed=3, logit_bias={"17": 100.0})
  (forced,) = run(engine, [seq], sp, "lb2")
  assert forced.output_ids == [17] * 5
  np.testing.assert_allclose(forced.output_logprobs, 0.0, atol=1e-4)
  too_many = {str(i): -1.0 for i in range(engine.max_logit_bias + 1)}
  with pytest.raises(json_body.ProtocolError, match="at most"):
    engine.submit(engine_lib.EngineRequest("lb3", seq, params(logit_bias=too_many)))
  with pytest.raises(json_body.ProtocolError, match="vocab_size"):
    engine.submit(engine_lib.EngineRequest("lb4", seq, params(logit_bias={"100000": 1.0})))
  for bad in ({"x": 1.0}, {"-1": 1.0}, {"3": "big"}, [1, 2]):
    with pytest.raises(json_body.ProtocolError, match="logit_bias"):
      params(logit_bias=bad)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_cache_keeps_each_write_exactly_and_writes_in_place(dtype):
  """Tokens and prompts written to the cache read back as the values cast to
  the compute dtype, other entries untouched; a bf16 decode step compiles
  with no conversion of the whole cache (XLA:CPU's bf16 writes made one per
  layer and step)."""
  import jax
  import jax.numpy as jnp

  from fluxjax.models import decode

  m = vlm.create_model(config.preset("tiny", dtype=dtype), seed=0)
  cache = decode.init_cache(m, 3, 32)
  rng = np.random.default_rng(0)
  k_SKH, v_SKH = (jnp.asarray(rng.normal(size=(3, 2, 16)), jnp.float32) for _ in range(2))
  lengths_S = jnp.asarray([0, 5, 31])
  cache = cache.write_tokens(1, lengths_S, k_SKH, v_SKH)
  k_1PKH = jnp.asarray(rng.normal(size=(1, 4, 2, 16)), jnp.float32)
  cache = cache.write_prompt(0, 2, k_1PKH, k_1PKH)
  keys, values = cache.keys(1, 3, 32), cache.values(1, 3, 32)
  assert keys.dtype == jnp.dtype(dtype)
  for s, n in enumerate([0, 5, 31]):
    np.testing.assert_array_equal(keys[s, :, n], k_SKH[s].astype(dtype))
    np.testing.assert_array_equal(values[s, :, n], v_SKH[s].astype(dtype))
  assert int((keys != 0).any(axis=(1, 3)).sum()) == 3  # nothing else written in layer 1
  want_KPH = k_1PKH[0].transpose(1, 0, 2).astype(dtype)
  np.testing.assert_array_equal(cache.keys(0, 3, 32)[2, :, :4], want_KPH)
  assert not bool(cache.keys(0, 2, 32).any())

  # The write scatters whole head-dim rows: slot, kv head and cache index all
  # indexed (a window dim between them made XLA:GPU transpose the whole cache).
  write = jax.jit(decode.KVCache.write_tokens).lower(cache, 1, lengths_S, k_SKH, v_SKH)
  dims = [line for line in write.as_text().splitlines() if "stablehlo.scatter" in line]
  assert len(dims) == 2 and all("update_window_dims = [2]" in d for d in dims), dims
  assert all("scatter_dims_to_operand_dims = [0, 1, 2, 3]" in d for d in dims), dims

  step = jax.jit(decode.decode_step, static_argnames="window", donate_argnums=1)
  hlo = step.lower(m, cache, lengths_S, lengths_S, lengths_S, window=16).compile().as_text()
  whole = ",".join(map(str, decode.cache_shape(m, 3, 32)))
  assert not [line for line in hlo.splitlines() if f"f32[{whole}]" in line]


def test_a_decode_window_reads_only_what_it_must(model):
  """decode_step over the first `window` cache entries equals the step over
  the whole capacity while every slot's length is inside the window, and
  leaves the same cache (the write goes to the full cache either way)."""
  import jax
  import jax.numpy as jnp

  from fluxjax.models import decode

  cache = decode.init_cache(model, 3, 64)
  rng = np.random.default_rng(0)
  cache = decode.KVCache.from_values(
    *(jnp.asarray(rng.normal(size=a.shape), cache.dtype) for a in (cache.k_LSKCH, cache.v_LSKCH))
  )
  tokens_S = jnp.asarray([5, 9, 11], jnp.int32)
  lengths_S = jnp.asarray([3, 15, 0], jnp.int32)
  step = jax.jit(decode.decode_step, static_argnames="window")
  full, full_cache = step(model, cache, tokens_S, lengths_S, lengths_S)
  windowed, windowed_cache = step(model, cache, tokens_S, lengths_S, lengths_S, window=16)
  np.testing.assert_allclose(np.asarray(windowed), np.asarray(full), atol=1e-5, rtol=1e-5)
  # The same entries written: layer 0's exactly (from the embeddings), the
  # next layer's up to the summation order of attention over 16 or 64 keys.
  for got, want in (
    (windowed_cache.k_LSKCH, full_cache.k_LSKCH),
    (windowed_cache.v_LSKCH, full_cache.v_LSKCH),
  ):
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
    values = [np.asarray(jax.lax.bitcast_convert_type(a, cache.dtype)) for a in (got, want)]
    np.testing.assert_allclose(*values, rtol=1e-6, atol=1e-6)
  # A window that misses a slot's keys changes its logits: the test can fail.
  short, _ = step(model, cache, tokens_S, lengths_S, lengths_S, window=4)
  assert not np.allclose(np.asarray(short)[1], np.asarray(full)[1], atol=1e-3)


def test_a_decode_step_over_the_first_slots_leaves_the_others_alone(model):
  """decode_step fed the first S slots' tokens gives their rows of the step
  over every slot and writes nothing into the slots past S."""
  import jax
  import jax.numpy as jnp

  from fluxjax.models import decode

  cache = decode.init_cache(model, 4, 32)
  rng = np.random.default_rng(1)
  cache = decode.KVCache.from_values(
    *(jnp.asarray(rng.normal(size=a.shape), cache.dtype) for a in (cache.k_LSKCH, cache.v_LSKCH))
  )
  tokens_S = jnp.asarray([5, 9, 11, 7], jnp.int32)
  lengths_S = jnp.asarray([3, 15, 0, 20], jnp.int32)
  step = jax.jit(decode.decode_step)
  full, full_cache = step(model, cache, tokens_S, lengths_S, lengths_S)
  first, first_cache = step(model, cache, tokens_S[:2], lengths_S[:2], lengths_S[:2])
  assert first.shape[0] == 2
  np.testing.assert_allclose(np.asarray(first), np.asarray(full)[:2], atol=1e-5, rtol=1e-5)
  for got, whole, before in [
    (first_cache.k_LSKCH, full_cache.k_LSKCH, cache.k_LSKCH),
    (first_cache.v_LSKCH, full_cache.v_LSKCH, cache.v_LSKCH),
  ]:
    np.testing.assert_array_equal(np.asarray(got)[:, :2], np.asarray(whole)[:, :2])
    np.testing.assert_array_equal(np.asarray(got)[:, 2:], np.asarray(before)[:, 2:])
    assert not np.array_equal(np.asarray(whole)[:, 2:], np.asarray(before)[:, 2:])


def test_several_decode_steps_per_call_give_what_one_step_gives(model, tok):
  # Seven requests over three slots, so that requests join between calls
  # after others stopped inside one: sampled and greedy, ending on a length,
  # on a stop token and on a stop string inside a call, one filling its slot.
  seqs = [text_seq(model.cfg, n, 20 + i) for i, n in enumerate((5, 9, 14, 30, 7, 11, 4))]
  base = [
    dict(max_new_tokens=8, temperature=1.0, sampling_seed=1),
    dict(max_new_tokens=12, temperature=0),
    dict(max_new_tokens=14, temperature=0.8, top_p=0.9, sampling_seed=2),
    dict(temperature=1.0, sampling_seed=3),  # max_new: the capacity left, 18
    dict(max_new_tokens=10, temperature=1.0, sampling_seed=4, logit_bias={"7": 2.0}),
    dict(max_new_tokens=16, temperature=1.0, sampling_seed=5, ignore_eos=True),
    dict(max_new_tokens=16, temperature=1.0, sampling_seed=6, ignore_eos=True),
  ]

  def generate(steps, kws):
    eng = engine_lib.Engine(
      model,
      tok,
      num_slots=3,
      capacity=48,
      prefill_buckets=(16, 48),
      num_continuous_decode_steps=steps,
    )
    reqs = [
      engine_lib.EngineRequest(f"k{i}", s, params(**kw)) for i, (s, kw) in enumerate(zip(seqs, kws))
    ]
    return eng.generate(reqs), eng.stats

  probe, _ = generate(1, base)
  base[5]["stop_token_ids"] = [probe[5].output_ids[5]]
  base[6]["stop"] = [
    next(tok.decode([t]) for t in probe[6].output_ids[4:] if tok.decode([t]).strip())
  ]
  (one, one_stats), (three, three_stats) = generate(1, base), generate(3, base)
  assert one[5].finish_reason["type"] == one[6].finish_reason["type"] == "stop"
  assert len(one[3].output_ids) == 18
  for a, b in zip(one, three):
    assert (a.output_ids, a.finish_reason, a.finished_text) == (
      b.output_ids,
      b.finish_reason,
      b.finished_text,
    )
    np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5, rtol=0)
  assert three_stats["decode_steps"] % 3 == 0  # whole calls of 3 steps
  assert three_stats["decode_steps"] / 3 < one_stats["decode_steps"] / 2  # calls


@pytest.mark.parametrize("steps", [1, 3])
def test_a_decode_step_floor_slows_each_step_and_changes_no_token(model, tok, steps):
  # The emulated memory-bound step (--min-decode-step-ms): every decode step
  # lasts at least the floor, whatever the slots it runs, and the tokens and
  # log-probs are the unfloored engine's.
  seqs = [text_seq(model.cfg, n, 40 + n) for n in (5, 9)]
  kws = [
    dict(max_new_tokens=7, temperature=1.0, sampling_seed=1),
    dict(max_new_tokens=3, temperature=0),
  ]

  def generate(floor_s):
    eng = engine_lib.Engine(
      model,
      tok,
      num_slots=2,
      capacity=32,
      prefill_buckets=(16,),
      num_continuous_decode_steps=steps,
      min_decode_step_s=floor_s,
    )
    out = []
    for round_ in range(2):  # the first compiles; the second is timed
      before = dict(eng.stats)
      reqs = [
        engine_lib.EngineRequest(f"f{round_}-{i}", q, params(**kw))
        for i, (q, kw) in enumerate(zip(seqs, kws))
      ]
      out = eng.generate(reqs)
    return out, {k: eng.stats[k] - before[k] for k in ("decode_s", "decode_steps")}

  (plain, plain_stats), (floored, stats) = generate(0.0), generate(0.04)
  for a, b in zip(plain, floored):
    assert a.output_ids == b.output_ids
    np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-6, rtol=0)
  assert stats["decode_steps"] == plain_stats["decode_steps"] >= 6  # the 7-token request's
  assert stats["decode_s"] >= 0.04 * stats["decode_steps"]
  with pytest.raises(ValueError, match="min_decode_step_s must be >= 0"):
    engine_lib.Engine(model, tok, num_slots=2, capacity=32, min_decode_step_s=-0.01)


def test_a_slot_writes_no_cache_entry_past_its_last_fed_token(model, tok):
  # 8 prompt tokens (one bucket, no padding) and 6 new ones in calls of 4
  # steps: the second call has one step to run; the 5 fed tokens' entries
  # end at index 12, and the call's other steps write nothing past it.
  eng = engine_lib.Engine(
    model, tok, num_slots=1, capacity=32, prefill_buckets=(8, 32), num_continuous_decode_steps=4
  )
  run(eng, [text_seq(model.cfg, 8, 1)], params(max_new_tokens=6, temperature=0), "w")
  keys_C = np.asarray(eng._cache.k_LSKCH)[0, 0, 0, :, 0]
  assert (keys_C[:13] != 0).all() and (keys_C[13:] == 0).all()
