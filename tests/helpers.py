"""Builders shared by several test modules (test modules never import each other).

TINY, PATCHES, mixed_batch, make_strategy   strategy-level tests on the
    tiny preset (tests/test_strategies.py and the trainers built on it);
SERVER_CONTEXT, TINY_SERVER, server_env,    rollout server processes and
    generate_body                           the requests they get;
tiny_run_config                             the GRPO loop, cut to seconds;
ROOT, train_command,                        the main job as a subprocess,
    assert_each_prompt_trained_once             and what a resumed run trained;
run_launcher, process_alive                 python -m fluxjax.launch, stopped
                                            with its processes on a timeout;
                                            whether a pid still runs;
TokenRollout, decode                        a backend whose tokens are a
    function of their position (partial rollouts);
PublishRecorder                             a backend that records what is
                                            published to it, generates nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import ml_collections

from fluxjax import config_args, launch
from fluxjax.data import pipeline, readers
from fluxjax.models import config as config_lib
from fluxjax.models import processor
from fluxjax.parallel import random_batch, strategies
from fluxjax.parallel.batch import TrainSequence
from fluxjax.parallel.strategies import Strategy
from fluxjax.rl import loop
from fluxjax.rollout.client import Completion
from fluxjax.rollout.publish import PublishReport

TINY = config_lib.preset("tiny")
PATCHES = 128  # patch buffer of the mixed batches below
SERVER_CONTEXT = 256  # context length of the test servers
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout


def train_command(workdir, overrides: dict) -> list[str]:
  """`python -m fluxjax.train` on configs/vlm.py in `workdir`, with --config overrides."""
  return [
    sys.executable,
    "-m",
    "fluxjax.train",
    f"--config={ROOT}/configs/vlm.py",
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
  rows = readers.read_rows(os.path.join(workdir, "data", "train", "manifest.jsonl"))
  config = json.load(open(os.path.join(workdir, "config.json")))
  loader = pipeline.ShadowLoader(
    rows,
    prompts_per_step,
    processor.VisionProcessorConfig(**config["data"]["vision"]),
    num_workers=0,
    seed=config["seed"],
  )
  expected = [sorted(s.id for s in loader.next_batch()) for _ in range(steps)]
  loader.close()
  assert [sorted(r["ids"]) for r in records] == expected
  return records


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
  cfg = config_args.load_config().sharding
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


def generate_body(ids, max_new: int = 4, seed: int | None = None) -> dict:
  """A /generate body for `ids`: temperature 1, exactly `max_new` tokens, logprobs."""
  sp = {"max_new_tokens": max_new, "temperature": 1.0, "ignore_eos": True}
  if seed is not None:
    sp["sampling_seed"] = seed
  return {"input_ids": [int(i) for i in ids], "sampling_params": sp, "return_logprob": True}


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
  c = config_args.load_config()
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
    meta_info={},
  )


def decode(ids, skip_special_tokens=True):
  """A stand-in tokenizer's decode for the fake backends' ids."""
  return " ".join(map(str, ids))


class PublishRecorder:
  """A rollout backend that records each (model, version) published to it.

  It generates nothing; a test that needs answers overrides `generate`.
  """

  def __init__(self):
    self.published: list[tuple[object, int]] = []

  async def start(self):
    pass

  async def close(self):
    pass

  async def __aenter__(self):
    return self

  async def __aexit__(self, *exc):
    pass

  async def generate(self, body, group=None):
    raise AssertionError("nothing is generated here")

  async def abort(self, rid):
    pass

  async def publish(self, model, version):
    self.published.append((model, version))
    return PublishReport(str(version), None, {"swap": 0.0}, [])

  def metrics(self):
    return {}

  def slot_stats(self):
    return None


class TokenRollout:
  """Decodes one token per `tick` seconds; an abort returns the tokens so far.

  The token at sequence position n is n % 97 with logprob -n / 1000, so a
  response continued from prompt + its partial tokens equals the
  uninterrupted one. Like an SGLang server it reports no per-token versions.
  """

  def __init__(self, tick=1e-3):
    self.tick = tick
    self.events: dict[str, asyncio.Event] = {}
    self.bodies: list[dict] = []

  async def generate(self, body, group=None):
    self.bodies.append(body)
    rid, start = body["rid"], len(body["input_ids"])
    limit = body["sampling_params"]["max_new_tokens"]
    ev = self.events[rid] = asyncio.Event()
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    try:
      await asyncio.wait_for(ev.wait(), limit * self.tick)
      n = min(limit - 1, int((loop.time() - t0) / self.tick))
      reason = {"type": "abort", "message": "Abort"}
    except TimeoutError:
      n, reason = limit, {"type": "length", "length": limit}
    ids = [pos % 97 for pos in range(start, start + n)]
    lps = [-pos / 1000 for pos in range(start, start + n)]
    meta = {"output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}
    return Completion(rid, decode(ids), ids, lps, reason, start, "?", "fake", meta)

  async def abort(self, rid):
    if rid in self.events:
      self.events[rid].set()

  def slot_stats(self):
    return None


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
  import numpy as np  # pylint: disable=import-outside-toplevel

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

  import numpy as np  # pylint: disable=import-outside-toplevel
  import PIL.Image  # pylint: disable=import-outside-toplevel

  buf = io.BytesIO()
  PIL.Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(buf, "PNG")
  data = bytearray(buf.getvalue())
  assert data[12:16] == b"IHDR"
  data[16:24] = struct.pack(">II", width, height)
  data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
  return bytes(data)
