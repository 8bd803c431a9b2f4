"""From a /generate request to model inputs: ids, decoded media, M-RoPE positions.

`build_sequence` is the entry point: it decodes the request's media (`load_media`) and
re-expands its vision spans as SGLang does (`expand_prompt`). Media strings: a local file
path (what RL clients on a shared filesystem send), a `data:<mime>;base64,` URI, or raw
base64. URLs are refused: a rollout server should not fetch from the network in the
middle of a batch.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import tempfile

import numpy as np

from fluxjax.models import inputs, media, processor
from fluxjax.models.config import ModelConfig
from fluxjax.models.inputs import SequenceInputs
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import media_cache
from fluxjax.rollout.json_body import ProtocolError
from fluxjax.rollout.protocol import GenerateRequest


def _names_path(item: str) -> bool:
  """Whether a media string is a path (else a data URI, raw base64 or a URL);
  a missing path fails with "file not found" when it is decoded."""
  return not item.startswith(("data:", "http://", "https://")) and (
    os.path.exists(item) or len(item) < 64
  )


def _payload(item: str, kind: str, index: int) -> bytes | None:
  """The bytes a base64 media string carries; None for a path."""
  if item.startswith(("http://", "https://")):
    raise ProtocolError(f"{kind} {index}: URLs are not supported; send a path or base64")
  if _names_path(item):
    return None
  # A data URI's payload, or raw base64, whose alphabet includes "/".
  payload = item.partition(",")[2] if item.startswith("data:") else item
  try:
    return base64.b64decode(payload, validate=True)
  except (binascii.Error, ValueError) as e:
    if payload is item and os.sep in item:
      return None  # a path after all: "file not found" below
    raise ProtocolError(f"{kind} {index}: not a path and not valid base64 ({e})") from e


def _load_item(
  item: str,
  kind: processor.Kind,
  index: int,
  proc: processor.VisionProcessorConfig,
  limits: media.MediaLimits,
) -> processor.ProcessedVision:
  """One media string decoded and preprocessed (base64 through a temporary file)."""
  data = _payload(item, kind, index)
  if data is None:
    return media.preprocess_file(kind, item, proc, limits)
  with tempfile.TemporaryDirectory(prefix="fluxjax-media-") as tmp:
    path = os.path.join(tmp, f"{kind}{index}")
    with open(path, "wb") as f:
      f.write(data)
    return media.preprocess_file(kind, path, proc, limits)


def load_media(
  req: GenerateRequest,
  proc: processor.VisionProcessorConfig,
  limits: media.MediaLimits = media.DEFAULT_LIMITS,
  cache: media_cache.MediaCache | None = None,
) -> list[processor.ProcessedVision]:
  """Decodes and preprocesses the request's images, then its videos, each
  once per `cache` (a group's requests name the same files).

  Each file's size is checked against `limits` from its header before it is
  decoded; any bad or oversized item is a ProtocolError (HTTP 400).
  """
  items: list[tuple[processor.Kind, int, str]]
  items = [("image", i, item) for i, item in enumerate(req.image_data)]
  items += [("video", i, item) for i, item in enumerate(req.video_data)]
  out = []
  try:
    for kind, i, item in items:
      load = functools.partial(_load_item, item, kind, i, proc, limits)
      if cache is None:
        out.append(load())
        continue
      k = media_cache.key(item, kind, (proc, limits), _names_path(item))
      out.append(load() if k is None else cache.get(k, load))
  except media.MediaError as e:
    raise ProtocolError(f"cannot load media: {e}") from e
  return out


def _spans(ids_T: np.ndarray, pad: int) -> list[tuple[int, int]]:
  """(start, length) of each run of `pad` ids."""
  is_pad = np.concatenate([[False], ids_T == pad, [False]])
  edges = np.flatnonzero(is_pad[1:] != is_pad[:-1])
  return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2])]


def expand_prompt(
  ids: list[int], vision: list[processor.ProcessedVision], cfg: ModelConfig
) -> np.ndarray:
  """Ids with every vision span holding its grid's number of pads.

  SGLang (`qwen_vl.py`) accepts prompts whose vision spans are either unexpanded (one
  `<|image_pad|>` per image, as the chat template renders them) or already expanded by
  the HF processor (one pad per merged patch); it re-expands both to the same ids. We do
  the same on ids: each span of pads must hold either 1 pad or exactly the image's token
  count, and spans must match `image_data` / `video_data` in number and order.
  """
  ids_T = np.asarray(ids, np.int32)
  m = cfg.vision.spatial_merge_size
  pieces, cursor = [], 0
  spans = sorted(
    [(s, n, "image") for s, n in _spans(ids_T, cfg.image_token_id)]
    + [(s, n, "video") for s, n in _spans(ids_T, cfg.video_token_id)]
  )
  kinds = [k for _, _, k in spans]
  if kinds != [v.kind for v in vision]:
    raise ProtocolError(
      f"the prompt's vision spans {kinds} do not match the media sent "
      f"({[v.kind for v in vision]}, images first then videos)"
    )
  for (start, n, kind), v in zip(spans, vision):
    want = processor.num_vision_tokens(v.grid_thw, m)
    if n not in (1, want):
      raise ProtocolError(
        f"a {kind} span holds {n} pad tokens; expected 1 (unexpanded) or "
        f"{want} for grid {tuple(v.grid_thw)}"
      )
    pad = cfg.image_token_id if kind == "image" else cfg.video_token_id
    pieces += [ids_T[cursor:start], np.full(want, pad, np.int32)]
    cursor = start + n
  pieces.append(ids_T[cursor:])
  return np.concatenate(pieces)


def build_sequence(
  req: GenerateRequest,
  tokenizer: Tokenizer,
  cfg: ModelConfig,
  proc: processor.VisionProcessorConfig,
  limits: media.MediaLimits = media.DEFAULT_LIMITS,
  cache: media_cache.MediaCache | None = None,
) -> SequenceInputs:
  """The request's prompt as SequenceInputs (raises ProtocolError on bad input);
  its media decoded once per `cache`."""
  if req.text is not None:
    ids = tokenizer.encode(req.text)
  elif req.input_ids is not None:
    ids = list(req.input_ids)
  else:
    raise ProtocolError("the prompt needs text or input_ids")
  if not ids:
    raise ProtocolError("the prompt is empty")
  # Images and videos come in separate lists; the prompt fixes their interleaving.
  order = _spans_order(ids, cfg)
  n_img, n_vid = len(req.image_data), len(req.video_data)
  if order.count("image") != n_img or order.count("video") != n_vid:
    raise ProtocolError(
      f"the prompt has {order.count('image')} image and "
      f"{order.count('video')} video placeholder(s) but the request sent "
      f"{n_img} image(s) and {n_vid} video(s)"
    )
  vision = load_media(req, proc, limits, cache)
  images = iter([v for v in vision if v.kind == "image"])
  videos = iter([v for v in vision if v.kind == "video"])
  ordered = [next(images) if k == "image" else next(videos) for k in order]
  tokens = expand_prompt(ids, ordered, cfg)
  try:
    return inputs.sequence_from_tokens(tokens, ordered, cfg)
  except ValueError as e:
    raise ProtocolError(str(e)) from e


def _spans_order(ids: list[int], cfg: ModelConfig) -> list[str]:
  ids_T = np.asarray(ids, np.int32)
  spans = sorted(
    [(s, "image") for s, _ in _spans(ids_T, cfg.image_token_id)]
    + [(s, "video") for s, _ in _spans(ids_T, cfg.video_token_id)]
  )
  return [k for _, k in spans]
