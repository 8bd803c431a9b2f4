"""The in-process rollout backend: the engine in a thread, the fleet's interface.

`EmbeddedRollout.generate(body, group)` takes the same SGLang /generate body
as `Fleet.generate` and returns the same `Completion`, so the coordinator does
not care which backend runs. Weight updates hand arrays over directly
(`update_params`), with no disk round trip.
"""

from __future__ import annotations

import asyncio

from fluxjax.models import processor, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout import prompt, protocol
from fluxjax.rollout.client import Completion, RequestRejected


class EmbeddedRollout:
  """An engine running in a background thread of this process."""

  url = "embedded"

  def __init__(self, model: vlm.Qwen25VL, tokenizer: Tokenizer, *, num_slots: int = 8,
               context_length: int = 512, seed: int = 0,
               proc_cfg: processor.VisionProcessorConfig | None = None):
    self.tokenizer = tokenizer
    self.engine = engine_lib.Engine(model, tokenizer, num_slots=num_slots,
                                    capacity=context_length, seed=seed)
    # Must equal the trainer's: the prompt's pad-token counts come from it.
    self.proc_cfg = proc_cfg or processor.VisionProcessorConfig()
    self.engine.start()

  async def generate(self, body: dict, group: str | None = None) -> Completion:
    del group  # one engine: every group shares it
    loop = asyncio.get_running_loop()
    try:
      req = protocol.parse_generate(body)
      seq = await loop.run_in_executor(None, prompt.build_sequence, req, self.tokenizer,
                                       self.engine.cfg, self.proc_cfg)
      done = loop.create_future()

      def on_event(r):
        if r.finish_reason is not None:
          loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))

      ereq = self.engine.submit(engine_lib.EngineRequest(
          req.rid, seq, req.sampling, return_logprob=req.return_logprob, on_event=on_event))
    except protocol.ProtocolError as e:
      raise RequestRejected(str(e)) from e
    try:
      await done
    finally:
      if ereq.finish_reason is None:
        self.engine.abort(ereq.rid)
    body = engine_lib.response(ereq, self.tokenizer, self.engine.weight_version)
    return Completion.from_response(body, self.url)

  async def abort(self, rid: str) -> None:
    self.engine.abort(rid)

  def update_params(self, params, weight_version: str) -> None:
    self.engine.update_params(params, weight_version)

  async def close(self) -> None:
    self.engine.stop()
