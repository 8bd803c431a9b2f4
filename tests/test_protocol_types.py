"""The typed request and response: JSON only at the HTTP edge, read back whole."""

import dataclasses

import hypothesis
import pytest
from hypothesis import strategies as st

from fluxjax.rollout import json_body, protocol, sampling_params
from fluxjax.rollout.protocol import Completion, GenerateRequest
from fluxjax.rollout.sampling_params import SamplingParams

ids = st.lists(st.integers(0, sampling_params.MAX_TOKEN_ID), min_size=1, max_size=8)
sampling = st.fixed_dictionaries(
  {},
  optional={
    "max_new_tokens": st.one_of(st.none(), st.integers(0, 4096)),
    "temperature": st.sampled_from([0.0, 0.5, 1.0, 1.3]),
    "top_p": st.sampled_from([0.1, 0.9, 1.0]),
    "top_k": st.sampled_from([-1, 1, 5]),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 1000), max_size=3),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "no_stop_trim": st.booleans(),
    "sampling_seed": st.integers(0, sampling_params.SEED_LIMIT - 1),
    "logit_bias": st.dictionaries(st.integers(0, 1000).map(str), st.floats(-100, 100), max_size=3),
  },
)


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
  ids=ids,
  sampling=sampling,
  images=st.lists(st.text(min_size=1, max_size=4), max_size=2),
  logprob=st.booleans(),
)
def test_a_request_reads_back_from_its_body(ids, sampling, images, logprob):
  """What the client sends is what the server parses: `parse_generate` of
  `to_body` is the request, whether max_new_tokens was given, null or absent."""
  request = GenerateRequest.of(ids, sampling, image_data=images, return_logprob=logprob)
  (parsed,), batched = protocol.parse_generate(request.to_body())
  assert not batched and parsed == request
  assert SamplingParams.from_dict(request.sampling.to_dict()) == request.sampling


def test_a_continued_request_asks_for_the_rest():
  request = GenerateRequest.of([1, 2], {"max_new_tokens": 10, "sampling_seed": 3}, rid="a")
  rest = request.continued([7, 8, 9])
  assert rest.input_ids == [1, 2, 7, 8, 9] and rest.rid == "a"
  assert rest.sampling.max_new_tokens == rest.requested_max_new_tokens == 7
  assert rest.sampling.sampling_seed == 3 and request.input_ids == [1, 2]
  unbounded = GenerateRequest.of([1], {"max_new_tokens": None}).continued([5])
  assert unbounded.sampling.max_new_tokens is None and unbounded.input_ids == [1, 5]
  with pytest.raises(ValueError, match="already reaches"):
    request.continued(list(range(10)))
  text = dataclasses.replace(request, input_ids=None, text="hi")
  with pytest.raises(ValueError, match="input_ids"):
    text.continued([1])


def test_a_request_is_refused_where_it_is_built():
  with pytest.raises(json_body.ProtocolError, match="unknown sampling"):
    GenerateRequest.of([1], {"seed": 1})
  with pytest.raises(json_body.ProtocolError, match="input_ids"):
    GenerateRequest.of([], {})
  with pytest.raises(json_body.ProtocolError, match="top_p"):
    GenerateRequest.of([1], {"top_p": 0.0})


def _completion(**kw) -> Completion:
  base = dict(
    rid="r",
    text="a b",
    output_ids=[4, 5],
    logprobs=[-0.5, None],
    finish_reason=protocol.finish_length(2),
    prompt_tokens=3,
    weight_version="7",
  )
  return Completion(**{**base, **kw})


@pytest.mark.parametrize(
  "completion",
  [
    _completion(),
    _completion(token_versions=["6", "7"], segments=2),
    _completion(finish_reason=None),  # a streamed chunk
    _completion(output_ids=[], logprobs=[], finish_reason=protocol.finish_abort()),
  ],
)
def test_a_completion_reads_back_from_its_body(completion):
  """Each field once in the typed response; the body carries every field
  SGLang's does, and a client reads the response whole from it."""
  body = completion.to_body(return_logprob=True, token_text=str)
  assert (
    body["meta_info"]["output_token_logprobs"][:1]
    == [[lp, t, str(t)] for lp, t in zip(completion.logprobs, completion.output_ids)][:1]
  )
  assert body["meta_info"]["completion_tokens"] == len(completion.output_ids)
  back = Completion.from_body(body, server=completion.server)
  assert back == completion
  assert Completion.from_dict(completion.to_dict()) == completion


def test_versions_of_a_response_and_of_its_pieces():
  sglang = _completion()  # SGLang reports the final version only
  assert sglang.versions() == ["7", "7"] and sglang.versions("5") == ["5", "5"]
  head = sglang.pinned("5")
  tail = _completion(rid="r2", output_ids=[6], logprobs=[-1.0], weight_version="8")
  whole = head.continued_by(tail.pinned("8"), "a b c")
  assert whole.versions() == ["5", "5", "8"] and whole.segments == 2
  assert whole.output_ids == [4, 5, 6] and whole.logprobs == [-0.5, None, -1.0]
  assert whole.prompt_tokens == 3 and whole.rid == "r2" and whole.text == "a b c"
  # A body whose per-token versions do not match its tokens is read as none.
  body = _completion(token_versions=["1", "2"]).to_body(return_logprob=False)
  body["meta_info"]["output_token_weight_versions"] = ["1"]
  assert Completion.from_body(body, "").token_versions is None
  with pytest.raises(ValueError, match="meta_info"):
    Completion.from_dict({**sglang.to_dict(), "meta_info": {}})
