"""The packed train batch shared by all strategies, built from a plan.

`materialize` packs a plan's `TrainSequence`s into a `TrainBatch` of host buffers, and
`to_device` places them. Per device and microbatch the buffers hold `capacity` tokens and
`patch_capacity` vision patches: static buckets, so the step compiles once per (capacity,
patch capacity, M) bucket.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

import jax
import numpy as np

from fluxjax.models import processor, vlm
from fluxjax.models import vision as vision_lib
from fluxjax.models.config import ModelConfig
from fluxjax.models.inputs import SequenceInputs
from fluxjax.planning.plan import Plan, capacity_bucket, doubling_bucket
from fluxjax.sharding import mesh as mesh_lib

P = jax.sharding.PartitionSpec


@dataclasses.dataclass
class TrainSequence:
  """One sequence with its per-token training fields (aligned with tokens).

  Attributes:
    inputs: tokens, positions and media.
    loss_mask_T: 1 where the token is a trained target (response tokens).
    advantages_T: advantage per token.
    old_logprobs_T: behaviour-policy logprob of each token (what the rollout
      engine reported when it sampled it).
    ref_logprobs_T: reference-policy logprob of each token (for KL), or None.
    prox_logprobs_T: proximal-policy logprob (the trainer's policy before this
      update, for decoupled importance correction), or None = behaviour.

  `loss_mask_T` may hold weights rather than 0/1: the step divides by their
  global sum, so 1/len(sequence) weights give sequence-mean aggregation.

  The per-token RL fields are aligned with the tokens they score (`old_logprobs_T[i]` is
  the behaviour logprob of token i); `materialize` shifts them to the input position
  that predicts them: input j predicts target j+1 of the same sequence.
  """

  inputs: SequenceInputs
  loss_mask_T: np.ndarray
  advantages_T: np.ndarray
  old_logprobs_T: np.ndarray
  ref_logprobs_T: np.ndarray | None = None
  prox_logprobs_T: np.ndarray | None = None

  def __len__(self):
    return len(self.inputs)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TrainBatch:
  """Buffers [M, D, ...] (positions [M, 3, D, C]).

  M microbatches (scanned, gradients accumulate), D devices (the leading device axis is
  sharded over every mesh axis, so device d holds row d), C `capacity` tokens.
  `materialize` builds them as host numpy arrays; `to_device` places them.
  """

  inputs: vlm.PackedInputs
  targets: jax.Array | np.ndarray
  loss_mask: jax.Array | np.ndarray
  advantages: jax.Array | np.ndarray
  old_logprobs: jax.Array | np.ndarray
  ref_logprobs: jax.Array | np.ndarray
  prox_logprobs: jax.Array | np.ndarray
  # Per token, 1 + the index of its sequence among the step's (0: padding);
  # set when `sequence_slots` > 0, the static number of sequences a step may
  # hold, for the step's per-sequence metric sums (train_step.sequence_sums).
  sequence_ids: jax.Array | np.ndarray | None = None
  sequence_slots: int = dataclasses.field(default=0, metadata=dict(static=True))

  @property
  def num_microbatches(self) -> int:
    return self.targets.shape[0]

  def microbatch(self, m: int) -> TrainBatch:
    return jax.tree.map(lambda x: x[m], self)


def _shifted(x_T: np.ndarray) -> np.ndarray:
  """Aligns a per-token field with the input position that predicts it."""
  out = np.zeros_like(x_T)
  out[:-1] = x_T[1:]
  return out


def _is_vision_token(tokens_T: np.ndarray, cfg: ModelConfig) -> np.ndarray:
  return (tokens_T == cfg.image_token_id) | (tokens_T == cfg.video_token_id)


def num_patches(item: processor.VisionMeta) -> int:
  """Patches of a media item from its grid alone (pixels may live elsewhere)."""
  return processor.num_patches(item.grid_thw)


def _media_in_row(row, seqs: Sequence[TrainSequence], cfg: ModelConfig):
  """(stream positions of its pad tokens, item) for each image/video of a row."""
  offset = 0
  for s in row.seqs:
    seq = seqs[s]
    pads = np.flatnonzero(_is_vision_token(seq.inputs.tokens_T, cfg))
    start = 0
    for item in seq.inputs.media:
      count = num_patches(item) // cfg.vision.merge_unit
      yield offset + pads[start : start + count], item
      start += count
    # The prompt's pads come first; pad ids beyond the media's count were
    # sampled in the response and are text.
    if start > len(pads):
      raise ValueError(f"sequence {s}: {len(pads)} vision tokens but media give {start}")
    offset += len(seq)


@dataclasses.dataclass(frozen=True)
class VisionUnit:
  """Frames [lo, hi) (temporal patch groups) of one image/video, encoded together."""

  item: processor.VisionMeta
  lo: int
  hi: int

  @property
  def grid_thw(self) -> tuple[int, int, int]:
    _, h, w = self.item.grid_thw
    return (self.hi - self.lo, int(h), int(w))

  @property
  def num_patches(self) -> int:
    return processor.num_patches(self.grid_thw)


def vision_assignment(
  plan: Plan, seqs: Sequence[TrainSequence], cfg: ModelConfig, balance: bool = False
):
  """Which device encodes what, and where each merged embedding must go.

  Without balancing each image/video is encoded whole on the device holding
  its first pad token. With balancing, images and single video frames (the
  vision tower attends within a frame) are spread over the microbatch's
  devices by patch count, largest first onto the least-loaded device.

  Returns:
    Per microbatch: ({device: [VisionUnit in buffer order]},
                     [(item, [(device, buffer index) of each pad token])]).
  """
  out = []
  for rows in plan.microbatches:
    routes, firsts = [], []
    for row in rows:
      for stream_pos, item in _media_in_row(row, seqs, cfg):
        routes.append((item, [plan.slot(row, p) for p in stream_pos]))
        firsts.append(plan.slot(row, stream_pos[0])[0])
    units: dict[int, list[VisionUnit]] = {}
    if not balance:
      for (item, _), d in zip(routes, firsts):
        units.setdefault(d, []).append(VisionUnit(item, 0, int(item.grid_thw[0])))
    else:
      frames = [
        VisionUnit(item, f, f + 1) for item, _ in routes for f in range(int(item.grid_thw[0]))
      ]
      load = np.zeros(plan.num_devices)
      for u in sorted(frames, key=lambda u: -u.num_patches):  # stable: ties keep order
        d = int(np.argmin(load))
        load[d] += u.num_patches
        units.setdefault(d, []).append(u)
    out.append((units, routes))
  return out


def patch_capacity_for(
  plan: Plan,
  seqs: Sequence[TrainSequence],
  cfg: ModelConfig,
  buckets: Sequence[int] | None = None,
  balance: bool = False,
) -> int:
  """The smallest patch bucket holding every device's vision work in every microbatch."""
  return _patch_bucket(vision_assignment(plan, seqs, cfg, balance), cfg, buckets)


