"""Qwen2.5-VL tokenizer wrapper and the synthetic tokenizer fluxjax ships.

`Tokenizer` wraps any Hugging Face `tokenizer.json` (a real Qwen2.5-VL one, or the
bundled asset) and looks its special tokens up by name, so the same code serves the
151k-token Qwen vocabulary and the 512-token synthetic one (`build_synthetic_tokenizer`).
fluxjax/data/tokenizer_corpus.py builds and writes the asset; a base model trained with
it is frozen with it.
"""

import functools
import itertools
import os
from collections.abc import Iterable, Iterator, Sequence

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

ASSET_PATH = os.path.join(os.path.dirname(__file__), "assets", "tokenizer.json")

# Qwen2.5's added tokens, in id order from 151643. The first 14 are special
# (skipped by `decode(skip_special_tokens=True)`); Qwen marks the tool-call and
# FIM tokens as ordinary added tokens, and so do we.
QWEN_ADDED_TOKENS = (
  "<|endoftext|>",
  "<|im_start|>",
  "<|im_end|>",
  "<|object_ref_start|>",
  "<|object_ref_end|>",
  "<|box_start|>",
  "<|box_end|>",
  "<|quad_start|>",
  "<|quad_end|>",
  "<|vision_start|>",
  "<|vision_end|>",
  "<|vision_pad|>",
  "<|image_pad|>",
  "<|video_pad|>",
  "<tool_call>",
  "</tool_call>",
  "<|fim_prefix|>",
  "<|fim_middle|>",
  "<|fim_suffix|>",
  "<|fim_pad|>",
  "<|repo_name|>",
  "<|file_sep|>",
)
_NUM_SPECIAL = 14

SYNTHETIC_VOCAB_SIZE = 512
SYNTHETIC_ORDINARY = SYNTHETIC_VOCAB_SIZE - len(QWEN_ADDED_TOKENS)  # 490

# Qwen2's pre-tokenizer split: contractions, words with one leading non-letter,
# single digits, punctuation runs, newlines, whitespace.
QWEN_SPLIT_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The special tokens the rest of fluxjax needs, by attribute name.
_REQUIRED = {
  "endoftext_id": "<|endoftext|>",
  "im_start_id": "<|im_start|>",
  "im_end_id": "<|im_end|>",
  "vision_start_id": "<|vision_start|>",
  "vision_end_id": "<|vision_end|>",
  "vision_pad_id": "<|vision_pad|>",
  "image_pad_id": "<|image_pad|>",
  "video_pad_id": "<|video_pad|>",
}


