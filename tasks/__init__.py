"""Tasks: a dataset and its models, knowing nothing of federated algorithms.

A task (a module, or for CIFAR a `cifar.CifarTask`) exposes NUM_CLASSES,
INPUT_SHAPE, INPUT_DTYPE, INPUT_DESCRIPTION, CLASS_LABELS, MODEL_NAMES,
BINARY_MODEL_NAMES, TRAIN_AUGMENTATION, DEFAULT_PARTITION, SERVER_EXAMPLES,
load_data and build_model:

  INPUT_DTYPE: the NumPy dtype of a model's input: np.float32 for images,
    np.int32 for Shakespeare's character ids (whose stored samples are uint8:
    cast them to INPUT_DTYPE when feeding the model).
  INPUT_DESCRIPTION: what a model's input is, for an exported file's metadata:
    `value_range` [low, high], `background` (the blank pixel's value, or None) and
    `preprocessing` (how raw inputs become the model's, in words); Shakespeare's
    adds its `vocabulary`.

  load_data(data_dir=None, *, partition=None, seed=0) -> a
    `data.FederatedData`, whose `server` field holds the server's examples
    when the task sets them aside and whose `shift` and `ood` fields hold its
    shifted and out-of-distribution evaluation sets when it has them;
    `partition` is a `partition.PartitionConfig` (None: the task's own
    clients, FEMNIST's writers) applied by `data.split_pool`.
  DEFAULT_PARTITION: the split when --partition is unset (None: natural
    clients). SERVER_EXAMPLES: the default (unlabeled, validation) examples
    a split sets aside for the server.
  build_model(name, *, seed=0, norm="batch") -> an un-compiled Keras model
    to logits. A model over a sequence that predicts its next element (Shakespeare's
    LSTM) names the layer of every position's logits PER_POSITION_LOGITS: the
    clients can then learn from every position of a window (`--train_positions`).
  TRAIN_AUGMENTATION: None, or `(x, y, seed) -> (x, y)` applied to each
    training example of a client (`seed`: int64 [2]); never to evaluation or
    server data.

A task with settings of its own declares them as a settings group, `SETTINGS`
(`tff_ens.settings.group`; their flags apply to that task only; `TASK_SETTINGS` finds it
without TensorFlow), and takes them as `load_data(..., config=SETTINGS(...))`.
"""

import importlib

from tasks import data
from tasks import partition  # noqa: F401

# Task name -> (module, attribute or None for the module itself); the first is --task's
# default. The modules
# build Keras models, so they are imported on first use: `tasks.data`,
# `tasks.partition`, `tasks.leaf` and `tasks.plays` run without TensorFlow (the
# device environment, device/).
TASKS = {
  "femnist": ("femnist", None),
  "cifar10": ("cifar", "CIFAR10"),
  "cifar100": ("cifar", "CIFAR100"),
  "shakespeare": ("shakespeare", None),
}

DEFAULT_TASK = next(iter(TASKS))

# Task name -> (module, attribute) of its settings group, in a module without TensorFlow.
TASK_SETTINGS = {"shakespeare": ("plays", "ShakespeareConfig")}


def task_settings(name: str):
  """The settings group of task `name` (`TASK_SETTINGS`), or None."""
  if name not in TASK_SETTINGS:
    return None
  module, attribute = TASK_SETTINGS[name]
  return getattr(importlib.import_module(f"tasks.{module}"), attribute)


# The layer of a sequence model's logits at every position: [batch, length, classes], where
# position i predicts the input's element i + 1 and the last position the label.
PER_POSITION_LOGITS = "per_position_logits"

# The error every task raises for missing or malformed data.
DataError = data.DataError


# --classes: every class of the task (the default), or FEMNIST's digits with its letters as
# out-of-distribution inputs (`femnist.DIGITS`).
CLASSES = ("all", "digits")
DEFAULT_CLASSES = CLASSES[0]


def __getattr__(name: str):
  """`tasks.femnist`, `tasks.cifar`, `tasks.shakespeare`: the task modules, imported on
  first use."""
  if name in ("femnist", "cifar", "shakespeare"):
    return importlib.import_module(f"tasks.{name}")
  raise AttributeError(f"module 'tasks' has no attribute {name!r}")


def get_task(name: str, classes: str = DEFAULT_CLASSES):
  """The task called `name`, with `classes`; ValueError if there is none."""
  if name not in TASKS:
    raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}")
  if classes not in CLASSES:
    raise ValueError(f"unknown classes {classes!r}: choose one of {', '.join(CLASSES)}")
  if classes == "digits":
    if name != "femnist":
      raise ValueError(f"classes 'digits' applies to femnist, not {name}: leave it at 'all'")
    return importlib.import_module("tasks.femnist").DIGITS
  module, attribute = TASKS[name]
  module = importlib.import_module(f"tasks.{module}")
  return getattr(module, attribute) if attribute else module
