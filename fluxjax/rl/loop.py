"""Builds a run from its config and runs the GRPO loop (what train.py calls).

Sections of a run: data (a synthetic dataset generated into the work directory
on first use, or config.data.train/eval files), model (preset or HF checkpoint,
created sharded), optimizer and train state, rollout (embedded engine or
fleet), rewards, coordinator, and the reference model when rl.kl_coef > 0
(rl/reference.py); then the loop with delayed metrics, held-out
evaluation, checkpoints and auto-resume. One ExitStack owns every resource of
a run and closes them in reverse order of creation, whatever ends it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os

import jax

from fluxjax.data import pipeline, readers, synth
from fluxjax.models import config as model_config
from fluxjax.models import hf_io, processor, sharded
from fluxjax.models.tokenizer import Tokenizer
from fluxjax.parallel import strategies, train_step
from fluxjax.rl import checkpoint as checkpoint_lib
from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import metrics as metrics_lib
from fluxjax.rl import reference, rewards, sft
from fluxjax.rollout import backend as backend_lib
from fluxjax.rollout import factory
from fluxjax.sharding import mesh as mesh_lib

log = logging.getLogger(__name__)


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
      log.info("generating %d synthetic %s samples (%s) into %s", n, split, d.mix, out)
      synth.generate(out, d.mix, n, seed)
    paths.append(manifest)
  return paths[0], paths[1]


def validate(config):
  """(model config, strategy, mesh) of a run; ValueError says what is wrong."""
  overrides = dict(
    dtype=config.model.dtype,
    param_dtype=config.model.param_dtype,
    attention_backend=config.model.attention_backend,
    remat=config.model.remat,
    logprob_vocab_chunk=config.model.logprob_vocab_chunk,
    mrope_text_after_vision=config.model.mrope_text_after_vision,
  )
  cfg = (
    model_config.load_hf_config(config.model.hf_path, **overrides)
    if config.model.hf_path
    else model_config.preset(config.model.preset, **overrides)
  )
  strategy = strategies.get_strategy(config.sharding, cfg, config.mesh)
  ref_path = config.rl.get("ref_hf_path")
  if config.rl.kl_coef and ref_path:
    ref_cfg = model_config.load_hf_config(ref_path, **overrides)
    if (ref_cfg.text, ref_cfg.vision) != (cfg.text, cfg.vision):
      raise ValueError(
        f"rl.ref_hf_path {ref_path} has a different architecture than the "
        "policy; the KL term compares the two models token by token"
      )
  try:
    rewards.get(config.rl.reward.fn)
  except KeyError as e:
    raise ValueError(str(e)) from None
  factory.check_config(config.rollout)
  mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.fsdp, strategy.sp_axes())
  return cfg, strategy, mesh


@dataclasses.dataclass
class Built:
  """What `build` made; each resource is closed by the ExitStack it was given.

  Attributes:
    coordinator: the run's Coordinator.
    loader: the training data (the coordinator's).
    eval_rows: held-out rows for evaluation.
    proc: the vision processor config.
  """

  coordinator: coordinator_lib.Coordinator
  loader: pipeline.ShadowLoader
  eval_rows: list[dict]
  proc: processor.VisionProcessorConfig


def build(config, workdir: str, stack: contextlib.ExitStack) -> Built:
  """Everything a run needs, created sharded; `stack` closes it in reverse order.

  Closing order: the coordinator (rollout stops), the reward pool, the
  rollout backend (on the rollout thread's loop), any launched servers, the
  loop, the loader.
  """
  cfg, strategy, mesh = validate(config)
  log.info("strategy %s (sp=%d) on mesh %s", strategy.name, strategy.sp, dict(mesh.shape))
  tokenizer = (
    Tokenizer.from_file(config.model.tokenizer_path)
    if config.model.tokenizer_path
    else Tokenizer.default()
  )
  max_replicated = config.sharding.max_replicated_bytes
  if config.model.hf_path:
    shardings = sharded.model_shardings(cfg, mesh, max_replicated_bytes=max_replicated)
    model = hf_io.load_hf_checkpoint(config.model.hf_path, cfg, shardings=shardings)
  else:
    model = sharded.create_sharded_model(
      cfg, mesh, seed=config.seed, max_replicated_bytes=max_replicated
    )
  tx = train_step.make_optimizer(config.optim)
  graphdef, state, state_shardings = train_step.create_train_state(model, tx, mesh)

  train_path, eval_path = dataset_paths(config, workdir)
  proc = processor.VisionProcessorConfig(**config.data.vision.to_dict())
  loader = pipeline.ShadowLoader(
    train_path,
    config.rl.prompts_per_step,
    proc,
    num_workers=config.data.num_workers,
    seed=config.seed,
  )
  stack.callback(loader.close)
  # Every backend call runs on this loop: a fleet's HTTP session belongs to it.
  thread = stack.enter_context(backend_lib.LoopThread("rollout"))
  rollout, launched = factory.make_backend(
    config.rollout,
    model=model,
    tokenizer=tokenizer,
    seed=config.seed,
    proc_cfg=proc,
    weights_root=os.path.join(workdir, "weights"),
  )
  if launched is not None:
    stack.callback(launched.stop)
  stack.enter_context(thread.running(rollout))
  reward = config.rl.reward
  scheduler = rewards.RewardScheduler(
    reward.num_workers,
    reward.fn,
    t_min=reward.t_min,
    t_max=reward.t_max,
    anchor_factor=reward.anchor_factor,
    correct_threshold=reward.correct_threshold,
  )
  stack.callback(scheduler.shutdown)
  coord = stack.enter_context(
    coordinator_lib.Coordinator(
      config,
      cfg,
      tokenizer,
      mesh,
      strategy,
      graphdef,
      state,
      state_shardings,
      tx,
      loader,
      rollout,
      scheduler,
      thread=thread,
    )
  )
  eval_rows = readers.read_rows(eval_path)[: config.eval.prompts]
  return Built(coord, loader, eval_rows, proc)


TRAINED = "trained.jsonl"


def read_trained(workdir: str) -> list[dict]:
  """The per-step record of which samples were trained: [{"step", "ids"}]."""
  path = os.path.join(workdir, TRAINED)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def run(config, workdir: str) -> dict:
  """The GRPO loop with auto-resume; returns the last metrics written."""
  os.makedirs(workdir, exist_ok=True)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  with contextlib.ExitStack() as stack:
    built = build(config, workdir, stack)
    coord = built.coordinator
    ckpt = checkpoint_lib.Checkpointer(workdir, save_every=config.checkpoint.every)
    stack.callback(ckpt.close)
    rng = jax.random.key(config.seed)
    first = 0
    if ckpt.latest_step() is not None:  # auto-resume from the work directory
      first, train_state, rng, coord_state, data_state = ckpt.restore(
        checkpoint_lib.abstract_like(coord.state)
      )
      coord.restore(train_state, coord_state, data_state)
      # Steps after the checkpoint are redone: their old records go.
      for name in (metrics_lib.JSONL, TRAINED):
        dropped = metrics_lib.truncate_after(os.path.join(workdir, name), first)
        if dropped:
          log.info("dropped %d records of %s after step %d", dropped, name, first)
      log.info("resumed from step %d (policy version %d)", first, coord.version)
    # Rollout samples from the policy the run starts (or resumes) with.
    coord.publish(new_version=False)
    writer = metrics_lib.MetricWriter(workdir)
    stack.callback(writer.close)
    trained_log = stack.enter_context(open(os.path.join(workdir, TRAINED), "a", buffering=1))
    eval_loader = pipeline.ShadowLoader(
      built.eval_rows, len(built.eval_rows), built.proc, num_workers=0, shuffle=False, num_epochs=1
    )
    stack.callback(eval_loader.close)
    eval_samples = eval_loader.next_batch()
    last = {}
    if first == 0:
      # Warm-up for GRPO (none without RL steps); logged at steps -sft.steps..0.
      if sft.runs(config):
        sft.warm_up(
          coord,
          config,
          dataset_paths(config, workdir)[0],
          built.proc,
          writer,
          lambda: coord.evaluate(eval_samples),
        )
      writer.write(0, coord.evaluate(eval_samples))
    if first < config.total_steps:
      if reference.needed(config):
        coord.set_reference(
          reference.reference_params(
            config,
            workdir,
            coord.cfg,
            coord.graphdef,
            coord.state.params,
            coord.state_shardings.params,
            fresh=first == 0,
          )
        )
      coord.start()  # rollout runs ahead from here, within the allowed lag
    progress = metrics_lib.Progress(config.total_steps, first)  # ETA from RL steps only
    for step in range(first + 1, config.total_steps + 1):
      try:
        result = coord.step()
      except StopIteration:
        log.info("data exhausted after step %d", step - 1)
        break
      host = dict(result.metrics, **built.loader.metrics())
      if config.eval.every and step % config.eval.every == 0:
        host.update(coord.evaluate(eval_samples))
      writer.write(step, host)
      trained_log.write(json.dumps({"step": step, "ids": result.trained}) + "\n")
      log.info(progress.line(step, host))
      last = host
      if ckpt.should_save(step) or step == config.total_steps:
        coord_state, data_state = coord.get_state()
        ckpt.save(step, coord.state, rng, coord_state, data_state, force=step == config.total_steps)
  return last
