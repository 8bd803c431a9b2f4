"""Builds a run from its config and runs the GRPO loop (what train.py calls).

Sections of a run: data (a synthetic dataset generated into the work directory
on first use, or config.data.train/eval files), model (preset or HF checkpoint,
created sharded), optimizer and train state, rollout (embedded engine or
fleet), rewards, coordinator; then the loop with delayed metrics, held-out
evaluation, checkpoints and auto-resume.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
from absl import logging

from fluxjax import checkpoint as checkpoint_lib
from fluxjax import metrics as metrics_lib
from fluxjax import train_step
from fluxjax.data import pipeline, readers, synth
from fluxjax.models import config as model_config
from fluxjax.models import hf_io, processor
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import rewards
from fluxjax.rollout import embedded, fleet
from fluxjax.sharding import mesh as mesh_lib
from fluxjax.sharding import rules, strategies


def dataset_paths(config, workdir: str) -> tuple[str, str]:
  """(train, eval) manifests: configured files, or synthetic ones made once."""
  d = config.data
  if d.train:
    return d.train, d.eval or d.train
  root = os.path.join(workdir, "data")
  paths = []
  for split, n, seed in (("train", d.synth_train, d.seed), ("eval", d.synth_eval, d.seed + 1)):
    out = os.path.join(root, split)
    manifest = os.path.join(out, "manifest.jsonl")
    if not os.path.exists(manifest):
      logging.info("generating %d synthetic %s samples (%s) into %s", n, split, d.mix, out)
      synth.generate(out, d.mix, n, seed)
    paths.append(manifest)
  return paths[0], paths[1]


def validate(config):
  """(model config, strategy, mesh) of a run; ValueError says what is wrong."""
  overrides = dict(dtype=config.model.dtype, param_dtype=config.model.param_dtype,
                   attention_backend=config.model.attention_backend, remat=config.model.remat,
                   logprob_vocab_chunk=config.model.logprob_vocab_chunk,
                   mrope_text_after_vision=config.model.mrope_text_after_vision)
  cfg = (model_config.load_hf_config(config.model.hf_path, **overrides)
         if config.model.hf_path else model_config.preset(config.model.preset, **overrides))
  strategy = strategies.get_strategy(config.sharding, cfg)
  mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.fsdp, strategy.sp_axes())
  logging.info("strategy %s (sp=%d) on mesh %s", strategy.name, strategy.sp, dict(mesh.shape))
  return cfg, strategy, mesh


def build(config, workdir: str):
  """Everything a run needs, created sharded; returns (coordinator, extras)."""
  cfg, strategy, mesh = validate(config)
  tokenizer = (Tokenizer.from_file(config.model.tokenizer_path) if config.model.tokenizer_path
               else Tokenizer.default())
  if config.model.hf_path:
    model = hf_io.load_hf_checkpoint(config.model.hf_path, cfg,
                                     shardings=rules.model_shardings(cfg, mesh))
  else:
    model = rules.create_sharded_model(cfg, mesh, seed=config.seed,
                                       max_replicated_bytes=config.sharding.max_replicated_bytes)
  tx = train_step.make_optimizer(config.optim)
  graphdef, state, state_shardings = train_step.create_train_state(model, tx, mesh)

  train_path, eval_path = dataset_paths(config, workdir)
  proc = processor.VisionProcessorConfig(**config.data.vision.to_dict())
  loader = pipeline.ShadowLoader(train_path, config.rl.prompts_per_step, proc,
                                 num_workers=config.data.num_workers, seed=config.seed)
  if config.rollout.backend == "embedded":
    rollout = embedded.EmbeddedRollout(model, tokenizer, num_slots=config.rollout.num_slots,
                                       context_length=config.rollout.context_length,
                                       seed=config.seed, proc_cfg=proc)
  else:
    rollout, _ = fleet.make_rollout(config.rollout, model, tokenizer)
  reward = config.rl.reward
  scheduler = rewards.RewardScheduler(reward.num_workers, reward.fn, t_min=reward.t_min,
                                      t_max=reward.t_max, anchor_factor=reward.anchor_factor,
                                      correct_threshold=reward.correct_threshold)
  coord = coordinator_lib.Coordinator(config, cfg, tokenizer, mesh, strategy, graphdef, state,
                                      state_shardings, tx, loader, rollout, scheduler)
  eval_rows = readers.read_rows(eval_path)[:config.data.eval_prompts]
  return coord, {"eval_rows": eval_rows, "proc": proc}


def run(config, workdir: str) -> dict:
  """The GRPO loop with auto-resume; returns the last metrics written."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  coord, extras = build(config, workdir)
  ckpt = checkpoint_lib.Checkpointer(workdir, save_every=config.checkpoint.every)
  writer = metrics_lib.MetricWriter(workdir)
  rng = jax.random.key(config.seed)
  first = 0
  if ckpt.latest_step() is not None:  # auto-resume from the work directory
    first, coord.state, rng, coord_state, data_state = ckpt.restore(
        checkpoint_lib.abstract_like(coord.state))
    coord.version = int(coord_state.get("version", first))
    coord.loader.set_state(data_state)
    coord.publish(new_version=False)  # the engine samples from the restored policy
    logging.info("resumed from step %d", first)
  eval_loader = pipeline.ShadowLoader(extras["eval_rows"], len(extras["eval_rows"]),
                                      extras["proc"], num_workers=0, shuffle=False, num_epochs=1)
  eval_samples = eval_loader.next_batch()
  delayed = train_step.DelayedMetrics()
  progress = metrics_lib.Progress(config.total_steps, first)
  last = {}
  try:
    if first == 0:
      writer.write(0, {"eval/accuracy": coord.evaluate(eval_samples)})
    for step in range(first + 1, config.total_steps + 1):
      samples = coord.loader.next_batch()
      result = coord.step(samples)
      coord.loader.release(samples)
      ready = delayed.push(step, result.metrics["device"])
      host = dict(result.metrics["host"], **coord.loader.metrics())
      if config.eval_every and step % config.eval_every == 0:
        host["eval/accuracy"] = coord.evaluate(eval_samples)
      if ready is not None:
        host.update({f"train/{k}": v for k, v in ready[1].items()})
      writer.write(step, host)
      logging.info(progress.line(step, host))
      last = host
      ckpt.save(step, coord.state, rng, {"version": coord.version}, coord.loader.get_state())
    done = delayed.flush()
    if done is not None:
      writer.write(done[0], {f"train/{k}": v for k, v in done[1].items()})
  finally:
    ckpt.close()
    writer.close()
    eval_loader.close()
    coord.loader.close()
    coord.rewards.shutdown()
    if hasattr(coord.rollout, "engine"):  # the embedded engine's decode thread
      coord.rollout.engine.stop()
  return last
