"""The committed base (fluxjax/models/assets/base_tiny, configs/pretrain.py's
export): it loads, decodes as when its card was written, and its card is whole."""

import json
import os

from fluxjax.rl import base_card

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "fluxjax", "models", "assets", "base_tiny")


def test_the_committed_base_scores_its_cards_fixed_prompts(tmp_path):
  with open(os.path.join(BASE, "card.json")) as f:
    card = json.load(f)
  assert card["command"] == "python -m fluxjax.train --config=configs/pretrain.py"
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
