"""FEMNIST: handwritten digits and letters (62 classes), one client per writer.

Citations:
  Caldas, Duddu, Wu, Li, Konecny, McMahan, Smith and Talwalkar, "LEAF: A Benchmark for
  Federated Settings", arXiv:1812.01097, 2018 (the federated split by writer, the JSON
  format and the CNN below).
  Cohen, Afshar, Tapson and van Schaik, "EMNIST: an extension of MNIST to handwritten
  letters", IJCNN 2017 (the images, from NIST Special Database 19).

Load: `load_leaf` (`tasks.leaf`, NumPy only) reads a directory as LEAF's preprocessing
writes it (train/*.json and test/*.json, each {"users", "num_samples", "user_data":
{writer: {"x", "y"}}}); `load_tff` converts TFF's copy (`tff.simulation.datasets.emnist`);
`load_data` picks the first that is available. Preprocess: each writer's examples become
float32 images [n, 28, 28, 1] in [0, 1] (1.0 is the background, as in both sources) and
int32 labels in 0..61 (digits, then upper case, then lower case letters:
CLASS_LABELS[label]).

Test writers with training data form the test split; test writers without training data are
"new clients", never seen in training (for new-client evaluation or as unlabeled server data).
"""

import collections
import contextlib
import os
import socket
import sqlite3

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import data as data_lib
from tasks import leaf
from tasks import partition as partition_lib
from tasks import resnet
from tasks.data import DataError
from tasks.data import FederatedData
from tasks.leaf import digits_only
from tasks.leaf import load_leaf

NUM_CLASSES = leaf.NUM_CLASSES
INPUT_SHAPE = leaf.INPUT_SHAPE
# The model's input: float32 images.
INPUT_DTYPE = np.float32
CLASS_LABELS = leaf.CLASS_LABELS
# What a model's input is, for an exported file's metadata (`export.convert.describe`).
INPUT_DESCRIPTION = {
  "value_range": [0.0, 1.0],
  "background": 1.0,
  "preprocessing": (
    "28x28 grayscale image, row-major (LEAF's 784 values), as float32 in [0, 1] with "
    "1.0 = white background and darker ink towards 0.0 (LEAF and TFF's FEMNIST); shape "
    "[batch, 28, 28, 1]"
  ),
}
DATA_DIR_ENV = leaf.DATA_DIR_ENV
MODEL_NAMES = (
  "cnn",
  "cnn_ppd_student",
  "resnet8",
  "resnet20",
  "resnet8_binary",
  "resnet20_binary",
  "mlp",
)
# FedPPD's default student for a teacher architecture (its supplement, Table 2).
STUDENT_MODELS = {"cnn": "cnn_ppd_student"}
# The models with 1-bit layers (larq), which export as `lce` and `binary`.
BINARY_MODEL_NAMES = ("resnet8_binary", "resnet20_binary")
# The clients are the writers unless --partition pools them (see `load_data`).
DEFAULT_PARTITION = None
# The server's (unlabeled, validation) examples of a pooled split: 17% of the slice's
# 14,708 training examples (CIFAR sets aside 22%).
SERVER_EXAMPLES = (2_000, 500)
# No augmentation of training examples (see tasks/__init__.py).
TRAIN_AUGMENTATION = None
# TFF's downloader opens its URL without a timeout: without this, a network that drops
# packets would hang the download instead of failing.
DOWNLOAD_TIMEOUT_SECONDS = 30

# The features of TFF's emnist protos (tff.simulation.datasets.emnist._add_proto_parsing).
_TFF_FEATURES = {
  "pixels": tf.io.FixedLenFeature((28, 28), tf.float32),
  "label": tf.io.FixedLenFeature((), tf.int64),
}


