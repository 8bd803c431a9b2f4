"""The in-process rollout backend: the engine in a thread, the fleet's interface.

`EmbeddedRollout` implements `backend.RolloutBackend`: `generate(request,
group)` takes the same typed request as `Fleet.generate` and returns the same
`Completion` (no JSON on the way), so the coordinator does not care which backend runs. Weight
updates hand arrays over directly (`publish`, `update_params`), with no disk
round trip, and the engine's slot counters feed tail batching's statistics.
"""

from __future__ import annotations

import asyncio

from fluxjax.models import media, processor, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout import json_body, media_cache, prompt, protocol
from fluxjax.rollout import publish as publish_lib
from fluxjax.rollout.backend import SlotStats
from fluxjax.rollout.client import RequestRejected
from fluxjax.rollout.protocol import Completion, GenerateRequest


class EmbeddedRollout:
  """An engine running in a background thread of this process.

  The engine's thread runs from construction until `close`.
  """

  url = "embedded"

  def __init__(
    self,
    model: vlm.Qwen25VL,
    tokenizer: Tokenizer,
    *,
    num_slots: int,
    context_length: int,
    num_continuous_decode_steps: int = 1,
    seed: int = 0,
    proc_cfg: processor.VisionProcessorConfig | None = None,
    limits: media.MediaLimits = media.DEFAULT_LIMITS,
  ):
    self.tokenizer = tokenizer
    self.limits = limits
    self.engine = engine_lib.Engine(
      model,
      tokenizer,
      num_slots=num_slots,
      capacity=context_length,
      seed=seed,
      num_continuous_decode_steps=num_continuous_decode_steps,
    )
    # Must equal the trainer's: the prompt's pad-token counts come from it.
    self.proc_cfg = proc_cfg or processor.VisionProcessorConfig()
    self.media = media_cache.MediaCache()
    self.engine.start()

  async def generate(self, request: GenerateRequest, group: str | None = None) -> Completion:
    """The request's completion; raises `protocol.NonFiniteLogits` if the weights
    gave non-finite logits for it (a broken policy, not a refused request)."""
    del group  # one engine: every group shares it
    loop = asyncio.get_running_loop()
    try:
      seq = await loop.run_in_executor(
        None,
        prompt.build_sequence,
        request,
        self.tokenizer,
        self.engine.cfg,
        self.proc_cfg,
        self.limits,
        self.media,
      )
      # What the server refuses, in the same words (its context is the slots').
      protocol.check_context_length(
        len(seq), request.requested_max_new_tokens, self.engine.capacity
      )
      done = loop.create_future()

      def on_event(r):
        if r.finish_reason is not None:
          loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))

      ereq = self.engine.submit(
        engine_lib.EngineRequest(
          request.rid,
          seq,
          request.sampling,
          return_logprob=request.return_logprob,
          on_event=on_event,
        )
      )
    except json_body.ProtocolError as e:
      raise RequestRejected(str(e)) from e
    try:
      await done
    finally:
      if ereq.finish_reason is None:
        self.engine.abort(ereq.rid)
    if ereq.error is not None:  # the served weights gave non-finite logits
      raise ereq.error
    return engine_lib.response(ereq, self.tokenizer, self.engine.weight_version, self.url)

  async def abort(self, rid: str) -> None:
    self.engine.abort(rid)

  def update_params(self, params, weight_version: str) -> None:
    self.engine.update_params(params, weight_version)

  async def publish(self, model: vlm.Qwen25VL, version: int) -> publish_lib.PublishReport:
    """Swaps `model`'s arrays into the engine.

    The swap runs in an executor thread: it waits for the engine's current
    step, which must not stall the event loop.
    """
    return await asyncio.get_running_loop().run_in_executor(
      None, publish_lib.publish_in_process, [self], model, version
    )

  def metrics(self) -> dict[str, float]:
    return {}

  def slot_stats(self) -> SlotStats:
    return SlotStats(
      decode_steps=int(self.engine.stats["decode_steps"]), num_slots=self.engine.num_slots
    )

  async def start(self) -> None:
    """Nothing to open: the engine's thread runs from construction."""

  async def close(self) -> None:
    self.engine.stop()

  async def __aenter__(self) -> EmbeddedRollout:
    await self.start()
    return self

  async def __aexit__(self, *exc: object) -> None:
    await self.close()
