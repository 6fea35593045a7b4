"""Every project module, and the fragile third-party import chains, import.

The project's modules are imported one per test case (in this process;
`tff_ens.main` defines its absl flags once). The third-party packages are
imported together in one fresh interpreter, so that nothing this process
already imported can hide a broken chain, and their versions are checked
against the lock: TFF 0.87 needs NumPy 1.25; a newer tensorflow-datasets or
pyarrow would pull NumPy 2 and break tensorflow_privacy's import chain, and a
newer tensorflow-metadata needs protobuf 5, which TF 2.14 cannot import.
"""

import importlib
import json
import os
import pathlib
import pkgutil
import subprocess
import sys
import textwrap

import pytest

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("tff_ens", "tasks", "export")


def project_modules() -> list[str]:
  """Every package and module under PACKAGES, found on disk (no imports)."""
  modules = []
  for package in PACKAGES:
    modules.append(package)
    for info in pkgutil.walk_packages([str(REPO_ROOT / package)], prefix=f"{package}."):
      modules.append(info.name)
  return sorted(modules)


def test_project_modules_are_found():
  modules = project_modules()
  assert {"tff_ens.main", "tff_ens.program.training", "tasks.femnist"} <= set(modules)


@pytest.mark.parametrize("name", project_modules())
def test_project_module_imports(name):
  module = importlib.import_module(name)
  assert pathlib.Path(module.__file__).resolve().is_relative_to(REPO_ROOT)


# Import name -> (distribution, version prefix). The prefixes are the locked
# versions (uv.lock).
THIRD_PARTY = {
  "numpy": ("numpy", "1.25."),
  "tensorflow": ("tensorflow", "2.14."),
  "tensorflow_federated": ("tensorflow-federated", "0.87."),
  "tensorflow_privacy": ("tensorflow-privacy", "0.9."),
  "tensorflow_model_optimization": ("tensorflow-model-optimization", "0.7."),
  "larq": ("larq", "0.13."),
  "larq_compute_engine": ("larq-compute-engine", "0.13."),
  "tflite_runtime.interpreter": ("tflite-runtime", "2.14."),
  "jax": ("jax", "0.4."),
  "dp_accounting": ("dp-accounting", "0.4."),
  "tensorflow_datasets": ("tensorflow-datasets", "4.9."),
  # Its protos: the protobuf they need must be one TF 2.14 imports too.
  "tensorflow_metadata.proto.v0.schema_pb2": ("tensorflow-metadata", "1.16."),
  "matplotlib.pyplot": ("matplotlib", "3.11."),
  # What `uv run tensorboard` imports: it needs pkg_resources, gone from setuptools 82.
  "tensorboard.default": ("tensorboard", "2.14."),
}

_IMPORT_ALL = textwrap.dedent("""
    import importlib, importlib.metadata, json, sys
    result = {}
    for name, distribution in json.loads(sys.argv[1]).items():
      try:
        module = importlib.import_module(name)
      except Exception as e:  # Report every broken chain, not the first.
        result[name] = {"error": f"{type(e).__name__}: {e}"}
        continue
      top = sys.modules[name.split(".")[0]]
      result[name] = {
          "distribution_version": importlib.metadata.version(distribution),
          "module_version": getattr(top, "__version__", None),
          "file": getattr(module, "__file__", None),
      }
    print("RESULT " + json.dumps(result))
""")


@pytest.fixture(scope="module")
def third_party_imports() -> dict:
  """{import name: versions or error}, from one fresh interpreter."""
  argument = json.dumps({k: d for k, (d, _) in THIRD_PARTY.items()})
  run = subprocess.run(
    [sys.executable, "-c", _IMPORT_ALL, argument],
    capture_output=True,
    text=True,
    timeout=300,
    cwd=REPO_ROOT,
    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MPLBACKEND": "Agg"},
  )
  lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
  assert run.returncode == 0 and lines, (
    f"the import subprocess failed ({run.returncode}):\n{run.stderr[-3000:]}"
  )
  return json.loads(lines[-1][len("RESULT ") :])


# The module's fixture imports every package in a fresh interpreter: 155 s once on a loaded
# machine (tests/watchdog.py).
@pytest.mark.timeout_seconds(600)
@pytest.mark.parametrize("name", sorted(THIRD_PARTY))
def test_third_party_imports(third_party_imports, name):
  result = third_party_imports[name]
  assert "error" not in result, f"import {name}: {result.get('error')}"
  distribution, prefix = THIRD_PARTY[name]
  version = result["distribution_version"]
  assert version.startswith(prefix), (
    f"{distribution} {version} is installed, the lock has {prefix}*"
  )
  if result["module_version"] is not None:
    assert result["module_version"] == version


@pytest.mark.timeout_seconds(600)
def test_numpy_is_1_25(third_party_imports):
  # TFF 0.87 needs NumPy 1.25 (and a NumPy 2 would break tensorflow_privacy).
  assert third_party_imports["numpy"]["module_version"].startswith("1.25")
