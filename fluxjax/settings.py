"""A run's configuration as typed, frozen sections.

configs/vlm.py is the one source of every default and says what each field
means; this module holds each section's shape once, with no defaults (but
`MediaLimits`, a domain class whose defaults vlm.py reads), and
`Settings.of(config)` reads a resolved ConfigDict into it: a field the config
lacks, a key no section declares or a value not of its field's type is an
error naming the flag. Library code receives the sections it needs
(`settings.rl`, `settings.rollout`, ...); only the entry points and the
run's composition root see the whole.
"""

from __future__ import annotations

import dataclasses
import numbers
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  every: int


@dataclasses.dataclass(frozen=True)
class Lag:
  """`coordinator.lag`: the admission mode, and the adaptive controller and
  staleness metric that rl/async_control.py runs on this section as it is."""

  mode: str
  controller: str
  fixed_lag: int
  min_lag: int
  max_lag: int
  sync_interval: int
  target_staleness: float
  tolerance: float
  hard_bound: float
  ema_decay: float
  kp: float
  ki: float
  kd: float
  max_step: float
  initial_ratio: float
  min_async_ratio: float
  max_async_ratio: float
  gap_weight: float
  kl_weight: float
  iw_weight: float
  max_version_gap: float
  kl_normalizer: float
  iw_normalizer: float


@dataclasses.dataclass(frozen=True)
class Coordinator:
  lag: Lag
  stream_groups: int
  response_records: bool


@dataclasses.dataclass(frozen=True)
class MediaLimits:
  """What a media file may claim in its header; anything outside is a bad file
  (the `data.limits` section; configs/vlm.py takes these defaults).

  Checked from header facts before any pixel buffer is allocated, by the
  metadata probe (`fluxjax.data.meta.media_ref`) and again by every decode
  (`models/media.py` `load_image`, `load_video`), which may run where no
  probe did (a rollout server decoding a request's media).

  Attributes:
    max_image_pixels: largest image (height * width). PIL refuses more than
      2 * PIL.Image.MAX_IMAGE_PIXELS (about 179M) on its own, so a larger
      value has no effect.
    min_side: smallest side of an image or a video frame, in pixels.
    max_video_frames: most frames in a video file; every frame up to the last
      sampled one is decoded, so this bounds a decode's work.
    max_frame_pixels: largest video frame (height * width).
    max_sampled_video_pixels: most pixels of the frames a decode keeps
      (sampled frames * height * width): the uint8 RGB array `load_video`
      returns takes 3 bytes per pixel (6 GB at the default).
  """

  max_image_pixels: int = 64_000_000
  min_side: int = 1
  max_video_frames: int = 1_000_000
  max_frame_pixels: int = 36_000_000  # 8K UHD (7680 x 4320) fits
  max_sampled_video_pixels: int = 2_000_000_000


@dataclasses.dataclass(frozen=True)
class Vision:
  image_min_pixels: int
  image_max_pixels: int
  video_min_pixels: int
  video_max_pixels: int
  video_max_frames: int


@dataclasses.dataclass(frozen=True)
class Data:
  train: str
  eval: str
  holdout: float
  mix: str
  synth_train: int
  synth_eval: int
  seed: int
  num_workers: int
  blind: bool
  limits: MediaLimits
  vision: Vision


@dataclasses.dataclass(frozen=True)
class Distributed:
  auto: bool
  coordinator_address: str
  num_processes: int
  process_id: int
  local_device_ids: str


@dataclasses.dataclass(frozen=True)
class Eval:
  every: int
  prompts: int
  samples_per_prompt: int
  greedy: bool
  reward: str


