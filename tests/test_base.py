"""The committed base (fluxjax/models/assets/base_tiny, configs/pretrain.py's
export): it loads, decodes as when its card was written, and its card is whole."""

import json
import os

from fluxjax.data import readers, synth
from fluxjax.models import tokenizer as tokenizer_lib
from fluxjax.rl import base_card, sft

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "fluxjax", "models", "assets", "base_tiny")


def test_the_committed_base_scores_its_cards_fixed_prompts(tmp_path):
  with open(os.path.join(BASE, "card.json")) as f:
    card = json.load(f)
  assert card["command"].startswith("python -m fluxjax.train --config=configs/pretrain.py")
  assert {"commit", "machine", "seed", "sft_steps", "wall_time_s", "table", "marks"} <= set(card)
  size = sum(os.path.getsize(os.path.join(BASE, n)) for n in os.listdir(BASE))
  assert size <= 20 * 2**20
  fixed = card["fixed_prompts"]
  assert {k: fixed[k] for k in base_card.FIXED_PROMPTS} == base_card.FIXED_PROMPTS
  model, tok, cfg, proc = base_card.load_base(BASE)
  got = base_card.fixed_prompt_accuracy(model, tok, cfg, proc, str(tmp_path))
  # Greedy decoding may break a near-tie otherwise on another CPU: 3 of 32.
  assert abs(got - fixed["greedy_accuracy"]) <= 3 / 32 + 1e-9
  assert got >= 0.3  # random weights score about 0.03


def test_the_cards_forced_openings_are_how_the_base_was_taught_to_begin(tmp_path):
  """A forced prefix must tokenize as the first tokens of the trained
  responses: "<think> " would end in a lone space token, which never
  precedes a chain's first item in training."""
  tok = tokenizer_lib.resolve("", BASE)
  rows = readers.read_rows(synth.generate(str(tmp_path), "pretrain", 60, 0))
  chains = [r for r in rows if r.get("solution")]
  assert chains and len(chains) < len(rows)
  think, direct = tok.encode(base_card.THINK), tok.encode(base_card.DIRECT)
  for r in chains:
    chain = sft.answer_ids(tok, r["answer"], r["solution"])
    assert chain[: len(think)] == think, r["task"]
  for r in rows:
    answer = sft.answer_ids(tok, r["answer"])
    assert answer[: len(direct)] == direct, r["task"]
