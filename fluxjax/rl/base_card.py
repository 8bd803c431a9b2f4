"""The card of a pretrained base: what it does per task, level and response format.

  python -m fluxjax.rl.base_card --base DIR --workdir PRETRAIN_WORKDIR [--samples 8]

Run on the HF folder the pretraining command exported (configs/pretrain.py) and that
run's held-out set (WORKDIR/data/eval), it writes DIR/card.json: how the base was made
(`provenance`), the figures per task, level and format (`evaluate`) and the pretraining
issue's pass marks beside them (`marks`). docs/config.md, "Pretraining the base", says
what a re-run gives.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import hashlib
import json
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from fluxjax import provenance as provenance_lib
from fluxjax.data import cot_tasks, readers, synth
from fluxjax.data.meta import ToMeta
from fluxjax.models import config as config_lib
from fluxjax.models import hf_load, inputs, media, processor
from fluxjax.models import tokenizer as tokenizer_lib
from fluxjax.rl import evaluation, metrics, reward_fns, sft
from fluxjax.rollout import engine as engine_lib
from fluxjax.rollout.sampling_params import SamplingParams

# The forced openings: each must be the first tokens of every response the
# base was trained on in that format (tests/test_base.py). "<think> a" is
# "<think", ">", " a", so "<think> " would force a lone " " token; and a
# listed answer merges ">" with its first letter, so the direct opening
# stops before ">".
THINK, DIRECT = "<think>", "<answer"
# A fixed set the suite scores the committed base on again (tests/test_base.py):
# rows of the pretraining mix drawn by their own seed. They may share items
# with the pretraining pool: a check that the base loads and decodes as when
# its card was written, not a held-out figure.
FIXED_PROMPTS: dict[str, int | str] = {"mix": "pretrain", "rows": 32, "seed": 52}
COPYING = ("colour_list", "pair_census", "colour_census")  # chains that copy their question
MAX_NEW_TOKENS = 80


@dataclasses.dataclass(frozen=True)
class Item:
  task: str
  level: str
  answer: str
  solution: str
  prompt: inputs.SequenceInputs


def load_items(manifest: str, proc: processor.VisionProcessorConfig, tok, cfg) -> list[Item]:
  """The held-out rows as prompts, their media decoded and preprocessed."""
  to_meta = ToMeta(proc)
  items = []
  for i, row in enumerate(readers.read_rows(manifest)):
    meta = to_meta(i, row)
    if meta.error is not None:
      raise ValueError(f"held-out row {meta.id}: {meta.error}")
    vision = [media.preprocess_file(m.kind, m.path, proc) for m in meta.media]
    prompt = inputs.sequence_from_chat(meta.messages(), vision, tok, cfg)
    items.append(Item(meta.task, meta.difficulty, meta.answer or "", meta.solution, prompt))
  return items


class Decoder:
  """Greedy and sampled responses of the base, after an optional forced prefix."""

  def __init__(self, model, tok, capacity: int, seed: int = 0, temperature: float = 1.0):
    self.tok = tok
    self.temperature = temperature
    self.engine = engine_lib.Engine(model, tok, num_slots=32, capacity=capacity, seed=seed)
    self._n = 0

  def texts(self, items: Sequence[Item], prefix: str, k: int, greedy: bool) -> list[list[str]]:
    """k responses per item, each its prefix and what followed it."""
    ids = self.tok.encode(prefix) if prefix else []
    reqs = []
    for item in items:
      for _ in range(k):
        self._n += 1
        sampling = SamplingParams(
          max_new_tokens=MAX_NEW_TOKENS,
          temperature=self.temperature,
          top_k=1 if greedy else SamplingParams.top_k,
          sampling_seed=self._n,
        )
        prompt = item.prompt.extend(ids) if ids else item.prompt
        reqs.append(engine_lib.EngineRequest(f"card-{self._n}", prompt, sampling, False))
    done = self.engine.generate(reqs)
    out = [prefix + self.tok.decode(r.output_ids, skip_special_tokens=True) for r in done]
    return [out[j * k : (j + 1) * k] for j in range(len(items))]


@functools.cache
def _copied_ids(tok) -> tuple[frozenset[int], int]:
  """(the ids a chain copies from its question: keys, colours, shapes; the
  id that opens </think>, where the chain ends)."""
  words = (*cot_tasks.KEYS, *tokenizer_lib.COLORS, *tokenizer_lib.SHAPES)
  return frozenset(tok.encode(" " + w)[0] for w in words), tok.encode("</")[0]


@functools.cache
def _logits(graphdef):
  return jax.jit(lambda state, row: nnx.merge(graphdef, state).logits(row))


def copy_accuracy(model, tok, cfg, item: Item, capacity: int | None = None) -> tuple[int, int]:
  """(copied tokens ranked first, copied tokens) on the item's reference chain;
  rows padded to `capacity` tokens compile once."""
  response = sft.answer_ids(tok, item.answer, item.solution)
  row = inputs.pack_row([item.prompt.extend(response)], cfg, token_capacity=capacity)
  predicted = np.asarray(jax.device_get(_logits(nnx.graphdef(model))(nnx.state(model), row)))
  predicted = predicted[0].argmax(-1)
  copied, closing = _copied_ids(tok)
  end = response.index(closing) if closing in response else len(response)
  start = len(item.prompt)
  hits = total = 0
  for j, target in enumerate(response[:end]):
    if target in copied:
      total += 1
      hits += int(predicted[start + j - 1] == target)
  return hits, total


def load_base(base: str):
  """(model, tokenizer, model config, vision preprocessing) of an exported base,
  from its folder alone."""
  tok = tokenizer_lib.resolve("", base)
  cfg = config_lib.with_tokenizer_ids(
    config_lib.load_hf_config(base), tok.model_token_ids(), tok.vocab_size, from_checkpoint=True
  )
  limits: dict[str, Any] = dict(processor.VisionProcessorConfig.read_hf_files(base))
  proc = dataclasses.replace(processor.VisionProcessorConfig(), **limits)
  return hf_load.load_hf_checkpoint(base, cfg), tok, cfg, proc


def fixed_prompt_accuracy(model, tok, cfg, proc, out_dir: str) -> float:
  """Greedy accuracy on FIXED_PROMPTS, generated into `out_dir` if not there."""
  manifest = os.path.join(out_dir, "manifest.jsonl")
  if not os.path.exists(manifest):
    mix, rows, seed = (FIXED_PROMPTS[k] for k in ("mix", "rows", "seed"))
    synth.generate(out_dir, str(mix), int(rows), int(seed))
  items = load_items(manifest, proc, tok, cfg)
  capacity = max(len(it.prompt) for it in items) + MAX_NEW_TOKENS
  greedy = Decoder(model, tok, capacity).texts(items, "", 1, greedy=True)
  score = reward_fns.get("accuracy")
  return float(np.mean([score(g[0], it.answer) for it, g in zip(items, greedy, strict=True)]))


def evaluate(
  model, tok, cfg, items: Sequence[Item], samples: int, temperature: float = 1.0
) -> dict:
  """The card's table: {task: {level: figures}}, and its marks.

  The figures of every task and level:

  Sampled figures are at `temperature` (RL's default, 1.0, unless given).

  choice         the model chooses its format: accuracy sampled and
                 greedy, and `think_rate`, the share of sampled
                 responses that open with <think> (greedy opens with it too
                 or not: `greedy_thinks`)
  think          "<think>" forced after the prompt: greedy accuracy, and
                 pass@k and the mean accuracy (`think_sampled`) of `--samples`
                 sampled responses
  direct         "<answer" forced: greedy accuracy, and on chain tasks the
                 mean of `--samples` sampled (`direct_sampled`)
  copy           teacher-forced: on the reference chain of an item whose
                 chain copies from its question (keyed lists, census), the
                 share of copied tokens (keys, colours, shapes) the model
                 ranks first given the reference so far
  """
  score = reward_fns.get("accuracy")
  capacity = max(len(it.prompt) for it in items) + len(tok.encode(THINK)) + MAX_NEW_TOKENS
  dec = Decoder(model, tok, capacity, temperature=temperature)
  chains = [it for it in items if it.solution]
  sampled = dec.texts(items, "", 1, greedy=False)
  greedy = dec.texts(items, "", 1, greedy=True)
  direct = dec.texts(items, DIRECT, 1, greedy=True)
  direct_k = dec.texts(chains, DIRECT, samples, greedy=False)
  think_greedy = dec.texts(chains, THINK, 1, greedy=True)
  think_k = dec.texts(chains, THINK, samples, greedy=False)
  rows: dict = collections.defaultdict(
    lambda: collections.defaultdict(lambda: collections.defaultdict(list))
  )
  for it, s, g, d in zip(items, sampled, greedy, direct):
    r = rows[it.task][it.level]
    r["choice_sampled"].append(score(s[0], it.answer))
    r["choice_greedy"].append(score(g[0], it.answer))
    r["direct_greedy"].append(score(d[0], it.answer))
    r["think_rate"].append(float(reward_fns.reasons(s[0])))
    r["greedy_thinks"].append(float(reward_fns.reasons(g[0])))
  for it, g, ks, ds in zip(chains, think_greedy, think_k, direct_k):
    r = rows[it.task][it.level]
    r["think_greedy"].append(score(g[0], it.answer))
    c = sum(score(x, it.answer) >= 1.0 for x in ks)
    r[f"think_pass@{samples}"].append(evaluation.pass_at_k(samples, c, samples))
    # Sampled as RL samples (temperature 1 by default): which format pays there.
    r["think_sampled"].append(c / samples)
    r["direct_sampled"].append(sum(score(x, it.answer) >= 1.0 for x in ds) / samples)
    if it.task in COPYING:
      hits, total = copy_accuracy(model, tok, cfg, it, capacity)
      r["copy_hits"].append(hits)
      r["copy_tokens"].append(total)
  table = {t: {lv: _figures(r) for lv, r in by.items()} for t, by in rows.items()}
  return {"table": table, "marks": marks(rows, samples)}


def _figures(r: dict) -> dict:
  out = {k: float(np.mean(v)) for k, v in r.items() if k not in ("copy_hits", "copy_tokens")}
  if r.get("copy_tokens"):
    out["copy_token_accuracy"] = sum(r["copy_hits"]) / max(sum(r["copy_tokens"]), 1)
  out["items"] = len(r["choice_sampled"])
  return out


def marks(rows: dict, samples: int) -> dict:
  """The pass marks of a base (the pretraining issue) beside their figures."""
  pool = collections.defaultdict(list)
  for task, by in rows.items():
    for level, r in by.items():
      for k, v in r.items():
        pool[(k, level if task in cot_tasks.TASKS else "direct_task")].extend(v)
  hard = {k: v for (k, lv), v in pool.items() if lv == "hard"}
  chain_levels = [lv for lv in ("easy", "medium", "hard") if ("think_rate", lv) in pool]
  think_rate = float(np.mean([x for lv in chain_levels for x in pool[("think_rate", lv)]]))
  copy_hits = sum(sum(v) for (k, _), v in pool.items() if k == "copy_hits")
  copy_tokens = sum(sum(v) for (k, _), v in pool.items() if k == "copy_tokens")
  greedy_thinks = float(np.mean([x for lv in chain_levels for x in pool[("greedy_thinks", lv)]]))
  figures = {
    "copy_token_accuracy": copy_hits / max(copy_tokens, 1),
    "think_greedy_hard": float(np.mean(hard.get("think_greedy", [np.nan]))),
    f"think_pass@{samples}_hard": float(np.mean(hard.get(f"think_pass@{samples}", [np.nan]))),
    "think_rate_chain_tasks": think_rate,
    "greedy_thinks_chain_tasks": greedy_thinks,
  }
  rules = {
    "copy_token_accuracy": (">= 0.98", lambda x: x >= 0.98),
    "think_greedy_hard": (">= 0.6", lambda x: x >= 0.6),
    f"think_pass@{samples}_hard": (">= 0.8", lambda x: x >= 0.8),
    "think_rate_chain_tasks": ("0.15-0.35", lambda x: 0.15 <= x <= 0.35),
    "greedy_thinks_chain_tasks": ("low: greedy answers directly", lambda x: x < 0.5),
  }
  return {
    k: {"figure": figures[k], "mark": mark, "passed": bool(ok(figures[k]))}
    for k, (mark, ok) in rules.items()
  }


def _command(argv: Sequence[str] | None) -> str:
  """The training command as its first invocation gave it, less its work directory."""
  args = [
    a for a in (argv or ["", "--config=configs/pretrain.py"])[1:] if not a.startswith("--workdir")
  ]
  return " ".join(["python -m fluxjax.train", *args])


def provenance(workdir: str) -> dict:
  """How the base was made, from the pretraining run's records: the commit
  its first invocation started at, and its working time over all of them."""
  records = metrics.read_metrics(workdir)
  steps = sum(1 for r in records if "sft/loss" in r)
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  started = provenance_lib.invocations(workdir)
  seconds: float | None
  if started:
    commit = started[0]["commit"] + " (tree dirty)" * bool(started[0]["tree_dirty"])
    times = [r["time"] for r in metrics.read_records(workdir)]
    seconds = provenance_lib.busy_seconds([s["time"] for s in started], times)
  else:  # a run from before invocations were recorded: its last invocation
    commit = f"{provenance_lib.commit()} (carded; started at an unrecorded commit)"
    seconds = next((r["sft/seconds"] for r in records if "sft/seconds" in r), None)
  return {
    "command": _command(started[0].get("argv") if started else None),
    "commit": commit,
    "invocations": len(started) or None,
    "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__},
    "seed": config.get("seed"),
    "sft_steps": steps,
    "wall_time_s": seconds,
    "reproducibility": "a fresh re-run gives a statistically equivalent base, not the same bytes",
  }


def weights_sha256(base: str) -> str:
  """The hash of a base's weights file: which model a card describes."""
  with open(os.path.join(base, "model.safetensors"), "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _lineage(workdir: str, base: str, old: dict | None) -> dict:
  """What an earlier card in the base's folder adds. The base's own (its
  weights' hash, or no hash and no parent run) means carded again: the base
  was made at that card's commit, from its parent. Otherwise the run refined
  the base at model.hf_path: its parent's card is the one the run kept
  (provenance.keep_parent_card), else the folder's if the export left it."""
  with open(os.path.join(workdir, "config.json")) as f:
    refined_from = json.load(f).get("model", {}).get("hf_path", "")
  own = old is not None and (
    old["weights_sha256"] == weights_sha256(base)
    if "weights_sha256" in old
    else not refined_from  # a card from before the hash, of a base made from scratch
  )
  if own and old is not None:
    return {k: old[k] for k in ("commit", "parent") if k in old}
  if not refined_from:
    return {}
  return {"parent": provenance_lib.parent_card(workdir) or old or {"path": refined_from}}


def main(argv: Sequence[str] | None = None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--base", required=True, help="the exported HF folder")
  p.add_argument("--workdir", required=True, help="the pretraining run's work directory")
  p.add_argument("--samples", type=int, default=8, help="k of pass@k with the think prefix")
  p.add_argument(
    "--temperature", type=float, default=1.0, help="of the sampled figures (RL's: 1.0)"
  )
  args = p.parse_args(argv)
  model, tok, cfg, proc = load_base(args.base)
  items = load_items(os.path.join(args.workdir, "data", "eval", "manifest.jsonl"), proc, tok, cfg)
  t0 = time.perf_counter()
  figures = evaluate(model, tok, cfg, items, args.samples, args.temperature)
  card = {**provenance(args.workdir), "sample_temperature": args.temperature, **figures}
  card["card_commit"] = card["commit"]
  path = os.path.join(args.base, "card.json")
  old = None
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
  card.update(_lineage(args.workdir, args.base, old), weights_sha256=weights_sha256(args.base))
  with tempfile.TemporaryDirectory() as tmp:
    fixed = fixed_prompt_accuracy(model, tok, cfg, proc, tmp)
  card["fixed_prompts"] = {**FIXED_PROMPTS, "greedy_accuracy": fixed}
  card["card_seconds"] = time.perf_counter() - t0
  with open(path, "w") as f:
    json.dump(card, f, indent=1)
  for k, m in card["marks"].items():
    print(f"{k}: {m['figure']:.3f} (mark {m['mark']}): {'pass' if m['passed'] else 'FAIL'}")


if __name__ == "__main__":
  main()
