"""The embedded rollout engine: slot-based continuous batching in JAX.

In `Engine` a fixed number of slots share one KV cache (models/decode.py); a jitted call
runs `num_continuous_decode_steps` decode steps over the slots up to the highest busy one
and the cache entries they reach, both in buckets, so cost follows the live load.
Thread-safe: `submit`, `abort`, `pause`, `resume` and `update_params` from any thread
while `run_forever` (the server) or `generate` steps it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fluxjax.models import config as config_lib
from fluxjax.models import decode, hf_delta, hf_load, vision, vlm
from fluxjax.models.inputs import SequenceInputs
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.planning import plan as plan_lib
from fluxjax.rollout import protocol, sampling
from fluxjax.rollout.json_body import ProtocolError
from fluxjax.rollout.protocol import NonFiniteLogits
from fluxjax.rollout.sampling_params import SamplingParams
from fluxjax.sharding import rules

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class EngineRequest:
  """A request inside the engine, with its output as it grows.

  `on_event(req)` is called from the engine thread after each new token and
  once more when the request finishes (`finish_reason` set).
  """

  rid: str
  prompt: SequenceInputs
  sampling: SamplingParams
  return_logprob: bool = True
  on_event: Callable[[EngineRequest], None] | None = None
  output_ids: list[int] = dataclasses.field(default_factory=list)
  output_logprobs: list[float] = dataclasses.field(default_factory=list)
  # The weight version that sampled each output token: a request may span a
  # weight update (partial rollout), and staleness is counted per token.
  output_versions: list[str] = dataclasses.field(default_factory=list)
  finish_reason: dict | None = None
  finished_text: str | None = None  # text after stop trimming, set at the end
  created: float = dataclasses.field(default_factory=time.time)
  done: threading.Event = dataclasses.field(default_factory=threading.Event)
  # Engine bookkeeping.
  seed: int = 0
  max_new: int = 0
  slot: int = -1
  abort_message: str | None = None
  # Set when the request was refused for non-finite logits (finished as an abort).
  error: NonFiniteLogits | None = None

  @property
  def prompt_tokens(self) -> int:
    return len(self.prompt)


# Prefill buckets (prompt lengths) and decode buckets (one program each): slots
# in powers of 2 from the smallest, cache entries read (the window) in powers
# of 2 from the smallest.
PREFILL_LEN_MIN = 16
DECODE_SLOTS_MIN = 8
DECODE_WINDOW_MIN = 256


def _cache_sharding(state: nnx.State, shape) -> jax.sharding.NamedSharding | None:
  """The KV cache's layout on the parameters' mesh; None for a one-device model."""
  for leaf in jax.tree.leaves(state):
    sharding = leaf.sharding if isinstance(leaf, jax.Array) else None
    if (
      isinstance(sharding, jax.sharding.NamedSharding)
      and isinstance(sharding.mesh, jax.sharding.Mesh)
      and sharding.mesh.size > 1
    ):
      return rules.kv_cache_sharding(shape, sharding.mesh)
  return None


def _pin(cache: decode.KVCache, sharding: jax.sharding.Sharding | None) -> decode.KVCache:
  """The cache leaves each program where it came in: one layout, one compile."""
  return cache if sharding is None else jax.lax.with_sharding_constraint(cache, sharding)


def _programs(graphdef, cache_sharding: jax.sharding.NamedSharding | None):
  """The engine's jitted programs: (prefill, decode, clear_slot).

  Each takes the parameter state as an argument, so a weight swap never
  recompiles; `_pin` keeps the cache in one layout across them.
  """

  def prefill_fn(
    state, cache, slot, tokens_P, positions_3P, length, vis, temp, top_p, top_k, seed, bias
  ):
    model = nnx.merge(graphdef, state)
    logits_V, cache = decode.prefill(model, cache, slot, tokens_P, positions_3P, length, vis)
    cache = _pin(cache, cache_sharding)
    finite = sampling.finite_rows(logits_V[None])[0]  # the model's, before any bias
    logits_V = sampling.apply_logit_bias(logits_V[None], bias[0][None], bias[1][None])[0]
    # The first output token sits at position `length` of the sequence.
    tok, lp = sampling.sample(
      logits_V[None], temp[None], top_p[None], top_k[None], seed[None], length[None]
    )
    return tok[0], lp[0], finite, cache

  def decode_fn(
    state,
    cache,
    tokens_S,
    lengths_S,
    delta_S,
    budget_S,
    temp_S,
    top_p_S,
    top_k_S,
    seed_S,
    bias_ids_SK,
    bias_SK,
    window,
    steps,
  ):
    # The arrays cover the first S slots (a bucket); the cache all of them.
    # `steps` decode steps in one call: a slot feeds each sampled token on
    # while its budget (tokens it may still sample) lasts and its logits
    # are finite; the host reads what it needs of the [steps, S] outputs.
    model = nnx.merge(graphdef, state)

    def one_token(carry, _):
      cache, tokens_S, lengths_S, budget_S = carry
      rope_pos_S = lengths_S + delta_S
      logits_SV, cache = decode.decode_step(model, cache, tokens_S, lengths_S, rope_pos_S, window)
      cache = _pin(cache, cache_sharding)
      finite_S = sampling.finite_rows(logits_SV)
      logits_SV = sampling.apply_logit_bias(logits_SV, bias_ids_SK, bias_SK)
      # The sampled token sits at position length + 1 of its sequence.
      tok_S, lp_S = sampling.sample(logits_SV, temp_S, top_p_S, top_k_S, seed_S, lengths_S + 1)
      feeds_S = (budget_S > 1) & finite_S
      carry = (
        cache,
        jnp.where(feeds_S, tok_S, tokens_S),
        lengths_S + feeds_S,
        jnp.where(feeds_S, budget_S - 1, 0),
      )
      return carry, (tok_S, lp_S, finite_S)

    carry = (cache, tokens_S, lengths_S, budget_S)
    (cache, *_), (tok_KS, lp_KS, finite_KS) = jax.lax.scan(one_token, carry, length=steps)
    return tok_KS, lp_KS, finite_KS, cache

  def clear_fn(cache, slot):
    cache = jax.tree.map(lambda a: a.at[:, slot].set(0), cache)
    return _pin(cache, cache_sharding)

  # The cache is donated (updated in place); parameters never are. One
  # decode program per slot bucket, window and step count (shapes and statics).
  return (
    jax.jit(prefill_fn, donate_argnums=1),
    jax.jit(decode_fn, donate_argnums=1, static_argnames=("window", "steps")),
    jax.jit(clear_fn, donate_argnums=0),
  )


def check_decode_steps(steps: int, name: str = "num_continuous_decode_steps") -> None:
  """Raises ValueError naming `name` (how the caller sets it) unless steps >= 1."""
  if steps < 1:
    raise ValueError(f"{name} must be 1 or more (decode steps per call), got {steps}")


def check_min_decode_step(value: float, name: str = "min_decode_step_s") -> None:
  """Raises ValueError naming `name` (how the caller sets it) if the floor is negative."""
  if value < 0:
    raise ValueError(f"{name} must be >= 0, not {value}")


class Engine:
  """Continuous batching over `num_slots` slots of `capacity` tokens each.

  Between calls, waiting requests join free slots (one prefill each, padded to a bucket
  length) and finished or aborted ones leave; a request that stops inside a call holds
  its slot to its end. Sampling parameters are per-slot arrays (rollout/sampling.py);
  non-finite logits end a request as an abort carrying a `NonFiniteLogits`. Weights swap
  between steps as a jitted argument: no recompile.
  """

  def __init__(
    self,
    model: vlm.Qwen25VL,
    tokenizer: Tokenizer,
    *,
    num_slots: int = 8,
    capacity: int = 512,
    seed: int = 0,
    weight_version: str = "default",
    prefill_buckets: Sequence[int] | None = None,
    max_logit_bias: int = 16,
    num_continuous_decode_steps: int = 1,
    min_decode_step_s: float = 0.0,
  ):
    check_decode_steps(num_continuous_decode_steps)
    check_min_decode_step(min_decode_step_s)
    self.cfg = model.cfg
    self.num_continuous_decode_steps = num_continuous_decode_steps
    # A memory-bound accelerator's decode step reads every weight whatever
    # the batch: each step lasts at least this long (benchmarks only; 0 off).
    self.min_decode_step_s = min_decode_step_s
    self.tokenizer = tokenizer
    self.num_slots = num_slots
    self.capacity = capacity
    self.weight_version = weight_version
    self.deltas_applied = 0  # weight updates read as a delta (load_weights_from_disk)
    self.buckets = sorted(prefill_buckets or plan_lib.default_buckets(capacity, PREFILL_LEN_MIN))
    if self.buckets[-1] > capacity:
      raise ValueError(f"prefill bucket {self.buckets[-1]} exceeds capacity {capacity}")
    self._graphdef, self._state = nnx.split(model)
    cache_sharding = _cache_sharding(self._state, decode.cache_shape(model, num_slots, capacity))
    if cache_sharding is not None and self.cfg.decode_attention == "pallas_gpu":
      raise ValueError(
        f"model.decode_attention={self.cfg.decode_attention!r} reads the cache on one device; "
        f"this engine's model spans {cache_sharding.mesh.size} devices: use xla"
      )
    self._cache = decode.init_cache(model, num_slots, capacity, cache_sharding)
    # A prefix of the slots is every device's only while the slot axis is whole.
    spec = tuple(cache_sharding.spec) if cache_sharding is not None else ()
    slots_split = len(spec) > 1 and spec[1] is not None
    self._slot_buckets = (
      [num_slots] if slots_split else list(plan_lib.default_buckets(num_slots, DECODE_SLOTS_MIN))
    )
    self._windows = list(plan_lib.default_buckets(capacity, DECODE_WINDOW_MIN))
    self._rng = np.random.default_rng(seed)
    self.eos_ids = frozenset({self.cfg.eos_token_id, *tokenizer.eos_ids})
    # Host-side slot state.
    self._slots: list[EngineRequest | None] = [None] * num_slots
    self._tokens_S = np.zeros(num_slots, np.int32)
    self._lengths_S = np.zeros(num_slots, np.int32)
    self._delta_S = np.zeros(num_slots, np.int32)
    self._temperature_S = np.ones(num_slots, np.float32)
    self._top_p_S = np.ones(num_slots, np.float32)
    self._top_k_S = np.ones(num_slots, np.int32)
    self._seed_S = np.zeros(num_slots, np.uint32)
    self.max_logit_bias = max_logit_bias
    self._bias_ids_SK = np.zeros((num_slots, max_logit_bias), np.int32)
    self._bias_SK = np.zeros((num_slots, max_logit_bias), np.float32)
    self._waiting: deque[EngineRequest] = deque()
    self._by_rid: dict[str, EngineRequest] = {}
    self._cv = threading.Condition()
    self._step_lock = threading.RLock()
    self._paused = False
    self._stopped = False
    self._thread: threading.Thread | None = None
    # decode_steps: each step computes every slot it covers; a jitted call
    # runs num_continuous_decode_steps of them.
    self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "decode_steps": 0, "tokens": 0}

    self._prefill, self._decode, self._clear_slot = _programs(self._graphdef, cache_sharding)

  # --- requests ---------------------------------------------------------------------

  def submit(self, req: EngineRequest) -> EngineRequest:
    """Queues a request; raises ProtocolError if it can never run."""
    n = len(req.prompt)
    if n == 0:
      raise ProtocolError("the prompt is empty")
    # The prompt must fit; max_new_tokens is clipped to the context left, as
    # SGLang's scheduler clips it (the HTTP server refuses an explicit one
    # that does not fit before it gets here).
    protocol.check_context_length(n, None, self.capacity)
    vocab = self.cfg.text.vocab_size
    if int(req.prompt.tokens_T.max()) >= vocab:
      raise ProtocolError(f"input_ids must be < vocab_size {vocab}")
    bias = req.sampling.logit_bias
    if len(bias) > self.max_logit_bias:
      raise ProtocolError(
        f"logit_bias has {len(bias)} entries; this server takes at most {self.max_logit_bias}"
      )
    if bias and bias[-1][0] >= vocab:
      raise ProtocolError(f"logit_bias token ids must be < vocab_size {vocab}")
    limit = self.capacity - n
    mnt = req.sampling.max_new_tokens
    req.max_new = limit if mnt is None else min(mnt, limit)
    req.seed = (
      req.sampling.sampling_seed
      if req.sampling.sampling_seed is not None
      else int(self._rng.integers(0, 2**31))
    )
    with self._cv:
      if req.rid in self._by_rid:
        raise ProtocolError(f"a request with rid {req.rid!r} is already running")
      self._by_rid[req.rid] = req
      self._waiting.append(req)
      self._cv.notify_all()
    return req

  def abort(self, rid: str | None = None, abort_all: bool = False, message: str = "Abort") -> int:
    """Marks requests for abort; they finish at the next step boundary."""
    with self._cv:
      victims = (
        list(self._by_rid.values())
        if abort_all
        else ([self._by_rid[rid]] if rid in self._by_rid else [])
      )
      for req in victims:
        req.abort_message = message
      self._cv.notify_all()
    return len(victims)

  def pause(self, mode: str = "abort") -> None:
    """Stops scheduling; "abort" also aborts everything in flight."""
    protocol.check_pause_mode(mode)
    with self._cv:
      self._paused = True
    if mode == "abort":
      self.abort(abort_all=True, message="Abort: generation paused")
      with self._step_lock:
        self._finish_aborted()

  def resume(self) -> None:
    with self._cv:
      self._paused = False
      self._cv.notify_all()

  @property
  def paused(self) -> bool:
    return self._paused

  def load(self) -> dict:
    with self._cv:
      running = [r for r in self._slots if r is not None]
      return {
        "num_reqs": len(running) + len(self._waiting),
        "num_running_reqs": len(running),
        "num_waiting_reqs": len(self._waiting),
        "num_tokens": int(sum(len(r.prompt) + len(r.output_ids) for r in running)),
      }

  def idle(self) -> bool:
    with self._cv:
      return not self._by_rid

  # --- weights ----------------------------------------------------------------------

  def update_params(self, params: nnx.State | vlm.Qwen25VL, weight_version: str) -> None:
    """Swaps in new parameters between steps (arrays handed over directly)."""
    state = nnx.split(params)[1] if isinstance(params, nnx.Module) else params
    with self._step_lock:
      jax.tree.map(lambda a, b: _check_same(a, b), self._state, state)
      self._state = state
      self.weight_version = str(weight_version)

  def load_hf_tensors(self, named, weight_version: str) -> None:
    """Swaps in the parameters that (HF name, tensor) pairs give, read as they
    arrive (a distributed weight update's stream), the others kept.

    All or nothing: every tensor is read and checked before one swap of
    parameters and version between steps; a bad one raises
    hf_load.CheckpointFormatError and the engine serves on unchanged.
    """
    with self._step_lock:
      state = self._state
    self.update_params(hf_load.with_hf_tensors(state, self.cfg, named), weight_version)

  def load_weights_from_disk(self, path: str, weight_version: str) -> None:
    """Reads an HF checkpoint folder (same architecture) and swaps it in.

    All or nothing: the folder is checked whole and read completely
    (hf_load.load_hf_checkpoint) before one swap of parameters and version
    between steps. A folder whose delta applies to the served version
    (models/hf_delta.py) is read as that delta instead, also all or nothing;
    a delta that fails leaves the folder to be loaded. A folder that fails
    (ProtocolError: another architecture; hf_load.CheckpointFormatError: a
    file or tensor missing, truncated or misshapen; OSError: unreadable)
    raises, and the engine serves on with the weights and version it had.
    """
    disk = config_lib.load_hf_config(path)
    if (disk.text, disk.vision) != (self.cfg.text, self.cfg.vision):
      raise ProtocolError(
        f"checkpoint at {path} has a different architecture than the served model"
      )
    if hf_delta.base_version(path) == self.weight_version:
      with self._step_lock:
        state = self._state
      try:
        current = hf_load.hf_tensor_reader(state, self.cfg)
        named = hf_delta.apply(path, current, hf_load.TensorIndex(path).read)
        self.load_hf_tensors(named, weight_version)
        self.deltas_applied += 1
        return
      except (ValueError, KeyError, OSError) as e:  # the folder itself may still load
        log.warning("the delta in %s was not applied (%s); loading the folder", path, e)
    model = hf_load.load_hf_checkpoint(path, self.cfg)
    self.update_params(nnx.split(model)[1], weight_version)

  # --- the loop ---------------------------------------------------------------------

  def start(self) -> None:
    self._thread = threading.Thread(target=self.run_forever, name="rollout-engine", daemon=True)
    self._thread.start()

  def stop(self) -> None:
    with self._cv:
      self._stopped = True
      self._cv.notify_all()
    if self._thread is not None:
      self._thread.join(timeout=10)

  def run_forever(self) -> None:
    while True:
      with self._cv:
        while not self._stopped and not self._has_work():
          self._cv.wait(timeout=0.5)
        if self._stopped:
          return
      try:
        self.step()
      except Exception:
        log.exception("engine step failed; aborting the running requests")
        self.abort(abort_all=True, message="Abort: engine error")
        with self._step_lock:
          self._finish_aborted()

  def _has_work(self) -> bool:
    if any(r.abort_message for r in self._by_rid.values()):
      return True
    if self._paused:
      return False
    return bool(self._waiting) or any(s is not None for s in self._slots)

  def generate(self, reqs: Sequence[EngineRequest]) -> list[EngineRequest]:
    """Runs requests to completion on the calling thread (in-process use).

    Raises:
      NonFiniteLogits: the weights gave non-finite logits for a request (the
        first such); the others ran to completion.
    """
    for r in reqs:
      self.submit(r)
    while not all(r.done.is_set() for r in reqs):
      if not self.step():
        time.sleep(0.001)
    refused = next((r.error for r in reqs if r.error is not None), None)
    if refused is not None:
      raise refused
    return list(reqs)

  def step(self) -> bool:
    """Admits, prefills, decodes one token for every slot. Returns if it worked."""
    with self._step_lock:
      self._finish_aborted()
      admitted = self._admit()
      for req in admitted:
        self._prefill_one(req)
      active = [i for i, r in enumerate(self._slots) if r is not None]
      if not active or self._paused:
        return bool(admitted)
      self._decode_all(active)
      return True

  def _admit(self) -> list[EngineRequest]:
    out: list[EngineRequest] = []
    with self._cv:
      if self._paused:
        return out
      free = [i for i, r in enumerate(self._slots) if r is None]
      while free and self._waiting:
        req = self._waiting.popleft()
        if req.max_new == 0:
          self._finish(req, protocol.finish_length(0))
          continue
        req.slot = free.pop(0)
        self._slots[req.slot] = req
        out.append(req)
    return out

  def _finish_aborted(self) -> None:
    with self._cv:
      victims = [r for r in self._by_rid.values() if r.abort_message]
      for req in victims:
        if req.slot >= 0:
          assert req.abort_message is not None, "victims are chosen by their message"
          self._slots[req.slot] = None
          self._finish(req, protocol.finish_abort(req.abort_message))
        else:
          self._waiting.remove(req)
          self._finish(req, protocol.finish_abort(protocol.ABORT_WAITING))

  def _set_slot_sampling(self, req: EngineRequest) -> None:
    s, sp = req.slot, req.sampling
    self._temperature_S[s] = sp.temperature
    self._top_p_S[s] = sp.top_p
    self._top_k_S[s] = min(sp.top_k, self.cfg.text.vocab_size)
    self._seed_S[s] = req.seed
    self._bias_ids_SK[s] = 0
    self._bias_SK[s] = 0.0
    for k, (token, bias) in enumerate(sp.logit_bias):
      self._bias_ids_SK[s, k], self._bias_SK[s, k] = token, bias

  def _prefill_one(self, req: EngineRequest) -> None:
    t0 = time.perf_counter()
    n = len(req.prompt)
    bucket = next(b for b in self.buckets if b >= n)
    tokens = np.zeros(bucket, np.int32)
    tokens[:n] = req.prompt.tokens_T
    positions = np.zeros((3, bucket), np.int32)
    positions[:, :n] = req.prompt.positions_3T
    vis = None
    if req.prompt.media:
      media = req.prompt.decoded_media()
      cap = plan_lib.doubling_bucket(req.prompt.num_patches, max(self.cfg.vision.merge_unit, 16))
      vis = vision.make_vision_inputs(
        [m.patches for m in media], [m.grid_thw for m in media], self.cfg.vision, cap
      )
    self._set_slot_sampling(req)
    s = req.slot
    tok, lp, finite, self._cache = self._prefill(
      self._state,
      self._cache,
      np.int32(s),
      tokens,
      positions,
      np.int32(n),
      vis,
      self._temperature_S[s],
      self._top_p_S[s],
      self._top_k_S[s],
      self._seed_S[s],
      (self._bias_ids_SK[s], self._bias_SK[s]),
    )
    tok, lp, finite = int(tok), float(lp), bool(finite)
    self.stats["prefill_s"] += time.perf_counter() - t0
    self._lengths_S[s] = n
    self._delta_S[s] = req.prompt.mrope_delta
    if finite:
      self._append(req, tok, lp)
    else:
      self._refuse(req)

  def _decode_all(self, active: list[int]) -> None:
    t0 = time.perf_counter()
    n = next(b for b in self._slot_buckets if b > max(active))
    steps = self.num_continuous_decode_steps
    running: dict[int, EngineRequest] = {}
    budget_S = np.zeros(n, np.int32)  # tokens each slot may still sample
    for s in active:
      req = self._slots[s]
      assert req is not None, "active slots hold a request"
      running[s] = req
      budget_S[s] = req.max_new - len(req.output_ids)
    tok_KS, lp_KS, finite_KS, self._cache = self._decode(
      self._state,
      self._cache,
      self._tokens_S[:n],
      self._lengths_S[:n],
      self._delta_S[:n],
      budget_S,
      self._temperature_S[:n],
      self._top_p_S[:n],
      self._top_k_S[:n],
      self._seed_S[:n],
      self._bias_ids_SK[:n],
      self._bias_SK[:n],
      window=self._window(active, budget_S, steps),
      steps=steps,
    )
    tok_KS, lp_KS, finite_KS = jax.device_get((tok_KS, lp_KS, finite_KS))
    time.sleep(max(0.0, t0 + steps * self.min_decode_step_s - time.perf_counter()))
    self.stats["decode_s"] += time.perf_counter() - t0
    self.stats["decode_steps"] += steps
    # Token by token, slot by slot: the order a one-step call would see them.
    for tok_S, lp_S, finite_S in zip(tok_KS, lp_KS, finite_KS):
      for s, req in running.items():
        if self._slots[s] is not req:
          continue  # finished earlier in this call: the rest of its tokens are void
        self._lengths_S[s] += 1
        if finite_S[s]:
          self._append(req, int(tok_S[s]), float(lp_S[s]))
        else:
          self._refuse(req)

  def _window(self, active: list[int], budget_S: np.ndarray, steps: int) -> int:
    """The decode window: the smallest bucket that holds every entry an active
    slot writes during the call (idle slots attend to nothing that matters)."""
    writes = np.minimum(budget_S[active], steps)
    longest = int((self._lengths_S[active] + writes).max())
    return next(w for w in self._windows if w >= longest)

  def _append(self, req: EngineRequest, tok: int, lp: float) -> None:
    """Records a sampled token, then finishes the request or feeds the token on."""
    req.output_ids.append(tok)
    req.output_logprobs.append(lp)
    req.output_versions.append(self.weight_version)
    self.stats["tokens"] += 1
    reason = self._finish_reason(req)
    if reason is None:
      self._tokens_S[req.slot] = tok
      if req.on_event is not None:
        req.on_event(req)
      return
    with self._cv:
      self._slots[req.slot] = None
      self._tokens_S[req.slot] = 0
      self._lengths_S[req.slot] = 0
      self._finish(req, reason)

  def _refuse(self, req: EngineRequest) -> None:
    """Finishes a request whose logits are non-finite, as an abort that says so.

    Its tokens so far stay (each sampled from finite logits); `req.error`
    holds the `NonFiniteLogits` that `generate` and the embedded backend raise.
    """
    req.error = NonFiniteLogits(req.rid, self.weight_version, len(req.output_ids))
    log.error("%s", req.error)
    # The slot's cache now holds non-finite keys and values; a later request
    # in it would meet them at masked positions (0 * NaN) whatever its weights.
    self._cache = self._clear_slot(self._cache, np.int32(req.slot))
    with self._cv:
      self._slots[req.slot] = None
      self._tokens_S[req.slot] = 0
      self._lengths_S[req.slot] = 0
      self._finish(req, req.error.finish_reason())

  def _finish_reason(self, req: EngineRequest) -> dict | None:
    """SGLang's `check_finished` order: length, then stop token, then stop string."""
    sp = req.sampling
    if len(req.output_ids) >= req.max_new:
      return protocol.finish_length(req.max_new)
    last = req.output_ids[-1]
    if last in sp.stop_token_ids or (not sp.ignore_eos and last in self.eos_ids):
      return protocol.finish_stop_token(last)
    if sp.stop:
      tail = self.tokenizer.decode(req.output_ids)
      for s in sp.stop:
        if s in tail:
          return protocol.finish_stop_str(s)
    return None

  def _finish(self, req: EngineRequest, reason: dict) -> None:
    """Sets the final text and wakes the waiter (caller holds `_cv`)."""
    req.finish_reason = reason
    req.slot = -1
    self._by_rid.pop(req.rid, None)
    req.finished_text = output_text(req, self.tokenizer)
    req.done.set()
    if req.on_event is not None:
      req.on_event(req)


def _check_same(a, b):
  if a.shape != b.shape:
    raise ValueError(f"new parameter shape {b.shape} != served {a.shape}")


def output_text(req: EngineRequest, tokenizer: Tokenizer) -> str:
  """`text` as SGLang returns it: the matched stop token/string trimmed."""
  return protocol.output_text(req.output_ids, req.finish_reason, req.sampling, tokenizer.decode)


def response(
  req: EngineRequest, tokenizer: Tokenizer, weight_version: str, server: str = ""
) -> protocol.Completion:
  """The request's completion so far (final once it has a finish reason)."""
  text = req.finished_text
  if text is None:  # still running (a streamed chunk)
    text = output_text(req, tokenizer)
  logprobs = (
    # orjson writes NaN/Inf as null; so do we.
    [lp if np.isfinite(lp) else None for lp in req.output_logprobs] if req.return_logprob else []
  )
  return protocol.Completion(
    rid=req.rid,
    text=text,
    output_ids=list(req.output_ids),
    logprobs=logprobs,
    finish_reason=req.finish_reason,
    prompt_tokens=req.prompt_tokens,
    weight_version=weight_version,
    token_versions=list(req.output_versions),
    server=server,
  )
