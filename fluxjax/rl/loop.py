"""Builds a run from its config and runs the GRPO loop (what train.py calls).

`validate` checks a config once per start, `build` creates everything the leader runs,
and `run` is the loop with delayed metrics, held-out evaluation, checkpoints and
auto-resume. One ExitStack owns every resource of a run and closes them in reverse order
of creation, whatever ends it. In a multi-controller run every process builds the policy
worker (`build_policy`) and processes k > 0 `follow` the leader's ops (docs/design.md,
section 3, "Multi-controller runs").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import shlex
import time
from typing import NamedTuple

import jax
import numpy as np
from flax import nnx

from fluxjax import provenance
from fluxjax import settings as settings_lib
from fluxjax.data import materializer as materializer_lib
from fluxjax.data import pipeline, readers, synth
from fluxjax.data import store as store_lib
from fluxjax.data import workers as workers_lib
from fluxjax.models import config as model_config
from fluxjax.models import hf_load, processor, sharded
from fluxjax.models import tokenizer as tokenizer_lib
from fluxjax.parallel import multihost, strategies, train_step
from fluxjax.rl import config_rules, reference, reward_pool, reward_spec, sft
from fluxjax.rl import coordinator as coordinator_lib
from fluxjax.rl import metrics as metrics_lib
from fluxjax.rl import preemption as preemption_lib
from fluxjax.rl import summary as summary_lib
from fluxjax.rl import worker as worker_lib
from fluxjax.rollout import backend as backend_lib
from fluxjax.rollout import factory
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.rollout import publish as publish_lib
from fluxjax.sharding import mesh as mesh_lib

log = logging.getLogger(__name__)


def dataset_rows(
  settings: settings_lib.Settings, workdir: str
) -> tuple[list[dict], list[dict], bool]:
  """(training rows, evaluation rows, whether the evaluation rows are held out).

  Media given as bytes are written once into WORKDIR/data/media. With no
  data.eval, a seeded data.holdout share of data.train (at most eval.prompts
  rows) leaves training for evaluation; with data.holdout 0 evaluation reads
  training rows, and the log and the summary say so.
  """
  d = settings.data
  train_path, eval_path = dataset_paths(d, workdir)
  media_dir = os.path.join(workdir, "data", "media")
  train = readers.read_rows(train_path, media_dir)
  prompts = settings.eval.prompts
  if eval_path:
    return train, readers.read_rows(eval_path, media_dir)[:prompts], True
  k = min(prompts, math.ceil(d.holdout * len(train)), len(train) - 1)
  if k <= 0:
    log.warning(
      "data.eval is empty and data.holdout is 0: evaluation scores training rows of %s, "
      "so its accuracy is not held out",
      train_path,
    )
    return train, train[:prompts], False
  held = set(np.random.default_rng([d.seed, 7]).choice(len(train), k, replace=False).tolist())
  log.info(
    "data.eval is empty: %d of the %d rows of %s are held out of training for evaluation "
    "(data.holdout %g, data.seed %d)",
    k,
    len(train),
    train_path,
    d.holdout,
    d.seed,
  )
  kept = [r for i, r in enumerate(train) if i not in held]
  return kept, [train[i] for i in sorted(held)], True


def dataset_paths(d: settings_lib.Data, workdir: str) -> tuple[str, str]:
  """(train, eval) files of the `data` section: configured ones (eval "" if
  none is), or synthetic ones made once; with `data.blind`, copies of them
  whose media carry no pixels."""
  paths = (d.train, d.eval) if d.train else _synthetic_paths(d, workdir)
  if not d.blind:
    return paths
  blind = []
  for split, manifest in zip(("train", "eval"), paths):
    if not manifest:
      blind.append("")
      continue
    out = os.path.join(workdir, "data_blind", split)
    if not os.path.exists(os.path.join(out, "manifest.jsonl")):
      log.info("writing a pixel-free copy of %s into %s", manifest, out)
      synth.blind_copy(manifest, out)
    blind.append(os.path.join(out, "manifest.jsonl"))
  return blind[0], blind[1]


def _synthetic_paths(d: settings_lib.Data, workdir: str) -> tuple[str, str]:
  """(train, eval) manifests of the synthetic mix, generated once per workdir."""
  root = os.path.join(workdir, "data")
  paths: list[str] = []
  for split, n, seed in (("train", d.synth_train, d.seed), ("eval", d.synth_eval, d.seed + 1)):
    out = os.path.join(root, split)
    manifest = os.path.join(out, "manifest.jsonl")
    if not os.path.exists(manifest):
      log.info("generating %d synthetic %s samples (%s) into %s", n, split, d.mix, out)
      # The held-out set shares no item with the training set.
      exclude = synth.content_keys(paths[0]) if paths else frozenset()
      synth.generate(out, d.mix, n, seed, exclude=exclude)
    paths.append(manifest)
  return paths[0], paths[1]


class Validated(NamedTuple):
  """What `validate` derives from a run's config (each entry point runs it once)."""

  cfg: model_config.ModelConfig
  strategy: strategies.Strategy
  mesh: jax.sharding.Mesh
  settings: settings_lib.Settings
  tokenizer: tokenizer_lib.Tokenizer


