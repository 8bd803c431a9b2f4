"""`python -m fluxjax.rollout.server` as a real process on loopback, speaking SGLang's API.

One server process (tiny fp32 checkpoint) is shared by the module. References
are computed in-test from the same checkpoint: a plain greedy loop (full
forward per token) and the trainer's logprobs of the returned tokens.
"""

import asyncio
import base64
import json
import os
import urllib.error
import urllib.request

import av
import numpy as np
import pytest
from PIL import Image

from fluxjax.models import chat, config, hf_export, hf_load, inputs, media, processor, vlm
from fluxjax.models import tokenizer as tokenizer_lib
from fluxjax.rollout import client as client_lib
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.rollout import json_body, launcher, protocol, publish, sampling_params
from fluxjax.rollout.protocol import GenerateRequest
from helpers import SERVER_CONTEXT, reference_greedy, server_env, trainer_logprobs

CONTEXT = SERVER_CONTEXT
PIXELS = 56 * 56
LOGPROB_TOL = 1e-4


def http(url, path, body=None, method=None):
  """(status, parsed body) with urllib: the raw wire, no client library."""
  data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
  req = urllib.request.Request(
    url + path,
    data=data,
    method=method or ("POST" if data is not None else "GET"),
    headers={"Content-Type": "application/json"},
  )
  try:
    with urllib.request.urlopen(req, timeout=60) as r:
      raw, status = r.read(), r.status
  except urllib.error.HTTPError as e:
    raw, status = e.read(), e.code
  try:
    return status, json.loads(raw) if raw else None
  except json.JSONDecodeError:
    return status, raw.decode()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, tiny_model):
  path = str(tmp_path_factory.mktemp("rollout") / "v0")
  hf_export.save_hf_checkpoint(
    tiny_model, path, dtype="float32", extra_files={"tokenizer.json": tokenizer_lib.ASSET_PATH}
  )
  return path


@pytest.fixture(scope="module")
def model(ckpt):
  return hf_load.load_hf_checkpoint(ckpt)


@pytest.fixture(scope="module")
def url(ckpt, tmp_path_factory):
  cmd = [
    "python",
    "-m",
    "fluxjax.rollout.server",
    "--model-path",
    ckpt,
    "--num-slots",
    "4",
    "--context-length",
    str(CONTEXT),
    "--seed",
    "0",
    "--image-min-pixels",
    str(PIXELS),
    "--video-min-pixels",
    str(PIXELS),
    "--video-max-pixels",
    str(PIXELS),
    "--min-decode-step-ms",  # the benches' emulated step floor, reported below
    "1",
  ]
  logs = str(tmp_path_factory.mktemp("logs"))
  launched = launcher.launch_servers(cmd, 1, env=server_env(), timeout_s=120, log_dir=logs)
  yield launched.urls[0]
  launched.stop()


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.Tokenizer.default()


def prompt_ids(n, seed):
  return [int(i) for i in np.random.default_rng(seed).integers(0, 490, n)]


GREEDY = {"temperature": 0, "max_new_tokens": 6}


def test_generate_request_and_response_shapes(url):
  status, out = http(
    url,
    "/generate",
    {
      "input_ids": prompt_ids(7, 0),
      "rid": "shape-1",
      "sampling_params": GREEDY,
      "return_logprob": True,
    },
  )
  assert status == 200, out
  assert set(out) == {"text", "output_ids", "meta_info"}
  meta = out["meta_info"]
  assert meta["id"] == "shape-1"
  assert meta["finish_reason"] == {"type": "length", "length": 6}
  assert meta["prompt_tokens"] == 7 and meta["completion_tokens"] == 6
  assert meta["weight_version"] == "default"
  assert isinstance(meta["e2e_latency"], float)
  lps = meta["output_token_logprobs"]
  assert [x[1] for x in lps] == out["output_ids"] and len(lps) == 6
  assert all(isinstance(x[0], float) and x[2] is None for x in lps)
  assert meta["input_token_logprobs"] == []
  # Without return_logprob there are no logprob keys.
  _, out = http(url, "/generate", {"input_ids": prompt_ids(7, 0), "sampling_params": GREEDY})
  assert "output_token_logprobs" not in out["meta_info"]
  for path in (
    "/get_server_info",
    "/server_info",
    "/get_model_info",
    "/model_info",
    "/get_weight_version",
    "/get_load",
  ):
    status, _ = http(url, path)
    assert status == 200, path
  assert http(url, "/get_server_info")[1]["context_length"] == CONTEXT
  assert http(url, "/get_server_info")[1]["min_decode_step_ms"] == 1.0
  assert http(url, "/health")[0] == 200 and http(url, "/health_generate")[0] == 200


