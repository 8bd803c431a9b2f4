"""The SFT warm-up (fluxjax.rl.sft): its loss, its targets, and its place in the loop."""

import dataclasses
import functools
import json
import logging
import os
import signal
import types

import jax
import jax.numpy as jnp
import numpy as np
import PIL.Image
import PIL.ImageDraw
import pytest
import safetensors
from flax import nnx

from fluxjax import config_args, export
from fluxjax.data import drawing, readers, visual_tasks
from fluxjax.data import meta as meta_lib
from fluxjax.models import hf_load, inputs, processor, sharded
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import train_step
from fluxjax.rl import base_card, loop, preemption, reward_fns, sft
from fluxjax.rl import metrics as metrics_lib
from fluxjax.settings import ChainFraction, Guess, Settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _config():
  return config_args.load_config(os.path.join(ROOT, "configs", "vlm.py"), "tiny")


@dataclasses.dataclass
class _Policy:
  """The run's policy as the warm-up sees it (`sft.Policy`), without rollout."""

  cfg: object
  tokenizer: Tokenizer
  mesh: object
  strategy: object
  graphdef: object
  state: train_step.TrainState

  def prompt(self, sample):
    return inputs.sequence_from_chat(
      sample.messages(), list(sample.media), self.tokenizer, self.cfg
    )

  def load_params(self, params):
    self.state = train_step.TrainState(params, self.state.opt_state, self.state.step)

  def publish(self, new_version=True):
    return 0.0


def _image(colour, size=56):
  image = PIL.Image.new("RGB", (size, size), drawing.BACKGROUND)
  drawing.draw_shape(PIL.ImageDraw.Draw(image), "circle", colour, size / 2, size / 2, size / 3)
  return image


@pytest.fixture(scope="module")
def setup(devices):
  del devices  # the fake 8-device mesh: the warm-up runs sharded, as RL does
  config = _config()
  config.sft.lr, config.sft.warmup_steps, config.sft.steps = 1e-2, 0, 5
  cfg, strategy, mesh, settings, _ = loop.validate(config)
  model = sharded.create_sharded_model(cfg, mesh, seed=0)
  tx = train_step.make_optimizer(config.optim)
  graphdef, state, _ = train_step.create_train_state(model, tx, mesh)
  tokenizer = Tokenizer.default()
  proc = loop.processor_config(settings.data.vision)
  coord = _Policy(cfg, tokenizer, mesh, strategy, graphdef, state)
  seqs, answers = [], []
  for colour, question in (
    ("red", "What colour is the shape in the image?"),
    ("blue", "Which colour is the shape?"),
    ("white", "Colour?"),
  ):
    img = processor.preprocess_image(_image(colour), proc)
    messages = [
      {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}
    ]
    prompt = inputs.sequence_from_chat(messages, [img], tokenizer, cfg)
    ids = sft.answer_ids(tokenizer, colour)
    seqs.append(sft.sft_sequence(prompt, ids))
    answers.append((colour, len(prompt), ids))
  return config, coord, seqs, answers


@functools.cache
def _token_logprobs(graphdef):
  """One jitted forward per model structure, reused by every _numpy_nll call."""
  return jax.jit(lambda params, row, tgt: nnx.merge(graphdef, params).token_logprobs(row, tgt))


def _numpy_nll(coord, seqs, answers, answer_only=True):
  """Mean NLL of the answer tokens, one sequence at a time, outside any plan."""
  logprobs = _token_logprobs(coord.graphdef)
  total, count = 0.0, 0
  for seq, (_, prompt_len, ids) in zip(seqs, answers):
    row = inputs.pack_row([seq.inputs], coord.cfg)
    targets = np.zeros((1, len(seq)), np.int32)
    targets[0, :-1] = seq.inputs.tokens_T[1:]
    logp_T = jax.device_get(logprobs(coord.state.params, row, targets))[0]
    logp = np.asarray(logp_T).astype(np.float64)
    # Input j predicts token j + 1: the answer's tokens are predicted from
    # positions prompt_len - 1 .. len - 2.
    first = prompt_len - 1 if answer_only else 0
    trained = logp[first : len(seq) - 1]
    if answer_only:
      assert len(trained) == len(ids)
    total -= trained.sum()
    count += len(trained)
  return total / count


