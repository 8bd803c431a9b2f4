"""The shipped synthetic tokenizer, trained on the synthetic tasks' own text.

  python -m fluxjax.data.tokenizer_corpus --out fluxjax/models/assets/tokenizer.json

The corpus is the chat and number text of `tokenizer.synthetic_corpus` plus `task_texts`.
Changing a task's wording changes the corpus: regenerate the asset, and retrain any base
model frozen with the old one.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator, Sequence

import numpy as np

from fluxjax.data import cot_tasks, synth, visual_tasks
from fluxjax.models import tokenizer as tokenizer_lib

SAMPLES_PER_LEVEL = 40  # per task and level
SEED = 0


def _chat(question: str, response: str) -> str:
  return f"user\n{question}\nassistant\n{response}\n"


def task_texts() -> Iterator[str]:
  """Questions and reference responses of every task, in a fixed order.

  A fixed draw at every level: the question wordings, the keyed lists ("a red, b blue")
  and the chains ("<think> a red1 b blue1</think>"), so the words the tasks use become
  single tokens (each key letter with its space among them).
  """
  rng = np.random.default_rng(SEED)
  decks = cot_tasks.AnswerDecks(rng)
  for level in visual_tasks.LEVELS:
    for _ in range(SAMPLES_PER_LEVEL):
      for task in visual_tasks.TASKS:
        s = visual_tasks.draw(rng, task, level)
        yield _chat(s.question, visual_tasks.reference_response(s.answer, s.solution))
      for task in cot_tasks.ALL:
        s = cot_tasks.draw(rng, task, level, decks.deal(task, level))
        yield _chat(s.question, visual_tasks.reference_response(s.answer, s.solution))
  for _ in range(SAMPLES_PER_LEVEL):
    for make in synth.SHAPES_TASKS.values():
      _, question, answer = make(rng, visual_tasks.IMAGE_SIZE)
      yield _chat(question, visual_tasks.reference_response(answer))


def tokenizer_json() -> str:
  """The shipped asset's exact text (pretty JSON, trailing newline)."""
  return tokenizer_lib.build_synthetic_tokenizer(task_texts()).to_str(pretty=True) + "\n"


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--out", default=tokenizer_lib.ASSET_PATH, help="where to write tokenizer.json"
  )
  args = parser.parse_args(argv)
  text = tokenizer_json()
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w", encoding="utf-8") as f:
    f.write(text)
  print(f"wrote {args.out}: {tokenizer_lib.SYNTHETIC_VOCAB_SIZE} tokens")


if __name__ == "__main__":
  main()
