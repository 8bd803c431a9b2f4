"""Chat rendering and vision-token expansion against Hugging Face.

The template below is Qwen2-VL / Qwen2.5-VL's chat template, verbatim as in the
Qwen2.5-VL-*-Instruct `chat_template.json` and transformers' own fixture
(tests/models/qwen2_vl/test_processing_qwen2_vl.py); the installed transformers
package does not ship it. Expansion is checked against `Qwen2_5_VLProcessor`
itself, with a stub in place of the video processor (it needs torchvision),
so the placeholder replacement and `mm_token_type_ids` are HF's own code.
"""

import types

import hypothesis
import hypothesis.strategies as st
import jinja2.sandbox
import numpy as np
import pytest
from PIL import Image
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

from fluxjax.models import chat
from fluxjax.models import processor as processor_lib
from fluxjax.models import tokenizer as tokenizer_lib

QWEN2_5_VL_CHAT_TEMPLATE = (
  "{% set image_count = namespace(value=0) %}"
  "{% set video_count = namespace(value=0) %}{% for message in messages %}"
  "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
  "You are a helpful assistant.<|im_end|>\n"
  "{% endif %}<|im_start|>{{ message['role'] }}\n"
  "{% if message['content'] is string %}{{ message['content'] }}"
  "<|im_end|>\n"
  "{% else %}{% for content in message['content'] %}"
  "{% if content['type'] == 'image' or 'image' in content or 'image_url' "
  "in content %}"
  "{% set image_count.value = image_count.value + 1 %}"
  "{% if add_vision_id %}Picture {{ image_count.value }}: "
  "{% endif %}<|vision_start|><|image_pad|><|vision_end|>"
  "{% elif content['type'] == 'video' or 'video' in content %}"
  "{% set video_count.value = video_count.value + 1 %}"
  "{% if add_vision_id %}Video {{ video_count.value }}: "
  "{% endif %}<|vision_start|><|video_pad|><|vision_end|>"
  "{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
  "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# transformers compiles chat templates in this environment.
_JINJA = jinja2.sandbox.ImmutableSandboxedEnvironment(
  trim_blocks=True, lstrip_blocks=True
).from_string(QWEN2_5_VL_CHAT_TEMPLATE)


def jinja_render(messages, add_generation_prompt=True, add_vision_id=False):
  return _JINJA.render(
    messages=messages, add_generation_prompt=add_generation_prompt, add_vision_id=add_vision_id
  )


def text(s):
  return {"type": "text", "text": s}


IMAGE = {"type": "image"}
VIDEO = {"type": "video"}

CONVERSATIONS = {
  "text_only_string": [{"role": "user", "content": "What is 2 + 3?"}],
  "text_only_parts": [{"role": "user", "content": [text("Hi"), text(" there")]}],
  "system_given": [
    {"role": "system", "content": "Answer with one word."},
    {"role": "user", "content": [IMAGE, text("Which colour?")]},
  ],
  "system_as_parts": [
    {"role": "system", "content": [text("Be brief.")]},
    {"role": "user", "content": "ok"},
  ],
  "multiple_images": [
    {
      "role": "user",
      "content": [
        text("Compare "),
        IMAGE,
        text(" and "),
        IMAGE,
        IMAGE,
        text(". How many red circles in all?"),
      ],
    }
  ],
  "video": [{"role": "user", "content": [VIDEO, text("Which colour appears last in the video?")]}],
  "multi_turn": [
    {"role": "user", "content": [IMAGE, text("How many stars?")]},
    {"role": "assistant", "content": "<answer>4</answer>"},
    {"role": "user", "content": [VIDEO, text("And here?"), IMAGE]},
    {"role": "assistant", "content": [text("<answer>2</answer>")]},
    {"role": "user", "content": "Thanks.\n"},
  ],
  "hf_style_keys": [
    {
      "role": "user",
      "content": [
        {"type": "image", "image": "file:///a.png"},
        {"type": "image_url", "image_url": {"url": "http://x/b.png"}},
        {"type": "video", "video": "file:///c.mp4"},
        text("?"),
      ],
    }
  ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_render_matches_qwen_template(name, gen):
  messages = CONVERSATIONS[name]
  assert chat.render_chat(messages, add_generation_prompt=gen) == (jinja_render(messages, gen))
  assert chat.render_chat(messages, gen, add_vision_id=True) == (
    jinja_render(messages, gen, add_vision_id=True)
  )


def test_render_matches_transformers_apply_chat_template():
  hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_lib.ASSET_PATH)
  for messages in CONVERSATIONS.values():
    want = hf.apply_chat_template(
      messages, chat_template=QWEN2_5_VL_CHAT_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert chat.render_chat(messages) == want


def test_render_known_prompt():
  # The SGLang protocol reference's example prompt.
  messages = [{"role": "user", "content": [IMAGE, text("How many cats are there?")]}]
  assert chat.render_chat(messages) == (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
    "How many cats are there?<|im_end|>\n<|im_start|>assistant\n"
  )


_free_text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=20)
_part = st.one_of(_free_text.map(text), st.just(IMAGE), st.just(VIDEO))
_message = st.fixed_dictionaries(
  {
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.one_of(_free_text, st.lists(_part, max_size=5)),
  }
)


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(st.lists(_message, min_size=1, max_size=5), st.booleans(), st.booleans())
def test_render_matches_qwen_template_random(messages, gen, vision_id):
  assert chat.render_chat(messages, gen, vision_id) == (jinja_render(messages, gen, vision_id))


def test_render_rejects_what_the_template_would_drop():
  with pytest.raises(ValueError, match="unsupported content part"):
    chat.render_chat([{"role": "user", "content": [{"type": "audio"}]}])
  with pytest.raises(ValueError, match="content must be"):
    chat.render_chat([{"role": "user", "content": None}])
  with pytest.raises(ValueError, match="role"):
    chat.render_chat([{"content": "hi"}])


# --- expansion against Qwen2_5_VLProcessor -----------------------------------


class _StubVideoProcessor:
  """Stands in for the torchvision video processor: reports fixed grids."""

  merge_size = 2
  temporal_patch_size = 2

  def __init__(self):
    self.grids = []

  def __call__(self, videos, **kwargs):
    del kwargs
    assert len(videos) == len(self.grids)
    meta = types.SimpleNamespace(sampled_fps=2.0)
    return {
      "video_grid_thw": np.array(self.grids, dtype=np.int64),
      "video_metadata": [meta] * len(self.grids),
    }


class _Processor(Qwen2_5_VLProcessor):
  def check_argument_for_proper_class(self, argument_name, argument):
    if argument_name == "video_processor":
      return type(argument)
    return super().check_argument_for_proper_class(argument_name, argument)


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.Tokenizer.default()


@pytest.fixture(scope="module")
def processor(tok):
  return _Processor(
    image_processor=Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64),
    tokenizer=PreTrainedTokenizerFast(tokenizer_object=tok.backend),
    video_processor=_StubVideoProcessor(),
  )


def _hf_tokens(processor, messages, image_sizes, video_grids):
  images = [Image.new("RGB", (w, h), (i * 40, 0, 0)) for i, (h, w) in enumerate(image_sizes)]
  processor.video_processor.grids = [list(g) for g in video_grids]
  videos = [np.zeros((4, 28, 28, 3), np.uint8) for _ in video_grids]
  out = processor(text=[chat.render_chat(messages)], images=images or None, videos=videos or None)
  grids = [tuple(int(x) for x in g) for g in out.get("image_grid_thw", [])]
  return (np.array(out["input_ids"][0]), np.array(out["mm_token_type_ids"][0]), grids)


EXPANSION_CASES = {
  "text_only": (CONVERSATIONS["text_only_string"], [], []),
  "one_image": (CONVERSATIONS["system_given"], [(56, 84)], []),
  "several_images": (CONVERSATIONS["multiple_images"], [(56, 84), (120, 60), (200, 200)], []),
  "video": (CONVERSATIONS["video"], [], [(2, 4, 6)]),
  "multi_turn_mixed": (CONVERSATIONS["multi_turn"], [(56, 56), (90, 140)], [(3, 8, 4)]),
}


@pytest.mark.parametrize("name", sorted(EXPANSION_CASES))
def test_expansion_matches_qwen2_5_vl_processor(name, tok, processor):
  messages, image_sizes, video_grids = EXPANSION_CASES[name]
  want_ids, want_types, image_grids = _hf_tokens(processor, messages, image_sizes, video_grids)
  got = chat.tokenize_chat(messages, tok, image_grids=image_grids, video_grids=video_grids)
  assert got.input_ids.dtype == np.int32
  assert got.mm_token_type_ids.dtype == np.int32
  np.testing.assert_array_equal(got.input_ids, want_ids)
  np.testing.assert_array_equal(got.mm_token_type_ids, want_types)
  assert got.num_image_tokens == int((want_types == 1).sum())
  assert got.num_video_tokens == int((want_types == 2).sum())
  assert got.num_image_tokens == sum(t * h * w // 4 for t, h, w in image_grids)


def test_pads_never_merge_with_neighbours(tok):
  # Text glued to the placeholders on both sides: the text tokens equal those
  # of the text alone, and the pads are exactly the expanded run.
  messages = [{"role": "user", "content": [text("red"), IMAGE, text("circle"), VIDEO, text("<|")]}]
  got = chat.tokenize_chat(messages, tok, image_grids=[(1, 4, 4)], video_grids=[(2, 2, 2)])
  ids = got.input_ids.tolist()
  i = ids.index(tok.image_pad_id)
  assert ids[i - 1] == tok.vision_start_id and ids[i + 4] == tok.vision_end_id
  assert ids[i : i + 4] == [tok.image_pad_id] * 4
  j = ids.index(tok.video_pad_id)
  assert ids[j : j + 2] == [tok.video_pad_id] * 2
  assert ids[j + 2] == tok.vision_end_id
  # Decoding and re-encoding the expanded prompt gives the same ids.
  assert tok.encode(tok.decode(ids)) == ids


@pytest.mark.parametrize(
  "images,videos,match",
  [
    ([], [], "1 image placeholder"),
    ([(1, 4, 4), (1, 4, 4)], [], "2 image grid"),
    ([(1, 4, 4)], [(2, 4, 4)], "1 video grid"),
  ],
)
def test_placeholder_grid_mismatch_raises(tok, images, videos, match):
  messages = CONVERSATIONS["system_given"]
  with pytest.raises(ValueError, match=match):
    chat.tokenize_chat(messages, tok, image_grids=images, video_grids=videos)


def test_expanding_twice_raises(tok):
  once = chat.tokenize_chat(CONVERSATIONS["system_given"], tok, image_grids=[(1, 4, 4)])
  with pytest.raises(ValueError, match="4 image placeholder"):
    chat.expand_vision_tokens(
      once.input_ids,
      image_pad_id=tok.image_pad_id,
      video_pad_id=tok.video_pad_id,
      image_grids=[(1, 4, 4)],
    )


def test_grid_validation():
  assert processor_lib.num_vision_tokens((2, 4, 6)) == 12
  assert processor_lib.num_vision_tokens((1, 6, 6), merge_size=3) == 4
  with pytest.raises(ValueError, match="multiples"):
    processor_lib.num_vision_tokens((1, 3, 4))
  with pytest.raises(ValueError, match="positive"):
    processor_lib.num_vision_tokens((0, 4, 4))


def test_expand_vision_tokens_counts(tok):
  ids = [1, tok.image_pad_id, 2, tok.video_pad_id, tok.image_pad_id]
  got = chat.expand_vision_tokens(
    ids,
    image_pad_id=tok.image_pad_id,
    video_pad_id=tok.video_pad_id,
    image_grids=[(1, 2, 2), (1, 4, 2)],
    video_grids=[(2, 2, 4)],
  )
  assert got.input_ids.tolist() == ([1, 502, 2] + [503] * 4 + [502] * 2)
  assert got.mm_token_type_ids.tolist() == [0, 1, 0] + [2] * 4 + [1] * 2
  assert (got.num_image_tokens, got.num_video_tokens) == (3, 4)
  assert len(got) == 9