def validate(config) -> Validated:
  """(model config, strategy, mesh, typed settings) of a run's ConfigDict (or
  its Settings); ValueError says what is wrong."""
  settings = settings_lib.Settings.of(config)
  settings = dataclasses.replace(
    settings,
    data=dataclasses.replace(
      settings.data, vision=vision_settings(settings.data.vision, settings.model.hf_path)
    ),
  )
  overrides = dict(
    dtype=settings.model.dtype,
    param_dtype=settings.model.param_dtype,
    attention_backend=settings.model.attention_backend,
    decode_attention=settings.model.decode_attention,
    remat=settings.model.remat,
    logprob_vocab_chunk=settings.model.logprob_vocab_chunk,
    mrope_text_after_vision=settings.model.mrope_text_after_vision,
  )
  base = (
    model_config.load_hf_config(settings.model.hf_path, **overrides)
    if settings.model.hf_path
    else model_config.preset(settings.model.preset, **overrides)
  )
  tokenizer = tokenizer_lib.resolve(settings.model.tokenizer_path, settings.model.hf_path)
  cfg = model_config.with_tokenizer_ids(
    base,
    tokenizer.model_token_ids(),
    tokenizer.vocab_size,
    from_checkpoint=bool(settings.model.hf_path),
  )
  settings = dataclasses.replace(settings, mesh=resolved_mesh(settings.mesh, cfg))
  strategy = strategies.get_strategy(
    settings.sharding, cfg, settings.mesh, longest=settings.rollout.context_length
  )
  ref_path = settings.rl.ref_hf_path
  if settings.rl.kl_coef and ref_path:
    ref_cfg = model_config.load_hf_config(ref_path, **overrides)
    if (ref_cfg.text, ref_cfg.vision) != (cfg.text, cfg.vision):
      raise ValueError(
        f"rl.ref_hf_path {ref_path} has a different architecture than the "
        "policy; the KL term compares the two models token by token"
      )
  check_rewards(settings)
  factory.check_config(settings.rollout)
  mesh = mesh_lib.make_mesh(settings.mesh.data, settings.mesh.fsdp, strategy.sp_axes())
  config_rules.check(settings, cfg, strategy, mesh.size)
  return Validated(cfg, strategy, mesh, settings, tokenizer)


