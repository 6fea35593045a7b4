"""The packages import along their layers (docs/layout.md): no package imports one above it,
so `tff_ens`'s layers, `tasks` and `export` form no import cycle."""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Each package and the first-party packages it may import (besides itself).
FOUNDATIONS = ("tff_ens",)
ALLOWED = {
  "tff_ens": (),
  "tasks": FOUNDATIONS,
  "tff_ens.math": FOUNDATIONS,
  "tff_ens.server": (*FOUNDATIONS, "tasks", "tff_ens.math"),
  "tff_ens.execution": FOUNDATIONS,
  "export": (*FOUNDATIONS, "tasks", "tff_ens.math", "tff_ens.execution"),
  "tff_ens.templates": (
    *FOUNDATIONS,
    "tasks",
    "tff_ens.math",
    "tff_ens.server",
    "tff_ens.execution",
  ),
  "tff_ens.algorithms": (
    *FOUNDATIONS,
    "tasks",
    "tff_ens.math",
    "tff_ens.server",
    "tff_ens.execution",
    "tff_ens.templates",
  ),
  "tff_ens.program": (
    *FOUNDATIONS,
    "tasks",
    "export",
    "tff_ens.math",
    "tff_ens.server",
    "tff_ens.execution",
    "tff_ens.templates",
    "tff_ens.algorithms",
  ),
}
# The command lines sit above every layer.
ENTRY_POINTS = (
  "tff_ens/main.py",
  "tff_ens/worker.py",
  "tff_ens/credentials.py",
  "tff_ens/compare.py",
)


def _package_of(module: str) -> str | None:
  """The layer of a first-party module name, or None for a third-party one."""
  parts = module.split(".")
  if parts[0] in ("tasks", "export"):
    return parts[0]
  if parts[0] != "tff_ens":
    return None
  if len(parts) > 1 and (ROOT / "tff_ens" / parts[1] / "__init__.py").exists():
    return f"tff_ens.{parts[1]}"
  return "tff_ens"


def _imports(path: pathlib.Path) -> set[str]:
  names = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      names.add(node.module)
      # `from tff_ens import math` imports the package `tff_ens.math`.
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  return names


def _modules():
  for package in ALLOWED:
    directory = ROOT / package.replace(".", "/")
    for path in sorted(directory.glob("*.py")):
      if str(path.relative_to(ROOT)) not in ENTRY_POINTS:
        yield package, path


def test_every_package_has_a_layer():
  packages = {"tasks", "export", "tff_ens"}
  packages |= {f"tff_ens.{p.parent.name}" for p in ROOT.glob("tff_ens/*/__init__.py")}
  assert packages == set(ALLOWED)


@pytest.mark.parametrize("package,path", list(_modules()), ids=lambda v: str(v)[-40:])
def test_a_module_imports_only_its_layer_and_those_below(package, path):
  above = {
    f"{name} ({_package_of(name)})"
    for name in _imports(path)
    if _package_of(name) not in (None, package, *ALLOWED[package])
  }
  assert not above, f"{path.relative_to(ROOT)} imports {sorted(above)}"


def _own_flags() -> dict[str, str]:
  """{flag: algorithm} of the flags that one algorithm alone reads."""
  from tff_ens import algorithms
  from tff_ens import settings

  owners = {}
  for spec in algorithms.REGISTRY.values():
    for group in spec.settings:
      readers = [n for n, s in algorithms.REGISTRY.items() if group in s.settings]
      if readers == [spec.name]:
        owners.update(dict.fromkeys(settings.flags_of(group), spec.name))
  return owners


# What the program, the command lines and the export are: they call an algorithm's hooks and
# never name one (docs/library.md).
PROGRAM_FILES = sorted(
  [*(ROOT / "tff_ens" / "program").glob("*.py"), *(ROOT / "export").rglob("*.py")]
  + [ROOT / path for path in ENTRY_POINTS]
)


def _code_names(path: pathlib.Path) -> set[str]:
  """The attribute names and string constants (docstrings apart) of a module's code."""
  tree = ast.parse(path.read_text())
  docstrings = {
    id(node.body[0].value)
    for node in ast.walk(tree)
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
    and node.body
    and isinstance(node.body[0], ast.Expr)
    and isinstance(node.body[0].value, ast.Constant)
  }
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute):
      names.add(node.attr)
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
      if id(node) not in docstrings:
        names.update(re.findall(r"[a-z][a-z0-9_]*", node.value))
  return names


def test_the_program_names_no_algorithm_nor_a_flag_only_one_reads():
  from tff_ens import algorithms

  own = _own_flags()
  assert {"ditto_lambda_choice", "prototypes"} <= set(own)
  named = {
    str(path.relative_to(ROOT)): sorted(
      (_code_names(path) & (set(algorithms.REGISTRY) | set(own))) - {algorithms.ALGORITHMS[0]}
    )
    for path in PROGRAM_FILES
  }
  assert {path: names for path, names in named.items() if names} == {}


LIBRARY_FILES = sorted(
  path
  for package in ("tff_ens", "tasks", "export")
  for path in (ROOT / package).rglob("*.py")
  if "node_modules" not in path.parts
)


def test_no_module_is_over_500_lines_nor_a_function_over_80():
  long_modules, long_functions = {}, {}
  for path in LIBRARY_FILES:
    text = path.read_text()
    name = str(path.relative_to(ROOT))
    if text.count("\n") > 500:
      long_modules[name] = text.count("\n")
    for node in ast.walk(ast.parse(text)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        lines = node.end_lineno - node.lineno + 1
        if lines > 80:
          long_functions[f"{name}:{node.name}"] = lines
  assert (long_modules, long_functions) == ({}, {})


_WITHOUT_DITTO = """
import sys
from absl import flags
from tff_ens import algorithms, main  # noqa: F401  (main defines the flags)
from tff_ens.program import experiment
assert algorithms.__file__.startswith(sys.argv[1]), algorithms.__file__
assert "ditto" not in algorithms.REGISTRY
assert not [f for f in flags.FLAGS if f.startswith("ditto")]
for name in algorithms.ALGORITHMS:
  experiment.resolve(experiment.ExperimentConfig(algorithm=name, data_dir=sys.argv[2]))
print(" ".join(algorithms.ALGORITHMS))
"""


def test_an_algorithm_removed_with_its_registry_lines_leaves_the_program_whole(tmp_path):
  """Ditto's module and its two registry lines deleted from a copy of the packages: the
  command line still imports, defines every other flag and resolves every other algorithm."""
  import shutil

  from tests import femnist_runs

  for package in ("tff_ens", "tasks", "export"):
    shutil.copytree(
      ROOT / package,
      tmp_path / package,
      ignore=shutil.ignore_patterns("node_modules", "__pycache__", "*.tflite"),
    )
  (tmp_path / "tff_ens/algorithms/ditto.py").unlink()
  registry = tmp_path / "tff_ens/algorithms/__init__.py"
  lines = registry.read_text().splitlines(keepends=True)
  kept = [line for line in lines if "ditto" not in line]
  assert len(lines) - len(kept) == 2, "the registry names Ditto in other than two lines"
  registry.write_text("".join(kept))
  run = subprocess.run(
    [sys.executable, "-c", _WITHOUT_DITTO, str(tmp_path), femnist_runs.DATA_DIR],
    cwd=tmp_path,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stderr[-3000:]
  from tff_ens import algorithms

  assert run.stdout.split() == [a for a in algorithms.ALGORITHMS if a != "ditto"]