@dataclasses.dataclass(frozen=True)
class Faults:
  nonfinite_steps: int
  unwritten_publishes: int
  failed_rounds: int
  prompt_errors: int
  request_retries: int

  def limits(self) -> dict[str, int]:
    """Every fault's limit in a row, by name (faults.Faults takes them)."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Mesh:
  data: int
  fsdp: int


@dataclasses.dataclass(frozen=True)
class Model:
  preset: str
  hf_path: str
  tokenizer_path: str
  dtype: str
  param_dtype: str
  attention_backend: str
  decode_attention: str
  remat: str
  logprob_vocab_chunk: int
  mrope_text_after_vision: str


@dataclasses.dataclass(frozen=True)
class Optim:
  lr: float
  warmup_steps: int
  total_steps: int
  end_lr_frac: float
  max_grad_norm: float
  b1: float
  b2: float
  eps: float
  weight_decay: float
  lr_scale_steps: tuple[int, ...]
  lr_scales: tuple[float, ...]
  refuse_nonfinite: str


@dataclasses.dataclass(frozen=True)
class Reward:
  fn: str
  weights: tuple[float, ...]
  num_workers: int
  t_min: float
  t_max: float
  anchor_factor: float
  correct_threshold: float


@dataclasses.dataclass(frozen=True)
class RL:
  prompts_per_step: int
  responses_per_prompt: int
  max_new_tokens: int
  temperature: float
  updates_per_batch: int
  adv_std_normalize: bool
  adv_eps: float
  loss_agg_mode: str
  clip_low: float
  clip_high: float
  clip_c: float
  is_mode: str
  is_cap: float
  prox: str
  kl_coef: float
  kl_estimator: str
  kl_clamp: float
  ref_hf_path: str
  entropy_coef: float
  dynamic_sampling: bool
  max_refill_rounds: int
  reward: Reward


@dataclasses.dataclass(frozen=True)
class TailBatching:
  eta: float
  recycle: bool
  continue_in: str


@dataclasses.dataclass(frozen=True)
class Rollout:
  backend: str
  urls: tuple[str, ...]
  router_url: str
  launch: tuple[str, ...]
  router_launch: tuple[str, ...]
  num_servers: int
  server_gpus: str
  launch_timeout_s: float
  health_interval_s: float
  num_slots: int
  context_length: int
  num_continuous_decode_steps: int
  embedded_devices: int
  seeded: bool
  weight_sync: str
  weight_deltas: bool
  defer_updates: bool
  weight_group_backend: str
  weight_group_address: str
  weight_group_timeout_s: float
  weight_bucket_mb: float
  tail_batching: TailBatching


@dataclasses.dataclass(frozen=True)
class ChainFraction:
  """The share of warm-up samples whose reference response shows its
  reasoning, per difficulty level; `other`: samples without a level."""

  easy: float
  medium: float
  hard: float
  other: float

  def at(self, level: str) -> float:
    """The share of `level` (one of the fields, which name the levels)."""
    named = level != "other" and level in {f.name for f in dataclasses.fields(self)}
    return getattr(self, level) if named else self.other


@dataclasses.dataclass(frozen=True)
class Guess:
  """Where the warm-up teaches a direct answer as a guess (rl/sft.py
  `Guesses`): on rows of `tasks`, and on rows at `levels`."""

  tasks: tuple[str, ...]
  levels: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class SFT:
  enabled: bool
  steps: int
  batch_size: int
  levels: tuple[str, ...]
  chain_fraction: ChainFraction
  guess: Guess
  lr: float
  warmup_steps: int
  end_lr_frac: float
  eval_every: int
  checkpoint_every: int
  export_dir: str


@dataclasses.dataclass(frozen=True)
class Sharding:
  strategy: str
  sp: int
  sync: str
  capacity: int
  capacity_buckets: tuple[int, ...]
  balance_vision: bool
  max_replicated_bytes: int


@dataclasses.dataclass(frozen=True)
class Settings:
  """The whole run (configs/vlm.py): each section typed, frozen."""

  variant: str
  seed: int
  total_steps: int
  data: Data
  eval: Eval
  checkpoint: Checkpoint
  model: Model
  mesh: Mesh
  distributed: Distributed
  sharding: Sharding
  rollout: Rollout
  rl: RL
  coordinator: Coordinator
  faults: Faults
  sft: SFT
  optim: Optim

  @classmethod
  def of(cls, config: Mapping[str, Any] | Settings) -> Settings:
    """The run's settings from its (resolved) ConfigDict; settings as they are.

    Raises:
      ValueError: the config lacks a field, or holds a key no section
        declares (a misspelt override), named as its flag.
    """
    if isinstance(config, Settings):
      return config
    return section(cls, config)


def section(cls: type[T], values: Mapping[str, Any], where: str = "") -> T:
  """`cls` (a section above) from a mapping with exactly its fields, each
  value of its field's type (an int is taken for a float, as 1 for 1.0)."""
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]  # cls is a section
  unknown = sorted(set(values.keys()) - set(names))
  if unknown:
    flags = ", ".join(f"--config.{where}{k}" for k in unknown)
    raise ValueError(f"{flags}: no such setting (fluxjax/settings.py lists them)")
  missing = [n for n in names if n not in values]
  if missing:
    flags = ", ".join(f"config.{where}{k}" for k in missing)
    raise ValueError(f"{flags} missing from the config (configs/vlm.py sets every field)")
  out = {}
  for name in names:
    kind, value = hints[name], values[name]
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
      out[name] = section(kind, value, f"{where}{name}.")
    else:
      out[name] = _typed(kind, value, f"--config.{where}{name}")
  return cls(**out)


def _typed(kind: Any, value: Any, flag: str) -> Any:
  """`value` as a field of type `kind` holds it: a scalar (int, float, bool,
  str) or a tuple of one of them; a value of another type is an error naming
  `flag`."""
  if typing.get_origin(kind) is tuple:
    item = typing.get_args(kind)[0]  # tuple[X, ...], the one tuple sections declare
    if isinstance(value, (tuple, list)) and all(_is(item, v) for v in value):
      return tuple(item(v) for v in value)
    raise ValueError(f"{flag}: expected a tuple of {item.__name__}, got {value!r}")
  if not _is(kind, value):
    raise ValueError(f"{flag}: expected {kind.__name__}, got {value!r}")
  return kind(value)


def _is(kind: type, value: Any) -> bool:
  """Whether `value` is a `kind` (int, float, bool or str): a bool is not a
  number, and an int is a float (--config.optim.lr=1 means 1.0)."""
  if kind is bool or isinstance(value, bool):
    return kind is bool and isinstance(value, bool)
  if kind is float:
    return isinstance(value, numbers.Real)
  if kind is int:
    return isinstance(value, numbers.Integral)
  return isinstance(value, kind)