def test_targets_are_the_formatted_answer_with_eos(setup):
  _, coord, seqs, answers = setup
  tok = coord.tokenizer
  for seq, (colour, prompt_len, ids) in zip(seqs, answers):
    mask = seq.loss_mask_T
    assert mask[:prompt_len].sum() == 0 and np.all(mask[prompt_len:] == 1)
    np.testing.assert_array_equal(seq.advantages_T, mask)
    answer = seq.inputs.tokens_T[prompt_len:]
    np.testing.assert_array_equal(answer, ids)
    assert answer[-1] == tok.im_end_id and tok.im_end_id in tok.eos_ids
    # What the rollout engine would return for these tokens earns full reward.
    text = tok.decode(answer, skip_special_tokens=True)
    assert text == f"<answer>{colour}</answer>"
    assert reward_fns.accuracy_with_format(text, colour) == 1.0
    # The answer continues the prompt's M-RoPE positions.
    last = seq.inputs.positions_3T[:, prompt_len - 1].max()
    assert seq.inputs.positions_3T[0, prompt_len] == last + 1


def test_each_level_shows_its_own_share_of_chains(setup):
  """`sft.chain_fraction` per level: of 600 samples a level, about its share
  carry <think>solution</think>, each the same on every call; rows without a
  level take `other`."""
  _, coord, *_ = setup
  rollout = types.SimpleNamespace(
    requests=types.SimpleNamespace(
      tokenizer=coord.tokenizer,
      prompt=lambda s: inputs.sequence_from_chat(s.messages(), [], coord.tokenizer, coord.cfg),
    )
  )
  fraction = ChainFraction(easy=0.1, medium=0.5, hard=0.9, other=0.0)
  think = coord.tokenizer.encode("<think>")[0]

  def shown(samples) -> list[bool]:
    seqs = sft.sequences(samples, rollout, fraction)
    return [think in s.inputs.tokens_T[s.loss_mask_T > 0] for s in seqs]

  for level, share in (("easy", 0.1), ("medium", 0.5), ("hard", 0.9), ("", 0.0)):
    samples = [
      meta_lib.SampleMeta(k, f"{level}-{k}", "Count.", "2", difficulty=level, solution="a1 b2")
      for k in range(600)
    ]
    first = shown(samples)
    assert abs(np.mean(first) - share) < 0.06, level
    assert shown(samples) == first
  assert all(think in s.inputs.tokens_T for s in sft.sequences(samples, rollout))  # default: all
  # Its fields name the data's levels.
  assert [f.name for f in dataclasses.fields(ChainFraction)] == [*visual_tasks.LEVELS, "other"]


def test_guessed_direct_answers_follow_the_answer_prior(setup):
  """`sft.guess`: at a guessed level (or on a guessed task) a direct answer is
  another row's answer of the same task and level, the same on every call; a
  shown reasoning ends in the item's own answer; other rows keep theirs."""
  _, coord, *_ = setup
  rollout = types.SimpleNamespace(
    requests=types.SimpleNamespace(
      tokenizer=coord.tokenizer,
      prompt=lambda s: inputs.sequence_from_chat(s.messages(), [], coord.tokenizer, coord.cfg),
    )
  )
  answers = {"easy": "1", "hard": "2"}  # each row's own answer
  rows = [
    dict(id=f"{lvl}-{k}", task="scan_count", difficulty=lvl, answer=str(k % 4 + 1))
    for lvl in answers
    for k in range(400)
  ] + [dict(id=f"colour-{k}", task="colour", answer=c) for k, c in enumerate("ab" * 200)]
  guesses = sft.Guesses.of(rows, Guess(tasks=("colour",), levels=("hard",)))
  fraction = ChainFraction(easy=0.5, medium=0.5, hard=0.5, other=0.5)

  def taught(samples, guesses=guesses) -> list[str]:
    seqs = sft.sequences(samples, rollout, fraction, guesses)
    return [
      coord.tokenizer.decode(s.inputs.tokens_T[s.loss_mask_T > 0], skip_special_tokens=True)
      for s in seqs
    ]

  def samples(level, task="scan_count"):
    return [
      meta_lib.SampleMeta(
        k,
        f"q-{task}-{level}-{k}",
        "Count.",
        answers.get(level, "a"),
        difficulty=level,
        task=task,
        solution="a1 b2" if level else "",
      )
      for k in range(400)
    ]

  hard = taught(samples("hard"))
  assert hard == taught(samples("hard"))
  direct = [t for t in hard if not t.startswith("<think>")]
  chained = [t for t in hard if t.startswith("<think>")]
  assert 150 < len(direct) < 250 and all(t.endswith("<answer>2</answer>") for t in chained)
  # The direct ones spread over the hard rows' answers 1-4, about a quarter each.
  counts = {a: direct.count(f"<answer>{a}</answer>") for a in "1234"}
  assert sum(counts.values()) == len(direct) and min(counts.values()) > len(direct) / 8, counts
  # Unguessed level: every direct answer is the item's own.
  assert all(t.endswith("<answer>1</answer>") for t in taught(samples("easy")))
  # A guessed task: every row's answer "a", taught as the rows' a or b.
  assert set(taught(samples("", task="colour"))) == {"<answer>a</answer>", "<answer>b</answer>"}
  # No guesses asked: the item's own answer everywhere.
  assert all(t.endswith("<answer>2</answer>") for t in taught(samples("hard"), sft.Guesses()))


