"""M-RoPE position ids for Qwen2.5-VL sequences (host-side numpy).

Entry points: `get_rope_index` (one sequence; its docstring gives the rule for text
and vision spans and the `text_after_vision` choice), `get_rope_index_batch`,
`text_positions`, `vision_positions`. `mrope_delta` = max(position) + 1 -
len(sequence): decoding continues with text position len + delta.

Names: T tokens, B batch rows, 3 rotary sections.
"""

import itertools
from collections.abc import Iterator, Sequence

import numpy as np

MAX_PLUS_ONE = "max_plus_one"
GRID_EXTENT = "grid_extent"
_MODES = (MAX_PLUS_ONE, GRID_EXTENT)

# HF's `mm_token_type_ids` convention.
_TEXT, _IMAGE, _VIDEO = 0, 1, 2


def text_positions(n: int, start: int = 0) -> np.ndarray:
  """Positions of `n` text tokens starting at `start`: int32 [3, n]."""
  return np.broadcast_to(np.arange(start, start + n, dtype=np.int32), (3, n)).copy()


def vision_positions(
  start: int, grid_thw: Sequence[int], spatial_merge_size: int = 2, time_interval: float = 1.0
) -> np.ndarray:
  """Positions of one image/video span: int64 [3, t * h/m * w/m].

  Args:
    start: the text position the span starts at.
    grid_thw: (t, h, w) in patch units.
    spatial_merge_size: m, the merger's spatial merge size.
    time_interval: temporal spacing per grid step (1 for images,
      tokens_per_second * second_per_grid_t for videos).

  Returns:
    Temporal, height and width positions in the token order of the span.
  """
  t, h, w = (int(x) for x in grid_thw)
  gh, gw = h // spatial_merge_size, w // spatial_merge_size
  # float32 product, truncated: the same quantization as transformers.
  t_pos = (np.arange(t, dtype=np.float32) * np.float32(time_interval)).astype(np.int64)
  pos_t = np.repeat(t_pos, gh * gw)
  pos_h = np.tile(np.repeat(np.arange(gh, dtype=np.int64), gw), t)
  pos_w = np.tile(np.arange(gw, dtype=np.int64), t * gh)
  return np.stack([pos_t, pos_h, pos_w]) + start


def _token_types(input_ids_T: np.ndarray, image_token_id: int, video_token_id: int) -> np.ndarray:
  types_T = np.zeros(input_ids_T.shape, dtype=np.int64)
  types_T[input_ids_T == image_token_id] = _IMAGE
  types_T[input_ids_T == video_token_id] = _VIDEO
  return types_T