def plan_lines(validated: Validated, workdir: str) -> list[str]:
  """What a run would do, as `fluxjax.train --dry_run` prints it: model,
  mesh, data, rollout (each launched server's command and GPUs), weight
  sync and reward; nothing is built or started."""
  s, cfg = validated.settings, validated.cfg
  params = sum(math.prod(shape) for _, shape in hf_load.hf_layout(cfg))
  model = s.model.hf_path or f"preset {s.model.preset} (random weights)"
  train, eval_ = (s.data.train, s.data.eval or f"a {s.data.holdout:g} share held out of train")
  data = f"{train}, eval {eval_}" if train else f"synthetic {s.data.mix} into {workdir}/data"
  lines = [
    f"work directory: {workdir}",
    f"model: {model}, {params / 1e6:,.1f}M parameters, {s.model.dtype}",
    f"mesh {dict(validated.mesh.shape)} on {jax.device_count()} {jax.default_backend()} "
    f"device(s); strategy {validated.strategy.name} (sp {validated.strategy.sp})",
    f"data: {data}; vision limits {dataclasses.asdict(s.data.vision)}",
    f"RL: {s.total_steps} steps of {s.rl.prompts_per_step} prompts x "
    f"{s.rl.responses_per_prompt} responses, lag mode {s.coordinator.lag.mode}",
  ]
  r = s.rollout
  if factory.in_process(r):
    return [*lines, "rollout: the embedded engine, in this process", _reward_line(s)]
  if r.urls or r.router_url:
    lines.append(f"rollout: servers at {list(r.urls) or r.router_url}")
  else:
    cmd = factory.launch_command(s)
    gpus = factory.server_gpu_groups(r) or ["(inherited)"] * r.num_servers
    lines += [
      f"rollout server {i}: CUDA_VISIBLE_DEVICES={g} {shlex.join(cmd)} --host H --port P"
      for i, g in enumerate(gpus)
    ]
  if r.router_launch:
    lines.append(f"router: {shlex.join(r.router_launch)} --worker-urls ...")
  lines.append(f"weights to the servers: {r.weight_sync} (logs in {workdir}/logs)")
  return [*lines, _reward_line(s)]


def _reward_line(s: settings_lib.Settings) -> str:
  terms = reward_spec.parse(s.rl.reward.fn, s.rl.reward.weights)
  evaluation = reward_spec.evaluation(s.rl.reward.fn, s.eval.reward)
  if evaluation == s.rl.reward.fn:
    evaluation = "the same"
  return (
    "reward: "
    + " + ".join(f"{t.weight:g} x {t.name}" for t in terms)
    + (f"; evaluation reward: {evaluation}")
  )


def check_rewards(settings: settings_lib.Settings) -> None:
  """Every reward function of the run and of its evaluation loads here, so a
  typo stops the run before anything starts (the workers load their own)."""
  fn = settings.rl.reward.fn
  specs = [
    reward_spec.parse(fn, settings.rl.reward.weights),
    reward_spec.parse(reward_spec.evaluation(fn, settings.eval.reward)),
  ]
  for terms in specs:
    for term in terms:
      try:
        reward_spec.load(term.fn)
      except KeyError as e:
        raise ValueError(e.args[0]) from None


def export_hf(
  policy: worker_lib.PolicyWorker,
  path: str,
  tokenizer: tokenizer_lib.Tokenizer,
  proc: processor.VisionProcessorConfig,
  dtype: str = "float32",
) -> None:
  """The policy as an HF folder at `path`: weights in `dtype`, config.json,
  the run's tokenizer and its vision preprocessing (the warm-up's export,
  sft.export_dir, and `python -m fluxjax.export`)."""
  files = {
    "tokenizer.json": tokenizer.backend.to_str(pretty=True).encode(),
    **{name: json.dumps(d, indent=2).encode() for name, d in proc.hf_files().items()},
  }
  policy.export(os.path.abspath(path), files, dtype)
  log.info("exported the policy to %s (%s)", path, dtype)


def resolved_mesh(mesh: settings_lib.Mesh, cfg) -> settings_lib.Mesh:
  """The `mesh` section with mesh.data 0 (auto) resolved by the cost model
  (sharding/mesh.py `data_axis`) for this model on these devices."""
  params = sum(math.prod(shape) for _, shape in hf_load.hf_layout(cfg))
  # Any policy counts as regathering the weights: which ones XLA regathers
  # for is not measured.
  remat = cfg.remat != "none"
  return dataclasses.replace(mesh, data=mesh_lib.data_axis(mesh.data, params, remat=remat))