def test_loss_is_the_nll_of_answer_tokens_and_steps_lower_it(setup):
  config, coord, seqs, answers = setup
  expected = _numpy_nll(coord, seqs, answers)
  all_tokens = _numpy_nll(coord, seqs, answers, answer_only=False)
  s = Settings.of(config)
  trainer = sft.Trainer(coord, sft.optimizer_config(s.optim, s.sft))  # patches: the sequences'
  _, host = trainer.batch(seqs)
  # Sharded over the fake mesh: 8 devices, sequences placed by the strategy.
  assert host.targets.shape[1] == coord.mesh.size
  n_answer = sum(len(ids) for _, _, ids in answers)
  assert host.loss_mask.sum() == n_answer
  losses = []
  for _ in range(config.sft.steps):
    m = jax.device_get(trainer.train(seqs))
    losses.append(float(m["loss"]))
    assert m["tokens"] == n_answer
  # The first step's loss is that of the initial parameters.
  assert losses[0] == pytest.approx(expected, rel=1e-4)
  assert abs(all_tokens - expected) > 1e-2  # prompt tokens would change it
  assert losses[-1] < 0.5 * losses[0], losses
  # The run's parameters are untouched until finish(), then replaced.
  assert _numpy_nll(coord, seqs, answers) == pytest.approx(expected, rel=1e-6)
  trainer.finish()
  assert coord.state.opt_state is not None and int(coord.state.step) == 0
  assert _numpy_nll(coord, seqs, answers) < 0.5 * expected


def _learning_rates(optim, steps: int) -> np.ndarray:
  """The lr of each of `steps` updates: Adam's step on a constant gradient
  is the lr (m / sqrt(v) = 1 after bias correction)."""
  tx = train_step.make_optimizer(optim)
  params = jnp.zeros(())
  state = tx.init(params)
  out = []
  for _ in range(steps):
    update, state = tx.update(jnp.ones(()) * 1e-3, state, params)
    out.append(-float(update))
  return np.array(out)


def test_lr_scales_multiply_the_rl_schedule_from_their_update_on(setup):
  config, *_ = setup
  base = dataclasses.replace(
    Settings.of(config).optim, lr=1e-3, warmup_steps=0, end_lr_frac=1.0, total_steps=10
  )
  scaled = dataclasses.replace(base, lr_scale_steps=(4, 7), lr_scales=(3.0, 0.5))
  lr = _learning_rates(scaled, 10)
  np.testing.assert_allclose(lr, [1e-3] * 4 + [3e-3] * 3 + [1.5e-3] * 3, rtol=1e-4)
  np.testing.assert_allclose(_learning_rates(base, 10), [1e-3] * 10, rtol=1e-4)
  with pytest.raises(ValueError, match="one scale per step"):
    train_step.make_optimizer(dataclasses.replace(base, lr_scale_steps=(4,), lr_scales=()))
  warm_up = sft.optimizer_config(scaled, Settings.of(config).sft)
  assert warm_up.lr_scale_steps == warm_up.lr_scales == ()


def test_optimizer_config_is_the_warm_ups_own(setup):
  config, *_ = setup
  optim = sft.optimizer_config(Settings.of(config).optim, Settings.of(config).sft)
  assert (optim.lr, optim.total_steps) == (config.sft.lr, config.sft.steps)
  assert config.optim.lr != optim.lr  # the RL optimizer's settings are not changed
  assert optim.max_grad_norm == config.optim.max_grad_norm


def _pretrain_config(export_dir):
  """configs/pretrain.py's smoke run, smaller: 8 steps, checkpoints every 3."""
  c = config_args.load_config(os.path.join(ROOT, "configs", "pretrain.py"), "smoke")
  c.data.synth_train, c.data.synth_eval, c.eval.prompts = 64, 4, 4
  c.sft.steps, c.sft.batch_size, c.sft.eval_every = 8, 8, 0
  c.sft.checkpoint_every, c.sft.export_dir = 3, str(export_dir)
  c.rl.max_new_tokens = 16
  return c