class Tokenizer:
  """A Qwen2.5-VL-compatible tokenizer over `tokenizers.Tokenizer`.

  Special ids are found by token text, never assumed, so any Qwen2-VL-family
  `tokenizer.json` works.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer):
    self._tok = tokenizer
    ids: dict[str, int] = {}
    missing = []
    for attr, text in _REQUIRED.items():
      i = tokenizer.token_to_id(text)
      if i is None:
        missing.append(text)
      else:
        ids[attr] = i
    if missing:
      raise ValueError(f"tokenizer lacks required Qwen2.5-VL special tokens: {missing}")
    self._ids = ids

  @classmethod
  def from_file(cls, path: str) -> "Tokenizer":
    """Loads a Hugging Face `tokenizer.json`."""
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no tokenizer file at {path}")
    return cls(tokenizers.Tokenizer.from_file(os.fspath(path)))

  @classmethod
  def default(cls) -> "Tokenizer":
    """Loads the synthetic 512-token tokenizer shipped with the package."""
    return cls.from_file(ASSET_PATH)

  def model_token_ids(self) -> dict[str, int]:
    """The special ids a `ModelConfig` names, by its field names (Qwen's
    <|endoftext|> is its bos, <|im_end|> its eos, the pads its media tokens)."""
    return dict(
      image_token_id=self.image_pad_id,
      video_token_id=self.video_pad_id,
      vision_start_token_id=self.vision_start_id,
      vision_end_token_id=self.vision_end_id,
      bos_token_id=self.endoftext_id,
      eos_token_id=self.im_end_id,
    )

  @property
  def backend(self) -> tokenizers.Tokenizer:
    return self._tok

  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included (not the padded embedding size)."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str) -> list[int]:
    """Tokenizes `text`; special-token text becomes its id, no BOS/EOS added."""
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Turns ids back into text (the inverse of `encode` for any text)."""
    return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, i: int) -> str | None:
    return self._tok.id_to_token(int(i))

  @property
  def endoftext_id(self) -> int:
    return self._ids["endoftext_id"]

  @property
  def im_start_id(self) -> int:
    return self._ids["im_start_id"]

  @property
  def im_end_id(self) -> int:
    return self._ids["im_end_id"]

  @property
  def vision_start_id(self) -> int:
    return self._ids["vision_start_id"]

  @property
  def vision_end_id(self) -> int:
    return self._ids["vision_end_id"]

  @property
  def vision_pad_id(self) -> int:
    return self._ids["vision_pad_id"]

  @property
  def image_pad_id(self) -> int:
    return self._ids["image_pad_id"]

  @property
  def video_pad_id(self) -> int:
    return self._ids["video_pad_id"]

  @property
  def eos_ids(self) -> tuple[int, int]:
    """Generation stops at either (Qwen's generation_config lists both)."""
    return (self.im_end_id, self.endoftext_id)

  @property
  def vision_ids(self) -> tuple[int, ...]:
    """The vision markup: span delimiters and the pads media expand into."""
    return (
      self.vision_start_id,
      self.vision_end_id,
      self.vision_pad_id,
      self.image_pad_id,
      self.video_pad_id,
    )

  @property
  def response_stop_ids(self) -> tuple[int, ...]:
    """Where a rollout response ends: EOS, or any vision markup id.

    A response cannot hold media, and a partial response holding a pad id
    can never be continued (no server takes a prompt whose placeholders have
    no media), so sampling one ends the response there; it is trained like
    an EOS. A trained policy does not sample them; a random one does, about
    once in a hundred tokens of the tiny vocabulary.
    """
    return (*self.eos_ids, *self.vision_ids)

  @property
  def pad_id(self) -> int:
    """Qwen pads with <|endoftext|>."""
    return self.endoftext_id


# ---------------------------------------------------------------------------
# The synthetic tokenizer.

COLORS = ("red", "green", "blue", "yellow", "purple", "orange", "white", "black")
SHAPES = ("circle", "square", "triangle", "star")

_SYSTEM_PROMPTS = (
  "You are a helpful assistant.",
  "You are a helpful assistant. Think step by step, then give the final "
  "answer inside <answer></answer>.",
  "Answer with a single number or word.",
)
_FORMATS = (
  "Answer: {a}",
  "The answer is {a}.",
  "<answer>{a}</answer>",
  "<think>I look at the image carefully.</think><answer>{a}</answer>",
  "<think>I watch the video frame by frame.</think> <answer>{a}</answer>",
  "{a}",
)


def _plural(shape: str) -> str:
  return shape + "s"


def _questions() -> Iterator[tuple[str, str]]:
  """Yields (question, answer) pairs of every synthetic task, in fixed order."""
  for i, (color, shape) in enumerate(itertools.product(COLORS, SHAPES)):
    n = (7 * i + 3) % 13
    yield (f"How many {color} {_plural(shape)} are in the image?", str(n))
    yield (f"Count the {color} {_plural(shape)} in this image.", str(n))
    yield (f"How many {_plural(shape)} are {color}?", str(n))
  for i, color in enumerate(COLORS):
    other = COLORS[(i + 3) % len(COLORS)]
    yield ("Which colour appears last in the video?", color)
    yield ("Which color appears last in the video clip?", color)
    yield (f"A {other} shape appears first. Which colour appears last?", color)
  for shape in SHAPES:
    yield (f"Which shape appears last in the video? Is it a {shape}?", shape)
  for a in range(0, 101, 7):
    for b, (sym, word, fn) in enumerate(
      (
        ("+", "plus", lambda x, y: x + y),
        ("-", "minus", lambda x, y: x - y),
        ("*", "times", lambda x, y: x * y),
      )
    ):
      y = (a * 3 + b * 11) % 10 if sym == "*" else (a * 5 + b) % 50
      x, y = (max(a, y), min(a, y)) if sym == "-" else (a, y)
      res = fn(x, y)
      yield (f"What is {x} {sym} {y}? Read the expression in the image.", str(res))
      yield (f"Compute {x} {word} {y} as written in the image.", str(res))