@dataclasses.dataclass
class Built:
  """What `build` made; each resource is closed by the ExitStack it was given.

  Attributes:
    coordinator: the run's Coordinator.
    policy: the policy worker the coordinator drives (it leads the other
      processes in a multi-controller run).
    loader: the training data (the coordinator's).
    train_rows: the rows it reads (the SFT warm-up's too).
    eval_rows: rows for evaluation.
    held_out: whether eval_rows are out of training (`dataset_rows`).
    proc: the vision processor settings.
    settings: the run's typed settings.
  """

  coordinator: coordinator_lib.Coordinator
  policy: worker_lib.PolicyWorker
  loader: pipeline.ShadowLoader
  train_rows: list[dict]
  eval_rows: list[dict]
  held_out: bool
  proc: processor.VisionProcessorConfig
  settings: settings_lib.Settings


def rollout_shardings(settings: settings_lib.Settings, cfg, mesh):
  """Where the embedded engine's copy of the weights goes (`PolicyWorker.stage`).

  None keeps it on the training mesh (a fleet, which every process takes
  part in publishing to, one layer tensor at a time; or one process with
  rollout.embedded_devices 0). Otherwise the first rollout.embedded_devices
  (0: all) of the leader's devices: the leader runs rollout alone, so its
  programs must not span other processes.
  """
  k = settings.rollout.embedded_devices
  if not factory.in_process(settings.rollout) or (jax.process_count() == 1 and k == 0):
    return None
  devices = multihost.leader_devices()
  if k > len(devices):
    raise ValueError(
      f"rollout.embedded_devices={k} but process 0 has {len(devices)} devices; "
      f"set --config.rollout.embedded_devices to at most {len(devices)} (0: all)"
    )
  local = mesh_lib.make_mesh(1, -1, devices=devices[: k or None])
  return sharded.model_shardings(
    cfg, local, max_replicated_bytes=settings.sharding.max_replicated_bytes, log_table=False
  )


def build_policy(
  config,
  workdir: str,
  stack: contextlib.ExitStack,
  patch_source,
  *,
  owns_media: bool,
  validated: Validated | None = None,
) -> worker_lib.PolicyWorker:
  """This process's policy worker: the model created sharded, its train state, the checkpointer.

  Every process of a run calls it (the initialization programs are global).
  """
  cfg, strategy, mesh, settings, _ = validated or validate(config)
  log.info("strategy %s (sp=%d) on mesh %s", strategy.name, strategy.sp, dict(mesh.shape))
  max_replicated = settings.sharding.max_replicated_bytes
  if settings.model.hf_path:
    shardings = sharded.model_shardings(cfg, mesh, max_replicated_bytes=max_replicated)
    model = hf_load.load_hf_checkpoint(settings.model.hf_path, cfg, shardings=shardings)
  else:
    model = sharded.create_sharded_model(
      cfg, mesh, seed=settings.seed, max_replicated_bytes=max_replicated
    )
  tx = train_step.make_optimizer(settings.optim)
  graphdef, state, state_shardings = train_step.create_train_state(model, tx, mesh)
  policy = worker_lib.PolicyWorker(
    settings,
    workdir,
    cfg=cfg,
    mesh=mesh,
    strategy=strategy,
    graphdef=graphdef,
    state=state,
    state_shardings=state_shardings,
    tx=tx,
    patch_source=patch_source,
    owns_media=owns_media,
    rollout_shardings=rollout_shardings(settings, cfg, mesh),
  )
  return stack.enter_context(policy)


def processor_config(vision: settings_lib.Vision) -> processor.VisionProcessorConfig:
  return processor.VisionProcessorConfig(**dataclasses.asdict(vision))