# The open patch ladder's first rung. On the XLA path every vision attention
# block (window or full) is dense over the buffer, so padding costs its square
# and a coarser ladder loses more than its fewer compiles save: at 320 patches
# a 1024 buffer made a tiny-preset update 4.7x slower than 512. The ladder has
# no top: a device encodes each image or video whole where its first token
# sits, so one long video can need more patches than any multiple of the
# token capacity (72,192 in a 3B smoke run at 32k tokens a row).
SMALLEST_PATCH_BUCKET = 256


def _patch_bucket(assignment, cfg: ModelConfig, buckets: Sequence[int] | None) -> int:
  need = cfg.vision.merge_unit  # never zero: the vision inputs keep one static shape
  for units, _ in assignment:
    for us in units.values():
      need = max(need, sum(u.num_patches for u in us))
  if buckets is None:
    return doubling_bucket(need, SMALLEST_PATCH_BUCKET)
  return capacity_bucket(need, buckets, "patches")


def vision_route_stats(
  plan: Plan, seqs: Sequence[TrainSequence], cfg: ModelConfig, balance: bool = False
) -> dict[str, float]:
  """Patch balance and the traffic of routing merged embeddings to their tokens.

  `moved` counts merged embeddings encoded on another device than the one
  holding their token; each moves `text hidden x dtype` bytes in the gather.
  """
  per_mb_max, per_mb_mean, moved = [], [], 0
  merge = cfg.vision.merge_unit
  for units, routes in vision_assignment(plan, seqs, cfg, balance):
    load = np.zeros(plan.num_devices)
    where = {}
    for d, us in units.items():
      for u in us:
        load[d] += u.num_patches
        where[(id(u.item), u.lo)] = d
    for item, slots in routes:
      per_frame = processor.num_patches(item.grid_thw) // int(item.grid_thw[0]) // merge
      for k, (d, _) in enumerate(slots):
        frame = k // per_frame
        home = where.get((id(item), frame), where.get((id(item), 0)))
        moved += home != d
    per_mb_max.append(load.max())
    per_mb_mean.append(load.mean())
  bytes_per = cfg.text.hidden_size * np.dtype(cfg.dtype).itemsize
  return {
    "patch_max_over_mean": float(np.sum(per_mb_max) / max(np.sum(per_mb_mean), 1e-9)),
    "embeddings_moved": int(moved),
    "bytes_moved": float(moved * bytes_per),
  }