def _positions_one(
  types_T: np.ndarray,
  grids: dict[int, Iterator],
  seconds: Iterator,
  spatial_merge_size: int,
  tokens_per_second: float,
  text_after_vision: str,
) -> tuple[np.ndarray, int]:
  """Positions of one unpadded sequence, consuming its grids from `grids`."""
  n = int(types_T.shape[0])
  if n == 0:
    return np.zeros((3, 0), dtype=np.int64), 0
  chunks = []
  current = 0
  idx = 0
  for kind, run in itertools.groupby(types_T.tolist()):
    run_len = len(list(run))
    idx += run_len
    if kind == _TEXT:
      chunks.append(text_positions(run_len, current).astype(np.int64))
      current += run_len
      continue
    if kind not in (_IMAGE, _VIDEO):
      raise ValueError(f"unknown mm_token_type {kind}")
    name = "image" if kind == _IMAGE else "video"
    # A run of pads may hold several back-to-back spans of the same kind;
    # split it by the grids' token counts.
    while run_len > 0:
      grid = next(grids[kind], None)
      if grid is None:
        raise ValueError(f"more {name} tokens than {name} grids")
      t, h, w = (int(x) for x in grid)
      count = t * (h // spatial_merge_size) * (w // spatial_merge_size)
      if count <= 0 or count > run_len:
        raise ValueError(
          f"{name} grid {(t, h, w)} needs {count} tokens, but the span "
          f"ending at token {idx} has {run_len} left"
        )
      if kind == _VIDEO:
        # The float32 product, as transformers computes it (exact as a float).
        interval = float(np.float32(tokens_per_second) * np.float32(next(seconds)))
      else:
        interval = 1.0
      pos = vision_positions(current, (t, h, w), spatial_merge_size, interval)
      chunks.append(pos)
      if text_after_vision == MAX_PLUS_ONE:
        current = int(pos.max()) + 1
      else:
        current += max(h, w) // spatial_merge_size
      run_len -= count
  positions_3T = np.concatenate(chunks, axis=1)
  return positions_3T, int(positions_3T.max()) + 1 - n


def _grid_list(grid_thw) -> list[tuple[int, int, int]]:
  if grid_thw is None:
    return []
  return [(int(t), int(h), int(w)) for t, h, w in np.asarray(grid_thw).reshape(-1, 3)]


def _iterators(image_grid_thw, video_grid_thw, second_per_grid_ts):
  images = _grid_list(image_grid_thw)
  videos = _grid_list(video_grid_thw)
  if second_per_grid_ts is None:
    seconds = [1.0] * len(videos)
  else:
    seconds = [float(s) for s in np.asarray(second_per_grid_ts).reshape(-1)]
    if len(seconds) != len(videos):
      raise ValueError(f"{len(seconds)} second_per_grid_ts for {len(videos)} videos")
  return {_IMAGE: iter(images), _VIDEO: iter(videos)}, iter(seconds)


def _check_all_used(grids: dict[int, Iterator]) -> None:
  for kind, name in ((_IMAGE, "image"), (_VIDEO, "video")):
    if next(grids[kind], None) is not None:
      raise ValueError(f"more {name} grids than {name} spans in the tokens")


def get_rope_index(
  input_ids_T: Sequence[int] | np.ndarray,
  image_grid_thw: Sequence[Sequence[int]] | np.ndarray | None = None,
  video_grid_thw: Sequence[Sequence[int]] | np.ndarray | None = None,
  second_per_grid_ts: Sequence[float] | np.ndarray | None = None,
  *,
  image_token_id: int,
  video_token_id: int,
  spatial_merge_size: int = 2,
  tokens_per_second: float = 2,
  mm_token_type_ids_T: Sequence[int] | np.ndarray | None = None,
  text_after_vision: str = MAX_PLUS_ONE,
) -> tuple[np.ndarray, int]:
  """M-RoPE positions of one unpadded sequence.

  Text tokens get one position shared by the three rotary sections
  (temporal, height, width). A vision span of grid (t, h, w) (patch units) has
  t * (h/m) * (w/m) tokens (m = spatial merge size) whose positions start at the
  current text position `s`:

    temporal = s + floor(k * interval)   k = 0..t-1
    height   = s + i                      i = 0..h/m-1
    width    = s + j                      j = 0..w/m-1

  with interval = tokens_per_second * second_per_grid_t for videos and 1 for
  images. The product is taken in float32 before truncation, as transformers
  does with its float32 `second_per_grid_ts` tensor (a power-of-two
  tokens_per_second, Qwen2.5-VL's 2, makes SGLang's `k * spg * tps` order give
  identical results). Images always have t == 1, so SGLang's image interval of 0
  and transformers' 1 agree.

  Where the text after a vision span starts is the one rule the implementations
  disagree on, selected by `text_after_vision`:

    "max_plus_one" (default): at max(all positions so far) + 1. This is the
        original Qwen2.5-VL rule, used by SGLang, vLLM and veRL.
    "grid_extent": at s + max(h, w) / m, transformers 5.x's rule.

  They agree for text and images, and differ for videos whose temporal
  positions (t-1) * interval run past the spatial extent. The trainer must use
  the rule of the rollout server that produced the behaviour logprobs; ours is
  SGLang-compatible, hence the default.

  Args:
    input_ids_T: token ids, vision pads already expanded.
    image_grid_thw: (t, h, w) per image, in order of appearance.
    video_grid_thw: (t, h, w) per video, in order of appearance.
    second_per_grid_ts: seconds per temporal grid step, per video (default
      1.0 each, as transformers).
    image_token_id: id of `<|image_pad|>`.
    video_token_id: id of `<|video_pad|>`.
    spatial_merge_size: the vision merger's spatial merge size.
    tokens_per_second: `vision_config.tokens_per_second`.
    mm_token_type_ids_T: 0 text / 1 image / 2 video per token; derived from
      the pad ids when not given.
    text_after_vision: "max_plus_one" (SGLang, default) or "grid_extent"
      (transformers 5.x); see above.

  Returns:
    positions_3T: int32 [3, T].
    mrope_delta: max(positions) + 1 - T.

  Raises:
    ValueError: if vision spans and grids do not match.
  """
  if text_after_vision not in _MODES:
    raise ValueError(f"text_after_vision must be one of {_MODES}")
  input_ids_T = np.asarray(input_ids_T).reshape(-1)
  if mm_token_type_ids_T is None:
    types_T = _token_types(input_ids_T, image_token_id, video_token_id)
  else:
    types_T = np.asarray(mm_token_type_ids_T).reshape(-1)
    if types_T.shape != input_ids_T.shape:
      raise ValueError("mm_token_type_ids_T and input_ids_T differ in length")
  grids, seconds = _iterators(image_grid_thw, video_grid_thw, second_per_grid_ts)
  positions_3T, delta = _positions_one(
    types_T, grids, seconds, spatial_merge_size, tokens_per_second, text_after_vision
  )
  _check_all_used(grids)
  return positions_3T.astype(np.int32), delta


def get_rope_index_batch(
  input_ids_BT: np.ndarray,
  attention_mask_BT: np.ndarray | None = None,
  image_grid_thw: Sequence[Sequence[int]] | np.ndarray | None = None,
  video_grid_thw: Sequence[Sequence[int]] | np.ndarray | None = None,
  second_per_grid_ts: Sequence[float] | np.ndarray | None = None,
  *,
  image_token_id: int,
  video_token_id: int,
  spatial_merge_size: int = 2,
  tokens_per_second: float = 2,
  mm_token_type_ids_BT: np.ndarray | None = None,
  text_after_vision: str = MAX_PLUS_ONE,
) -> tuple[np.ndarray, np.ndarray]:
  """M-RoPE positions of a padded batch, in transformers' [3, B, T] layout.

  Grids and `second_per_grid_ts` list every row's images/videos in row order,
  as the HF processor batches them. Each row's positions are computed over its
  unmasked tokens (left or right padding); masked slots hold 0, as in
  transformers.

  Args:
    input_ids_BT: token ids [B, T].
    attention_mask_BT: 1 for real tokens, 0 for padding; all real if None.
    image_grid_thw: (t, h, w) per image over the whole batch.
    video_grid_thw: (t, h, w) per video over the whole batch.
    second_per_grid_ts: per video over the whole batch.
    image_token_id: id of `<|image_pad|>`.
    video_token_id: id of `<|video_pad|>`.
    spatial_merge_size: the vision merger's spatial merge size.
    tokens_per_second: `vision_config.tokens_per_second`.
    mm_token_type_ids_BT: 0/1/2 per token; derived from ids when not given.
    text_after_vision: "max_plus_one" or "grid_extent".

  Returns:
    positions_3BT: int32 [3, B, T].
    mrope_deltas_B: int32 [B] (transformers returns the same as [B, 1]).
  """
  if text_after_vision not in _MODES:
    raise ValueError(f"text_after_vision must be one of {_MODES}")
  input_ids_BT = np.asarray(input_ids_BT)
  if input_ids_BT.ndim != 2:
    raise ValueError(f"input_ids_BT must be [B, T], got {input_ids_BT.shape}")
  b, t = input_ids_BT.shape
  if mm_token_type_ids_BT is None:
    types_BT = _token_types(input_ids_BT, image_token_id, video_token_id)
  else:
    types_BT = np.asarray(mm_token_type_ids_BT).reshape(b, t)
  if attention_mask_BT is None:
    mask_BT = np.ones((b, t), dtype=bool)
  else:
    mask_BT = np.asarray(attention_mask_BT).reshape(b, t).astype(bool)
  grids, seconds = _iterators(image_grid_thw, video_grid_thw, second_per_grid_ts)
  positions_3BT = np.zeros((3, b, t), dtype=np.int32)
  deltas_B = np.zeros((b,), dtype=np.int32)
  for row in range(b):
    pos_3T, delta = _positions_one(
      types_BT[row][mask_BT[row]],
      grids,
      seconds,
      spatial_merge_size,
      tokens_per_second,
      text_after_vision,
    )
    positions_3BT[:, row, mask_BT[row]] = pos_3T
    deltas_B[row] = delta
  _check_all_used(grids)
  return positions_3BT, deltas_B
