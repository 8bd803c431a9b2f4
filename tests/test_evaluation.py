"""Evaluation statistics against direct computation."""

import itertools
import math

import numpy as np
import pytest

from fluxjax.rl import evaluation, reward_fns


def test_pass_at_k_counts_draws_without_replacement():
  for n, c, k in [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (4, 4, 4), (6, 3, 6)]:
    draws = list(itertools.combinations(range(n), k))
    hit = sum(any(i < c for i in d) for d in draws)  # the first c are correct
    assert evaluation.pass_at_k(n, c, k) == pytest.approx(hit / len(draws))
  with pytest.raises(ValueError, match="0 < k <= n"):
    evaluation.pass_at_k(3, 1, 4)


def test_accuracy_interval_treats_the_prompt_as_the_unit():
  rng = np.random.default_rng(0)
  scores = (rng.random((300, 4)) < rng.random((300, 1))).astype(float)
  out = evaluation.summarize(scores.tolist())
  per_prompt = scores.mean(1)
  assert out["eval/accuracy"] == pytest.approx(per_prompt.mean())
  se = per_prompt.std(ddof=1) / math.sqrt(300)
  assert out["eval/accuracy_ci95"] == pytest.approx(1.959964 * se)
  # Per-sample independence would understate the interval for correlated samples.
  assert out["eval/accuracy_ci95"] > 1.959964 * scores.std(ddof=1) / math.sqrt(1200)
  assert out["eval/pass@4"] == pytest.approx((scores.max(1) == 1).mean())
  assert (out["eval/prompts"], out["eval/samples"]) == (300.0, 1200.0)


def test_greedy_and_difficulty_breakdown():
  scores = [[1, 1], [0, 1], [0, 0], [1, 0]]
  levels, tasks = ["easy", "easy", "hard", ""], ["a", "b", "b", "b"]
  out = evaluation.summarize(scores, difficulties=levels, greedy=[1, 0, 0, 1], tasks=tasks)
  assert out["eval/accuracy_greedy"] == 0.5
  assert out["eval/accuracy/easy"] == 0.75 and out["eval/accuracy/hard"] == 0.0
  assert out["eval/task/a"] == 1.0 and out["eval/task/b"] == pytest.approx(1 / 3)
  assert out["eval/task_level/b@easy"] == 0.5 and out["eval/task_level/b@hard"] == 0.0
  assert "eval/task_level/b@" not in out  # the unlabelled prompt of b
  assert out["eval/task_greedy/a"] == 1.0 and out["eval/task_greedy/b"] == pytest.approx(1 / 3)
  assert not any(k.endswith("/") for k in out)  # unlabelled prompts are not a level
  assert evaluation.summarize([[1.0]])["eval/accuracy_ci95"] == 0.0
  with pytest.raises(ValueError, match="same, non-zero number"):
    evaluation.summarize([[1, 0], [1]])
  with pytest.raises(ValueError, match="3 greedy scores for 4 prompts"):
    evaluation.summarize(scores, greedy=[1, 0, 0])


def test_length_bands_of_the_reference_response():
  bands = [evaluation.length_band(n) for n in (1, 16, 17, 32, 33, 48, 49, 300)]
  assert bands == ["00-16", "00-16", "17-32", "17-32", "33-48", "33-48", "49+", "49+"]
  scores = [[1, 1], [0, 1], [0, 0]]
  out = evaluation.summarize(scores, bands=["00-16", "00-16", "49+"])
  assert out["eval/band/00-16"] == 0.75 and out["eval/band/49+"] == 0.0


def test_reasoning_shares_overall_per_level_and_greedy():
  texts = [
    ["<think> a red1</think><answer>1</answer>", "<answer>2</answer>"],
    ["  <think> b</think><answer>3</answer>", "<think> c</think><answer>3</answer>"],
    ["<answer>red</answer>", "think first? <think>x</think>"],
  ]
  reasoning = [[reward_fns.reasons(t) for t in ts] for ts in texts]
  out = evaluation.summarize(
    [[1, 0], [1, 1], [0, 0]],
    difficulties=["easy", "hard", "hard"],
    reasoning=reasoning,
    greedy_reasoning=[False, True, False],
  )
  assert out["eval/reasoning_share"] == pytest.approx(0.5)  # (0.5 + 1 + 0) / 3
  assert out["eval/reasoning_share/easy"] == 0.5 and out["eval/reasoning_share/hard"] == 0.5
  assert out["eval/reasoning_share_greedy"] == pytest.approx(1 / 3)
  assert "eval/reasoning_share" not in evaluation.summarize([[1, 0]])


def test_a_tasks_answer_prior_is_its_most_common_answers_share():
  tasks = ["count", "count", "count", "count", "colour", "colour"]
  answers = ["2", "3", "2", "2", "red", "blue"]
  out = evaluation.summarize([[0.0]] * 6, tasks=tasks, answers=answers)
  assert out["eval/prior/count"] == 0.75 and out["eval/prior/colour"] == 0.5
  with pytest.raises(ValueError, match="5 labels for 6 prompts"):
    evaluation.summarize([[0.0]] * 6, tasks=tasks, answers=answers[:5])
