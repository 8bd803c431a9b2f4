"""Builders shared by several test modules (test modules never import each other).

TINY, PATCHES, mixed_batch, make_strategy   strategy-level tests on the
    tiny preset (tests/test_strategies.py and the trainers built on it);
SERVER_CONTEXT, TINY_SERVER, server_env,    rollout server processes and
    generate_request, generate_body         the requests they get (typed,
                                            and as the HTTP body);
tiny_run_config                             the GRPO loop, cut to seconds;
ROOT, train_command,                        the main job as a subprocess,
    assert_each_prompt_trained_once             and what a resumed run trained;
run_launcher, process_alive                 python -m fluxjax.launch, stopped
                                            with its processes on a timeout;
                                            whether a pid still runs;
reference_greedy, trainer_logprobs          what the rollout engine must
                                            equal: greedy by a full forward
                                            per token, and the trainer's
                                            logprobs of a response;
InstantRewards                              the reward pool's interface,
                                            scoring at once in this process
                                            with the pool's own code;
ListLoader                                  the training data's interface
                                            over a list of samples;
ScriptedRollout, Act, decode, rid_key,      the test kit's one fake rollout
    completion                              backend: a script says per request
                                            how it ends (length, stop, its own
                                            pause, abort ignored, refusal,
                                            failure) and when; tokens are a
                                            function of their position, so a
                                            continued response equals the
                                            uninterrupted one.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import ml_collections
import numpy as np
from flax import nnx

from fluxjax import config_args, launch
from fluxjax.data import pipeline, readers
from fluxjax.models import config as config_lib
from fluxjax.models import inputs, processor
from fluxjax.parallel import random_batch, strategies
from fluxjax.parallel.batch import TrainSequence
from fluxjax.parallel.strategies import Strategy
from fluxjax.rl import loop, reward_pool, reward_spec
from fluxjax.rollout.backend import SlotStats
from fluxjax.rollout.client import RequestRejected
from fluxjax.rollout.protocol import Completion, GenerateRequest
from fluxjax.rollout.publish import PublishReport

TINY = config_lib.preset("tiny")
PATCHES = 128  # patch buffer of the mixed batches below
SERVER_CONTEXT = 256  # context length of the test servers
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def train_command(workdir, overrides: dict, variant: str = "tiny") -> list[str]:
  """`python -m fluxjax.train` on configs/vlm.py:`variant` in `workdir`, with
  --config overrides (tiny: the scratch job, short answers)."""
  return [
    sys.executable,
    "-m",
    "fluxjax.train",
    f"--config={ROOT}/configs/vlm.py:{variant}",
    f"--workdir={workdir}",
  ] + [f"--config.{k}={v}" for k, v in overrides.items()]


def assert_each_prompt_trained_once(workdir, steps: int, prompts_per_step: int) -> list[dict]:
  """trained.jsonl holds steps 1..steps once each, and their prompts are the
  seeded loader's first steps * P samples, each exactly once (sync lag and no
  tail batching: a step's prompts follow the loader's order; within a step
  groups arrive in finish order, so each step compares as a set).

  Returns the records.
  """
  records = loop.read_trained(str(workdir))
  assert [r["step"] for r in records] == list(range(1, steps + 1))
  trained = [i for r in records for i in r["ids"]]
  assert len(trained) == steps * prompts_per_step and len(set(trained)) == len(trained)
  ids = loader_ids(workdir, steps * prompts_per_step, prompts_per_step)
  p = prompts_per_step
  expected = [sorted(ids[k * p : (k + 1) * p]) for k in range(steps)]
  assert [sorted(r["ids"]) for r in records] == expected
  return records


def loader_ids(workdir, count: int, prompts_per_step: int) -> list[str]:
  """The ids of the first `count` samples the run's seeded loader hands out."""
  rows = readers.read_rows(os.path.join(workdir, "data", "train", "manifest.jsonl"))
  config = json.load(open(os.path.join(workdir, "config.json")))
  loader = pipeline.ShadowLoader(
    rows,
    prompts_per_step,
    processor.VisionProcessorConfig(**config["data"]["vision"]),
    num_workers=0,
    seed=config["seed"],
  )
  ids: list[str] = []
  while len(ids) < count:
    ids += [s.id for s in loader.next_batch()]
  loader.close()
  return ids[:count]


