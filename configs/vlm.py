r"""GRPO post-training of a Qwen2.5-VL model: the default fluxjax run.

  python -m fluxjax.train --config=configs/vlm.py --workdir=/tmp/fluxjax
  python -m fluxjax.train --config=configs/vlm.py:qwen25_vl_7b \
      --config.model.hf_path=/ckpt/Qwen2.5-VL-7B-Instruct
  python -m fluxjax.train --config=configs/vlm.py --config.sharding.strategy=ulysses
  python -m fluxjax.train --config=configs/vlm.py:qwen25_vl_7b,smoke

The default (`tiny_base`) runs on one CPU machine on embedded defaults: GRPO
post-training of the committed tiny base (configs/pretrain.py made it; loaded
through model.hf_path, as a Qwen2.5-VL checkpoint is), the in-process JAX
rollout engine and a generated synthetic dataset on which the base may reason
before it answers. `tiny` is the same model from random weights with a short
SFT warm-up and 16-token answers (a minutes-long job the tests build on).
Variants for real shapes switch model size and sharding; every field can be
overridden on the command line as --config.section.field=value.

The `smoke` modifier runs a variant end to end on a CPU in minutes: every
setting of the variant (rollout backend and how it starts, context and
response lengths, strategy, lag mode, tail batching, checkpoint cadence, data
mix, dtypes, remat) is kept, except the run's sizes: the model (the variant's
attention heads at the tiny preset's widths, models/config.py `_smoke`), the
step counts, prompts per step, the generated dataset and the evaluation set,
the media resolution (data.vision: the tiny variant's) and the trainer's
tokens per device (sharding.capacity).
A fleet variant given no servers launches `python -m fluxjax.rollout.server`
processes serving that model (rollout.launch = ("fluxjax.rollout.server",)).

The `fleet` modifier (`--config=configs/vlm.py:fleet`, or a variant's
`:qwen25_vl_7b,smoke,fleet`) runs rollout the way a cluster does: two
rollout servers (fluxjax's own, serving the run's model, unless the run
names servers or a command of its own) behind a launched sglang-router, with
weights broadcast over a torch.distributed group (needs
`pip install 'fluxjax[weight-sync]'`). With `python -m fluxjax.launch
--processes=2` it is the default job on two processes and a fleet.

Sharding strategies swap by `--config.sharding.strategy` alone on every
variant and mesh: `sharding.sp` (the largest sequence-parallel degree) is 0 =
auto, the largest degree the model's heads and the devices allow; set it (e.g.
--config.sharding.sp=4) to fix ulysses' degree or flex_ulysses' maximum.

Reading this file imports no JAX (tests/test_config.py checks).
"""

import dataclasses

import ml_collections

from fluxjax import config_args, settings

