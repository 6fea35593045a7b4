"""Small exported-run fixtures shared by the export tests: a FEMNIST-shaped model that
converts in a second, and a run directory holding models as `tff_ens.program.training` writes it."""

import json
import os

import tensorflow as tf

from export import runs
from tasks import femnist
from tff_ens import run_files

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIR = os.path.join(REPO_ROOT, "..", "shared", "data", "femnist")


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
    **(config or {}),
  }
  for name, value in ((run_files.CONFIG_FILE, config), (run_files.SUMMARY_FILE, summary or {})):
    with open(os.path.join(run_dir, name), "w") as f:
      json.dump(value, f)
  return runs.load_run(run_dir)