def assert_every_drawn_prompt_accounted_for(workdir, prompts_per_step: int) -> dict:
  """Every prompt the loader handed out over the run (a restart included) was
  trained once, is still held for training in the last checkpoint (queued,
  deferred or carried partly generated), or was dropped and counted with its
  reason (dynamic sampling's filter, a prompt too long or that cannot be
  built, a refused request):
  nothing lost, nothing twice. Async lag and tail batching change the order,
  not the count.

  Returns {"drawn", "trained", "held"}: Counters of sample ids, and
  {"dropped"}: the count of each reason a prompt was dropped for."""
  last = max(int(s) for s in os.listdir(os.path.join(workdir, "checkpoints")) if s.isdigit())
  step_dir = os.path.join(workdir, "checkpoints", str(last))
  coordinator = json.load(open(os.path.join(step_dir, "coordinator", "metadata")))
  data = json.load(open(os.path.join(step_dir, "data", "metadata")))
  assert data["skipped"] == 0, data
  trained = collections.Counter(i for r in loop.read_trained(str(workdir)) for i in r["ids"])
  held = collections.Counter(s["id"] for s in coordinator["samples"].values())
  drawn = collections.Counter(loader_ids(workdir, data["emitted"], prompts_per_step))
  assert not trained & held, f"held and trained: {trained & held}"
  assert not (trained + held) - drawn, f"never drawn: {(trained + held) - drawn}"
  lost = drawn - (trained + held)
  # Each prompt dropped on purpose is counted under its reason.
  counts = coordinator.get("counts", {})
  reasons = {
    "filtered": coordinator["filtered"],  # dynamic sampling: rewards all equal
    **{k: counts.get(f"data/skipped/{k}", 0) for k in ("prompt_too_long", "rejected")},
    "prompt_errors": coordinator.get("faults", {}).get("prompt_errors", 0),  # no prompt built
  }
  assert lost.total() == sum(reasons.values()), f"lost: {lost}; counted: {reasons}"
  return {"drawn": drawn, "trained": trained, "held": held, "dropped": reasons}


def run_launcher(command: list[str], *, timeout: float, **popen) -> subprocess.CompletedProcess:
  """subprocess.run for `python -m fluxjax.launch ...`: on a timeout the launcher
  gets SIGTERM, which it passes to the processes it started, before the
  TimeoutExpired is raised (killing it alone would leave them running)."""
  with subprocess.Popen(command, **popen) as proc:
    try:
      out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.send_signal(signal.SIGTERM)
      proc.communicate(timeout=60)
      raise
  return subprocess.CompletedProcess(command, proc.returncode, out, err)


def process_alive(pid: int) -> bool:
  """Whether `pid` runs (a zombie waiting for its parent to reap it counts as gone)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      stat = f.read()
  except FileNotFoundError:
    return False
  return stat.rpartition(")")[2].split()[0] != "Z"


def mixed_batch(seed: int = 0, long: bool = False) -> list[TrainSequence]:
  """Text, images and a video in one batch of the tiny preset.

  Positive advantages: the loss does not cancel to ~0, so a relative
  comparison of the loss is meaningful.
  """
  return random_batch.mixed_batch(TINY, seed, long=long, advantage_range=(0.5, 1.5))


def make_strategy(
  name: str, sp: int = 1, capacity: int = 96, buckets: tuple[int, ...] = (), sync: str = "layer"
) -> Strategy:
  """A strategy of the tiny preset from the same config section a run reads."""
  cfg = config_args.load_config(arg="tiny").sharding
  cfg.update(strategy=name, sp=sp, capacity=capacity, capacity_buckets=buckets, sync=sync)
  cfg.balance_vision = False
  return strategies.get_strategy(cfg, TINY)


# A tiny-preset server with random weights (launch_servers adds --host, --port).
TINY_SERVER = [
  "python",
  "-m",
  "fluxjax.rollout.server",
  "--preset",
  "tiny",
  "--seed",
  "0",
  "--num-slots",
  "4",
  "--context-length",
  str(SERVER_CONTEXT),
]


_forward = nnx.jit(lambda m, row: m.logits(row))


def reference_greedy(model, seq, n: int, token_capacity: int = 128) -> list[int]:
  """`n` greedy tokens after `seq`, by a full forward over the whole sequence
  per token (rows padded to one shape: one compile)."""
  out: list[int] = []
  patches = 64 if seq.media else None
  for _ in range(n):
    cur = seq.extend(out)
    row = inputs.pack_row([cur], model.cfg, token_capacity=token_capacity, patch_capacity=patches)
    out.append(int(np.argmax(np.asarray(_forward(model, row))[0, len(cur) - 1])))
  return out


def trainer_logprobs(model, seq, response) -> np.ndarray:
  """The trainer's logprob of each token of `response` after `seq`."""
  full = seq.extend(response)
  targets = np.concatenate([full.tokens_T[1:], [0]])[None]
  lp = np.asarray(model.token_logprobs(inputs.pack_row([full], model.cfg), targets))[0]
  return lp[len(seq) - 1 : len(full) - 1]


