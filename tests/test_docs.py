"""docs/design.md names what exists: every file, class and `module.name` it
puts in backticks is in the tree, so the design cannot drift from the code
unnoticed."""

import ast
import builtins
import importlib.util
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "design.md")
SOURCES = ("fluxjax", "tests", "bench", "configs")


def _python_files():
  for top in SOURCES:
    for folder, _, names in os.walk(os.path.join(ROOT, top)):
      for name in names:
        if name.endswith(".py"):
          yield os.path.relpath(os.path.join(folder, name), ROOT)


def _symbols() -> set[str]:
  """Top-level names of every fluxjax module, bare and as `module.name`, and
  each class's members as `Class.member` (and `module.Class.member`)."""
  names: set[str] = set()
  for path in _python_files():
    if not path.startswith("fluxjax"):
      continue
    module = os.path.splitext(os.path.basename(path))[0]
    if module == "__init__":
      module = os.path.basename(os.path.dirname(path))
    names.add(module)
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in tree.body:
      for name in _defined(node):
        names.update({name, f"{module}.{name}"})
      if isinstance(node, ast.ClassDef):
        for member in node.body:
          for name in _defined(member):
            names.update({f"{node.name}.{name}", f"{module}.{node.name}.{name}"})
          if isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
            names.add(f"{node.name}.{member.target.id}")
  return names


def _defined(node) -> list[str]:
  if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
    return [node.name]
  if isinstance(node, ast.Assign):
    return [t.id for t in node.targets if isinstance(t, ast.Name)]
  if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
    return [node.target.id]
  return []


def _quoted() -> list[str]:
  with open(DOC, encoding="utf-8") as f:
    return re.findall(r"`([^`\n]+)`", f.read())


def test_every_file_the_design_names_exists():
  files = list(_python_files())
  folders = {os.path.relpath(f, ROOT) for f, _, _ in os.walk(ROOT) if ".git" not in f}
  missing = []
  for token in _quoted():
    if re.fullmatch(r"[\w/.-]+\.py", token):
      known = files
    elif re.fullmatch(r"[\w/-]+/", token) and token not in RUN_FOLDERS:
      known, token = folders, token.rstrip("/")
    else:
      continue
    if not any(p == token or p.endswith("/" + token) for p in known):
      missing.append(token)
  assert not missing, f"docs/design.md names files that do not exist: {sorted(set(missing))}"


# The design's names for instances: `coord.step()` is `Coordinator.step`.
INSTANCES = {
  "coord": "Coordinator",
  "report": "PublishReport",
  "producer": "Producer",
  "admission": "AdmissionController",
  "plan": "Plan",
  "request": "GenerateRequest",
  "backend": "RolloutBackend",
}


FILE_SUFFIXES = {"py", "json", "jsonl", "md"}
# Names the design takes from other libraries by their short names.
ELSEWHERE = {"ExitStack", "FieldReference", "config_flags.DEFINE_config_file"}
# Config fields the design names as refused.
REFUSED_FIELDS = {"sharding.p_max"}
# Folders a run writes, which the design describes.
RUN_FOLDERS = {"delta/"}


def _config_fields() -> set[str]:
  from fluxjax import config_args  # pylint: disable=import-outside-toplevel

  def walk(d, prefix):
    for k, v in d.items():
      yield prefix + k
      if isinstance(v, dict):
        yield from walk(v, prefix + k + ".")

  return set(walk(config_args.load_config(arg="tiny").to_dict(), ""))


def _elsewhere(name: str) -> bool:
  """A builtin, or a name of a module outside fluxjax (functools.partial)."""
  head = name.split(".")[0]
  if hasattr(builtins, head):
    return True
  try:
    return importlib.util.find_spec(head) is not None and head != "fluxjax"
  except (ImportError, ValueError):
    return False


def test_every_class_method_and_config_field_the_design_names_exists():
  """A CapitalizedName, a `module.name` or `Class.member` (an instance's
  `coord.step()` as `Coordinator.step`; call arguments dropped) is defined
  in fluxjax/, and a `section.field` is a field of configs/vlm.py."""
  symbols, fields = _symbols(), _config_fields()
  missing = []
  for token in _quoted():
    name = re.sub(r"\(.*\)$", "", token)
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name) or name.isupper():
      continue  # code, paths, metrics, constants
    if name.rsplit(".", 1)[-1] in FILE_SUFFIXES or name in ELSEWHERE or name in REFUSED_FIELDS:
      continue
    if name.startswith("fluxjax."):
      if importlib.util.find_spec(name) is None:
        missing.append(token)
      continue
    head, *rest = name.split(".")
    if rest and head in INSTANCES:
      name = ".".join([INSTANCES[head], rest[0]])
    if (
      name in symbols
      or _elsewhere(name)
      or any(f == name or f.endswith("." + name) for f in fields)
    ):
      continue
    if "." in name or name[0].isupper():
      missing.append(token)
  assert not missing, f"docs/design.md names what does not exist: {sorted(set(missing))}"