def media_placement(plan: Plan, seqs: Sequence[TrainSequence], cfg: ModelConfig):
  """{(microbatch, device): [media items in buffer order]}.

  The one rule for where vision work happens: each image/video is encoded on
  the device holding its first pad token. The ShadowLoader uses it to send
  each item's preprocessing to the host that owns that device.
  """
  out: dict[tuple[int, int], list] = {}
  for m, rows in enumerate(plan.microbatches):
    for row in rows:
      for stream_pos, item in _media_in_row(row, seqs, cfg):
        out.setdefault((m, plan.slot(row, stream_pos[0])[0]), []).append(item)
  return out


def _row_streams(
  row, seqs: Sequence[TrainSequence], first_sequence: int | None
) -> dict[str, np.ndarray]:
  """A row's sequences end to end, one array per buffer (positions [3, n]);
  with `first_sequence`, also each token's 1 + first_sequence + its sequence's index."""
  stream: dict[str, list[np.ndarray]] = {
    k: [] for k in ("tok", "pos", "seg", "spos", "tgt", "mask", "adv", "old", "ref", "prox")
  }
  if first_sequence is not None:
    stream["sid"] = []
  for j, s in enumerate(row.seqs):
    seq = seqs[s]
    t = seq.inputs.tokens_T
    n = len(t)
    stream["tok"].append(t)
    stream["pos"].append(seq.inputs.positions_3T)
    stream["seg"].append(np.full(n, j + 1, np.int32))
    stream["spos"].append(np.arange(n, dtype=np.int32))
    stream["tgt"].append(_shifted(t))
    stream["mask"].append(_shifted(seq.loss_mask_T.astype(np.float32)))
    stream["adv"].append(_shifted(seq.advantages_T.astype(np.float32)))
    stream["old"].append(_shifted(seq.old_logprobs_T.astype(np.float32)))
    ref = seq.ref_logprobs_T if seq.ref_logprobs_T is not None else np.zeros(n, np.float32)
    stream["ref"].append(_shifted(ref.astype(np.float32)))
    prox = seq.prox_logprobs_T if seq.prox_logprobs_T is not None else seq.old_logprobs_T
    stream["prox"].append(_shifted(prox.astype(np.float32)))
    if first_sequence is not None:
      stream["sid"].append(np.full(n, 1 + first_sequence + s, np.int32))
  return {k: np.concatenate(v, axis=-1) for k, v in stream.items()}


