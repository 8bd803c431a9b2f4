"""The tokenizer wrapper and the shipped synthetic tokenizer."""

import os
import subprocess
import sys
import unicodedata

import hypothesis
import hypothesis.strategies as st
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from fluxjax.data import cot_tasks, tokenizer_corpus
from fluxjax.models import tokenizer as tokenizer_lib

EXPECTED_IDS = {
  "endoftext_id": 490,
  "im_start_id": 491,
  "im_end_id": 492,
  "vision_start_id": 499,
  "vision_end_id": 500,
  "vision_pad_id": 501,
  "image_pad_id": 502,
  "video_pad_id": 503,
}


@pytest.fixture(scope="module")
def tok():
  return tokenizer_lib.Tokenizer.default()


def test_shipped_asset_is_what_the_builder_makes():
  with open(tokenizer_lib.ASSET_PATH, encoding="utf-8") as f:
    shipped = f.read()
  assert tokenizer_corpus.tokenizer_json() == shipped


def test_cli_regenerates_an_identical_file(tmp_path):
  out = tmp_path / "tokenizer.json"
  # A fresh process with other hash seeds and one thread: nothing in the
  # build may depend on either.
  env = dict(os.environ, PYTHONHASHSEED="123", RAYON_NUM_THREADS="1")
  repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  subprocess.run(
    [sys.executable, "-m", "fluxjax.data.tokenizer_corpus", "--out", str(out)],
    check=True,
    env=env,
    cwd=repo_root,
    capture_output=True,
  )
  with open(tokenizer_lib.ASSET_PATH, "rb") as f:
    assert out.read_bytes() == f.read()


def test_the_tasks_words_are_single_tokens(tok):
  """A chain step is a fixed pattern of tokens: each key letter, colour and
  shape, with the space before it, is one token, and so is the count after
  it (Qwen's split regex makes each digit a token of its own)."""
  words = [*cot_tasks.KEYS, *tokenizer_lib.COLORS, *tokenizer_lib.SHAPES]
  assert {w: len(tok.encode(" " + w)) for w in words} == {w: 1 for w in words}
  assert tok.encode(" a red7") == tok.encode(" a") + tok.encode(" red") + tok.encode("7")


def test_layout(tok):
  assert tok.vocab_size == 512
  backend = tok.backend
  assert backend.get_vocab_size(with_added_tokens=False) == 490
  for offset, text in enumerate(tokenizer_lib.QWEN_ADDED_TOKENS):
    assert tok.token_to_id(text) == 490 + offset
  for name, want in EXPECTED_IDS.items():
    assert getattr(tok, name) == want, name
  assert tok.eos_ids == (492, 490)
  assert tok.pad_id == 490
  # All 256 byte symbols are ordinary ids below 490.
  vocab = backend.get_vocab(with_added_tokens=False)
  for ch in pre_tokenizers.ByteLevel.alphabet():
    assert vocab[ch] < 490
  assert max(vocab.values()) == 489


def test_special_flags_follow_qwen(tok):
  added = tok.backend.get_added_tokens_decoder()
  special = [added[490 + i].special for i in range(22)]
  assert special == [True] * 14 + [False] * 8


def test_no_bos_or_eos_and_specials_are_single_ids(tok):
  assert tok.encode("") == []
  ids = tok.encode("<|im_start|>user\nhi<|im_end|>\n")
  assert ids[0] == tok.im_start_id and tok.im_end_id in ids
  pads = tok.encode("a<|image_pad|><|image_pad|>b<|video_pad|>")
  assert pads.count(tok.image_pad_id) == 2
  assert pads.count(tok.video_pad_id) == 1


def test_decode_skips_special_tokens_like_qwen(tok):
  text = "<|im_start|>assistant\n<tool_call>7</tool_call><|im_end|>"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  assert tok.decode(ids, skip_special_tokens=True) == ("assistant\n<tool_call>7</tool_call>")


def test_digits_are_split_like_qwen(tok):
  ids = tok.encode("100")
  assert [tok.id_to_token(i) for i in ids] == ["1", "0", "0"]


def test_task_words_are_compact(tok):
  for word in tokenizer_lib.COLORS + tokenizer_lib.SHAPES:
    assert len(tok.encode(" " + word)) <= 2, word
  assert len(tok.encode("How many red circles are in the image?")) <= 10


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(st.text(max_size=60))
def test_round_trip_any_text(text):
  tok = tokenizer_lib.default_tokenizer()
  # Qwen normalizes to NFC; any NFC text comes back byte for byte.
  assert tok.decode(tok.encode(text)) == unicodedata.normalize("NFC", text)


def test_matches_transformers_fast_tokenizer(tok):
  hf = PreTrainedTokenizerFast(tokenizer_file=tokenizer_lib.ASSET_PATH)
  for text in [
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n",
    "How many purple stars?  <answer>12</answer>\n\n",
    "Ünïcödé — émoji 🙂 and tabs\t!",
  ]:
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_special_ids_are_found_by_name(tmp_path):
  # A tokenizer with the Qwen tokens at other ids, in another order.
  backend = tokenizers.Tokenizer(models.WordLevel({"x": 0, "y": 1}, unk_token="x"))
  backend.add_special_tokens(list(reversed(tokenizer_lib.QWEN_ADDED_TOKENS)))
  path = tmp_path / "other.json"
  backend.save(str(path))
  tok = tokenizer_lib.Tokenizer.from_file(str(path))
  n = len(tokenizer_lib.QWEN_ADDED_TOKENS)
  assert tok.im_start_id == 2 + n - 2
  assert tok.image_pad_id == 2 + n - 13
  assert tok.video_pad_id == 2 + n - 14
  assert tok.endoftext_id == 2 + n - 1
  assert tok.eos_ids == (tok.im_end_id, tok.endoftext_id)


def test_missing_special_tokens_raise_naming_them():
  backend = tokenizers.Tokenizer(models.WordLevel({"x": 0}, unk_token="x"))
  backend.add_special_tokens(["<|endoftext|>", "<|im_start|>"])
  with pytest.raises(ValueError) as err:
    tokenizer_lib.Tokenizer(backend)
  msg = str(err.value)
  for name in ("<|im_end|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>"):
    assert name in msg
  assert "<|im_start|>" not in msg