def vision_settings(vision: settings_lib.Vision, hf_path: str) -> settings_lib.Vision:
  """`data.vision` with each 0 resolved: the checkpoint's value (its
  preprocessor_config.json, which SGLang reads too), else the processor's
  default. A set value the checkpoint contradicts is an error: trainer and
  servers would count different vision tokens for the same image.
  """
  theirs = processor.VisionProcessorConfig.read_hf_files(hf_path) if hf_path else {}
  defaults = processor.VisionProcessorConfig()
  out = {}
  for field in dataclasses.fields(vision):
    ours, given = getattr(vision, field.name), theirs.get(field.name)
    if ours and given is not None and ours != given:
      raise ValueError(
        f"data.vision.{field.name}={ours}, but {hf_path}'s preprocessor config says {given}: "
        f"trainer and rollout servers would count different vision tokens; set "
        f"--config.data.vision.{field.name}={given} or 0 (the checkpoint's)"
      )
    out[field.name] = ours or (given if given is not None else getattr(defaults, field.name))
  return settings_lib.Vision(**{k: int(v) for k, v in out.items()})


def served_model(model: settings_lib.Model, cfg) -> fleet_lib.ServedModel:
  """The model a fleet's servers must serve: the trainer's, named as a
  server reports its own (`model_path`, or "preset:NAME")."""
  name = model.hf_path or f"preset:{model.preset}"
  return fleet_lib.ServedModel.of(name, cfg)


def media_source(
  settings: settings_lib.Settings, stack: contextlib.ExitStack
) -> materializer_lib.Materializer:
  """A follower's pixels: its own store, filled by its own decoders on demand."""
  store = store_lib.MetaStore()
  stack.callback(store.close)
  workers = max(1, settings.data.num_workers)
  pool = workers_lib.WorkerPool(
    workers,
    processor_config(settings.data.vision),
    store,
    limits=settings.data.limits,
  )
  stack.callback(pool.close)
  return materializer_lib.Materializer(store, pool)


def build(
  config, workdir: str, stack: contextlib.ExitStack, validated: Validated | None = None
) -> Built:
  """Everything the leader runs, created sharded; `stack` closes it in reverse order.

  Sections of a run: data (a synthetic dataset generated into the work directory on first
  use, or config.data.train/eval files), model (preset or HF checkpoint, created
  sharded), optimizer and train state, rollout (embedded engine or fleet), rewards,
  coordinator, and the reference model when rl.kl_coef > 0 (rl/reference.py).

  In a multi-controller run every other process runs `follow` meanwhile.
  Closing order: the coordinator (rollout stops), the reward pool, the
  rollout backend (on the rollout thread's loop), any launched servers, the
  loop, the policy worker (checkpoints finish), the loader.
  """
  validated = validated or validate(config)
  settings = validated.settings
  tokenizer = validated.tokenizer
  train_rows, eval_rows, held_out = dataset_rows(settings, workdir)
  log_rows(train_rows[:2])
  proc = processor_config(settings.data.vision)
  loader = pipeline.ShadowLoader(
    train_rows,
    settings.rl.prompts_per_step,
    proc,
    num_workers=settings.data.num_workers,
    seed=settings.seed,
    limits=settings.data.limits,
  )
  stack.callback(loader.close)
  policy = build_policy(
    settings,
    workdir,
    stack,
    materializer_lib.Materializer(loader.store, loader.pool),
    owns_media=False,
    validated=validated,
  )
  if jax.process_count() > 1:
    policy.lead(multihost.Channel())
  # Every backend call runs on this loop: a fleet's HTTP session belongs to it.
  thread = stack.enter_context(backend_lib.LoopThread("rollout"))
  engine_model = None
  if factory.in_process(settings.rollout):  # the engine's own copy of the weights
    engine_model = nnx.merge(policy.graphdef, policy.stage())
  inputs = factory.BackendInputs(
    launch=factory.launch_command(settings),
    model=engine_model,
    tokenizer=tokenizer,
    seed=settings.seed,
    proc_cfg=proc,
    limits=settings.data.limits,
    weights_root=publish_lib.weights_root(workdir),
    served_model=served_model(settings.model, validated.cfg),
    log_dir=os.path.join(workdir, "logs"),
  )
  rollout, launched = factory.make_backend(settings.rollout, inputs)
  if launched is not None:
    stack.callback(launched.stop)
    log.info("launched rollout processes log to %s", os.path.join(workdir, "logs"))
  stack.enter_context(thread.running(rollout))
  scheduler = reward_pool.RewardScheduler.from_config(settings.rl.reward)
  stack.callback(scheduler.shutdown)
  coord = stack.enter_context(
    coordinator_lib.Coordinator(
      settings, tokenizer, policy, loader, rollout, scheduler, thread=thread
    )
  )
  return Built(coord, policy, loader, train_rows, eval_rows, held_out, proc, settings)