def test_greedy_equals_reference_and_logprobs_equal_trainer(url, model):
  ids = prompt_ids(12, 1)
  seq = inputs.sequence_from_tokens(ids, [], model.cfg)
  _, out = http(url, "/generate", {"input_ids": ids, "sampling_params": GREEDY})
  assert out["output_ids"] == reference_greedy(model, seq, 6, CONTEXT)
  _, out = http(
    url,
    "/generate",
    {
      "input_ids": ids,
      "return_logprob": True,
      "sampling_params": {"temperature": 1.0, "max_new_tokens": 10, "sampling_seed": 3},
    },
  )
  got = [x[0] for x in out["meta_info"]["output_token_logprobs"]]
  np.testing.assert_allclose(
    got, trainer_logprobs(model, seq, out["output_ids"]), atol=LOGPROB_TOL, rtol=0
  )


def test_text_prompt_and_streaming(url, tok):
  text = "<|im_start|>user\nHow many red circles?<|im_end|>\n<|im_start|>assistant\n"
  body = {"text": text, "sampling_params": GREEDY, "return_logprob": True}
  _, whole = http(url, "/generate", body)
  assert whole["meta_info"]["prompt_tokens"] == len(tok.encode(text))

  async def stream():
    c = client_lib.SGLangClient(url)
    try:
      (request,), _ = protocol.parse_generate(body)
      return [chunk async for chunk in c.generate_stream(request)]
    finally:
      await c.close()

  chunks = asyncio.run(stream())
  assert chunks[-1].output_ids == whole["output_ids"]
  assert chunks[-1].finish_reason == whole["meta_info"]["finish_reason"]
  assert all(c.finish_reason is None for c in chunks[:-1])
  lengths = [len(c.output_ids) for c in chunks]
  assert lengths == sorted(lengths)  # cumulative


def test_abort_running_request_returns_partial_tokens(url):
  async def go():
    c = client_lib.SGLangClient(url)
    request = GenerateRequest.of(
      prompt_ids(5, 2), {"max_new_tokens": 200, "temperature": 1.0}, rid="to-abort"
    )
    chunks = []
    try:
      async for chunk in c.generate_stream(request):
        chunks.append(chunk)
        if len(chunks) == 2:
          await c.abort("to-abort")
    finally:
      await c.close()
    return chunks

  final = asyncio.run(go())[-1]
  assert final.finish_type == "abort", final.finish_reason
  assert 0 < len(final.output_ids) < 200
  assert len(final.logprobs) == len(final.output_ids)


@pytest.fixture(scope="module")
def media_files(tmp_path_factory):
  folder = tmp_path_factory.mktemp("media")
  rng = np.random.default_rng(0)
  image = folder / "img.png"
  Image.fromarray(rng.integers(0, 255, (56, 84, 3), dtype=np.uint8)).save(image)
  video = folder / "clip.mp4"
  with av.open(str(video), "w") as out:
    stream = out.add_stream("libx264", rate=4)
    stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
    for _ in range(8):
      frame = rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)
      for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
        out.mux(packet)
    for packet in stream.encode():
      out.mux(packet)
  return str(image), str(video)