def _read_tff_split(database: str, split: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """writer -> (x, y) of one split ("all_train", "all_test") of TFF's emnist database.

  Reads the `examples` table that TFF's `SqlClientData` documents in one scan and parses
  the tf.train.Example protos as `tff.simulation.datasets.emnist` does, in batches: going
  through `create_tf_dataset_for_client` costs ~0.3 s per writer (~30 min for the 3,400
  writers' train and test), this seconds.
  """
  pieces = collections.defaultdict(list)
  with contextlib.closing(sqlite3.connect(database)) as connection:
    cursor = connection.execute(
      "SELECT client_id, serialized_example_proto FROM examples WHERE split_name = ?", (split,)
    )
    while rows := cursor.fetchmany(10_000):
      ids, protos = zip(*rows)
      parsed = tf.io.parse_example(list(protos), _TFF_FEATURES)
      x = parsed["pixels"].numpy().reshape(-1, *INPUT_SHAPE)
      y = parsed["label"].numpy().astype(np.int32)
      ids = np.asarray(ids)
      for c in np.unique(ids):
        pieces[c].append((x[ids == c], y[ids == c]))
  return {str(c): tuple(map(np.concatenate, zip(*pieces.pop(c)))) for c in sorted(pieces)}


def load_tff(cache_dir: str | None = None) -> FederatedData:
  """Loads TFF's FEMNIST (emnist, only_digits=False), downloading it if it is not cached.

  TFF caches the database as `emnist_all.sqlite` in `cache_dir` (default ~/.tff). TFF splits
  every writer's examples into train and test, so there are no test-only writers and
  `new_clients` is empty. Held in memory, the 3,400 writers' 749,068 examples take ~2.4 GB.

  Raises DataError (one line) if the data can neither be found in the cache nor downloaded,
  or if the cached database cannot be read.
  """
  cache_dir = os.path.expanduser(cache_dir or os.path.join("~", ".tff"))
  database = os.path.join(cache_dir, "emnist_all.sqlite")
  cached = os.path.exists(database)
  timeout = socket.getdefaulttimeout()
  socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_SECONDS)
  try:
    # Downloads (if needed) and checks the database's tables.
    tff.simulation.datasets.emnist.load_data(only_digits=False, cache_dir=cache_dir)
  except Exception as e:
    if not cached and os.path.exists(database):  # Else a partial download would pass for cached.
      os.remove(database)
    if cached:
      raise DataError(
        f"{database}: not TFF's FEMNIST database ({_one_line(e)}); delete it so "
        "TFF downloads it again"
      ) from e
    raise DataError(
      "no FEMNIST data found: pass --data_dir=DIR (a LEAF femnist directory with train/ and "
      f"test/), set {DATA_DIR_ENV}, or allow network access so TFF can download it into "
      f"{cache_dir} ({_one_line(e)})"
    ) from e
  finally:
    socket.setdefaulttimeout(timeout)
  try:
    return leaf.split_by_writer(
      _read_tff_split(database, "all_train"), _read_tff_split(database, "all_test"), "tff:emnist"
    )
  except (tf.errors.OpError, sqlite3.Error) as e:
    raise DataError(
      f"{database}: cannot be read as TFF's FEMNIST ({_one_line(e)}); delete it "
      "so TFF downloads it again"
    ) from e


def _one_line(error: Exception) -> str:
  return " ".join(f"{type(error).__name__}: {error}".split())


def load_data(
  data_dir: str | None = None,
  *,
  partition: partition_lib.PartitionConfig | None = None,
  seed: int = 0,
) -> FederatedData:
  """Loads FEMNIST from `data_dir`, else from $TFF_ENS_DATA_DIR, else TFF's copy.

  `data_dir` and the environment variable name a LEAF directory (see `load_leaf`); TFF's
  copy is read from its cache or downloaded (see `load_tff`). Raises DataError with a
  one-line message saying how to provide the data when none is reachable.

  With `partition` None the clients are the writers. Otherwise the training writers'
  training examples are pooled and split by label as CIFAR's are (`data.split_pool`,
  seeded by `seed`): the server's examples are drawn from the pool first, and the
  training writers' test examples are split like the clients' labels, so `test_accuracy`
  is measured on the same 1,685 examples as with the writer split. The writers with test
  data only stay `new_clients` (and the server's data when the partition sets none aside).
  """
  data_dir = data_dir or os.environ.get(DATA_DIR_ENV)
  data = load_leaf(data_dir) if data_dir else load_tff()
  if partition is not None:
    partition = partition.for_task(DEFAULT_PARTITION, SERVER_EXAMPLES)
  if partition is None:
    return data
  return data_lib.repartitioned(data, partition, seed, NUM_CLASSES)


