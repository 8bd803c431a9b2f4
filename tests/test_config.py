"""configs/vlm.py: every variant parses without JAX, and every variant x
strategy builds a strategy and mesh from `sharding.strategy` alone."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import ml_collections
import pytest
import yaml

from fluxjax import config_args
from fluxjax import settings as settings_lib
from fluxjax.models import config as model_config
from fluxjax.parallel import strategies
from fluxjax.rl import loop
from fluxjax.rollout import factory, protocol, publish
from fluxjax.rollout import fleet as fleet_lib
from fluxjax.settings import Settings
from fluxjax.sharding import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("tiny", "tiny_base", "qwen25_vl_3b", "qwen25_vl_7b", "qwen25_vl_32b")
# Auto sp on the 8-device test mesh: the largest power of two dividing the
# query heads (kv heads dividing it or divided by it) and the 8 devices.
AUTO_SP = {"tiny": 8, "tiny_base": 8, "qwen25_vl_3b": 8, "qwen25_vl_7b": 4, "qwen25_vl_32b": 8}


def _config(variant, **sections):
  c = config_args.load_config(arg=variant)
  if c.rollout.backend == "sglang":  # validate wants a fleet; none is contacted
    c.rollout.urls = ("http://127.0.0.1:1",)
  for dotted, value in sections.items():
    section, field = dotted.split("__")
    c[section][field] = value
  return c


def _build(c):
  """Strategy and mesh as a run builds them from its config."""
  cfg = model_config.preset(c.model.preset)
  mesh = loop.resolved_mesh(Settings.of(c).mesh, cfg)
  strategy = strategies.get_strategy(c.sharding, cfg, mesh)
  return strategy, mesh_lib.make_mesh(mesh.data, mesh.fsdp, strategy.sp_axes())


def test_every_variant_parses_without_importing_jax():
  # A fresh interpreter: this process imported jax long ago (conftest.py).
  code = (
    "import sys\n"
    "from fluxjax import config_args\n"
    "from fluxjax.settings import Settings\n"
    f"for v in {VARIANTS!r}:\n"
    "  c = config_args.load_config('configs/vlm.py', v)\n"
    "  assert c.variant == v and c.rl.reward.fn and c.sharding.sp == 0\n"
    "  Settings.of(c)\n"
    "for a in ('', 'smoke'):\n"
    "  c = config_args.load_config('configs/pretrain.py', a)\n"
    "  assert c.total_steps == 0 and c.sft.export_dir and c.data.mix == 'pretrain'\n"
    "  Settings.of(c)\n"
    "bad = sorted(m for m in sys.modules if m == 'jax' or m.startswith('jax.'))\n"
    "assert not bad, bad\n"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
    env=dict(os.environ, PYTHONPATH=ROOT),
  )
  assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.parametrize("strategy", strategies.STRATEGIES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_one_flag_swaps_the_strategy(variant, strategy, devices):
  c = _config(variant)
  c.sharding.strategy = strategy
  _, got, mesh, _, _ = loop.validate(c)
  assert got.name == strategy
  assert got.sp == (1 if strategy == "packed_dp" else AUTO_SP[variant])
  assert mesh.size == len(devices)
  sp_size = 1
  for name, size in got.sp_axes():
    assert mesh.shape[name] == size
    sp_size *= size
  assert sp_size == got.sp
  assert mesh.shape["data"] * mesh.shape["fsdp"] * sp_size == len(devices)


@pytest.mark.parametrize(
  "strategy,sp,data,fsdp,want_sp,want_shape",
  [
    ("ulysses", 2, 1, -1, 2, {"data": 1, "fsdp": 4, "sp": 2}),
    ("flex_ulysses", 4, 1, -1, 4, {"data": 1, "fsdp": 2, "sp_0": 2, "sp_1": 2}),
    ("ulysses", 0, 2, -1, 4, {"data": 2, "fsdp": 1, "sp": 4}),  # auto leaves data its share
    ("flex_ulysses", 0, 1, 2, 4, {"data": 1, "fsdp": 2, "sp_0": 2, "sp_1": 2}),
    ("ulysses", 0, -1, 4, 2, {"data": 1, "fsdp": 4, "sp": 2}),
    ("packed_dp", 4, 2, -1, 1, {"data": 2, "fsdp": 4, "sp": 1}),  # sp does not apply
  ],
)
def test_sp_and_mesh_settings(strategy, sp, data, fsdp, want_sp, want_shape, devices):
  c = _config(
    "tiny", sharding__strategy=strategy, sharding__sp=sp, mesh__data=data, mesh__fsdp=fsdp
  )
  got, mesh = _build(c)
  assert (got.name, got.sp, dict(mesh.shape)) == (strategy, want_sp, want_shape)


@pytest.mark.parametrize(
  "variant,overrides,message",
  [
    (
      "tiny",
      dict(sharding__strategy="ulysses", sharding__sp=16),
      r"sharding.sp=16 .* 8 query heads; set --config.sharding.sp to one of \[1, 2, 4, 8\]",
    ),
    (
      "qwen25_vl_7b",
      dict(sharding__strategy="flex_ulysses", sharding__sp=8),
      r"28 query heads; set --config.sharding.sp to one of \[1, 2, 4\], or 0 \(auto: 4",
    ),
    (
      "tiny",
      dict(sharding__strategy="ulysses", sharding__sp=3),
      r"power of two; set --config.sharding.sp",
    ),
    (
      "tiny",
      dict(sharding__strategy="flex_ulysses", sharding__sp=4, mesh__fsdp=4),
      r"2 devices left .* set --config.sharding.sp to one of \[1, 2\].*--config.mesh.fsdp=-1",
    ),
    ("tiny", dict(mesh__data=3), r"mesh.data=3 .* set --config.mesh.data to one of \[1, 2, 4, 8\]"),
    ("tiny", dict(sharding__strategy="ulysses", mesh__fsdp=3), r"set --config.mesh.fsdp to -1"),
    ("tiny", dict(mesh__fsdp=4), r"!= 8 devices; set --config.mesh.fsdp=8 or -1"),
    ("tiny", dict(mesh__data=-1, mesh__fsdp=-1), r"at most one .* set --config.mesh.data"),
  ],
)
def test_bad_settings_name_the_flag(variant, overrides, message, devices):
  c = _config(variant, **overrides)
  with pytest.raises(ValueError, match=message):
    _build(c)


def test_p_max_is_not_a_second_name_for_sp():
  cfg = ml_collections.ConfigDict(dict(strategy="flex_ulysses", sp=0, p_max=8, capacity=64))
  with pytest.raises(ValueError, match=r"largest degree is sharding\.sp"):
    strategies.get_strategy(cfg, model_config.preset("tiny"), num_devices=8)


@pytest.mark.parametrize(
  "variant,num_devices,max_auto,want",
  [
    ("tiny", 1, 1, 1),  # one accelerator: no sequence parallelism
    ("qwen25_vl_7b", 2, 2, 2),
    ("qwen25_vl_7b", 16, 8, 4),  # 28 heads
    ("qwen25_vl_3b", 64, 8, 8),  # auto stays within one host's 8 devices
    ("qwen25_vl_32b", 6, 6, 2),  # 6 devices: 2 is the largest power of two dividing them
  ],
)
def test_auto_sp_on_other_device_counts(variant, num_devices, max_auto, want):
  c = _config(variant, sharding__strategy="ulysses")
  cfg = model_config.preset(c.model.preset)
  mesh = loop.resolved_mesh(Settings.of(c).mesh, cfg)
  assert strategies.resolve_sp(c.sharding, cfg, num_devices, mesh, max_auto) == want


@pytest.mark.parametrize(
  "longest,want",
  [
    (0, 8),  # unknown: within one host
    (8 * 16384, 8),  # 8 devices at capacity 16384 hold it
    (8 * 16384 + 1, 16),  # one token more: the smallest degree across hosts that holds it
    (64 * 16384, 16),  # nothing holds it: the largest degree the heads allow
  ],
)
def test_auto_sp_goes_across_hosts_only_for_a_sequence_one_host_cannot_hold(longest, want, caplog):
  """qwen25_vl_3b (16 heads) on 4 hosts of 8 devices: auto stays on the host
  while its devices' memory (sp x sharding.capacity tokens) holds the
  longest sequence, and the log weighs the choice in bytes between hosts."""
  c = _config("qwen25_vl_3b", sharding__strategy="ulysses")
  cfg = model_config.preset(c.model.preset)
  mesh = loop.resolved_mesh(Settings.of(c).mesh, cfg)
  assert c.sharding.capacity == 16384
  with caplog.at_level("INFO", logger="fluxjax.parallel.strategies"):
    got = strategies.resolve_sp(c.sharding, cfg, 32, mesh, 8, longest)
  assert got == want
  where = "across hosts" if want > 8 else "within one host"
  assert f"sharding.sp auto: {want}, {where}" in caplog.text
  assert re.search(r"(\d+\.\d) MB per (device per )?forward between hosts", caplog.text)


def test_flex_ulysses_on_one_device_has_no_sequence_axes(devices):
  c = _config("tiny", sharding__strategy="flex_ulysses")
  cfg = model_config.preset("tiny")
  resolved = loop.resolved_mesh(Settings.of(c).mesh, cfg)
  got = strategies.get_strategy(c.sharding, cfg, resolved, num_devices=1)
  mesh = mesh_lib.make_mesh(resolved.data, resolved.fsdp, got.sp_axes(), devices=devices[:1])
  assert got.sp == 1 and dict(mesh.shape) == {"data": 1, "fsdp": 1}
  plan = got.plan([40, 90, 7], mesh.size)
  plan.validate()


@pytest.mark.parametrize(
  "arg", [*VARIANTS, *(f"{v},smoke" for v in VARIANTS), "fleet", "qwen25_vl_7b,smoke,fleet"]
)
def test_every_variant_reads_into_typed_settings(arg):
  """configs/vlm.py and fluxjax/settings.py declare the same fields: every
  variant and modifier reads into frozen sections, resolved references
  included (optim.total_steps follows total_steps)."""
  c = config_args.load_config(arg=arg)
  c.total_steps = 7
  s = Settings.of(c)
  assert s.optim.total_steps == 7 and s.variant == c.variant
  assert c.variant == ("tiny_base" if arg == "fleet" else arg.split(",")[0])
  assert isinstance(s.rollout.launch, tuple) and isinstance(s.rl.reward, settings_lib.Reward)
  with pytest.raises(dataclasses.FrozenInstanceError):
    s.rl.max_new_tokens = 1  # type: ignore[misc]
  assert Settings.of(s) is s


@pytest.mark.parametrize("arg", ["fleet", "qwen25_vl_7b,smoke,fleet"])
def test_the_fleet_modifier_runs_rollout_on_launched_servers_behind_a_router(arg):
  """Two of fluxjax's own servers behind a launched sglang-router, weights
  broadcast; everything else as without the modifier."""
  c = config_args.load_config(arg=arg)
  base = config_args.load_config(arg=arg.replace(",fleet", "").replace("fleet", ""))
  assert c.rollout.backend == "sglang" and c.rollout.num_servers == 2
  assert tuple(c.rollout.launch) == factory.OWN_SERVER and not c.rollout.urls
  assert "sglang_router.launch_router" in c.rollout.router_launch and not c.rollout.router_url
  assert c.rollout.weight_sync == "distributed"
  factory.check_config(Settings.of(c).rollout)
  for section in ("rl", "sharding", "coordinator", "data", "model", "sft"):
    assert c[section].to_dict() == base[section].to_dict(), section


def test_the_decode_steps_and_attention_reach_our_server_and_are_checked():
  c = config_args.load_config(arg="qwen25_vl_7b,smoke,fleet")
  cmd = factory.server_command(Settings.of(c))
  flag = cmd.index("--num-continuous-decode-steps")
  assert cmd[flag + 1] == str(c.rollout.num_continuous_decode_steps) == "8"
  # So does the decode attention the run chose.
  c.model.decode_attention = "pallas_gpu"
  cmd = factory.server_command(Settings.of(c))
  assert cmd[cmd.index("--decode-attention") + 1] == "pallas_gpu"
  c.rollout.num_continuous_decode_steps = 0
  with pytest.raises(ValueError, match=r"rollout\.num_continuous_decode_steps must be 1 or more"):
    factory.check_config(Settings.of(c).rollout)


def test_a_launched_own_server_serves_the_runs_checkpoint_with_its_vision_limits():
  """A run from model.hf_path launches `fluxjax.rollout.server` on that
  checkpoint (its weights until the first publish, its tokenizer) with the
  limits the run resolved from it, not random weights of the preset."""
  from fluxjax.models import processor

  settings = loop.validate(config_args.load_config(arg="tiny_base")).settings
  cmd = factory.server_command(settings)
  assert cmd[cmd.index("--model-path") + 1] == os.path.abspath(config_args.TINY_BASE)
  theirs = processor.VisionProcessorConfig.read_hf_files(config_args.TINY_BASE)
  for key, value in dataclasses.asdict(settings.data.vision).items():
    assert value and cmd[cmd.index(protocol.server_flag(key)) + 1] == str(value)
    assert value == theirs.get(key, value)
  scratch = factory.server_command(Settings.of(config_args.load_config(arg="tiny")))
  assert "--model-path" not in scratch and scratch[scratch.index("--preset") + 1] == "tiny"


@pytest.mark.parametrize(
  "field, registry",
  [("backend", factory.BACKENDS), ("weight_sync", publish.WEIGHT_TRANSPORTS)],
)
def test_an_unknown_backend_or_transport_is_one_line_listing_the_registered(field, registry):
  """rollout.backend and rollout.weight_sync name entries of a registry: the
  check takes the allowed names from it, as a fleet does its transport."""
  assert set(factory.BACKENDS) == {"embedded", "sglang"}
  # Only the embedded engine runs in the trainer's process, on a copy of its weights.
  assert [k.name for k in factory.BACKENDS.values() if k.in_process] == ["embedded"]
  assert set(publish.WEIGHT_TRANSPORTS) == {"disk", "distributed"}
  c = _config("tiny")
  factory.check_config(Settings.of(c).rollout)
  c.rollout[field] = "bogus"
  with pytest.raises(ValueError) as e:
    factory.check_config(Settings.of(c).rollout)
  assert str(e.value) == f"unknown rollout.{field} 'bogus'; choose one of {sorted(registry)}"
  if field == "weight_sync":
    with pytest.raises(ValueError, match=r"^unknown rollout.weight_sync 'bogus'; choose one"):
      fleet_lib.Fleet(["http://127.0.0.1:1"], weight_sync="bogus")


def test_a_field_the_sections_do_not_declare_names_its_flag():
  c = config_args.load_config(arg="tiny")
  with c.unlocked():
    c.rl.max_new_token = 8  # misspelt
  with pytest.raises(ValueError, match=r"--config\.rl\.max_new_token: no such setting"):
    Settings.of(c)
  c = config_args.load_config(arg="tiny")
  del c.rollout.tail_batching["eta"]
  with pytest.raises(ValueError, match=r"config\.rollout\.tail_batching\.eta missing"):
    Settings.of(c)


@pytest.mark.parametrize(
  "field, value, expected",
  [
    ("rl.prompts_per_step", 2.5, "expected int, got 2.5"),
    ("rl.max_new_tokens", True, "expected int, got True"),  # a bool is no number
    ("eval.greedy", 3, "expected bool, got 3"),
    ("optim.lr", "fast", "expected float, got 'fast'"),
    ("data.train", 7, "expected str, got 7"),
    ("rl.reward.weights", (1.0, "a"), "expected a tuple of float, got (1.0, 'a')"),
    ("sharding.capacity_buckets", (256.0,), "expected a tuple of int, got (256.0,)"),
  ],
)
def test_a_wrongly_typed_setting_is_one_line_naming_its_flag(field, value, expected):
  """What the flags' parser lets through (a tuple's items, a saved config, a
  config file's own values) is checked against its section's type."""
  c = config_args.load_config(arg="tiny")
  *path, leaf = field.split(".")
  section = c
  for key in path:
    section = section[key]
  with section.ignore_type():
    section[leaf] = value
  with pytest.raises(ValueError) as e:
    Settings.of(c)
  assert str(e.value) == f"--config.{field}: {expected}"


def test_an_int_for_a_float_setting_is_that_float():
  """--config.optim.lr=1 means 1.0, in a tuple too."""
  c = config_args.load_config(arg="tiny")
  c.rl.reward.weights = (1, 2)
  s = Settings.of(c)
  assert s.rl.reward.weights == (1.0, 2.0) and all(type(w) is float for w in s.rl.reward.weights)
  optim = settings_lib.section(settings_lib.Optim, {**c.optim, "lr": 1}, "optim.")
  assert optim.lr == 1.0 and type(optim.lr) is float


@pytest.mark.parametrize(
  "override",
  [
    "--config.rl.prompts_per_step=2.5",
    "--config.eval.greedy=3",
    "--config.rl.reward.weights=(1.0,'a')",
  ],
)
def test_a_wrongly_typed_override_stops_the_run_in_one_line(override):
  """The command line: absl's parser refuses a scalar, the settings a tuple's
  items; either way one line naming the flag, before JAX is imported."""
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "fluxjax.train",
      f"--config={os.path.join(ROOT, 'configs', 'vlm.py')}",
      override,
    ],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=120,
  )
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
  assert lines[0].startswith("fluxjax.train: ") and override.partition("=")[0] in lines[0]


def test_each_config_and_variant_has_its_own_default_workdir():
  sys.path.insert(0, ROOT)
  from fluxjax.train import default_workdir

  assert default_workdir("configs/vlm.py") == os.path.join("workdir", "vlm")
  assert default_workdir("/abs/configs/vlm.py:qwen25_vl_7b,smoke") == os.path.join(
    "workdir", "vlm-qwen25_vl_7b-smoke"
  )
  assert default_workdir("configs/pretrain.py") == os.path.join("workdir", "pretrain")


def test_a_saved_config_over_todays_defaults_and_its_differences(tmp_path):
  """A run's config.json from before a setting existed reads back with the
  setting's default and a note; a resume names each field that changed."""
  config = config_args.load_config(os.path.join(ROOT, "configs", "vlm.py"), "qwen25_vl_7b")
  saved = json.loads(config.to_json_best_effort())
  del saved["eval"]["reward"]
  saved["rl"]["gone_setting"] = 1
  saved["rl"]["temperature"] = 0.7
  path = tmp_path / "config.json"
  path.write_text(json.dumps(saved))
  back, notes = config_args.load_saved(str(path))
  assert back.variant == "qwen25_vl_7b" and back.rl.temperature == 0.7
  assert back.eval.reward == config.eval.reward
  assert notes == [
    "eval.reward: not in the saved config, default ''",
    "rl.gone_setting: saved, but no longer a setting; dropped",
  ]
  Settings.of(back)  # whole and typed (lists read back as tuples)
  assert config_args.differences(str(path), config) == [
    "eval.reward: '(none)' -> ''",
    "rl.gone_setting: 1 -> '(none)'",
    "rl.temperature: 0.7 -> 1.0",
  ]


