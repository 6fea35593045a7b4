"""Small exported-run fixtures shared by the export tests: a FEMNIST-shaped model that
converts in a second, a run directory holding models as `tff_ens.program.training` writes it,
and the device environment's Python (`device/`, no TensorFlow) run in a subprocess."""

import json
import os
import subprocess

import pytest
import tensorflow as tf

from export import runs
from tasks import femnist
from tff_ens import run_files

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_ROOT, "..", "shared", "data", "femnist")

DEVICE_PYTHON = os.path.join(REPO_ROOT, "device", ".venv", "bin", "python")
needs_device_env = pytest.mark.skipif(
  not os.path.exists(DEVICE_PYTHON),
  reason="the device environment is not installed: uv sync --locked --project device",
)

# Runs `python -m export.evaluate ARGS` in the device process, then prints which
# TensorFlow modules that process imported.
EVALUATE_AND_LIST_MODULES = """
import json, runpy, sys
sys.argv[0] = "export.evaluate"
try:
  runpy.run_module("export.evaluate", run_name="__main__", alter_sys=True)
except SystemExit as e:
  status = e.code
heavy = ("tensorflow", "tensorflow_federated", "keras", "tasks.femnist", "tasks.cifar",
         "tasks.resnet")
print(json.dumps({"status": status, "tensorflow": "tensorflow" in sys.modules,
                  "modules": sorted(m for m in sys.modules
                                    if m.split(".")[0] in heavy or m in heavy)}))
"""


def run_in_device_env(*args) -> dict:
  """The last line of the device environment's `python -c ARGS`, as JSON (the process must
  succeed)."""
  result = subprocess.run(
    [DEVICE_PYTHON, "-c", *args],
    cwd=REPO_ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def small_femnist_model(seed: int, task=femnist) -> tf.keras.Model:
  """A model of `task`'s shape (FEMNIST: 28x28x1 -> 62 logits) that converts in a second."""
  init = tf.keras.initializers.GlorotUniform(seed=seed)
  return tf.keras.Sequential(
    [
      tf.keras.Input(task.INPUT_SHAPE),
      tf.keras.layers.Conv2D(4, 3, strides=2, activation="relu", kernel_initializer=init),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(task.NUM_CLASSES, kernel_initializer=init),
    ]
  )


def write_run(run_dir, models, config=None, summary=None) -> runs.Run:
  """A run directory as tff_ens.program.training writes it, holding `models`."""
  os.makedirs(run_dir, exist_ok=True)
  if len(models) == 1:
    models[0].save(os.path.join(run_dir, run_files.MODEL_FILE))
  else:
    os.makedirs(os.path.join(run_dir, run_files.MEMBERS_DIR))
    for k, model in enumerate(models):
      model.save(os.path.join(run_dir, run_files.MEMBERS_DIR, run_files.member_file(k)))
  config = {
    "task": "femnist",
    "model": "cnn",
    "algorithm": "fedavg",
    "data_dir": DATA_DIR,
    "seed": 0,
    **(config or {}),
  }
  for name, value in ((run_files.CONFIG_FILE, config), (run_files.SUMMARY_FILE, summary or {})):
    with open(os.path.join(run_dir, name), "w") as f:
      json.dump(value, f)
  return runs.load_run(run_dir)