def generate_request(ids, max_new: int = 4, seed: int | None = None) -> GenerateRequest:
  """A request for `ids`: temperature 1, exactly `max_new` tokens, logprobs."""
  sp = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}
  if seed is not None:
    sp["sampling_seed"] = seed
  return GenerateRequest.of(ids, sp)


def generate_body(ids, max_new: int = 4, seed: int | None = None) -> dict:
  """`generate_request` as the JSON body a client sends."""
  return generate_request(ids, max_new, seed).to_body()


def xla_flags(devices: int | None) -> str:
  """The suite's XLA_FLAGS with `devices` fake CPU devices (None: the plain one)."""
  return launch.with_cpu_devices(os.environ["XLA_FLAGS"], devices)


def server_env() -> dict[str, str]:
  """Environment of a server subprocess: one plain CPU device, not the fake mesh.

  Without the fake mesh's `NPROC` (conftest.py): one device needs no spare
  threads, and 24 on 2 cores cost a 3b smoke run 59 s against 50 s.
  """
  env = dict(os.environ)
  env["JAX_PLATFORMS"] = "cpu"
  env["XLA_FLAGS"] = xla_flags(devices=None)
  env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
  env.pop("NPROC", None)
  return env


def tiny_run_config(total_steps: int) -> ml_collections.ConfigDict:
  """The default run, cut to 2 prompts x 2 responses of <= 6 tokens, no warm-up."""
  c = config_args.load_config(arg="tiny")
  c.total_steps, c.eval.every = total_steps, 2
  c.data.synth_train, c.data.synth_eval, c.eval.prompts = 8, 2, 2
  c.eval.samples_per_prompt = 2
  c.rl.prompts_per_step, c.rl.responses_per_prompt, c.rl.max_new_tokens = 2, 2, 6
  c.rl.reward.num_workers = 1
  c.rollout.num_slots = 4
  c.checkpoint.every = 1
  c.sft.enabled = False  # the warm-up's loop runs in test_multiprocess.py
  return c


def adamw_config(lr: float = 1e-3, total_steps: int = 10) -> ml_collections.ConfigDict:
  """An `optim` section: AdamW, 2 warmup steps, cosine to 10% over `total_steps`."""
  return ml_collections.ConfigDict(
    dict(
      lr=lr,
      warmup_steps=2,
      total_steps=total_steps,
      end_lr_frac=0.1,
      max_grad_norm=1.0,
      b1=0.9,
      b2=0.95,
      eps=1e-8,
      weight_decay=0.0,
      lr_scale_steps=(),
      lr_scales=(),
    )
  )


def completion(ids: list[int], logprobs: list[float | None], version: str = "3") -> Completion:
  """A finished response with per-token behaviour logprobs and a weight version."""
  return Completion(
    rid=f"r{len(ids)}",
    text="",
    output_ids=list(ids),
    logprobs=list(logprobs),
    finish_reason={"type": "stop"},
    prompt_tokens=None,
    weight_version=version,
    server="embedded",
  )


def decode(ids, skip_special_tokens=True):
  """A stand-in tokenizer's decode for the fake backends' ids."""
  return " ".join(map(str, ids))


def rid_key(rid: str) -> tuple[str, str]:
  """(prompt, response index) of a tail-batched request id
  (`{prefix}-{epoch}-{round}-{prompt}-{index}-{try}`)."""
  prompt, index = rid.split("-")[3:5]
  return prompt, index