def test_a_bad_command_line_is_one_line_naming_the_cause():
  vlm = os.path.join(ROOT, "configs", "vlm.py")
  check = lambda *args: config_args.check_command_line(["train", *args], vlm)
  assert check() is None and check(f"--config={vlm}:qwen25_vl_7b,smoke") is None
  assert "unknown variant" in check("--config", f"{vlm}:qwen7b")  # absl's spaced form
  assert check("--config.rl.temperature=0.5", "--config.rl.reward.weights=(1.0,)") is None
  assert "unknown variant 'qwen7b'; variants: tiny_base, tiny," in check(f"--config={vlm}:qwen7b")
  assert "modifiers: smoke, fleet" in check(f"--config={vlm}:smoke,turbo")
  assert check("--config.rl.temprature=0.5") == (
    "--config.rl.temprature: no such setting in vlm.py; did you mean --config.rl.temperature?"
  )
  nope = "--config=configs/nope.py"
  assert check(nope) == f"{nope}: no config file configs/nope.py"
  assert "variants: tiny_base, tiny, qwen25_vl_3b" in config_args.describe(vlm)
  out = subprocess.run(
    [sys.executable, "-m", "fluxjax.train", f"--config={vlm}", "--config.rl.nope=1"],
    capture_output=True,
    text=True,
    cwd=ROOT,
    timeout=120,
  )
  assert out.returncode == 1
  assert out.stderr.strip().splitlines() == [
    "fluxjax.train: --config.rl.nope: no such setting in vlm.py"
  ]