def _build_cnn(seed: int, num_classes: int) -> tf.keras.Model:
  """LEAF's FEMNIST CNN (Caldas et al. 2018): two 5x5 conv + 2x2 max-pool, dense 2048."""
  seeds = resnet.seed_stream(seed)
  init = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential(
    [
      tf.keras.Input(shape=INPUT_SHAPE),
      layers.Conv2D(32, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Conv2D(64, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Flatten(),
      layers.Dense(2048, activation="relu", kernel_initializer=init()),
      layers.Dense(num_classes, kernel_initializer=init()),
    ],
    name="femnist_cnn",
  )


def _build_ppd_student(seed: int, num_classes: int) -> tf.keras.Model:
  """FedPPD's FEMNIST student (Bhatt et al., ACML 2023, supplement Table 2).

  Three 5x5 conv (50, 100, 200 channels) + 2x2 max-pool, dense 1600 and 180: about
  four times the LEAF CNN's multiply-adds. The table's dropout layers are left out:
  Keras dropout inside a TFF computation draws unseeded noise, which would break
  `--seed` reproducibility; the student's prior is its weight decay instead.
  """
  seeds = resnet.seed_stream(seed)
  init = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential(
    [
      tf.keras.Input(shape=INPUT_SHAPE),
      layers.Conv2D(50, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Conv2D(100, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Conv2D(200, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2, padding="same"),
      layers.Flatten(),
      layers.Dense(1600, activation="relu", kernel_initializer=init()),
      layers.Dense(180, activation="relu", kernel_initializer=init()),
      layers.Dense(num_classes, kernel_initializer=init()),
    ],
    name="femnist_ppd_student",
  )


def _build_mlp(seed: int, num_classes: int) -> tf.keras.Model:
  """McMahan et al. 2017's "2NN" (Sec. 3): two hidden layers of 200 ReLU units, about 210,000
  weights (the LEAF CNN's 3%), for fast runs."""
  seeds = resnet.seed_stream(seed)
  init = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential(
    [
      tf.keras.Input(shape=INPUT_SHAPE),
      layers.Flatten(),
      layers.Dense(200, activation="relu", kernel_initializer=init()),
      layers.Dense(200, activation="relu", kernel_initializer=init()),
      layers.Dense(num_classes, kernel_initializer=init()),
    ],
    name="femnist_mlp",
  )


def build_model(
  name: str, *, seed: int = 0, norm: str = "batch", num_classes: int = NUM_CLASSES
) -> tf.keras.Model:
  """An un-compiled model from 28x28x1 images to `num_classes` logits (no softmax).

  Args:
    name: one of MODEL_NAMES: "cnn" (LEAF's CNN, which has no normalization layers, so
      only norm="batch", the default, is accepted), "cnn_ppd_student" (FedPPD's
      student, likewise), "mlp" (McMahan et al.'s 2NN, likewise), "resnet8", "resnet20", or
      their binarized versions "resnet8_binary" and "resnet20_binary"
      (`resnet.build_binary_resnet`).
    seed: the weights are a deterministic function of it.
    norm: "batch" or "group" normalization in the ResNets.
    num_classes: 62, or 10 for `DIGITS`.
  """
  plain = {"cnn": _build_cnn, "cnn_ppd_student": _build_ppd_student, "mlp": _build_mlp}
  if name in plain:
    if norm != "batch":
      raise ValueError(
        f"model {name!r} has no normalization layers: norm={norm!r} applies only to the ResNets"
      )
    return plain[name](seed, num_classes)
  if name in ("resnet8", "resnet20"):
    return resnet.build_resnet(
      int(name[len("resnet") :]),
      input_shape=INPUT_SHAPE,
      num_classes=num_classes,
      norm=norm,
      seed=seed,
    )
  if name in BINARY_MODEL_NAMES:
    return resnet.build_binary_resnet(
      int(name[len("resnet") : -len("_binary")]),
      input_shape=INPUT_SHAPE,
      num_classes=num_classes,
      norm=norm,
      seed=seed,
    )
  raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")


class _Digits:
  """FEMNIST restricted to digits (`--classes=digits`): the task interface of this module
  with 10 classes, data from `digits_only`."""

  NUM_CLASSES = leaf.NUM_DIGITS
  CLASS_LABELS = CLASS_LABELS[:10]
  INPUT_SHAPE = INPUT_SHAPE
  INPUT_DTYPE = INPUT_DTYPE
  INPUT_DESCRIPTION = INPUT_DESCRIPTION
  MODEL_NAMES = MODEL_NAMES
  STUDENT_MODELS = STUDENT_MODELS
  BINARY_MODEL_NAMES = BINARY_MODEL_NAMES
  TRAIN_AUGMENTATION = TRAIN_AUGMENTATION
  DEFAULT_PARTITION = DEFAULT_PARTITION
  SERVER_EXAMPLES = SERVER_EXAMPLES
  DataError = DataError

  def __repr__(self) -> str:
    return "femnist digits"

  def load_data(
    self,
    data_dir: str | None = None,
    *,
    partition: partition_lib.PartitionConfig | None = None,
    seed: int = 0,
  ) -> FederatedData:
    if partition is not None:
      raise DataError(
        "--classes=digits keeps FEMNIST's writers as clients: leave "
        "--partition unset, or use --classes=all"
      )
    return digits_only(load_data(data_dir, seed=seed))

  def build_model(self, name: str, *, seed: int = 0, norm: str = "batch") -> tf.keras.Model:
    return build_model(name, seed=seed, norm=norm, num_classes=self.NUM_CLASSES)


DIGITS = _Digits()