def log_rows(rows: list[dict]) -> None:
  """Logs rows as the run reads them: the prompt rendered by the chat
  template, the media in prompt order, the answer (or the row's error)."""
  from fluxjax.models import chat

  for row in rows:
    if row.get("error"):
      log.info("row %s: skipped: %s", row["id"], row["error"])
      continue
    media = {"image": iter(row["images"]), "video": iter(row["videos"])}
    log.info(
      "row %s as parsed:\n%s\nmedia: %s\nanswer: %r",
      row["id"],
      chat.render_chat(row["turns"]),
      [f"{k} {next(media[k])}" for k in row["media_order"]],
      row["answer"],
    )


def follow(config, workdir: str, validated: Validated | None = None) -> int:
  """A follower's run (process k > 0): the leader's ops until it stops; returns ops run.

  The follower decodes its own devices' media with its own decoders. Metrics,
  trained.jsonl, config.json and evaluation are the leader's.
  """
  validated = validated or validate(config)
  with contextlib.ExitStack() as stack:
    media = media_source(validated.settings, stack)
    policy = build_policy(config, workdir, stack, media, owns_media=True, validated=validated)
    stack.enter_context(preemption_lib.Preemption(leader=False))
    return worker_lib.serve(policy, multihost.Channel())


TRAINED = "trained.jsonl"


def trained_record(step: int, result: coordinator_lib.StepResult) -> dict:
  """trained.jsonl's line of a step: its sample ids, and its responses when recorded."""
  out = {"step": step, "ids": result.trained}
  if result.responses:
    out["responses"] = [dataclasses.asdict(r) for r in result.responses]
  return out


def read_trained(workdir: str) -> list[dict]:
  """The per-step record of which samples were trained: [{"step", "ids"}], with
  "responses" (rl/records.ResponseRecord fields) when the run recorded them."""
  path = os.path.join(workdir, TRAINED)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def run(config, workdir: str, validated: Validated | None = None) -> dict:
  """The GRPO loop with auto-resume; returns the last metrics written.

  In a multi-controller run the leader runs the loop and returns its
  metrics; every other process follows it (`follow`) and returns {}.
  `validated`: what `validate(config)` returned, if the caller ran it
  already (the CLI does, to exit on a bad setting before anything is
  written); else it runs here.
  A run that ends without an error ends with its summary (rl/summary.py);
  one stopped by SIGTERM then raises `Preempted` (rl/preemption.py).
  """
  validated = validated or validate(config)
  if not multihost.is_leader():
    follow(config, workdir, validated)
    return {}
  t0 = time.time()
  os.makedirs(workdir, exist_ok=True)
  started = provenance.record_invocation(workdir)
  log.info(
    "fluxjax at commit %s%s", started["commit"], " (tree dirty)" * bool(started["tree_dirty"])
  )
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  with contextlib.ExitStack() as stack:
    built = build(config, workdir, stack, validated)
    policy = built.policy
    preemption = stack.enter_context(preemption_lib.Preemption(leader=True))
    try:
      last, first = _loop(validated.settings, workdir, built, stack, preemption)
    except BaseException as e:
      policy.abort(repr(e))  # the followers stop too (nothing with one process)
      raise
    policy.stop()
  # After the stack closed: the records are flushed, the checkpoints complete.
  summary_lib.report(
    workdir,
    metrics_lib.read_metrics(workdir),
    read_trained(workdir),
    wall_s=time.time() - t0,
    resumed_from=first,
    total_steps=validated.settings.total_steps,
    preempted=preemption.stopped_at is not None,
    held_out=built.held_out,
  )
  if preemption.stopped_at is not None:
    raise preemption_lib.Preempted(preemption.stopped_at)
  return last