def _fill_row(
  text: dict[str, np.ndarray], positions, m: int, plan: Plan, row, seqs, first_sequence
) -> None:
  """Writes a row's token buffers: its stream padded to degree x section
  capacity, one section-wide slice per device of the row."""
  cap, sec = plan.section(row)
  width = row.degree * cap
  streams = _row_streams(row, seqs, first_sequence)
  pad = width - streams["tok"].shape[-1]
  if pad < 0:
    raise ValueError(
      f"row on devices {row.devices} holds {streams['tok'].shape[-1]} tokens > {width}"
    )
  for name, arr in streams.items():
    arr = np.concatenate([arr, np.zeros(arr.shape[:-1] + (pad,), arr.dtype)], axis=-1)
    for k, d in enumerate(row.devices):
      piece = arr[..., k * cap : (k + 1) * cap]
      if name == "pos":
        positions[m, :, d, sec : sec + cap] = piece
      else:
        text[name][m, d, sec : sec + cap] = piece


def _fill_vision(
  bufs, m: int, assigned, cfg: ModelConfig, patch_capacity: int, patch_source, devices
):
  """Microbatch m's vision buffers: each unit is encoded where
  `vision_assignment` put it; merged embeddings are then gathered to wherever
  their tokens sit (`vision_index`)."""
  patches, frame_ids, window_ids, hw, vision_index = bufs
  vcfg = cfg.vision
  merged_cap = patch_capacity // vcfg.merge_unit
  units, routes = assigned
  frame_base = {}
  for d, us in units.items():
    n_patches = sum(u.num_patches for u in us)
    if n_patches > patch_capacity:
      raise ValueError(
        f"device {d} microbatch {m}: {n_patches} patches exceed the patch capacity {patch_capacity}"
      )
    if devices is None or d in devices:
      pieces = []
      for u in us:
        per_frame = u.num_patches // (u.hi - u.lo)
        pieces.append(np.asarray(patch_source(u.item))[u.lo * per_frame : u.hi * per_frame])
      vis = vision_lib.make_vision_inputs(pieces, [u.grid_thw for u in us], vcfg, patch_capacity)
      patches[m, d], frame_ids[m, d] = vis.patches_BNP[0], vis.frame_ids_BN[0]
      window_ids[m, d], hw[m, d] = vis.window_ids_BN[0], vis.hw_BN2[0]
    o = 0
    for u in us:
      per_frame = u.num_patches // (u.hi - u.lo) // vcfg.merge_unit
      for f in range(u.lo, u.hi):  # where frame f's merged embeddings start
        frame_base[(id(u.item), f)] = d * merged_cap + o + (f - u.lo) * per_frame
      o += u.num_patches // vcfg.merge_unit
  for item, slots in routes:
    per_frame = processor.num_patches(item.grid_thw) // int(item.grid_thw[0]) // vcfg.merge_unit
    for k, (d, i) in enumerate(slots):
      vision_index[m, d, i] = frame_base[(id(item), k // per_frame)] + k % per_frame


def materialize(
  plan: Plan,
  seqs: Sequence[TrainSequence],
  cfg: ModelConfig,
  patch_capacity: int | Sequence[int] | None = None,
  patch_source=None,
  balance_vision: bool = False,
  devices: Collection[int] | None = None,
  *,
  first_sequence: int = 0,
  sequence_slots: int = 0,
) -> TrainBatch:
  """Host numpy buffers for a plan (see `to_device`).

  Args:
    plan: the strategy's plan for these sequences.
    seqs: the sequences; their media need only `grid_thw` (and `kind`).
    cfg: the model config.
    patch_capacity: patches per device per microbatch (a bucket), or the
      buckets to pick the smallest fitting one from, or None for the open
      ladder from `SMALLEST_PATCH_BUCKET` in powers of two.
    patch_source: item -> float [num_patches, patch_dim]; default `item.patches`
      (in-process). The ShadowLoader passes a lookup into its worker store, so
      pixels never pass through the controller's sequences.
    balance_vision: spread images and video frames over devices by patch
      count (see `vision_assignment`) instead of encoding each where its first
      token sits.
    devices: the plan devices whose vision buffers are filled (None: all).
      A process of a multi-controller run passes its own
      (`sharding.mesh.local_device_indices`): only those rows reach its
      devices, so it reads no other process's pixels. Token rows are
      filled for every device (metadata the controller already holds).
    first_sequence: the index of `seqs[0]` among the step's sequences (a
      stream trainer's later parts start where the earlier ones ended).
    sequence_slots: how many sequences the step may hold; > 0 fills
      `sequence_ids` for the step's per-sequence metrics.
  """
  if sequence_slots and first_sequence + len(seqs) > sequence_slots:
    raise ValueError(
      f"sequences {first_sequence}..{first_sequence + len(seqs) - 1} of a step exceed its"
      f" {sequence_slots} sequence slots (prompts per step x responses per prompt)"
    )
  first = first_sequence if sequence_slots else None
  patch_source = patch_source or (lambda item: item.patches)
  if len(seqs) != len(plan.lengths) or any(len(s) != n for s, n in zip(seqs, plan.lengths)):
    raise ValueError("the plan was made for other sequence lengths")
  m_count, d_count, cap = plan.num_microbatches, plan.num_devices, plan.capacity
  vcfg = cfg.vision
  assignment = vision_assignment(plan, seqs, cfg, balance_vision)
  if not isinstance(patch_capacity, int):
    patch_capacity = _patch_bucket(assignment, cfg, patch_capacity)
  shape = (m_count, d_count, cap)
  tokens = np.zeros(shape, np.int32)
  positions = np.zeros((m_count, 3, d_count, cap), np.int32)
  segment_ids, segment_pos = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
  targets = np.zeros(shape, np.int32)
  vision_index = np.full(shape, -1, np.int32)  # -1: a text position
  loss_mask, adv = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
  old_lp, ref_lp = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
  prox_lp = np.zeros(shape, np.float32)
  patches = np.zeros((m_count, d_count, patch_capacity, vcfg.patch_dim), np.float32)
  frame_ids = np.zeros((m_count, d_count, patch_capacity), np.int32)
  window_ids = np.zeros((m_count, d_count, patch_capacity), np.int32)
  hw = np.zeros((m_count, d_count, patch_capacity, 2), np.int32)

  text = {
    "tok": tokens,
    "seg": segment_ids,
    "spos": segment_pos,
    "tgt": targets,
    "mask": loss_mask,
    "adv": adv,
    "old": old_lp,
    "ref": ref_lp,
    "prox": prox_lp,
  }
  if first is not None:
    text["sid"] = np.zeros(shape, np.int32)
  vision_bufs = (patches, frame_ids, window_ids, hw, vision_index)
  for m, rows in enumerate(plan.microbatches):
    for row in rows:
      if row.seqs:  # an empty row's buffers stay zero (segment id 0 = padding)
        _fill_row(text, positions, m, plan, row, seqs, first)
    _fill_vision(vision_bufs, m, assignment[m], cfg, patch_capacity, patch_source, devices)

  inputs = vlm.PackedInputs(
    tokens,
    positions,
    segment_ids,
    segment_pos,
    vision_lib.VisionInputs(patches, frame_ids, window_ids, hw),
    vision_index,
  )
  return TrainBatch(
    inputs,
    targets,
    loss_mask,
    adv,
    old_lp,
    ref_lp,
    prox_lp,
    sequence_ids=text.get("sid"),
    sequence_slots=sequence_slots,
  )


def batch_shardings(batch: TrainBatch, mesh: jax.sharding.Mesh) -> TrainBatch:
  """The device axis of every buffer sharded over all mesh axes."""
  rows = mesh_lib.batch_axes(mesh)

  def spec(path, x):
    is_positions = any(getattr(k, "name", None) == "positions_3BT" for k in path)
    lead = (None, None) if is_positions else (None,)
    rest = (None,) * (x.ndim - len(lead) - 1)
    return jax.sharding.NamedSharding(mesh, P(*lead, rows, *rest))

  return jax.tree_util.tree_map_with_path(spec, batch)


def to_device(batch: TrainBatch, mesh: jax.sharding.Mesh) -> TrainBatch:
  """Places host buffers; each process only transfers its own devices' rows."""
  shardings = batch_shardings(batch, mesh)

  def place(x: np.ndarray, s: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

  return jax.tree.map(place, batch, shardings)