@dataclasses.dataclass(frozen=True)
class Act:
  """What `ScriptedRollout` does with one request.

  Attributes:
    tokens: the response's length (None: the request's max_new_tokens).
    seconds: how long it decodes (None: `tokens` ticks).
    finish: how it ends: "length", "stop" (an EOS, its last token), or
      "abort" (the backend's own abort, as a pause for a weight update).
    abortable: False ignores `abort(rid)`: the request finished as its abort
      went out.
    refuse: answer 400 at once with this message (`RequestRejected`).
    fail: raise this after `seconds` (the backend went away).
  """

  tokens: int | None = None
  seconds: float | None = None
  finish: str = "length"
  abortable: bool = True
  refuse: str | None = None
  fail: Exception | None = None


OVER_CONTEXT = "Requested token count exceeds the model's maximum context length"


class ScriptedRollout:
  """The test kit's rollout backend (a whole `backend.RolloutBackend`).

  `script(request, group) -> Act` decides each request (default: `Act()`, the full
  max_new_tokens). The token at sequence position n is n % 97 with logprob
  -n / 1000, so a response continued from prompt + its partial tokens equals
  the uninterrupted one; an abort returns the tokens decoded so far (one per
  `tick` seconds). Like an SGLang server it reports no per-token versions;
  its `weight_version` is the last version published to it ("0" before).

  Args:
    script: (request, group) -> Act; group is the caller's affinity key
      (the tail batcher's prompt id, the coordinator's sample id).
    tick: seconds per token.
    num_slots: report slot counters (one decode step per output token), as
      the embedded engine does; None reports none, as a fleet.
    text: (request, group, output ids) -> the response text (default
      `decode` of the ids).

  Attributes:
    requests: (group, request) of every request, in arrival order.
    aborts: every aborted rid.
    returned: the rid of every response returned, in order.
    published: (model, version) of every publish.
  """

  def __init__(
    self,
    script: Callable[[GenerateRequest, str | None], Act] | None = None,
    *,
    tick: float = 1e-3,
    num_slots: int | None = None,
    text: Callable[[GenerateRequest, str | None, list[int]], str] | None = None,
  ):
    self.script = script or (lambda request, group: Act())
    self.tick, self.num_slots = tick, num_slots
    self.text = text or (lambda request, group, ids: decode(ids))
    self.requests: list[tuple[str | None, GenerateRequest]] = []
    self.aborts: list[str] = []
    self.returned: list[str] = []
    self.published: list[tuple[object, int]] = []
    self.decode_steps = 0
    self.version = "0"
    self._events: dict[str, asyncio.Event] = {}

  async def generate(self, request: GenerateRequest, group: str | None = None) -> Completion:
    self.requests.append((group, request))
    act = self.script(request, group)
    if act.refuse is not None:
      raise RequestRejected(act.refuse)
    limit = request.sampling.max_new_tokens or 128
    n = limit if act.tokens is None else min(act.tokens, limit)
    seconds = n * self.tick if act.seconds is None else act.seconds
    if act.fail is not None:
      await asyncio.sleep(seconds)
      raise act.fail
    aborted = self._events[request.rid] = asyncio.Event()
    loop = asyncio.get_running_loop()
    t0, start = loop.time(), len(request.input_ids or ())
    try:
      await asyncio.wait_for(aborted.wait() if act.abortable else asyncio.Event().wait(), seconds)
      elapsed = int((loop.time() - t0) / self.tick) if self.tick else 0
      n, reason = min(n - 1, elapsed), {"type": "abort", "message": "Abort"}
    except TimeoutError:
      reason = {
        "length": {"type": "length", "length": n},
        "stop": {"type": "stop", "matched": (start + n - 1) % 97},
        "abort": {"type": "abort", "message": "Abort: generation paused"},
      }[act.finish]
    ids = [pos % 97 for pos in range(start, start + n)]
    self.decode_steps += n
    self.returned.append(request.rid)
    return Completion(
      rid=request.rid,
      text=self.text(request, group, ids),
      output_ids=ids,
      logprobs=[-pos / 1000 for pos in range(start, start + n)],
      finish_reason=reason,
      prompt_tokens=start,
      weight_version=self.version,
      server="scripted",
    )

  async def abort(self, rid: str) -> None:
    self.aborts.append(rid)
    if rid in self._events:
      self._events[rid].set()

  def slot_stats(self) -> SlotStats | None:
    return None if self.num_slots is None else SlotStats(self.decode_steps, self.num_slots)

  async def publish(self, model, version: int) -> PublishReport:
    self.published.append((model, version))
    self.version = str(version)
    return PublishReport(str(version), None, {"swap": 0.0}, [])

  def metrics(self) -> dict[str, float]:
    return {"scripted/publishes": float(len(self.published))}

  async def start(self) -> None:
    pass

  async def close(self) -> None:
    pass

  async def __aenter__(self) -> ScriptedRollout:
    return self

  async def __aexit__(self, *exc: object) -> None:
    pass