@pytest.mark.slow
def test_a_killed_pretraining_resumes_to_the_same_base(tmp_path, monkeypatch, caplog):
  """A warm-up with checkpoints every 3 steps, stopped twice: SIGTERM (a
  scheduler's preemption) at step 4 checkpoints that step and exits 143;
  started again it goes on from there until it dies at step 8 (killed),
  and the third start goes on from step 6's checkpoint with its data where
  it was. It exports the same base as a run never stopped, and each step's
  loss is recorded once."""
  whole, cut = tmp_path / "whole", tmp_path / "cut"
  loop.run(_pretrain_config(whole / "base"), str(whole))
  train, calls = sft.Trainer.train, []

  def stopped_twice(self, seqs):
    calls.append(1)
    if len(calls) == 4:
      os.kill(os.getpid(), signal.SIGTERM)
    if len(calls) == 8:
      raise RuntimeError("killed")
    return train(self, seqs)

  monkeypatch.setattr(sft.Trainer, "train", stopped_twice)
  caplog.set_level(logging.INFO, logger="fluxjax.rl.sft")
  with pytest.raises(preemption.Preempted) as stopped:
    loop.run(_pretrain_config(cut / "base"), str(cut))
  assert stopped.value.step == -4 and not (cut / "base").exists()
  with pytest.raises(RuntimeError, match="killed"):
    loop.run(_pretrain_config(cut / "base"), str(cut))
  assert "resumed after step 4" in caplog.text and not (cut / "base").exists()
  monkeypatch.setattr(sft.Trainer, "train", train)
  loop.run(_pretrain_config(cut / "base"), str(cut))
  assert "resumed after step 6" in caplog.text

  def tensors(folder):
    with safetensors.safe_open(str(folder / "model.safetensors"), "np") as f:
      return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)

  theirs, ours = tensors(whole / "base"), tensors(cut / "base")
  assert ours.keys() == theirs.keys()
  for k in ours:
    np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)
  steps = [r["step"] for r in metrics_lib.read_metrics(str(cut)) if "sft/loss" in r]
  assert steps == list(range(-7, 1))
  # `export` writes the finished base again (its step-0 RL checkpoint);
  # `export --sft` the warm-up's checkpoints, all a run stopped mid-way has:
  # step 6's weights are the same in both runs, step 4's (the SIGTERM's) differ.
  assert export.export(str(whole), str(tmp_path / "end"), dtype="float32") == 0
  end = tensors(tmp_path / "end")
  for k in theirs:
    np.testing.assert_array_equal(end[k], theirs[k], err_msg=k)
  assert export.export(str(whole), str(tmp_path / "w6"), dtype="float32", sft=True) == 6
  assert export.export(str(cut), str(tmp_path / "c6"), dtype="float32", sft=True) == 6
  assert export.export(str(cut), str(tmp_path / "c4"), 4, "float32", sft=True) == 4
  w6, c6, c4 = (tensors(tmp_path / n) for n in ("w6", "c6", "c4"))
  for k in w6:
    np.testing.assert_array_equal(c6[k], w6[k], err_msg=k)
  assert any(not np.array_equal(c4[k], c6[k]) for k in c6)
  # The card of the export: every held-out item in its table, its marks.
  base_card.main(["--base", str(cut / "base"), "--workdir", str(cut), "--samples", "2"])
  card = json.loads((cut / "base" / "card.json").read_text())
  rows = len(readers.read_rows(str(cut / "data" / "eval" / "manifest.jsonl")))
  assert sum(lv["items"] for t in card["table"].values() for lv in t.values()) == rows
  assert card["sft_steps"] == 8 and card["seed"] == 0 and len(card["marks"]) == 5
  for name in ("config.json", "tokenizer.json", "preprocessor_config.json"):
    assert (cut / "base" / name).read_bytes() == (whole / "base" / name).read_bytes()
  # The path a post-training run takes: model.hf_path, its own tokenizer.
  c = _config()
  c.model.hf_path = str(cut / "base")
  validated = loop.validate(c)
  assert validated.cfg.image_token_id == validated.tokenizer.image_pad_id
  model = hf_load.load_hf_checkpoint(c.model.hf_path, validated.cfg)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model)))
