"""Checks that the top-level Bazel BUILD file covers the source tree.

BUILD is Starlark, whose syntax is a subset of Python's, so it is read with
`ast` and its calls evaluated by a tiny interpreter that knows only literals,
list concatenation and `requirement("name")`. `check_build(root)` returns one
line per problem; it is tested on the repository and, with files added or
removed, on copies of it in `tmp_path`.
"""

import ast
import dataclasses
import os
import pathlib
import re
import shutil
import tomllib

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]

# Directories whose every module must be in a py_library or py_binary.
PACKAGES = ("tff_ens", "tasks", "export")
RULES = ("py_library", "py_binary", "py_test")
# Top-level calls that declare no target.
OTHER_CALLS = ("load", "package")
# What `check_build` never walks into (besides dot directories).
_SKIPPED_DIRS = ("__pycache__", "node_modules")
_MAIN_BLOCK = re.compile(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class Requirement:
  """A `requirement("name")` third-party dependency."""

  package: str


@dataclasses.dataclass(frozen=True)
class Target:
  rule: str
  name: str
  attrs: dict
  line: int

  def files(self, attr: str) -> list[str]:
    """The file paths (not labels) in a label-list attribute."""
    return [
      v
      for v in self.attrs.get(attr, ())
      if isinstance(v, str) and not v.startswith((":", "//", "@"))
    ]

  def labels(self, attr: str) -> list[str]:
    return [v for v in self.attrs.get(attr, ()) if isinstance(v, str) and v.startswith((":", "//"))]


class BuildError(ValueError):
  """BUILD uses something this checker cannot evaluate."""


def _evaluate(node: ast.expr):
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.List):
    return [_evaluate(e) for e in node.elts]
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
    return _evaluate(node.left) + _evaluate(node.right)
  if (
    isinstance(node, ast.Call)
    and isinstance(node.func, ast.Name)
    and node.func.id == "requirement"
    and len(node.args) == 1
    and not node.keywords
    and isinstance(node.args[0], ast.Constant)
  ):
    return Requirement(node.args[0].value)
  raise BuildError(
    f"line {node.lineno}: cannot evaluate {ast.unparse(node)!r}: list files "
    "and labels literally (no glob) so that this check can read them"
  )


def parse_build(path: pathlib.Path) -> list[Target]:
  """The py_* targets of a BUILD file; BuildError on anything unexpected."""
  tree = ast.parse(path.read_text(), filename=str(path))
  targets = []
  for statement in tree.body:
    if not (
      isinstance(statement, ast.Expr)
      and isinstance(statement.value, ast.Call)
      and isinstance(statement.value.func, ast.Name)
    ):
      raise BuildError(
        f"line {statement.lineno}: expected a rule call, got {ast.unparse(statement)[:60]!r}"
      )
    call = statement.value
    rule = call.func.id
    if rule in OTHER_CALLS:
      continue
    if rule not in RULES:
      raise BuildError(f"line {call.lineno}: unknown rule {rule!r}")
    if call.args:
      raise BuildError(f"line {call.lineno}: {rule} takes keyword arguments")
    attrs = {k.arg: _evaluate(k.value) for k in call.keywords}
    if not isinstance(attrs.get("name"), str):
      raise BuildError(f"line {call.lineno}: {rule} without a name")
    targets.append(Target(rule, attrs["name"], attrs, call.lineno))
  return targets


def _python_files(root: pathlib.Path):
  """Relative paths of the .py files under `root`, skipping dot directories."""
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(
      d
      for d in dirnames
      if not d.startswith(".")
      and d not in _SKIPPED_DIRS
      and not d.endswith(".egg-info")
      and not d.startswith("bazel-")
    )
    for filename in sorted(filenames):
      if filename.endswith(".py"):
        yield (pathlib.Path(dirpath) / filename).relative_to(root).as_posix()