def test_image_and_video_prompts(url, model, tok, media_files):
  image, video = media_files
  pcfg = processor.VisionProcessorConfig(
    image_min_pixels=PIXELS, video_min_pixels=PIXELS, video_max_pixels=PIXELS
  )
  img = processor.preprocess_image(media.load_image(image), pcfg)
  frames, fps = media.load_video(video, pcfg)
  vid = processor.preprocess_video(frames, pcfg, fps)
  messages = [
    {
      "role": "user",
      "content": [
        {"type": "image"},
        {"type": "text", "text": "and"},
        {"type": "video"},
        {"type": "text", "text": "?"},
      ],
    }
  ]
  seq = inputs.sequence_from_chat(messages, [img, vid], tok, model.cfg)
  want = reference_greedy(model, seq, 6, CONTEXT)
  # Unexpanded placeholders in text, files as paths.
  _, out = http(
    url,
    "/generate",
    {
      "text": chat.render_chat(messages),
      "image_data": [image],
      "video_data": [video],
      "sampling_params": GREEDY,
    },
  )
  assert out["meta_info"]["prompt_tokens"] == len(seq)
  assert out["output_ids"] == want
  # Already expanded input_ids (as AReaL/verl send), the image as a data URI.
  with open(image, "rb") as f:
    uri = "data:image/png;base64," + base64.b64encode(f.read()).decode()
  _, out = http(
    url,
    "/generate",
    {
      "input_ids": seq.tokens_T.tolist(),
      "image_data": uri,
      "video_data": [video],
      "sampling_params": GREEDY,
    },
  )
  assert out["output_ids"] == want


@pytest.mark.parametrize(
  "body, message",
  [
    ({"input_ids": [1, 2], "sampling_params": {"seed": 1}}, "unknown sampling parameter"),
    ({"input_ids": [1, 2], "text": "hi"}, "exactly one of text / input_ids"),
    ({"input_ids": list(range(CONTEXT + 10))}, "longer than the model's context length"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p"),
    ({"input_ids": [1, 2], "image_data": ["/no/such/file.png"]}, "placeholder"),
    ({"text": chat.IMAGE_PLACEHOLDER, "image_data": ["/no/such/file.png"]}, "file not found"),
    ({"input_ids": [1, 2], "return_entropy": True}, "return_entropy=True is not supported"),
    ({"input_ids": [[1, 2], []]}, "non-empty list"),
    ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "duplicate rids"),
    ({"input_ids": [[1, 2], [3]], "sampling_params": [{}]}, "1 entries for a batch of 2"),
    ({"input_ids": [[1, 2]], "stream": True}, "streaming a batched"),
    (b"{not json", "not valid JSON"),
  ],
)
def test_malformed_request_gets_400_and_server_stays_up(url, body, message):
  status, out = http(url, "/generate", body)
  assert status == 400
  assert message in out["error"]["message"]
  assert http(url, "/health")[0] == 200
  assert http(url, "/generate", {"input_ids": [1, 2], "sampling_params": GREEDY})[0] == 200


@pytest.mark.parametrize("mode", ["abort", "in_place"])
def test_pause_holds_new_requests_outside_the_engine_until_continue(url, mode):
  """As SGLang's tokenizer manager: a request sent while paused waits, and
  the cache can be flushed meanwhile (a weight update's next step)."""

  async def go():
    c = client_lib.SGLangClient(url)
    try:
      await c.pause(mode)
      task = asyncio.create_task(c.generate(GenerateRequest.of([3, 4, 5], GREEDY)))
      await asyncio.sleep(0.5)
      held = not task.done()
      await c.flush_cache(retries=1)  # raises ServerUnavailable if the request were queued
      await c.resume()
      return held, await task
    finally:
      await c.close()

  held, out = asyncio.run(go())
  assert held and out.finish_type == "length"