def test_print_config_shows_the_resolved_config_with_its_overrides_and_exits(tmp_path):
  """What the run would use, overrides applied, and nothing started: no
  work directory appears."""
  vlm = os.path.join(ROOT, "configs", "vlm.py")
  workdir = tmp_path / "never"
  out = subprocess.run(
    [sys.executable, "-m", "fluxjax.train", f"--config={vlm}:tiny,smoke", "--print_config",
     "--config.rl.temperature=0.7", f"--workdir={workdir}"],
    capture_output=True, text=True, cwd=ROOT, timeout=120,
  )  # fmt: skip
  assert out.returncode == 0, out.stderr
  # ConfigDict's own YAML; its tuples carry a Python tag.
  printed = ml_collections.ConfigDict(yaml.load(out.stdout, Loader=yaml.UnsafeLoader))
  want = config_args.load_config(vlm, "tiny,smoke")
  want.rl.temperature = 0.7
  assert printed.rl.temperature == 0.7 and printed.total_steps == want.total_steps
  assert printed.model.preset == want.model.preset and printed.data.mix == want.data.mix
  assert not workdir.exists()


def test_vision_limits_come_from_the_checkpoint_or_the_run_refuses(tmp_path):
  """0 takes the checkpoint's preprocessor config (what SGLang reads); a set
  value it contradicts names both; a folder writes what it reads back."""
  from fluxjax.models import processor

  v = settings_lib.Vision(0, 0, 0, 0, 0)
  defaults = processor.VisionProcessorConfig()
  assert loop.vision_settings(v, "") == settings_lib.Vision(
    defaults.image_min_pixels,
    defaults.image_max_pixels,
    defaults.video_min_pixels,
    defaults.video_max_pixels,
    defaults.video_max_frames,
  )
  (tmp_path / "preprocessor_config.json").write_text(
    json.dumps({"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14})
  )
  got = loop.vision_settings(v, str(tmp_path))
  assert (got.image_min_pixels, got.image_max_pixels) == (3136, 12845056)
  assert got.video_max_pixels == defaults.video_max_pixels  # no video file: the default
  same = dataclasses.replace(v, image_max_pixels=12845056)
  assert loop.vision_settings(same, str(tmp_path)).image_max_pixels == 12845056
  with pytest.raises(ValueError, match=r"image_max_pixels=1003520, but .* says 12845056"):
    loop.vision_settings(dataclasses.replace(v, image_max_pixels=1003520), str(tmp_path))
  # transformers' newer layout, and what our exports write.
  (tmp_path / "preprocessor_config.json").write_text(
    json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 1000000}})
  )
  assert loop.vision_settings(v, str(tmp_path)).image_max_pixels == 1000000
  small = processor.VisionProcessorConfig(image_max_pixels=12544, video_max_frames=16)
  for name, d in small.hf_files().items():
    (tmp_path / name).write_text(json.dumps(d))
  back = processor.VisionProcessorConfig.read_hf_files(str(tmp_path))
  assert back["image_max_pixels"] == 12544 and back["video_max_frames"] == 16
  # The GPU variants take the checkpoint's; tiny sets its own small ones.
  assert Settings.of(config_args.load_config(arg="qwen25_vl_7b")).data.vision == v
  assert Settings.of(config_args.load_config(arg="tiny")).data.vision.image_max_pixels == 112 * 112


def test_the_default_job_post_trains_the_committed_base():
  """`python -m fluxjax.train --config=configs/vlm.py` starts RL from the
  committed base, through model.hf_path as a user's checkpoint, with no
  warm-up and KL to that base; `tiny` keeps the scratch job."""
  c = config_args.load_config()
  assert c.variant == "tiny_base" and c.model.hf_path == config_args.TINY_BASE
  assert os.path.exists(os.path.join(c.model.hf_path, "model.safetensors"))
  assert not c.sft.enabled and c.rl.kl_coef > 0 and not c.rl.ref_hf_path
  scratch = config_args.load_config(arg="tiny")
  assert not scratch.model.hf_path and scratch.sft.enabled