# What the variants set differently; every other default is shared. `tiny`
# runs on one CPU machine (the tiny preset, the embedded engine, synthetic
# data, an SFT warm-up); the real shapes run on GPU hosts with an SGLang
# fleet and differ from each other only in the model preset. Each field's
# comment at its use below says why it has these values.
_CPU = dict(
  total_steps=150,
  mix="reasoning_tiny",
  reward="accuracy_with_format",
  synth_train=1024,
  data_workers=1,
  small_media=True,
  eval_every=15,
  checkpoint_every=5,
  dtype="float32",
  remat="none",
  logprob_vocab_chunk=128,
  strategy="packed_dp",
  capacity=256,
  balance_vision=False,
  backend="embedded",
  context_length=256,
  decode_steps=1,
  prompts_per_step=16,
  max_new_tokens=16,
  weight_group_backend="gloo",
  lag_mode="sync",
  sft=True,
  lr=3e-4,
  warmup_steps=0,
  end_lr_frac=1.0,
  base="",
  kl_coef=0.0,
)
_GPU_FLEET = dict(
  total_steps=500,
  mix="image_heavy",
  reward="accuracy",
  synth_train=256,
  data_workers=8,
  small_media=False,
  eval_every=25,
  checkpoint_every=25,
  dtype="bfloat16",
  remat="full",
  logprob_vocab_chunk=8192,
  strategy="flex_ulysses",
  capacity=16384,
  balance_vision=True,
  backend="sglang",
  context_length=8192,
  decode_steps=8,
  prompts_per_step=64,
  max_new_tokens=1024,
  weight_group_backend="nccl",
  lag_mode="adaptive",
  sft=False,
  lr=1e-5,
  warmup_steps=10,
  end_lr_frac=0.1,
  base="",
  kl_coef=0.0,
)
# The tiny job post-training the committed base (configs/pretrain.py): no
# warm-up; 55% direct-answer prompts and 45% chain tasks, on which the base
# reasons on about a quarter of the items and RL learns where reasoning
# pays; KL to the base; 80 new tokens hold the longest chains; lr 3e-4, of
# 1e-4, 3e-4 and 1e-3 the rate that learns most with either loss normalizer
# (bench/README.md, "The loss normalizers"). A CPU step of this model costs
# per microbatch, not per token, so microbatches hold 1024 tokens, the
# fastest capacity measured (bench/README.md, "The main job in 15 minutes").
_TINY_BASE = dict(
  _CPU,
  preset="tiny",
  capacity=1024,
  base=config_args.TINY_BASE,
  sft=False,
  mix="post_train",
  max_new_tokens=80,
  lr=3e-4,
  kl_coef=0.05,
  total_steps=100,
  eval_every=50,
)
VARIANTS = {
  "tiny_base": _TINY_BASE,
  "tiny": dict(_CPU, preset="tiny"),
  "qwen25_vl_3b": dict(_GPU_FLEET, preset="3b"),
  "qwen25_vl_7b": dict(_GPU_FLEET, preset="7b"),
  "qwen25_vl_32b": dict(_GPU_FLEET, preset="32b"),
}
# `--config=configs/vlm.py:variant,modifier`: what each modifier does.
MODIFIERS = {
  "smoke": "the variant's every setting at CPU sizes, minutes on a CPU",
  "fleet": "rollout on two launched servers behind sglang-router, weights over torch.distributed",
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = config_args.parse_arg(arg, variant="tiny_base", **dict.fromkeys(MODIFIERS, False))
  if arg.variant not in VARIANTS:
    raise ValueError(
      f"unknown variant {arg.variant!r}; variants: {', '.join(VARIANTS)}; "
      f"modifiers: {', '.join(MODIFIERS)}"
    )
  v = ml_collections.ConfigDict(VARIANTS[arg.variant])
  c = ml_collections.ConfigDict()
  c.variant = arg.variant
  c.seed = 0
  # A reference: the learning-rate schedule (optim.total_steps) follows overrides.
  c.total_steps = ml_collections.FieldReference(v.total_steps)

  # Data: JSONL, JSON or Parquet files (docs/data.md), or (train empty) a
  # synthetic dataset generated into WORKDIR/data on first use. With train
  # and no eval, `holdout` of the training rows (at most eval.prompts, drawn
  # by data.seed) leave training for evaluation; 0 evaluates on training rows
  # and the log and summary say so.
  c.data = ml_collections.ConfigDict()
  c.data.train = ""
  c.data.eval = ""
  c.data.holdout = 0.05
  # image_heavy | video_heavy | only_video | text | shapes | reasoning |
  # reasoning_tiny | one task (fluxjax/data/synth.py MIXES). Tiny:
  # `reasoning_tiny`, the colour of a shape, how many shapes of a named colour
  # (an image) and a shape's colour at the end of a clip (a video); a
  # 524k-parameter model learns both colour tasks from the pixels in minutes
  # on a CPU, the count only to its answer prior (bench/README.md).
  c.data.mix = v.mix
  c.data.synth_train = v.synth_train
  c.data.synth_eval = 256
  c.data.seed = 0
  # The blind control (bench/learning.py): the same rows with every image and
  # video frame a flat grey of the same size, for training and evaluation.
  c.data.blind = False
  c.data.num_workers = v.data_workers
  # Vision preprocessing limits, shared by the loader's workers and the rollout
  # servers (the prompt's pad-token counts depend on them). 0 = the
  # checkpoint's (model.hf_path's preprocessor_config.json, which SGLang
  # reads too), else Qwen2VLImageProcessor's defaults; a set value the
  # checkpoint contradicts stops the run (rl/loop.py vision_settings). Tiny
  # and smoke runs: a few tokens per image/frame so a CPU run stays small (a
  # 7k-token prompt's prefill alone takes GBs with CPU attention). 16 frames
  # keep a count_changes clip whole: 8 temporal patches, so each of its up to
  # 7 colour changes falls between two of them.
  small_media = v.small_media or arg.smoke
  c.data.vision = ml_collections.ConfigDict(
    dict(
      image_min_pixels=28 * 28 * 4 if small_media else 0,
      image_max_pixels=112 * 112 if small_media else 0,
      video_min_pixels=28 * 28 * 4 if small_media else 0,
      video_max_pixels=56 * 56 if small_media else 0,
      video_max_frames=16 if small_media else 0,
    )
  )
  # Media size budgets (fluxjax/settings.py MediaLimits says what each bounds;
  # its defaults), checked from each file's header before anything is
  # decoded, by the loader's probe, its workers and the embedded engine: a
  # file outside them is a counted skip (data/skipped/size).
  c.data.limits = ml_collections.ConfigDict(dataclasses.asdict(settings.MediaLimits()))

  # Held-out evaluation (rl/evaluation.py): samples_per_prompt responses per
  # prompt at the training temperature give eval/accuracy with its 95%
  # interval (the prompt is the unit) and pass@k; one greedy response per
  # prompt gives eval/accuracy_greedy; rows with a difficulty get a breakdown.
  # Logged at step 0 (the RL start), every `every` RL steps, at the last step
  # (the run's summary compares it with step 0) and during the SFT warm-up
  # (sft.eval_every). The first `prompts` rows of data.eval are used; prompts
  # over the prompt budget are skipped (eval/skipped_too_long).
  c.eval = ml_collections.ConfigDict()
  c.eval.every = v.eval_every
  c.eval.prompts = 256
  c.eval.samples_per_prompt = 4
  c.eval.greedy = True
  # The reward that decides a held-out response is correct (its value reaches
  # rl.reward.correct_threshold): "" = the run's rl.reward, or a spec of its
  # own (rl/reward_spec.py), e.g. a strict checker beside a shaped training
  # reward.
  c.eval.reward = ""

  # Every `every` RL steps (0: none between) and at the last; also at step 0
  # after an SFT warm-up, so that a resumed run never repeats it.
  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = v.checkpoint_every

  # Model: a preset with random weights, or an HF checkpoint folder (which wins).
  c.model = ml_collections.ConfigDict()
  c.model.preset = v.preset
  c.model.hf_path = v.base
  c.model.tokenizer_path = ""  # "" = the shipped synthetic tokenizer (tiny) or hf_path's
  c.model.dtype = v.dtype
  c.model.param_dtype = "float32"
  # models/attention/: "auto" (on CPUs blockwise XLA for long rows, which
  # skips the masked blocks of packed rows; else the XLA reference), "xla",
  # "xla_blocked", or a GPU kernel ("cudnn", "pallas_gpu", "tokamax_gpu").
  c.model.attention_backend = "auto"
  # The rollout engine's decode steps (models/decode.py): "xla", the
  # reference, or "pallas_gpu", a kernel reading the KV cache in place (one
  # device per engine).
  c.model.decode_attention = "xla"
  # What each decoder/vision layer keeps for the backward pass
  # (models/layers.py REMAT_POLICIES): "none", "full" (28+ layers' activations
  # do not fit otherwise), "save_dots" (keeps the projections' outputs:
  # shorter steps for GBs more memory, bench/README.md mfu.py),
  # "save_dots_attention".
  c.model.remat = v.remat
  c.model.logprob_vocab_chunk = v.logprob_vocab_chunk
  # Trainer and rollout server must build M-RoPE positions the same way; SGLang
  # starts text after a vision span at max(position)+1 (see models/rope_index.py).
  c.model.mrope_text_after_vision = "max_plus_one"

  # Mesh: data replicas x FSDP x the strategy's sequence-parallel axes
  # (sharding.sp devices). -1 = all devices the other axes leave. data 0 =
  # auto: one replica per host (FSDP within each, a hybrid mesh) when the
  # train state fits that way, which moves fewer bytes between hosts, else 1
  # (sharding/mesh.py data_axis; CPUs report no memory limit: 1).
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 0
  c.mesh.fsdp = -1
  # Multi-controller runs (several processes, one jax.distributed job): either an
  # explicit coordinator address (host:port; python -m fluxjax.launch sets it and
  # the ids), or auto-detection of a Slurm step, Open MPI job or TPU pod, which
  # JAX reads the address and ids from. A Kubernetes job (or another launcher
  # JAX can detect) sets FLUXJAX_DISTRIBUTED=1 or an explicit address: JAX sees
  # Kubernetes in every pod, single-process ones included.
  c.distributed = ml_collections.ConfigDict()
  c.distributed.coordinator_address = ""  # "" = JAX_COORDINATOR_ADDRESS or detected
  c.distributed.num_processes = -1  # -1 = detected
  c.distributed.process_id = -1  # -1 = detected
  c.distributed.local_device_ids = ""  # e.g. "0,1"; "" = JAX_LOCAL_DEVICE_IDS or detected
  c.distributed.auto = True  # initialize when a multi-process cluster job is detected

  # Sharding strategy, swapped by --config.sharding.strategy alone (every
  # other field keeps its meaning): packed_dp (veRL-like: sequences packed
  # whole into each device's rows), ulysses (every sequence split over sp
  # devices), flex_ulysses (FlexRL: each sequence split only as far as its
  # length needs, up to sp).
  c.sharding = ml_collections.ConfigDict()
  c.sharding.strategy = v.strategy
  # The largest sequence-parallel degree: ulysses' fixed degree, flex_ulysses'
  # p_max; packed_dp ignores it. A power of two dividing the query heads (and
  # the kv heads, or divided by them) and the devices left after mesh.data and
  # mesh.fsdp. 0 = auto: the largest such degree within one host's devices,
  # e.g. on 8 devices 4 for 7B (28 query heads) and 8 for tiny, 3B and 32B;
  # across hosts only when rollout.context_length needs more than one host's
  # sp x capacity tokens (docs/design.md).
  c.sharding.sp = 0
  # Tokens/device/microbatch. Tiny: 256 (~4 sequences of the default task and
  # their 256 patches); on a CPU a row's attention cost grows with its length.
  c.sharding.capacity = v.capacity
  # Static buffer sizes the step compiles for (largest = capacity); () = powers of 2.
  c.sharding.capacity_buckets = ()
  # (Vision buffers need no setting: each takes the smallest power of two,
  # from 256 patches, that holds its device's images and frames.)
  # "layer": FSDP gathers/reduces per layer (LB-Micro for packed_dp); "minibatch":
  # ODC's relaxation: gather once, each device runs its own microbatches,
  # reduce-scatter once (LB-Mini for packed_dp).
  c.sharding.sync = "layer"
  # Spread images and video frames over devices by patch count (vision tower
  # balancing); embeddings are gathered back to their tokens.
  c.sharding.balance_vision = v.balance_vision
  # Refuse to start if a parameter larger than this would sit whole on every device.
  c.sharding.max_replicated_bytes = 1 << 20

  # Rollout: the embedded JAX engine in-process, or a fleet speaking SGLang's
  # native HTTP API (a list of URLs, or a launch command started num_servers
  # times on free ports; the server must accept --port).
  c.rollout = ml_collections.ConfigDict()
  c.rollout.backend = v.backend
  # For sglang give one of: --config.rollout.urls='("http://h1:30000",)' or
  # --config.rollout.launch='("python","-m","sglang.launch_server","--model-path","/ckpt")';
  # launch=("fluxjax.rollout.server",) (rollout/factory.py OWN_SERVER) starts
  # fluxjax's own server with the run's model, seed, context and pixel limits.
  c.rollout.urls = ()
  c.rollout.launch = ()
  c.rollout.num_servers = 1
  # The GPUs launched servers run on, split evenly among them in order, each
  # server's CUDA_VISIBLE_DEVICES its share: the trainer and SGLang on one
  # node, e.g. the trainer started with CUDA_VISIBLE_DEVICES=0,1,2,3 and
  # server_gpus "4,5,6,7" (examples/one_node_8gpu.sh). "" = the servers
  # inherit the trainer's environment.
  c.rollout.server_gpus = ""
  # Behind the SGLang router (sglang-router): generation goes through it and
  # weight updates to each of its workers. router_url names a running router
  # (its workers are read from it); router_launch starts one in front of the
  # servers, e.g. ("python","-m","sglang_router.launch_router","--policy","cache_aware").
  c.rollout.router_url = ""
  c.rollout.router_launch = ()
  # How long launched servers and a router (until it lists a worker) may take to come up.
  c.rollout.launch_timeout_s = 600.0
  c.rollout.health_interval_s = 2.0
  c.rollout.num_slots = 32  # embedded engine: concurrent requests
  # Prompt + response tokens: the embedded engine's per-slot KV cache, a
  # fleet's server context (SGLang's --context-length). Prompts longer than
  # context_length - rl.max_new_tokens are skipped (counted); the trainer must
  # place a sequence this long (validated against sharding.capacity).
  c.rollout.context_length = v.context_length
  # Decode steps per jitted call of our engine (embedded or served; SGLang's
  # --num-continuous-decode-steps; an SGLang fleet takes its own flag): the
  # call's dispatch and the host's fetch of its tokens are paid once per this
  # many tokens, and a request that stops inside a call holds its slot to the
  # call's end. The tiny job's train step dominates, so it takes 1; the GPU
  # variants take 8: on an H200 it gave the 3B engine 1.06-1.26x the tokens/s
  # of one step a call (bench/README.md, rollout.py).
  c.rollout.num_continuous_decode_steps = v.decode_steps
  # Embedded engine placement: 0 runs it on the trainer's mesh (one process)
  # or on all of process 0's devices (several processes); k > 0 runs it on
  # the first k devices of process 0, with its own copy of the weights.
  c.rollout.embedded_devices = 0
  # Each request carries a sampling_seed derived from (seed, sample position,
  # response index), so its tokens do not depend on batching or thread timing:
  # a run on the embedded engine repeats. SGLang honours the seed with
  # --enable-deterministic-inference (as slime's deterministic mode does).
  c.rollout.seeded = True
  # How a fleet gets new weights (rollout/publish.py): "disk" writes a
  # versioned HF folder that every server loads (SGLang's
  # update_weights_from_disk; needs a filesystem the servers share with the
  # trainer); "distributed" broadcasts bf16 tensors from the trainer to every
  # server over a torch.distributed group (update_weights_from_distributed;
  # needs torch: pip install 'fluxjax[weight-sync]'). The group's backend
  # (gloo on CPUs, nccl between GPUs), the address servers reach the trainer
  # at ("" = loopback when every server is local, else this host's name), and
  # how long a rendezvous or a broadcast may wait.
  c.rollout.weight_sync = "disk"
  # With "disk", each version's folder also holds the bf16 elements that
  # changed since the previous one (models/hf_delta.py): a server serving
  # that version (fluxjax's own) reads those instead of the whole folder;
  # SGLang and servers that missed a version read the folder. Costs the
  # trainer a read of its previous files per publish.
  c.rollout.weight_deltas = True
  # A publish returns at once: the trainer's main thread gathers the tensors
  # between the next step's ops while it waits for rollouts, a thread writes
  # the folder ("disk") or the broadcast sends them ("distributed"), and the
  # servers load the version while the trainer goes on; the next update waits
  # for the gathers left, paced by the write or send (the coordinator waits
  # for the whole publish before the next one and before an evaluation).
  # False: the trainer waits for all.
  c.rollout.defer_updates = True
  c.rollout.weight_group_backend = v.weight_group_backend
  c.rollout.weight_group_address = ""
  c.rollout.weight_group_timeout_s = 600.0
  # The distributed transport sends the model in buckets of at most this many
  # MiB, one update call each: a server holds one bucket's receive buffers at
  # a time (slime's update buffer is 512 MiB too).
  c.rollout.weight_bucket_mb = 512.0

  # Tail batching (Flexes): a short round launches eta*P prompts and keeps the
  # first P to finish; the others wait for a long round. 1.0 disables it.
  # recycle (partial rollouts): each prompt runs exactly R responses, a kept
  # prompt is all of them (no length bias), and a deferred prompt's responses
  # are continued from where they were aborted (no decode work discarded).
  # recycle=False is Flexes as published: eta*R responses, the first R kept,
  # the rest discarded. rl/tail_batching.py has both.
  c.rollout.tail_batching = ml_collections.ConfigDict()
  c.rollout.tail_batching.eta = 1.25
  c.rollout.tail_batching.recycle = True
  # Where a deferred prompt's partial responses go on: "long_round" (with P
  # other deferred prompts, Flexes' order) or "next_round" (APRIL's order:
  # first in the next short round, so its early tokens are less stale). On
  # the default job next_round made recycled tokens younger for fewer trained
  # samples/s at the same accuracy, so long_round stays (bench/README.md
  # async.py).
  c.rollout.tail_batching.continue_in = "long_round"

  # RL algorithm (rl/losses.py has the loss formula): GRPO advantages, PPO
  # clip (DAPO clip-higher), decoupled truncated importance correction,
  # optional KL to a reference; rewards. These are the only defaults: code
  # reads every field from here (tests: config_args.load_config().rl).
  c.rl = ml_collections.ConfigDict()
  # Tiny: 16 prompts x 8 responses gained the most per minute of the sweep
  # (bench/README.md learning.py).
  c.rl.prompts_per_step = v.prompts_per_step
  c.rl.responses_per_prompt = 8
  c.rl.max_new_tokens = v.max_new_tokens
  c.rl.temperature = 1.0
  # PPO clip around pi_prox: the ratio stays in [1 - clip_low, 1 + clip_high].
  # clip_high above clip_low is DAPO's clip-higher: low-probability tokens can
  # grow, which keeps entropy from collapsing (Yu et al. 2025 use 0.28; 0.2
  # for symmetric clipping).
  c.rl.clip_low = 0.2
  c.rl.clip_high = 0.28
  # Dual-clip bound for A < 0 (veRL clip_ratio_c = 3); 0 = off, else > 1.
  c.rl.clip_c = 0.0
  # KL-to-reference penalty coefficient; 0 disables the term and its metric
  # (no reference logprobs are computed then).
  c.rl.kl_coef = v.kl_coef
  # The reference model (an HF checkpoint folder); "" = the policy as RL
  # begins (rl/reference.py).
  c.rl.ref_hf_path = ""
  # "k1" (unbiased, signed) or "k3" (non-negative, low variance; veRL low_var_kl).
  c.rl.kl_estimator = "k3"
  # Per-token KL clamped to [-kl_clamp, kl_clamp] (veRL clamps low_var_kl at
  # 10 against bf16 overflow); 0 disables.
  c.rl.kl_clamp = 10.0
  # Truncation of the decoupled importance weight w = pi_prox / mu (veRL/Tunix
  # truncated IS); 0 leaves w uncapped.
  c.rl.is_cap = 2.0
  # "truncate" (w = min(w, is_cap)), "mask" (w = 0 above is_cap; AReaL's
  # rejection) or "off" (w = 1: no correction for the behaviour policy; the
  # control bench/learning.py --runs stress measures the correction against).
  c.rl.is_mode = "truncate"
  # Where pi_prox comes from: "trainer" (the trainer's policy before the
  # batch's first update: sg(logp) with one update per batch, no extra forward
  # pass; with more, a forward of that policy kept with each part) or "batch"
  # (the batch's prox_logprobs; the behaviour logprobs where a sequence
  # carries none).
  c.rl.prox = "trainer"
  # Optimizer updates per batch (PPO epochs). The first is streamed while
  # rollout goes on; each later one passes over the batch again, clipped
  # around pi_prox, so the clip and clip-higher act (train/clipfrac).
  c.rl.updates_per_batch = 1
  # Entropy bonus coefficient (0: entropy is a metric only).
  c.rl.entropy_coef = 0.0
  # How token losses aggregate (veRL's loss_agg_mode; rl/advantages.py):
  # "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or
  # "token-sum-norm" (Dr. GRPO: divided by the constant prompts_per_step x
  # responses_per_prompt x max_new_tokens, so a token weighs the same in
  # whatever batch tail batching puts it).
  c.rl.loss_agg_mode = "token-mean"
  # GRPO divides advantages by the group's std (+ adv_eps).
  c.rl.adv_std_normalize = True
  c.rl.adv_eps = 1e-6
  # DAPO dynamic sampling: groups whose rewards are all equal carry no signal
  # and are refilled, for up to max_refill_rounds rounds before training anyway.
  c.rl.dynamic_sampling = False
  c.rl.max_refill_rounds = 3
  # Rewards (rl/reward_spec.py, run by rl/reward_pool.py): the function, or
  # several comma-separated for their weighted sum: a registered name,
  # "module:fn" or "path/to/file.py:fn" for your own (veRL's
  # custom_reward_function; veRL's compute_score signature works), the
  # worker processes, and Flexes' adaptive timeout T = min(max(t_min,
  # anchor_factor * T_anchor), t_max) seconds; a reward >= correct_threshold
  # counts as correct (in training metrics and in evaluation).
  c.rl.reward = ml_collections.ConfigDict()
  # Tiny: its prompts ask for <answer></answer>, so the format earns 0.1; the
  # GPU variants' synthetic prompts ask for no format, so correctness alone.
  c.rl.reward.fn = v.reward
  c.rl.reward.weights = ()  # one per function of rl.reward.fn; () = all 1
  c.rl.reward.num_workers = 4
  c.rl.reward.t_min = 2.0
  c.rl.reward.t_max = 30.0
  c.rl.reward.anchor_factor = 1.5
  c.rl.reward.correct_threshold = 1.0

  # Coordinator: how far rollout may run ahead of training (Flux). "sync":
  # lag 0; "fixed": lag fixed_lag; "adaptive": the Flux async controller
  # (rl/async_control.py) keeps the staleness near target_staleness. Admission
  # of new rollouts is throttled; finished samples are never dropped. (Named
  # `lag`, not `async`: flag overrides are parsed as Python, where async is a
  # keyword.)
  c.coordinator = ml_collections.ConfigDict()
  # Stream trainer: finished groups are trained in parts of this many while
  # rollout continues (0 = half a batch); the update waits for the whole batch.
  c.coordinator.stream_groups = 0
  # Per trained response, a record in WORKDIR/trained.jsonl ("responses"): its
  # length, reward, version gap, share of the update and the loss's metrics
  # over its tokens (fluxjax/rl/records.py). Costs a per-sequence sum of each
  # loss metric in the train step; `bench/async.py --quintiles` and
  # `bench/learning.py --runs stress` turn them on.
  c.coordinator.response_records = False
  # Adaptive, per step: the batch's staleness s = clip(kl_weight * KL /
  # kl_normalizer + iw_weight * log1p(Var w) / iw_normalizer + gap_weight *
  # version gap / max_version_gap, 0, 1) (a normalizer is the value that counts
  # as fully stale); ema = ema_decay * ema + (1 - ema_decay) * s. Outside the
  # band |target_staleness - ema| <= tolerance the async ratio, within
  # [min_async_ratio, max_async_ratio] from initial_ratio, moves by a PID step
  # (kp, ki, kd on target - ema) of at most max_step; inside it the ratio holds.
  # The lag is min_lag + ratio * (max_lag - min_lag), its mean over steps kept
  # by error diffusion. A sync barrier (lag 0 until the rollouts in flight are
  # trained and one batch comes from the current policy, and while ema stays
  # above hard_bound) is forced when ema > hard_bound, and when sync_interval
  # steps have passed since the last one (0: never). These are the Flux
  # design's values but kp and ki, five times the design's so that the ratio
  # reaches the band from either end of its range within 20 steps, and
  # sync_interval, 10 in the design, off because its barriers bought neither
  # accuracy nor time over three paired seeds (bench/README.md, learning.py
  # --runs controller); max_version_gap, which the design leaves open, is
  # max_lag, and max_step is not in the design. controller="design" runs the
  # design's update as written (docs/training-loop.md, deviations).
  c.coordinator.lag = ml_collections.ConfigDict(
    dict(
      mode=v.lag_mode,
      controller="fluxjax",
      fixed_lag=1,
      min_lag=0,
      max_lag=4,
      target_staleness=0.15,
      tolerance=0.05,
      hard_bound=0.2,
      min_async_ratio=0.1,
      max_async_ratio=0.9,
      initial_ratio=0.5,
      kp=0.5,
      ki=0.05,
      kd=0.05,
      max_step=0.05,
      ema_decay=0.9,
      sync_interval=0,
      kl_weight=0.4,
      iw_weight=0.3,
      gap_weight=0.3,
      kl_normalizer=0.1,
      iw_normalizer=2.0,
      max_version_gap=4.0,
    )
  )

  # Fault policy (fluxjax/faults.py): each failure below is counted
  # (faults/<name>_total, checkpointed) and this many in a row stop the run
  # with an error that names the cause; 0 = never stop.
  c.faults = ml_collections.ConfigDict()
  # Updates refused as non-finite (loss, gradient norm, or the updated
  # parameters or optimizer state), the SFT warm-up's included: none is
  # applied or published, so the checkpoints hold the last good policy.
  # Weights that pass but give non-finite logits (a probe forward before each
  # publish) stop the run at once.
  c.faults.nonfinite_steps = 3
  # Weight publishes whose write failed (a full disk) and reached no server:
  # the fleet keeps its weights and rollout goes on, ever further off-policy.
  c.faults.unwritten_publishes = 3
  # Rollout rounds a backend error stopped (their kept prompts are trained,
  # the rest queued again; a backoff of 2^n s, at most 30, between them).
  c.faults.failed_rounds = 5
  # Samples whose prompt could not be built (each skipped): that many in a
  # row is a broken tokenizer or chat template, not bad samples.
  c.faults.prompt_errors = 100
  # Per response, not per run: backend aborts without progress (a pause, an
  # engine error) re-launched before its round fails (a failed round).
  c.faults.request_retries = 2

  # Supervised warm-up (rl/sft.py), once before the first GRPO step of a fresh
  # run: train prompts with their reference answers as "<answer>x</answer>".
  # A random-init model never produces that format, so GRPO alone gets reward
  # 0 and no signal. Its own AdamW (lr, warmup, cosine to end_lr_frac); the RL
  # optimizer state starts fresh after it. Off for real checkpoints, and not
  # run when total_steps is 0 (build, evaluate, stop).
  c.sft = ml_collections.ConfigDict()
  c.sft.enabled = v.sft
  # Tiny: long enough to teach the format and part of the task, short
  # enough to leave GRPO headroom; a longer warm-up left less gain
  # (bench/README.md, the sweep that chose the defaults).
  c.sft.steps = 60
  c.sft.batch_size = 32
  # The difficulty labels the warm-up teaches; training rows with another
  # label are left to RL, rows without one are always taught. () = all.
  c.sft.levels = ()
  # The share of warm-up samples whose reference response shows its reasoning
  # (<think>solution</think> before the answer), per difficulty level (`other`:
  # rows without one); the others answer directly, so RL can find out where
  # reasoning pays.
  c.sft.chain_fraction = ml_collections.ConfigDict(dict(easy=1.0, medium=1.0, hard=1.0, other=1.0))
  # Direct answers taught as guesses: on a row of one of `tasks`, or at one of
  # `levels`, a direct answer is another training row's answer of the same
  # task and level, so the model learns the format and the answer prior there
  # but not the item; a shown reasoning still works the item out, and RL can
  # find that reasoning pays (configs/pretrain.py). () = none.
  c.sft.guess = ml_collections.ConfigDict(dict(tasks=(), levels=()))
  c.sft.lr = 2e-3
  c.sft.warmup_steps = 10
  c.sft.end_lr_frac = 0.1
  c.sft.eval_every = 30  # held-out accuracy during the warm-up (0: before and after only)
  # Warm-up checkpoints every this many steps (0: none), from which a killed
  # warm-up resumes; a long one (pretraining a base, configs/pretrain.py) needs them.
  c.sft.checkpoint_every = 0
  # Where the warmed-up model is written as an HF folder (config.json,
  # safetensors, tokenizer.json, preprocessor_config.json; a relative path is
  # inside the work directory); with it set the warm-up runs even without RL
  # steps: that is pretraining a base (configs/pretrain.py).
  c.sft.export_dir = ""

  # Optimizer: AdamW + global-norm clipping + warmup/cosine.
  c.optim = ml_collections.ConfigDict()
  # Tiny: a constant lr from the first step (bench/README.md, the sweep that
  # chose the defaults: a higher one knocked held-out accuracy down first);
  # a warmup that starts at 0 and a cosine spent most of a short run's lr
  # budget idle.
  c.optim.lr = v.lr
  c.optim.warmup_steps = v.warmup_steps
  c.optim.total_steps = c.get_ref("total_steps")
  c.optim.end_lr_frac = v.end_lr_frac
  c.optim.max_grad_norm = 1.0
  c.optim.b1 = 0.9
  c.optim.b2 = 0.999
  c.optim.eps = 1e-8
  c.optim.weight_decay = 0.0
  # An update is refused (the state kept) when it is not finite: "state"
  # checks the loss, the gradient norm and the updated parameters and
  # moments, which then sit beside the old ones in device memory until known
  # finite (one more copy of the fp32 state and AdamW moments); "inputs"
  # checks the loss and gradient norm only and updates in place
  # (train_step.apply_update says what it leaves to the publisher's check).
  c.optim.refuse_nonfinite = "state"
  # Once lr_scale_steps[i] optimizer updates are done (one per RL step, or
  # rl.updates_per_batch), the schedule's lr is multiplied by lr_scales[i]
  # (cumulatively): a step change mid-run, e.g. (75,) and (3.0,) triple it
  # from RL step 76. The warm-up's schedule has none.
  c.optim.lr_scale_steps = ()
  c.optim.lr_scales = ()
  if arg.smoke:
    _smoke(c)
  if arg.fleet:
    _fleet(c)
  return c


def _fleet(c: ml_collections.ConfigDict) -> None:
  """The `fleet` modifier (module docstring)."""
  c.rollout.backend = "sglang"
  if not (c.rollout.urls or c.rollout.router_url or c.rollout.launch):
    c.rollout.launch = ("fluxjax.rollout.server",)  # rollout/factory.py OWN_SERVER
  c.rollout.num_servers = 2
  if not c.rollout.router_url:
    c.rollout.router_launch = ("python", "-m", "sglang_router.launch_router", "--log-level", "warn")
  c.rollout.weight_sync = "distributed"


def _smoke(c: ml_collections.ConfigDict) -> None:
  """The `smoke` modifier (module docstring): the run's sizes only."""
  if c.model.preset != "tiny":
    c.model.preset += "_smoke"
  c.total_steps = 2
  # A random-weight model answers at length, so every response is
  # max_new_tokens of CPU decoding, and a decode step costs what its busiest
  # slot bucket (8, 16, 32) does. One prompt: its 8 responses and tail
  # batching's extra prompt fill 16 slots; an evaluation's 2 prompts x (2
  # sampled + greedy) fill 8.
  c.rl.prompts_per_step = 1
  c.data.synth_train, c.data.synth_eval = 64, 8
  c.eval.prompts, c.eval.samples_per_prompt = 2, 2
  # Tokens per device: 2048 keeps a CPU step of the 7b smoke model short;
  # prompts are then bounded by the trainer's longest sequence.
  c.sharding.capacity = min(c.sharding.capacity, 2048)
  c.sft.steps, c.sft.eval_every = 4, 0
  if c.rollout.backend == "sglang" and not (c.rollout.urls or c.rollout.router_url):
    c.rollout.launch = c.rollout.launch or ("fluxjax.rollout.server",)
