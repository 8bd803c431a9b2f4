"""The base model's card (fluxjax/rl/base_card.py): what it counts and marks."""

import numpy as np

from fluxjax.data import cot_tasks
from fluxjax.models import config as config_lib
from fluxjax.models import inputs, processor, vlm
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rl import base_card


def _item(task, level, answer, rng, cfg, tok):
  s = cot_tasks.draw(rng, task, level, answer)
  proc = processor.VisionProcessorConfig(image_min_pixels=28 * 28 * 4, image_max_pixels=112 * 112)
  messages = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}
  ]
  prompt = inputs.sequence_from_chat(
    messages, [processor.preprocess_image(s.image, proc)], tok, cfg
  )
  return s, base_card.Item(task, level, s.answer, s.solution, prompt)


def test_copy_accuracy_counts_every_copied_word_of_the_chain_and_no_count():
  """Keys, colours and shapes of each step are the copied tokens; the counts,
  the format and the answer are not."""
  cfg, tok = config_lib.preset("tiny"), Tokenizer.default()
  model = vlm.create_model(cfg, 0)
  rng = np.random.default_rng(0)
  for task, level, answer in (("colour_list", "medium", 3), ("pair_census", "hard", 4)):
    s, item = _item(task, level, answer, rng, cfg, tok)
    listed = s.question.split(": ", 1)[1].split("?")[0].split(", ")
    hits, total = base_card.copy_accuracy(model, tok, cfg, item)
    assert total == sum(len(x.split()) for x in listed) and 0 <= hits <= total


def test_marks_read_hard_items_and_the_choice_to_think():
  rows = {
    "colour_list": {
      "hard": {
        "think_greedy": [1.0, 1.0, 0.0],
        "think_pass@8": [1.0, 1.0, 1.0],
        "think_rate": [0.0, 1.0, 0.0],
        "greedy_thinks": [0.0, 0.0, 0.0],
        "copy_hits": [9, 10],
        "copy_tokens": [10, 10],
      },
      "easy": {"think_rate": [0.0], "greedy_thinks": [1.0]},
    }
  }
  marks = base_card.marks(rows, 8)
  assert marks["copy_token_accuracy"]["figure"] == 19 / 20
  assert not marks["copy_token_accuracy"]["passed"]
  assert marks["think_greedy_hard"]["figure"] == 2 / 3 and marks["think_greedy_hard"]["passed"]
  assert marks["think_pass@8_hard"]["passed"]
  assert marks["think_rate_chain_tasks"]["figure"] == 0.25
  assert marks["greedy_thinks_chain_tasks"]["figure"] == 0.25
