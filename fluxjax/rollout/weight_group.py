"""The torch.distributed side of SGLang's distributed weight update
(/update_weights_from_distributed; docs/fleet.md, "Weight sync: disk or distributed").

The trainer is rank 0 of a process group of its own (`init_group`) and broadcasts each
tensor (`send`); a server receives them (`receive`). NCCL on GPUs (tensors on the GPU:
`tensor_device`), gloo on CPUs. torch joins only here, imported when a group is made
(`pip install fluxjax[weight-sync]`); bf16 crosses as its bits (numpy has no bf16 of its
own: ml_dtypes' is viewed as uint16 and back, `_as_torch`).
"""

from __future__ import annotations

import contextlib
import datetime
import queue
import threading
import warnings
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import ml_dtypes
import numpy as np

T = TypeVar("T")


def _torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
    import torch.distributed  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(
      "the distributed weight update needs torch: pip install 'fluxjax[weight-sync]' "
      "(a CPU build: pip install torch==2.13.0 first), or use rollout.weight_sync=disk"
    ) from e
  return torch


def init_group(
  backend: str,
  master_address: str,
  master_port: int,
  world_size: int,
  rank: int,
  group_name: str,
  timeout_s: float,
) -> Any:
  """This process's member of the update group (blocks until all have joined).

  Server i's ranks (one per GPU, tp x pp) start at its `rank_offset`
  (publish.rank_layout). Both sides make the group as SGLang's
  `init_custom_process_group` does (a TCP rendezvous at
  `tcp://master_address:master_port`, a store prefixed by the group name, a group apart
  from any default one), so our trainer talks to SGLang's servers and our server to
  SGLang-style trainers.

  Raises:
    RuntimeError: the rendezvous timed out or failed (torch's error).
  """
  torch = _torch()
  c10d = torch.distributed.distributed_c10d
  timeout = datetime.timedelta(seconds=timeout_s)
  store, rank, world_size = next(
    c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
  )
  store.set_timeout(timeout)
  store = c10d.PrefixStore(group_name, store)
  group, _ = c10d._new_process_group_helper(  # pylint: disable=protected-access
    world_size,
    rank,
    [],
    c10d.Backend(backend),
    store,
    group_name=group_name,
    timeout=timeout,
  )
  c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # pylint: disable=protected-access
  return group


def tensor_device(backend: str) -> str:
  """Where a group's broadcast tensors live: NCCL moves GPU memory only."""
  return "cuda" if backend == "nccl" else "cpu"


def destroy_group(group: Any) -> None:
  _torch().distributed.destroy_process_group(group)


def _as_torch(x: np.ndarray):
  """A torch view of `x`, read-only arrays included (a sender only reads it)."""
  torch = _torch()
  x = np.ascontiguousarray(x)
  bits = x.view(np.uint16) if x.dtype == ml_dtypes.bfloat16 else x
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    t = torch.from_numpy(bits)
  return t.view(torch.bfloat16) if x.dtype == ml_dtypes.bfloat16 else t


def _as_numpy(t) -> np.ndarray:
  torch = _torch()
  if t.dtype == torch.bfloat16:
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
  return t.numpy()


def prefetched(
  items: Iterable[T], depth: int = 1, *, finish: bool = False
) -> Generator[T, None, None]:
  """`items`, produced by a thread of its own up to `depth` ahead: the sender
  converts the next tensor while one is on the wire, the receiver receives
  the next while one is converted. An error in the producer is raised here.

  With `finish`, a consumer that stops early (closes this generator) leaves
  the producer to run `items` to its end and waits for it: each item may be
  a step of a collective that other processes take part in.
  """
  done = object()
  q: queue.Queue = queue.Queue(maxsize=depth)
  stopped = threading.Event()

  def produce():
    try:
      for x in items:
        if stopped.is_set():
          if finish:
            continue
          return
        q.put(x)
      q.put(done)
    except BaseException as e:  # handed to the consumer
      q.put(e)

  thread = threading.Thread(target=produce, name="weight-prefetch", daemon=True)
  thread.start()
  try:
    while (x := q.get()) is not done:
      if isinstance(x, BaseException):
        raise x
      yield x
  finally:
    stopped.set()
    while finish and thread.is_alive():  # a producer blocked in put goes on
      with contextlib.suppress(queue.Empty):
        q.get(timeout=0.1)


def send(
  group: Any, tensors: Iterable[np.ndarray], device: str = "cpu", *, finish: bool = False
) -> int:
  """Broadcasts each tensor from rank 0, in order; returns the bytes sent.

  Per update call, one bucket of tensors (hf_export.byte_runs), the HTTP call carries
  names, dtypes and shapes only, and the trainer then broadcasts each tensor, in the
  same order, from rank 0.

  One tensor is on the wire while the next is made (`prefetched`), so the
  sender holds at most two more tensors than it already had. With `finish`,
  a failed broadcast still runs `tensors` to its end (`prefetched`).
  """
  torch = _torch()
  sent = 0
  with contextlib.closing(prefetched(tensors, finish=finish)) as stream:
    for x in stream:
      t = _as_torch(x).to(device)
      torch.distributed.broadcast(t, src=0, group=group)
      sent += x.nbytes
  return sent


def receive(
  group: Any, dtypes: Sequence[str], shapes: Sequence[Sequence[int]], device: str = "cpu"
) -> Iterator[np.ndarray]:
  """Receives the tensors rank 0 broadcasts, in order, as numpy arrays."""
  torch = _torch()
  for dtype, shape in zip(dtypes, shapes):
    t = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
    torch.distributed.broadcast(t, src=0, group=group)
    yield _as_numpy(t.cpu())
