"""A run's reward as users write it: their module or file, veRL's signature,
a weighted sum, the row's context; in the worker processes that run it."""

import math
import textwrap

import pytest

from fluxjax.data import readers
from fluxjax.rl import reward_fns, reward_pool, reward_spec
from fluxjax.rl.reward_spec import RewardContext

CONTEXT = RewardContext(
  prompt="How many red squares?", task="count", data_source="geo3k", extra={"index": 7}
)

USER_REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """veRL's signature."""
    hit = float(solution_str.strip() == ground_truth)
    return hit + 0.01 * extra_info["index"] if data_source == "geo3k" else -1.0

def by_prompt(response, prompt):
    return float(len(prompt))

def everything(response, **kwargs):
    return float(len(kwargs))

def positional(text, ref):
    return float(text == ref)
'''


@pytest.fixture
def user_file(tmp_path):
  path = tmp_path / "my_rewards.py"
  path.write_text(textwrap.dedent(USER_REWARDS))
  return str(path)


def test_a_function_gets_what_it_names(user_file):
  load = lambda name: reward_spec.load(f"{user_file}:{name}")
  assert reward_spec.call(load("compute_score"), "12", "12", CONTEXT) == pytest.approx(1.07)
  assert reward_spec.call(load("by_prompt"), "x", "y", CONTEXT) == len(CONTEXT.prompt)
  # **kwargs gets every argument its named ones leave: answer, prompt, task,
  # data_source, extra.
  assert reward_spec.call(load("everything"), "x", "y", CONTEXT) == 5.0
  # No known name: the two-argument convention, positionally.
  assert reward_spec.call(load("positional"), "7", "7", CONTEXT) == 1.0
  assert reward_spec.call(reward_fns.get("accuracy"), "<answer>7</answer>", "7", CONTEXT) == 1.0


def test_specs_name_registered_module_and_file_functions(user_file, tmp_path):
  assert reward_spec.load("accuracy") is reward_fns.get("accuracy")
  assert reward_spec.load("fault_rewards:signal_unless_numeric").__name__ == "signal_unless_numeric"
  assert reward_spec.load(f"{user_file}:positional")("a", "a") == 1.0
  for spec, cause in [
    ("no_such_reward", "unknown reward"),
    ("no_such_module:fn", "ModuleNotFoundError"),
    (f"{tmp_path}/missing.py:fn", "FileNotFoundError"),
    (f"{user_file}:no_such_fn", "AttributeError"),
  ]:
    with pytest.raises(KeyError, match=cause):
      reward_spec.load(spec)


def test_weighted_terms_and_their_errors(user_file, monkeypatch, tmp_path):
  monkeypatch.chdir(tmp_path)
  terms = reward_spec.parse("accuracy, my_rewards.py:by_prompt", (1.0, 0.5))
  assert [(t.name, t.weight) for t in terms] == [("accuracy", 1.0), ("by_prompt", 0.5)]
  assert terms[1].fn == f"{user_file}:by_prompt"  # absolute: workers may start elsewhere
  fns = [reward_spec.load(t.fn) for t in terms]
  total, values = reward_spec.score(terms, fns, "<answer>3</answer>", "3", CONTEXT)
  assert values == {"accuracy": 1.0, "by_prompt": float(len(CONTEXT.prompt))}
  assert total == pytest.approx(1.0 + 0.5 * len(CONTEXT.prompt))
  for fn, weights, match in [
    ("", (), "names no reward"),
    ("accuracy,format", (1.0,), "1 weights for 2 functions"),
    ("accuracy", (math.nan,), "finite"),
    ("accuracy,accuracy", (), "two functions alike"),
  ]:
    with pytest.raises(ValueError, match=match):
      reward_spec.parse(fn, weights)
  with pytest.raises(ValueError, match="reward nan_reward returned a non-finite value nan"):
    nan = [reward_spec.Term("nan_reward", "x")]
    reward_spec.score(nan, [lambda r, a: math.nan], "", "", CONTEXT)


def test_the_pool_runs_a_users_file_with_context_and_logs_each_term(user_file):
  terms = reward_spec.parse(f"{user_file}:compute_score,format", (1.0, 0.5))
  with reward_pool.RewardScheduler(1, terms, t_max=60.0) as rs:
    ok = rs.submit("<answer>4</answer>", "<answer>4</answer>", key="a", context=CONTEXT)
    other = rs.submit("5", "5", key="b", context=RewardContext(data_source="gsm8k"))
    one = rs.submit("<answer>4</answer>", "4", fn="accuracy", key="c")
    results = rs.gather([ok, other, one], timeout=60)
  assert [r.status for r in results] == ["ok"] * 3
  assert results[0].terms == pytest.approx({"compute_score": 1.07, "format": 1.0})
  assert results[0].reward == pytest.approx(1.07 + 0.5)
  assert results[1].terms == {"compute_score": -1.0, "format": 0.0}  # its data source
  assert results[2].terms == {"accuracy": 1.0} and results[2].reward == 1.0


def test_readers_keep_a_rows_other_fields_for_the_reward(tmp_path):
  row = {
    "data_source": "geo3k",
    "prompt": [{"role": "user", "content": "What is 2+2?"}],
    "reward_model": {"style": "rule", "ground_truth": "4"},
    "extra_info": {"split": "train", "index": 3},
    "ability": "math",
    "image_bytes": b"\xff\xd8",  # not a JSON value: left out
  }
  out = readers.normalize_row(row, 0, str(tmp_path))
  assert out["answer"] == "4" and out["source"] == "geo3k"
  assert out["extra"] == {
    "reward_model": {"style": "rule", "ground_truth": "4"},
    "ability": "math",
    "split": "train",
    "index": 3,
  }


def test_a_control_run_is_evaluated_with_the_task_reward_it_controls():
  # A run trained on 1 - accuracy must show its accuracy fall: scored with
  # its own reward, its held-out figure would rise as it unlearns.
  for control in ("accuracy_reversed", "random", "constant"):
    assert reward_spec.evaluation(control, "") == "accuracy"
    assert reward_spec.evaluation(control, "exact") == "exact"  # a set eval.reward wins
  assert reward_spec.evaluation("accuracy_with_format", "") == "accuracy_with_format"
  assert reward_spec.evaluation("format,accuracy", "") == "format,accuracy"
