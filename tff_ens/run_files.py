"""The names of the files in a run's output directory, and how JSON files there are written.

No TensorFlow: `export.runs` reads runs in the device environment too. The files themselves
are written by `run_outputs` (config, metrics, checkpoints, models) and `reporting` (the
summary).
"""

import json
import os
import re

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.csv"
SUMMARY_FILE = "summary.json"
# Each test writer's accuracy of the final model(s) (`per_client_accuracy` is
# their mean), for `tff_ens.compare`.
PER_CLIENT_ACCURACY_FILE = "per_client_accuracy.json"
# Each test writer's accuracy with personalization (`personalized_accuracy` is their
# mean): its own model or its ensemble weights.
PERSONALIZED_PER_CLIENT_ACCURACY_FILE = "personalized_per_client_accuracy.json"
# The summary's key of those accuracies, which `reporting.write_summary` moves to that file,
# keeping their mean, `personalized_accuracy`.
PERSONALIZED_PER_CLIENT = "personalized_per_client_accuracy"
# The server step's learning curves by round (`RunOutputs.release_curves`).
CURVES_FILE = "distillation_curves.json"
CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_PREFIX = "round_"
TENSORBOARD_DIR = "tensorboard"
# The final model: `model.keras`, or an ensemble's `members/member_k.keras`.
MODEL_FILE = "model.keras"
MEMBERS_DIR = "members"
# Model prototypes (clients of different architectures): `prototypes/<name>.keras`.
PROTOTYPES_DIR = "prototypes"
# Each client's own model where an algorithm keeps one: `clients/<client id>.keras`.
CLIENTS_DIR = "clients"


# Ensemble member k's file in MEMBERS_DIR (`member_file`), and its pattern.
MEMBER_FILE_PATTERN = re.compile(r"member_(\d+)\.keras")


def member_file(k: int) -> str:
  """The file name of ensemble member `k` in `MEMBERS_DIR`."""
  return f"member_{k}.keras"


def write_json_atomically(path: str, value):
  """Writes `value` as JSON to `path` through a temporary file, so a crash leaves the old file
  or the new one, never half of one."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=2, sort_keys=True)
  os.replace(tmp, path)
