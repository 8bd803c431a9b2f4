"""Weight publishing: trainer parameters -> versioned HF folder -> every server.

Entry points: `publish_to_fleet` (write, then `Fleet.update_weights`: pause, flush,
update, resume), `publish_distributed` (torch.distributed buckets), `publish_in_process`
(swaps an embedded engine's arrays), `deferred_write` and `PublishReport`. The
refit sequence, a failed write, the distributed transport and the deferred publish
are told in docs/fleet.md, "Weight sync" and "Deferred publish".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import functools
import itertools
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import jax
import numpy as np

from fluxjax.models import hf_export, hf_load, vlm
from fluxjax.models import tokenizer as tokenizer_lib
from fluxjax.rollout import json_body, tensor_feed, weight_group, weight_protocol

log = logging.getLogger(__name__)


@dataclasses.dataclass
class PublishReport:
  """What a publish did.

  Attributes:
    version: the weight version published.
    path: the folder the servers were told to load; None when none was (an
      in-process publish, or a write that failed, when `failed` says why and
      every server still serves its previous version).
    seconds: per phase.
    failed: what failed: servers (marked down, refit when they rejoin) or
      the write.
    sent_bytes: bytes the trainer broadcast (the distributed transport).
    buckets: update calls the broadcast took (the distributed transport).
    pending: the servers' part of a deferred publish, still running on the
      rollout loop: a task whose result is the publish's final report (this
      one then says only what the trainer was blocked for); None when this
      report is final.
    reads_params: the publish still reads the trainer's arrays after it
      returns: the next update, which donates them, waits for the reads
      (the rest of `feed`'s gathers when there is one, else all of `pending`).
    feed: the items of a deferred publish, which the trainer's main thread
      gathers (`TensorFeed.pump`, then `finish` before the next update) and
      `pending` writes or sends: every deferred write, and a broadcast from
      a trainer that spans processes.
  """

  version: str
  path: str | None
  seconds: dict[str, float]
  failed: list[str]
  sent_bytes: int = 0
  buckets: int = 0
  pending: asyncio.Task | None = None
  reads_params: bool = False
  feed: tensor_feed.TensorFeed | None = None


def write_checkpoint(
  model: vlm.Qwen25VL,
  root: str,
  version: int | str,
  *,
  dtype: str = weight_protocol.PUBLISHED_DTYPE,
  extra_files: Mapping[str, str | bytes] | None = None,
  deltas: bool = False,
) -> str:
  """Writes <root>/v<version> atomically and returns its path.

  First clears what a writer killed mid-write left under `root` (process
  0, before the write's first collective). A model sharded across processes
  needs every process to call this (`hf_export.save_hf_checkpoint`). With
  `deltas` the folder also holds its changes from the latest earlier version
  under `root` (`delta_base`), which a server serving that version loads
  instead (models/hf_delta.py).

  Raises:
    OSError: the folder could not be written; nothing under `root` changed.
  """
  path, extra, delta_from = _prepare_write(root, version, extra_files, deltas)
  return hf_export.save_hf_checkpoint(
    model, path, dtype=dtype, extra_files=extra, delta_from=delta_from
  )


def _prepare_write(root: str, version: int | str, extra_files, deltas: bool):
  """(folder, files copied in, (base folder, base version) of its delta or
  None) of version `version` under `root`, once process 0 has cleared what a
  writer killed mid-write left there (before the write's first collective)."""
  extra = {"tokenizer.json": tokenizer_lib.ASSET_PATH} if extra_files is None else extra_files
  if jax.process_index() == 0:
    hf_export.remove_interrupted_writes(root)
  base = delta_base(root, version) if deltas else None
  delta_from = (version_path(root, base), base) if base is not None else None
  return version_path(root, version), extra, delta_from


def delta_base(root: str, version: int | str) -> str | None:
  """The latest version folder under `root` before `version` (what the fleet
  serves unless a publish failed); the same on every process."""
  if not str(version).isdigit() or not os.path.isdir(root):
    return None
  earlier = [
    int(e[1:])
    for e in os.listdir(root)
    if e[:1] == "v" and e[1:].isdigit() and int(e[1:]) < int(version)
  ]
  return str(max(earlier)) if earlier else None


def weights_root(workdir: str) -> str:
  """Where a run's published versions go: a folder its servers can read."""
  return os.path.join(workdir, "weights")


def version_path(root: str, version: int | str) -> str:
  return os.path.join(root, f"v{version}")


def take_part(
  model: vlm.Qwen25VL,
  weight_sync: str,
  root: str,
  version: int | str,
  deltas: bool = False,
  defer: bool = False,
) -> tensor_feed.TensorFeed | None:
  """A follower's part in a fleet publish of `model` (sharded across
  processes), while process 0 publishes it: the same collectives in the same
  order, as the `weight_sync` transport takes them (`WeightTransport.take_part`).

  Returns:
    None when the part is done; deferred, a feed whose gathers the caller
    runs (`TensorFeed.take`) as the leader announces them, the leader's main
    thread feeding its own part (`PublishReport.feed`).
  """
  return weight_transport(weight_sync).take_part(model, root, version, deltas=deltas, defer=defer)


def _row_feed(
  model: vlm.Qwen25VL,
  dtype: str = weight_protocol.PUBLISHED_DTYPE,
  consumer: Callable[[str], int] | None = None,
  **kwargs,
) -> tensor_feed.TensorFeed:
  """A feed of `model`'s published tensors in runs of rows
  (`hf_export.hf_tensor_rows`), each gathered when the feed asks for it, to
  the process `consumer(name)` names (default 0)."""
  items = hf_export.hf_tensor_rows(model, dtype, consumer=consumer)
  return tensor_feed.TensorFeed(items, hf_export.hf_row_count(model, dtype), **kwargs)


class WeightTransport:
  """How a fleet publish brings the tensors to the servers (`rollout.weight_sync`).

  `publish` is process 0's whole publish; `take_part` the part of every other
  process when the trainer spans processes (the same collectives, in order).
  """

  name: ClassVar[str] = ""

  async def publish(self, fleet, model: vlm.Qwen25VL, version: int | str) -> PublishReport:
    """Publishes `model` as `version` to `fleet` (a `fleet.Fleet`), as its settings ask."""
    raise NotImplementedError

  def take_part(
    self, model: vlm.Qwen25VL, root: str, version: int | str, *, deltas: bool, defer: bool
  ) -> tensor_feed.TensorFeed | None:
    """A follower's part in the publish (`take_part`, the module function)."""
    raise NotImplementedError


# The transports `rollout.weight_sync` names, by name (`register_transport`).
WEIGHT_TRANSPORTS: dict[str, WeightTransport] = {}


def register_transport(cls: type[WeightTransport]) -> type[WeightTransport]:
  """Class decorator: makes `cls` the transport `rollout.weight_sync=cls.name` picks."""
  if not cls.name or cls.name in WEIGHT_TRANSPORTS:
    raise ValueError(f"a weight transport needs a name of its own, got {cls.name!r}")
  WEIGHT_TRANSPORTS[cls.name] = cls()
  return cls


def weight_transport(name: str) -> WeightTransport:
  """The registered transport `name`."""
  if name not in WEIGHT_TRANSPORTS:
    raise ValueError(
      f"unknown rollout.weight_sync {name!r}; choose one of {sorted(WEIGHT_TRANSPORTS)}"
    )
  return WEIGHT_TRANSPORTS[name]


@register_transport
class DiskTransport(WeightTransport):
  """A versioned folder every server loads (`publish_to_fleet`)."""

  name = "disk"

  async def publish(self, fleet, model: vlm.Qwen25VL, version: int | str) -> PublishReport:
    return await publish_to_fleet(
      fleet,
      model,
      fleet.weights_root,
      version,
      dtype=fleet.weights_dtype,
      deltas=fleet.weight_deltas,
      defer=fleet.defer_updates,
    )

  def take_part(
    self, model: vlm.Qwen25VL, root: str, version: int | str, *, deltas: bool, defer: bool
  ) -> tensor_feed.TensorFeed | None:
    """Writes this process's run of the folder's files (a failure is logged
    here; process 0 reports it)."""
    if defer:
      return deferred_write(model, root, version, deltas=deltas)[0]
    try:
      write_checkpoint(model, root, version, deltas=deltas)
    except OSError as e:
      log.error("weight version %s: this process's files were not written: %s", version, e)
    return None


@register_transport
class DistributedTransport(WeightTransport):
  """bf16 tensors broadcast over a torch.distributed group (`publish_distributed`)."""

  name = "distributed"

  async def publish(self, fleet, model: vlm.Qwen25VL, version: int | str) -> PublishReport:
    return await publish_distributed(fleet, model, version, defer=fleet.defer_updates)

  def take_part(
    self, model: vlm.Qwen25VL, root: str, version: int | str, *, deltas: bool, defer: bool
  ) -> tensor_feed.TensorFeed | None:
    """Runs the gathers whose tensors process 0 broadcasts."""
    del root, version, deltas
    if defer:
      return _row_feed(model, consumed=False)
    collections.deque(hf_export.hf_tensor_rows(model, weight_protocol.PUBLISHED_DTYPE), 0)
    return None


def broadcast_tensors(model: vlm.Qwen25VL) -> Iterator[np.ndarray]:
  """The broadcast's tensors in `hf_load.hf_layout` order, each gathered when
  asked for. A model that spans processes is gathered to process 0 alone in
  runs of rows (each a collective the others run in `take_part`), and process
  0 puts each tensor together whole, as the protocol sends it."""
  if hf_export.spans_processes(model):
    return hf_export.whole_tensors(
      hf_export.hf_tensor_rows(model, weight_protocol.PUBLISHED_DTYPE), model.cfg
    )
  return (x for _, x in hf_export.hf_tensors(model, weight_protocol.PUBLISHED_DTYPE))


async def publish_to_fleet(
  fleet,
  model: vlm.Qwen25VL,
  root: str,
  version: int | str,
  *,
  dtype: str = weight_protocol.PUBLISHED_DTYPE,
  pause_mode: str = "abort",
  extra_files: Mapping[str, str | bytes] | None = None,
  deltas: bool = False,
  defer: bool = False,
) -> PublishReport:
  """Writes the checkpoint, then pause -> flush -> update -> continue everywhere.

  Args:
    fleet: a `fleet.Fleet`.
    model: the trainer's model (parameters may be sharded; gathered on write).
    root: folder that holds the versions.
    version: the new weight version (sent as a string, as SGLang expects).
    dtype: tensor dtype on disk.
    pause_mode: SGLang's pause mode.
    extra_files: copied into the folder (default: the shipped tokenizer.json).
    deltas: also write the changes from the previous version (`write_checkpoint`).
    defer: return at once: the caller's main thread gathers the tensors
      (`PublishReport.feed`), a thread writes them, and the servers load the
      folder once it is finished, all in `PublishReport.pending`.

  Returns:
    The report, with seconds per phase and what failed: servers (marked
    down), or the write (then no server was told anything and `path` is None).
  """
  t = time.perf_counter()
  previous = fleet.published
  feed = None
  try:
    if defer:
      feed, written = deferred_write(
        model, root, version, dtype=dtype, extra_files=extra_files, deltas=deltas
      )
    else:
      path = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: write_checkpoint(
          model, root, version, dtype=dtype, extra_files=extra_files, deltas=deltas
        ),
      )
  except OSError as e:
    return _unwritten(version, e, time.perf_counter() - t)

  async def load(path: str) -> PublishReport:
    write_s = time.perf_counter() - t
    seconds, failed = await fleet.update_weights(path, str(version), pause_mode=pause_mode)
    keep = {path} | ({previous[1]} if previous is not None else set())
    await asyncio.get_running_loop().run_in_executor(None, remove_old_versions, root, keep)
    return PublishReport(str(version), path, {"write": write_s, **seconds}, failed)

  if feed is None:
    return await load(path)

  async def write_and_load() -> PublishReport:
    try:
      path = await asyncio.wrap_future(written)
    except (OSError, tensor_feed.Abandoned) as e:
      return _unwritten(version, e, time.perf_counter() - t)
    return await load(path)

  pending = asyncio.create_task(write_and_load())
  return PublishReport(str(version), None, {}, [], pending=pending, reads_params=True, feed=feed)


def _unwritten(version: int | str, e: BaseException, seconds: float) -> PublishReport:
  log.error("weight version %s not published, the fleet keeps its weights: %s", version, e)
  return PublishReport(str(version), None, {"write": seconds}, [f"write: {e}"])


def deferred_write(
  model: vlm.Qwen25VL,
  root: str,
  version: int | str,
  *,
  dtype: str = weight_protocol.PUBLISHED_DTYPE,
  extra_files: Mapping[str, str | bytes] | None = None,
  deltas: bool = False,
) -> tuple[tensor_feed.TensorFeed, concurrent.futures.Future]:
  """This process's part of `write_checkpoint`, deferred: the feed's gathers
  (run as the caller's main thread pumps or takes them) go to a thread that
  writes them; right after the last one the folder is finished on the
  gathering thread (a collective when several processes write) and the
  future holds its path, or the OSError.

  Raises:
    OSError: the temporary folder could not be made.
  """
  path, extra, delta_from = _prepare_write(root, version, extra_files, deltas)
  writer = hf_export.FolderWriter(model, path, dtype, extra_files=extra, delta_from=delta_from)
  written: concurrent.futures.Future = concurrent.futures.Future()

  def write_all() -> None:
    try:
      for name, start, rows in feed:
        writer.write(name, start, rows)
    except tensor_feed.Abandoned as e:
      writer.abort()
      written.set_exception(e)
    except Exception as e:  # shared with the other processes as this one's failure
      log.exception("weight version %s: the writer failed", version)
      writer.own.failure = OSError(f"the writer failed: {e!r}")
      feed.close()

  thread = threading.Thread(target=write_all, name="weight-writer", daemon=True)

  def finish() -> None:
    thread.join()
    try:
      written.set_result(writer.finish())
    except OSError as e:
      if jax.process_index() != 0:  # process 0 reports the publish's failure
        log.error("weight version %s: this process's files were not written: %s", version, e)
      written.set_exception(e)

  feed = _row_feed(model, dtype, writer.writer_of, after_last=finish)
  thread.start()
  return feed, written


@dataclasses.dataclass
class WeightGroup:
  """The trainer's side of a distributed update group (rank 0) and the
  servers in it, in rank order (server i is rank i + 1)."""

  group: Any
  urls: tuple[str, ...]

  def close(self) -> None:
    weight_group.destroy_group(self.group)


def rank_layout(ranks_per_server: Sequence[int]) -> tuple[list[int], int]:
  """(each server's rank_offset, world size) of an update group whose rank 0
  is the trainer and whose server i holds `ranks_per_server[i]` ranks (its
  GPUs: tp x pp), as slime and AReaL lay it out (SGLang's /init_weights_update_group)."""
  offsets, next_rank = [], 1
  for n in ranks_per_server:
    if n < 1:
      raise ValueError(f"a server holds at least one rank, got {n}")
    offsets.append(next_rank)
    next_rank += n
  return offsets, next_rank


class PartOfVersion(RuntimeError):
  """A server took every bucket sent, but another server failed one: it holds
  part of the new version."""


class UnsupportedServer(Exception):
  """A server the distributed transport cannot update; no retry helps, so the
  run stops with this error rather than counting it as a failed publish."""


async def _server_ranks(fleet, servers) -> list[int]:
  """Each server's rank count in the group: tp_size x pp_size from its
  /get_server_info (ours reports 1 x 1); a server with data-parallel
  replicas (dp_size > 1) is refused, as its replicas would take the same ranks."""

  async def ranks(server) -> int:
    info = await server.client.server_info()
    tp, pp, dp = (info.get(k, 1) for k in ("tp_size", "pp_size", "dp_size"))
    if not all(isinstance(n, int) for n in (tp, pp, dp)):
      raise json_body.ProtocolError(
        f"{server.client.url}/get_server_info gives tp_size={tp!r}, pp_size={pp!r}, "
        f"dp_size={dp!r}: need ints"
      )
    if dp != 1:
      raise UnsupportedServer(
        f"{server.client.url} runs dp_size={dp}: its data-parallel replicas would join the "
        "weight update group under the same ranks; start one server per replica "
        "(--dp-size 1) or use rollout.weight_sync=disk"
      )
    return tp * pp

  return list(await asyncio.gather(*(ranks(s) for s in servers)))


async def _join(fleet, servers) -> list:
  """Makes the update group of `servers` (the trainer's old one is closed):
  every server's /init_weights_update_group and the trainer's own rendezvous
  at once, as they wait for each other. One result per server."""
  if fleet.weight_group is not None:
    fleet.weight_group.close()
    fleet.weight_group = None
  address, port = fleet.weight_group_endpoint()
  try:
    offsets, world = rank_layout(await _server_ranks(fleet, servers))
  except (json_body.ProtocolError, ValueError, OSError, RuntimeError) as e:
    log.error("the weight update group was not made: %s", e)
    return [e] * len(servers)
  timeout, name = fleet.weight_group_timeout_s, weight_protocol.WEIGHT_GROUP_NAME
  bodies = {
    s: weight_protocol.InitWeightsGroup(
      address, port, offset, world, name, fleet.weight_group_backend
    )
    for s, offset in zip(servers, offsets)
  }
  mine = asyncio.get_running_loop().run_in_executor(
    None,
    weight_group.init_group,
    fleet.weight_group_backend,
    address,
    port,
    world,
    0,
    name,
    timeout,
  )
  results = await fleet.broadcast_to(
    {s: lambda c, b=b: c.init_weights_update_group(b, timeout) for s, b in bodies.items()}
  )
  try:
    group = await mine  # a server that never joined times the rendezvous out here
  except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
    log.error("the weight update group was not made: %s", e)
    return [r if isinstance(r, Exception) else e for r in results]
  if all(not isinstance(r, Exception) for r in results):
    fleet.weight_group = WeightGroup(group, tuple(s.client.url for s in servers))
  else:
    weight_group.destroy_group(group)
  return results


async def publish_distributed(
  fleet, model: vlm.Qwen25VL, version: int | str, *, defer: bool = False
) -> PublishReport:
  """pause -> flush -> broadcast -> continue: the servers receive bf16 tensors
  from this process over the update group (made on first use, and again when
  the healthy servers change), one layer tensor at a time, with no disk.

  Args:
    fleet: a `fleet.Fleet`.
    model: the trainer's model.
    version: the new weight version.
    defer: return at once, the broadcast running in `PublishReport.pending`
      (`reads_params`: it reads `model`'s arrays until it is done); when
      `model` spans processes, the caller's main thread gathers the tensors
      (`PublishReport.feed`; docs/fleet.md, "Deferred publish").

  Returns:
    The report: seconds per phase, failed servers (marked down; a rejoining
    server takes part in the next publish), and the bytes broadcast.
  """
  if not defer:
    return await _broadcast_version(fleet, model, version)
  feed = _row_feed(model) if hf_export.spans_processes(model) else None
  pending = asyncio.create_task(_broadcast_version(fleet, model, version, feed))
  return PublishReport(str(version), None, {}, [], pending=pending, reads_params=True, feed=feed)


async def _broadcast_version(
  fleet, model: vlm.Qwen25VL, version: int | str, feed: tensor_feed.TensorFeed | None = None
) -> PublishReport:
  """`publish_distributed`'s whole sequence: the tensors (from `feed` when
  given) in buckets of at most `fleet.weight_bucket_bytes`, one
  /update_weights_from_distributed each; the last sets the version and
  flushes the cache."""
  layout = hf_load.hf_layout(model.cfg)
  # One update call per bucket: a server holds one bucket's receive buffers
  # at a time, not the whole model's.
  sizes = hf_export.tensor_bytes(model.cfg, weight_protocol.PUBLISHED_DTYPE)
  runs = hf_export.byte_runs([n for _, n in sizes], fleet.weight_bucket_bytes)
  updates = [
    weight_protocol.DistributedUpdate(
      names=tuple(layout[i][0] for i in run),
      dtypes=(weight_protocol.PUBLISHED_DTYPE,) * len(run),
      shapes=tuple(layout[i][1] for i in run),
      group_name=weight_protocol.WEIGHT_GROUP_NAME,
      weight_version=str(version) if last else None,
      flush_cache=last,
    )
    for run, last in zip(runs, [False] * (len(runs) - 1) + [True])
  ]
  sent = 0
  join_s = 0.0
  # Each tensor of a model that spans processes is a collective gather every
  # process takes part in (`take_part`): a publish that sends none or only
  # some of them still runs them all (the `finally` below, `send`'s finish),
  # unless a feed gathers them, which then drops what is not taken.
  tensors = (
    hf_export.whole_tensors(feed, model.cfg) if feed is not None else broadcast_tensors(model)
  )
  spans = hf_export.spans_processes(model) and feed is None
  device = weight_group.tensor_device(fleet.weight_group_backend)

  async def send_bucket(servers, group, update, source) -> list:
    nonlocal sent
    timeout = fleet.weight_group_timeout_s
    send = functools.partial(weight_group.send, device=device, finish=spans)
    bucket = itertools.islice(source, len(update.names))
    mine = asyncio.get_running_loop().run_in_executor(None, send, group, bucket)
    results = await fleet.broadcast(
      lambda c: c.update_weights_from_distributed(update, timeout), servers
    )
    try:
      sent += await mine
    except RuntimeError as e:  # torch's DistBackendError: a member never took its part
      why = RuntimeError(f"the trainer's broadcast failed: {e}")
      return [r if isinstance(r, Exception) else why for r in results]
    return results

  async def send_version(servers, source) -> list:
    """The group (made anew when its servers change), then every bucket;
    per server None, or why its update failed, naming the stage."""
    nonlocal join_s
    t = time.perf_counter()
    urls = tuple(s.client.url for s in servers)
    if fleet.weight_group is None or fleet.weight_group.urls != urls:
      joined = await _join(fleet, servers)
      join_s += time.perf_counter() - t
      if fleet.weight_group is None:
        return [RuntimeError(f"joining the weight update group: {r or 'not made'}") for r in joined]
    for k, update in enumerate(updates):
      results = await send_bucket(servers, fleet.weight_group.group, update, source)
      if any(isinstance(r, Exception) for r in results):  # the group may be broken: make it anew
        fleet.weight_group.close()
        fleet.weight_group = None
        stage = f"bucket {k + 1} of {len(updates)}"
        return [
          RuntimeError(f"{stage}: {r}")
          if isinstance(r, Exception)
          else PartOfVersion(f"{stage} failed on another server")
          for r in results
        ]
    return results

  async def broadcast(servers) -> list:
    """The version to `servers`. Those that took every bucket up to one
    another server refused hold part of it: when this process can read the
    tensors again (it alone holds the model), they get the whole version once
    more, without the servers that failed; else they wait for the next one."""
    results = await send_version(servers, tensors)
    part = [s for s, r in zip(servers, results) if isinstance(r, PartOfVersion)]
    if part and not hf_export.spans_processes(model):
      log.warning(
        "weight version %s: sent again to %d servers that hold part of it", version, len(part)
      )
      again = dict(zip(part, await send_version(part, broadcast_tensors(model))))
      results = [again.get(s, r) for s, r in zip(servers, results)]
    return results

  try:
    seconds, failed = await fleet.update_weights_with(broadcast, str(version))
  finally:
    if feed is not None:
      feed.close()
    elif spans:
      await asyncio.get_running_loop().run_in_executor(None, collections.deque, tensors, 0)
  seconds["join"] = join_s
  return PublishReport(str(version), None, seconds, failed, sent_bytes=sent, buckets=len(updates))


def remove_old_versions(root: str, keep: set[str]) -> list[str]:
  """Removes the version folders under `root` other than `keep` (paths).

  A fleet needs the folder it serves, which rejoining servers are refit to,
  and the one before it (a server may still be loading it); every older one
  is a full copy of the model that only fills the disk. The run's history
  is in its checkpoints.

  Returns:
    The names removed.
  """
  kept = {os.path.basename(os.path.normpath(p)) for p in keep}
  removed = []
  for entry in sorted(os.listdir(root)):
    full = os.path.join(root, entry)
    if entry.startswith("v") and entry not in kept and os.path.isdir(full):
      shutil.rmtree(full, ignore_errors=True)
      removed.append(entry)
  if removed:
    log.info("removed published weights %s (the fleet serves %s)", removed, sorted(kept))
  return removed


def publish_in_process(engines: Sequence, model: vlm.Qwen25VL, version: int | str) -> PublishReport:
  """Hands the arrays to in-process engines (Engine or EmbeddedRollout)."""
  from flax import nnx

  t = time.perf_counter()
  state = nnx.split(model)[1]
  for e in engines:
    e.update_params(state, str(version))
  return PublishReport(str(version), None, {"swap": time.perf_counter() - t}, [])