def _normalized(package: str) -> str:
  return re.sub(r"[-_.]+", "-", package).lower()


def _locked_packages(root: pathlib.Path) -> set[str] | None:
  lock = root / "uv.lock"
  if not lock.exists():
    return None
  with open(lock, "rb") as f:
    return {_normalized(p["name"]) for p in tomllib.load(f).get("package", ())}


def check_build(root: pathlib.Path) -> list[str]:
  """Problems of `root`/BUILD against the tree at `root`, one line each."""
  root = pathlib.Path(root)
  try:
    targets = parse_build(root / "BUILD")
  except (OSError, SyntaxError, BuildError) as e:
    return [f"BUILD: {e}"]
  problems = []
  by_name = {}
  for t in targets:
    if t.name in by_name:
      problems.append(
        f"BUILD:{t.line}: target name {t.name!r} is already used at line {by_name[t.name].line}"
      )
    by_name.setdefault(t.name, t)

  locked = _locked_packages(root)
  for t in targets:
    where = f"BUILD:{t.line}: {t.rule} {t.name!r}"
    for attr in ("srcs", "data"):
      for f in t.files(attr):
        if not (root / f).is_file():
          problems.append(f"{where} lists {f}, which does not exist")
    main = t.attrs.get("main")
    if main is not None and main not in t.files("srcs"):
      problems.append(f"{where}: main {main} is not in its srcs")
    for attr in ("deps", "data"):
      for label in t.labels(attr):
        if label.split(":")[-1] not in by_name:
          problems.append(f"{where}: {attr} {label} is not a target of BUILD")
    for dep in t.attrs.get("deps", ()):
      if (
        isinstance(dep, Requirement)
        and locked is not None
        and _normalized(dep.package) not in locked
      ):
        problems.append(f"{where}: requirement({dep.package!r}) is not a package of uv.lock")

  in_lib_or_bin = {f for t in targets if t.rule != "py_test" for f in t.files("srcs")}
  in_any = {f for t in targets for f in t.files("srcs")}
  binaries = {f for t in targets if t.rule == "py_binary" for f in t.files("srcs")}
  tests = {t.name: t for t in targets if t.rule == "py_test"}
  for path in _python_files(root):
    top = path.split("/")[0]
    if top in PACKAGES and path not in in_lib_or_bin:
      problems.append(f"{path}: not in the srcs of a py_library or py_binary")
    elif top == "tests":
      stem = pathlib.PurePosixPath(path).stem
      if "/" not in path[len("tests/") :] and stem.startswith("test_"):
        if stem not in tests or path not in tests[stem].files("srcs"):
          problems.append(f"{path}: no py_test named {stem!r} with it in srcs")
      elif path not in in_any:
        problems.append(f"{path}: not in the srcs of any target")
    if (
      top != "tests"
      and path not in binaries
      and _MAIN_BLOCK.search((root / path).read_text(errors="replace"))
    ):
      problems.append(f"{path}: has a __main__ block but no py_binary")
  return problems


def test_repository_build_covers_the_tree():
  problems = check_build(REPO_ROOT)
  assert not problems, "BUILD is out of date:\n" + "\n".join(problems)


# The checker itself, on copies of the tree ------------------------------------


@pytest.fixture
def tree(tmp_path):
  """A copy of BUILD, uv.lock, the docs and the repository's .py files in tmp_path."""
  root = tmp_path / "repo"
  root.mkdir()
  for name in ("BUILD", "uv.lock", "README.md"):
    shutil.copy(REPO_ROOT / name, root / name)
  shutil.copytree(REPO_ROOT / "docs", root / "docs")
  for path in _python_files(REPO_ROOT):
    (root / path).parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO_ROOT / path, root / path)
  return root


def _new_problems(root, change):
  """Problems that `change(root)` adds (the copy may have some already)."""
  before = set(check_build(root))
  change(root)
  return sorted(set(check_build(root)) - before)


