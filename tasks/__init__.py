"""Tasks: a dataset and the models for it, knowing nothing of federated algorithms.

A task module exposes NUM_CLASSES, INPUT_SHAPE, CLASS_LABELS, MODEL_NAMES, load_data and
build_model.
"""

import types

from tasks import femnist

TASKS = {"femnist": femnist}

# The error every task raises for missing or malformed data.
DataError = femnist.DataError


def get_task(name: str) -> types.ModuleType:
  """The task module called `name`; ValueError if there is none."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
  return TASKS[name]