def video_codec() -> str:
  """H.264 (what real datasets hold), or mpeg4 where PyAV has no libx264."""
  import av  # pylint: disable=import-outside-toplevel

  return "libx264" if "libx264" in av.codecs_available else "mpeg4"


def grey_level(i: int) -> int:
  """Flat grey level of frame i: distinct per frame, survives compression."""
  return (i * 8) % 256


def write_video(
  path,
  *,
  num_frames: int,
  fps: float,
  height: int,
  width: int,
  codec: str | None = None,
  container_format: str | None = None,
  options: dict | None = None,
):
  """Writes a real video of flat grey frames (frame i at `grey_level(i)`) with PyAV.

  Args:
    codec: encoder name; None: `video_codec()`.

  Returns:
    path.
  """
  import av  # pylint: disable=import-outside-toplevel

  with av.open(str(path), "w", format=container_format, options=options or {}) as out:
    stream = out.add_stream(codec or video_codec(), rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    for i in range(num_frames):
      frame_HWC = np.full((height, width, 3), grey_level(i), np.uint8)
      out.mux(stream.encode(av.VideoFrame.from_ndarray(frame_HWC, format="rgb24")))
    out.mux(stream.encode())
  return path


def lying_png(height: int, width: int) -> bytes:
  """A real 4x4 PNG whose IHDR claims height x width (with a valid CRC, so
  that decoders believe it): a decompression bomb when the claim is huge."""
  import io  # pylint: disable=import-outside-toplevel
  import struct  # pylint: disable=import-outside-toplevel
  import zlib  # pylint: disable=import-outside-toplevel

  import PIL.Image  # pylint: disable=import-outside-toplevel

  buf = io.BytesIO()
  PIL.Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, "PNG")
  data = bytearray(buf.getvalue())
  assert data[12:16] == b"IHDR"
  data[16:24] = struct.pack(">II", width, height)
  data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
  return bytes(data)


class InstantRewards:
  """The reward pool's `submit`, scored at once in this process with the
  pool's code (rl/reward_spec.py): `fn` is a spec or a module-level callable
  (e.g. `lambda`-free `length`). `submitted` lists the keys, in order."""

  def __init__(self, fn="accuracy_with_format"):
    self.fn = fn
    self.submitted: list = []

  def submit(self, text, answer, fn=None, key=None, tag=None, context=None):
    import concurrent.futures

    self.submitted.append(key)
    terms = reward_spec.terms_of(fn or self.fn)
    fns = [reward_spec.load(t.fn) for t in terms]
    total, values = reward_spec.score(
      terms, fns, text, answer, context or reward_spec.RewardContext()
    )
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(reward_pool.RewardResult(total, "ok", 0.0, 1.0, key, tag, terms=values))
    return future

  def metrics(self) -> dict:
    return {"reward/timeout": 0.0}


class ListLoader:
  """The training data (`producer.Loader`) over `samples`, `batch_size` at a
  time: [] at the end, or StopIteration with `stop_at_end` (as the real
  loader's last epoch ends). `released` lists what was released, in order."""

  store = pool = None

  def __init__(self, samples=(), batch_size: int | None = None, stop_at_end: bool = False):
    self.samples = list(samples)
    self.batch_size = batch_size or max(len(self.samples), 1)
    self.stop_at_end = stop_at_end
    self.position = 0
    self.released: list = []

  def next_batch(self) -> list:
    if self.stop_at_end and self.position >= len(self.samples):
      raise StopIteration
    batch = self.samples[self.position : self.position + self.batch_size]
    self.position += len(batch)
    return batch

  def release(self, batch) -> None:
    self.released.extend(batch)

  def get_state(self) -> dict:
    return {"position": self.position}

  def set_state(self, state: dict) -> None:
    self.position = state.get("position", 0)