def _append_to_build(root, text):
  with open(root / "BUILD", "a") as f:
    f.write("\n" + text)


def test_copy_of_tree_checks_like_the_repository(tree):
  assert check_build(tree) == check_build(REPO_ROOT)


@pytest.mark.parametrize(
  "path", [f"{p}/new_module.py" for p in PACKAGES] + ["tff_ens/sub/__init__.py"]
)
def test_new_module_without_build_entry_fails(tree, path):
  def add(root):
    (root / path).parent.mkdir(exist_ok=True)
    (root / path).write_text('"""New."""\n')

  problems = _new_problems(tree, add)
  assert problems and all(path in p for p in problems), problems


def test_new_module_with_build_entry_passes(tree):
  def add(root):
    (root / "tff_ens/new_module.py").write_text('"""New."""\n')
    _append_to_build(
      root, 'py_library(name = "new_module", srcs = ["tff_ens/new_module.py"], deps = [":tasks"])\n'
    )

  assert _new_problems(tree, add) == []


def test_new_test_without_py_test_fails(tree):
  def add(root):
    (root / "tests/test_new.py").write_text("def test_x():\n  pass\n")

  problems = _new_problems(tree, add)
  assert problems == ["tests/test_new.py: no py_test named 'test_new' with it in srcs"]


def test_new_test_with_py_test_passes(tree):
  def add(root):
    (root / "tests/test_new.py").write_text("def test_x():\n  pass\n")
    _append_to_build(
      root, 'py_test(name = "test_new", srcs = ["tests/test_new.py"], deps = [":tff_ens"])\n'
    )

  assert _new_problems(tree, add) == []


def test_py_test_named_unlike_its_file_fails(tree):
  def add(root):
    (root / "tests/test_new.py").write_text("def test_x():\n  pass\n")
    _append_to_build(root, 'py_test(name = "new", srcs = ["tests/test_new.py"])')

  assert _new_problems(tree, add) == [
    "tests/test_new.py: no py_test named 'test_new' with it in srcs"
  ]


def test_test_helper_outside_any_target_fails(tree):
  def add(root):
    (root / "tests/helpers.py").write_text('"""Helpers."""\n')

  assert _new_problems(tree, add) == ["tests/helpers.py: not in the srcs of any target"]


def test_script_with_main_block_needs_a_py_binary(tree):
  def add(root):
    (root / "benchmarks").mkdir(exist_ok=True)
    (root / "benchmarks/new_script.py").write_text('if __name__ == "__main__":\n  print(1)\n')

  assert _new_problems(tree, add) == [
    "benchmarks/new_script.py: has a __main__ block but no py_binary"
  ]


def test_listed_file_that_does_not_exist_fails(tree):
  problems = _new_problems(tree, lambda r: (r / "tasks/resnet.py").unlink())
  assert len(problems) == 1 and "lists tasks/resnet.py, which does not exist" in problems[0], (
    problems
  )


def test_duplicate_target_name_fails(tree):
  problems = _new_problems(
    tree, lambda r: _append_to_build(r, 'py_library(name = "tasks", srcs = [])')
  )
  assert len(problems) == 1 and "target name 'tasks' is already used" in problems[0], problems


def test_unknown_local_dep_and_unlocked_requirement_fail(tree):
  problems = _new_problems(
    tree,
    lambda r: _append_to_build(
      r, 'py_library(name = "extra", srcs = [], deps = [":nope", requirement("tensorflw")])'
    ),
  )
  assert len(problems) == 2, problems
  assert "deps :nope is not a target of BUILD" in problems[0]
  assert "requirement('tensorflw') is not a package of uv.lock" in problems[1]


def test_glob_is_reported_not_evaluated(tree):
  _append_to_build(tree, 'py_library(name = "g", srcs = glob(["*.py"]))')
  [problem] = check_build(tree)
  assert "cannot evaluate" in problem and "glob" in problem