def _loop(
  settings: settings_lib.Settings,
  workdir: str,
  built: Built,
  stack: contextlib.ExitStack,
  preemption: preemption_lib.Preemption,
) -> tuple[dict, int]:
  """Runs the steps; (the last step's metrics, the step it resumed from: 0 if fresh)."""
  coord, policy = built.coordinator, built.policy
  # Auto-resume from the work directory; the leader's view of it decides.
  restored = policy.restore(policy.latest_step())
  first = 0
  if restored is not None:
    first = restored.step
    coord.restore(restored.coordinator, restored.data)
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
    built.eval_rows,
    len(built.eval_rows),
    built.proc,
    num_workers=0,
    shuffle=False,
    num_epochs=1,
    limits=settings.data.limits,
  )
  stack.callback(eval_loader.close)
  eval_samples = eval_loader.next_batch()
  last: dict[str, float] = {}
  if restored is None:
    # Warm-up for GRPO (none without RL steps); logged at steps -sft.steps..0.
    warm_up = sft.runs(settings.sft, settings.total_steps)
    if warm_up:
      if settings.sft.export_dir:  # the export may replace the model's folder
        provenance.keep_parent_card(settings.model.hf_path, workdir)
      summary = sft.warm_up(
        coord,
        settings,
        built.train_rows,
        built.proc,
        writer,
        lambda: coord.evaluate(eval_samples),
        stop=lambda: preemption.requested,
      )
      if "sft/stopped_after" in summary:
        preemption.stopped_at = int(summary["sft/stopped_after"])
        coord.settle_publish()
        return last, first
    writer.write(0, coord.evaluate(eval_samples))
    if warm_up:  # checkpoint 0, the RL start: a resumed run never repeats the warm-up
      policy.save(0, *coord.get_state(), force=True)
    if warm_up and settings.sft.export_dir:
      path = os.path.join(workdir, settings.sft.export_dir)  # a relative one: in the workdir
      export_hf(policy, path, coord.requests.tokenizer, built.proc)
  if first < settings.total_steps:
    if reference.needed(settings.rl):
      policy.set_reference(fresh=first == 0)
    coord.start()  # rollout runs ahead from here, within the allowed lag
  progress = metrics_lib.Progress(settings.total_steps, first)  # ETA from RL steps only
  done = first  # the last step trained
  for step in range(first + 1, settings.total_steps + 1):
    try:
      result = coord.step()
    except StopIteration:
      log.info("data exhausted after step %d", step - 1)
      break
    host = dict(result.metrics, **built.loader.metrics())
    # Every eval.every steps and at the last (the summary's end accuracy).
    if step == settings.total_steps or (settings.eval.every and step % settings.eval.every == 0):
      host.update(coord.evaluate(eval_samples))
    writer.write(step, host)
    trained_log.write(json.dumps(trained_record(step, result)) + "\n")
    log.info(progress.line(step, host))
    last, done = host, step
    stop = preemption.requested and step < settings.total_steps
    if policy.should_save(step) or step == settings.total_steps or stop:
      coord_state, data_state = coord.get_state()
      policy.save(step, coord_state, data_state, force=step == settings.total_steps or stop)
    if stop:
      preemption.stopped_at = step
      log.warning("preempted: stopped after step %d, checkpointed; the same command resumes", step)
      break
  # The data ran out between evaluations. A preempted run skips this: its
  # grace period is the scheduler's, and the resumed run evaluates at its end.
  if done > first and "eval/accuracy" not in last and preemption.stopped_at is None:
    held_out = coord.evaluate(eval_samples)
    writer.write(done, held_out)
    last = {**last, **held_out}
  # Before the followers are stopped: a deferred broadcast's gathers need them.
  coord.settle_publish()
  return last, first