def synthetic_corpus() -> Iterator[str]:
  """The training text: chat turns, questions, answers, numbers and words."""
  for k, (q, a) in enumerate(_questions()):
    system = _SYSTEM_PROMPTS[k % len(_SYSTEM_PROMPTS)]
    fmt = _FORMATS[k % len(_FORMATS)]
    yield (f"system\n{system}\nuser\n{q}\nassistant\n{fmt.format(a=a)}\n")
  for n in range(101):
    yield f"{n} {n}. Answer: {n} <answer>{n}</answer> The answer is {n}.\n"
  for word in COLORS + SHAPES:
    yield (f"{word} {word.capitalize()} {_plural(word)} <answer>{word}</answer> Answer: {word}\n")
  yield "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) . , : ; ? ! ' \" < > [ ] { }\n"


def build_synthetic_tokenizer(task_texts: Iterable[str] = ()) -> tokenizers.Tokenizer:
  """Trains the deterministic 512-token byte-level BPE and checks its layout.

  Built like Qwen2's (NFC, Qwen's split regex, ByteLevel pre-tokenizer and decoder, no
  BOS/EOS), trained on a generated corpus of the synthetic tasks' language: this module's
  chat and number text (`synthetic_corpus`) plus the questions and reference responses of
  every synthetic task. Its layout is fixed:

    ids 0..489    256 byte symbols + 234 merges
    ids 490..511  Qwen2.5's 22 added tokens, in Qwen's order (151643..151664)

  so `id - 490 + 151643` maps a synthetic special id to its Qwen id.

  Args:
    task_texts: the tasks' own text, trained on after `synthetic_corpus`.

  Returns:
    A `tokenizers.Tokenizer` with ordinary ids 0..489 and Qwen2.5's added
    tokens at 490..511 in Qwen's order.
  """
  tok = tokenizers.Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ]
  )
  # The ByteLevel decoder takes no options (it only maps bytes back), whatever
  # the pre-tokenizer's are.
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(
    add_prefix_space=False, trim_offsets=False, use_regex=False
  )
  trainer = trainers.BpeTrainer(
    vocab_size=SYNTHETIC_ORDINARY,
    min_frequency=2,
    show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=[],
  )
  tok.train_from_iterator([*synthetic_corpus(), *task_texts], trainer=trainer)
  # Added after training so they land after the ordinary ids, as in Qwen.
  tok.add_tokens(
    [
      tokenizers.AddedToken(
        text,
        special=i < _NUM_SPECIAL,
        normalized=False,
        single_word=False,
        lstrip=False,
        rstrip=False,
      )
      for i, text in enumerate(QWEN_ADDED_TOKENS)
    ]
  )
  _check_synthetic_layout(tok)
  return tok


def _check_synthetic_layout(tok: tokenizers.Tokenizer) -> None:
  """Fails loudly if training did not give the documented id layout."""
  assert tok.get_vocab_size(with_added_tokens=False) == SYNTHETIC_ORDINARY, (
    "the corpus gave too few merges: "
    f"{tok.get_vocab_size(with_added_tokens=False)} != {SYNTHETIC_ORDINARY}"
  )
  assert tok.get_vocab_size(with_added_tokens=True) == SYNTHETIC_VOCAB_SIZE
  for offset, text in enumerate(QWEN_ADDED_TOKENS):
    assert tok.token_to_id(text) == SYNTHETIC_ORDINARY + offset, text
  alphabet = set(pre_tokenizers.ByteLevel.alphabet())
  singles = {
    t
    for t, i in tok.get_vocab(with_added_tokens=False).items()
    if len(t) == 1 and i < SYNTHETIC_ORDINARY
  }
  assert singles == alphabet, "all 256 byte symbols must be in the vocabulary"


def resolve(tokenizer_path: str, model_path: str) -> Tokenizer:
  """A run's tokenizer: `tokenizer_path`, else the checkpoint folder's
  tokenizer.json, else the shipped synthetic one (a preset's random weights)."""
  if tokenizer_path:
    return Tokenizer.from_file(tokenizer_path)
  in_checkpoint = os.path.join(model_path, "tokenizer.json") if model_path else ""
  if in_checkpoint and os.path.exists(in_checkpoint):
    return Tokenizer.from_file(in_checkpoint)
  return Tokenizer.default()


@functools.cache
def default_tokenizer() -> Tokenizer:
  """A process-wide `Tokenizer.default()`."""
  return Tokenizer.default()
