"""The package layering: imports only go down, and no module imports itself back;
and every function short enough to read at once (MAX_FUNCTION_LINES).

  train, plot, logs, config   entry points
  rl                          the loop, coordinator, algorithms, checkpoints, metrics
  data | rollout              peers: neither imports the other
  parallel                    batch packing, strategies, Ulysses, sync, the train step
  models                      the Qwen2.5-VL family
  sharding | planning          peers: mesh, axes, rules (JAX) | plans, planners, cost model (numpy)
  faults | settings | provenance  the fault policy; the run's typed config sections;
                              which code ran

Every import counts: module level or inside a function, `import x`,
`from x import y` and relative forms, and `importlib.import_module("...")`
with a literal name.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fluxjax"

# (layer rank, group): a module may import a lower rank, or its own group.
LAYERS = {
  "fluxjax": (6, "entry"),
  "fluxjax.train": (6, "entry"),
  "fluxjax.launch": (6, "entry"),
  "fluxjax.plot": (6, "entry"),
  "fluxjax.config_args": (6, "entry"),
  "fluxjax.export": (6, "entry"),
  "fluxjax.install_check": (6, "entry"),
  "fluxjax.logs": (6, "entry"),
  "fluxjax.rl": (5, "rl"),
  "fluxjax.data": (4, "data"),
  "fluxjax.rollout": (4, "rollout"),
  "fluxjax.parallel": (3, "parallel"),
  "fluxjax.models": (2, "models"),
  "fluxjax.sharding": (1, "sharding"),
  "fluxjax.planning": (1, "planning"),
  "fluxjax.faults": (0, "base"),
  "fluxjax.settings": (0, "base"),
  "fluxjax.provenance": (0, "base"),
}


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(name: str) -> str:
  """The fluxjax module a dotted name refers to (a symbol resolves to its module)."""
  while name:
    rel = pathlib.Path(*name.split("."))
    if (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists():
      return name
    name = name.rpartition(".")[0]
  raise AssertionError("unreachable: every name starts with fluxjax")


def _imports(path: pathlib.Path) -> set[str]:
  """Every fluxjax module `path` imports, anywhere in the file."""
  mod = _module_name(path)
  package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
  found: set[str] = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    names: list[str] = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
      if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        module = ".".join(base + ([node.module] if node.module else []))
      else:
        module = node.module or ""
      names = [f"{module}.{a.name}" for a in node.names]
    elif (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Attribute)
      and node.func.attr == "import_module"
      and node.args
      and isinstance(node.args[0], ast.Constant)
      and isinstance(node.args[0].value, str)
    ):
      names = [node.args[0].value]
    found.update(_resolve(n) for n in names if n == "fluxjax" or n.startswith("fluxjax."))
  found.discard(mod)
  return found


def _layer(module: str) -> tuple[int, str]:
  while module not in LAYERS:
    module = module.rpartition(".")[0]
  return LAYERS[module]


def _graph() -> dict[str, set[str]]:
  return {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_has_a_layer():
  graph = _graph()
  assert len(graph) > 50  # the walk found the package
  top = {m.split(".")[1] for m in graph if m.count(".") >= 1}
  unplaced = sorted(f"fluxjax.{t}" for t in top if f"fluxjax.{t}" not in LAYERS)
  assert not unplaced, f"place these in LAYERS: {unplaced}"


def test_imports_only_go_down():
  back = []
  for mod, deps in _graph().items():
    rank, group = _layer(mod)
    for dep in sorted(deps):
      dep_rank, dep_group = _layer(dep)
      if dep == "fluxjax" or (dep_group != group and dep_rank >= rank):
        back.append(f"{mod} -> {dep}")
  assert not back, "imports against the layering:\n" + "\n".join(back)


MAX_FUNCTION_LINES = 120


def test_no_function_is_longer_than_the_limit():
  long = []
  for path in sorted(PACKAGE.rglob("*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
          long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines} lines")
  assert not long, f"functions over {MAX_FUNCTION_LINES} lines, split them:\n" + "\n".join(long)


def test_no_import_cycles():
  graph = _graph()
  state: dict[str, int] = {}  # 1 on the stack, 2 done
  cycles = []

  def visit(mod, stack):
    state[mod] = 1
    stack.append(mod)
    for dep in sorted(graph.get(mod, ())):
      if state.get(dep) == 1:
        cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
      elif dep not in state:
        visit(dep, stack)
    stack.pop()
    state[mod] = 2

  for mod in sorted(graph):
    if mod not in state:
      visit(mod, [])
  assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize(
  "source, expected",
  [
    ("from fluxjax.parallel import train_step\n", {"fluxjax.parallel.train_step"}),
    ("def f():\n  from fluxjax.rl import loop\n", {"fluxjax.rl.loop"}),
    ("from ..rl.loop import run\n", {"fluxjax.rl.loop"}),
    ("import importlib\nimportlib.import_module('fluxjax.rl.sft')\n", {"fluxjax.rl.sft"}),
    ("import fluxjax.models.vlm as v\n", {"fluxjax.models.vlm"}),
  ],
)
def test_the_walk_sees_every_form_of_import(tmp_path, monkeypatch, source, expected):
  """The checker itself: a back-arrow written any of these ways is found."""
  fake = tmp_path / "fluxjax" / "sharding"
  fake.mkdir(parents=True)
  for rel in ("rl/loop.py", "rl/sft.py", "parallel/train_step.py", "models/vlm.py"):
    (tmp_path / "fluxjax" / rel).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "fluxjax" / rel).write_text("")
  (fake / "probe.py").write_text(source)
  monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
  assert _imports(fake / "probe.py") == expected


def test_torch_is_imported_only_for_a_distributed_weight_update():
  """The default install is torch-free: the trainer, the server, the fleet and
  the publish path load without torch; only a weight update group imports it
  (rollout/weight_group.py, the `weight-sync` extra)."""
  code = (
    "import sys\n"
    "import fluxjax.train, fluxjax.launch, fluxjax.rollout.server\n"
    "from fluxjax.rl import loop\n"
    "from fluxjax.rollout import fleet, publish, router, weight_group\n"
    "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.strip() == "[]", out.stdout[:300]