def test_weight_update_changes_outputs_and_version(url, ckpt, tmp_path):
  ids = prompt_ids(9, 4)
  new = vlm.create_model(config.preset("tiny"), seed=1)
  seq = inputs.sequence_from_tokens(ids, [], new.cfg)
  _, before = http(url, "/generate", {"input_ids": ids, "sampling_params": GREEDY})

  async def go(model, version):
    async with fleet_lib.Fleet([url]) as fleet:
      return await publish.publish_to_fleet(fleet, model, str(tmp_path), version, dtype="float32")

  report = asyncio.run(go(new, 1))
  assert set(report.seconds) == {"write", "pause", "flush", "update", "resume"}
  assert not report.failed and os.path.isdir(os.path.join(tmp_path, "v1"))
  _, after = http(url, "/generate", {"input_ids": ids, "sampling_params": GREEDY})
  assert after["meta_info"]["weight_version"] == "1"
  assert http(url, "/get_server_info")[1]["weight_version"] == "1"
  assert after["output_ids"] == reference_greedy(new, seq, 6, CONTEXT) != before["output_ids"]
  # A checkpoint of another architecture is refused and the old weights stay.
  status, out = http(url, "/update_weights_from_disk", {"model_path": "/no/such/dir"})
  assert status == 400 and out["success"] is False
  status, out = http(
    url, "/update_weights_from_disk", {"model_path": ckpt, "weight_version": "default"}
  )
  assert status == 200 and out["success"], out
  _, again = http(url, "/generate", {"input_ids": ids, "sampling_params": GREEDY})
  assert again["output_ids"] == before["output_ids"]


def test_protocol_rejects_unsupported_sampling_values():
  with pytest.raises(json_body.ProtocolError, match="not supported"):
    sampling_params.SamplingParams.from_dict({"n": 2})
  sp = sampling_params.SamplingParams.from_dict({"temperature": 0.0})
  assert sp.greedy and sp.temperature == 1.0
  assert sampling_params.SamplingParams.from_dict({}).max_new_tokens == 128


def test_generate_fields_are_used_ignored_or_refused_as_documented():
  """Every GenerateReqInput field is accepted (sglang-router forwards them);
  unknown fields are ignored as SGLang's binding ignores them; a field asking
  for something this server does not do is refused unless at its default."""
  ids = [1, 2, 3]
  ignored = {k: "x" for k in protocol.IGNORED_FIELDS}
  reqs, batched = protocol.parse_generate({"input_ids": ids, **ignored, "no_such_field": 1})
  assert not batched and reqs[0].input_ids == ids
  assert protocol.unknown_fields({"input_ids": ids, "no_such_field": 1}) == ["no_such_field"]
  reqs, _ = protocol.parse_generate({"input_ids": ids, **protocol.DEFAULT_ONLY_FIELDS})
  assert reqs[0].input_ids == ids
  for key in protocol.DEFAULT_ONLY_FIELDS:
    with pytest.raises(json_body.ProtocolError, match=key):
      protocol.parse_generate({"input_ids": ids, key: 3})


def test_batched_generate_answers_a_list_in_input_order(url):
  prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
  singles = [
    http(url, "/generate", {"input_ids": p, "sampling_params": GREEDY})[1]["output_ids"]
    for p in prompts
  ]
  status, out = http(
    url, "/generate", {"input_ids": prompts, "sampling_params": GREEDY, "return_logprob": True}
  )
  assert status == 200 and isinstance(out, list)
  assert [o["output_ids"] for o in out] == singles
  assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in out)
  status, out = http(url, "/generate", {"text": ["a", "b"], "rid": "t", "sampling_params": GREEDY})
  assert status == 200 and [o["meta_info"]["id"] for o in out] == ["t_0", "t_1"]


def test_a_negative_decode_step_floor_is_refused_by_name(capsys):
  from fluxjax.rollout import server

  with pytest.raises(SystemExit):
    server.parse_args(["--min-decode-step-ms", "-1"])
  assert "--min-decode-step-ms must be >= 0, not -1.0" in capsys.readouterr().err
