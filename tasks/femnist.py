"""FEMNIST: handwritten digits and letters (62 classes), one client per writer.

Citations:
  Caldas, Duddu, Wu, Li, Konecny, McMahan, Smith and Talwalkar, "LEAF: A Benchmark for
  Federated Settings", arXiv:1812.01097, 2018 (the federated split by writer, the JSON
  format and the CNN below).
  Cohen, Afshar, Tapson and van Schaik, "EMNIST: an extension of MNIST to handwritten
  letters", IJCNN 2017 (the images, from NIST Special Database 19).

Load: `load_leaf` reads a directory as LEAF's preprocessing writes it (train/*.json and
test/*.json, each {"users", "num_samples", "user_data": {writer: {"x", "y"}}}); `load_tff`
converts TFF's copy (`tff.simulation.datasets.emnist`); `load_data` picks the first that is
available. Preprocess: each writer's examples become float32 images [n, 28, 28, 1] in [0, 1]
(1.0 is the background, as in both sources) and int32 labels in 0..61 (digits, then upper
case, then lower case letters: CLASS_LABELS[label]).

Test writers with training data form the test split; test writers without training data are
"new clients", never seen in training (for new-client evaluation or as unlabeled server data).
"""

import collections
import contextlib
import dataclasses
import glob
import json
import logging
import os
import socket
import sqlite3
from collections.abc import Iterable

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import partition as partition_lib
from tasks import resnet

NUM_CLASSES = 62
INPUT_SHAPE = (28, 28, 1)
CLASS_LABELS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
DATA_DIR_ENV = "TFF_ENS_DATA_DIR"
MODEL_NAMES = ("cnn", "cnn_ppd_student", "resnet8", "resnet20", "resnet8_binary",
               "resnet20_binary")
# FedPPD's default student for a teacher architecture (its supplement, Table 2).
STUDENT_MODELS = {"cnn": "cnn_ppd_student"}
# The models with 1-bit layers (larq), which export as `lce` and `binary`.
BINARY_MODEL_NAMES = ("resnet8_binary", "resnet20_binary")
# No augmentation of training examples (see tasks/__init__.py).
TRAIN_AUGMENTATION = None
# TFF's downloader opens its URL without a timeout: without this, a network that drops
# packets would hang the download instead of failing.
DOWNLOAD_TIMEOUT_SECONDS = 30

_PIXELS = INPUT_SHAPE[0] * INPUT_SHAPE[1]
_LEAF_KEYS = ("users", "num_samples", "user_data")
# The features of TFF's emnist protos (tff.simulation.datasets.emnist._add_proto_parsing).
_TFF_FEATURES = {"pixels": tf.io.FixedLenFeature((28, 28), tf.float32),
                 "label": tf.io.FixedLenFeature((), tf.int64)}


class DataError(ValueError):
  """A one-line, user-facing problem with the input data (names the file/dir and the fix)."""


@dataclasses.dataclass(frozen=True)
class ClientArrays:
  """Examples of a set of clients, held in memory.

  Attributes:
    client_ids: the writer ids, sorted.
    x: writer id -> float32 images [n, 28, 28, 1], values in [0, 1], 1.0 = background.
    y: writer id -> int32 labels [n], in 0..61.
  """
  client_ids: tuple[str, ...]
  x: dict[str, np.ndarray]
  y: dict[str, np.ndarray]

  def num_examples(self, client_id: str | None = None) -> int:
    """The number of examples of `client_id`, or of all clients if it is None."""
    if client_id is not None:
      return len(self.y[client_id])
    return sum(len(self.y[c]) for c in self.client_ids)

  def concatenated(self) -> tuple[np.ndarray, np.ndarray]:
    """All clients' images and labels, in `client_ids` order."""
    if not self.client_ids:
      return np.zeros((0, *INPUT_SHAPE), np.float32), np.zeros((0,), np.int32)
    return (np.concatenate([self.x[c] for c in self.client_ids]),
            np.concatenate([self.y[c] for c in self.client_ids]))

  def to_client_data(self) -> tff.simulation.datasets.ClientData:
    """A TFF ClientData whose elements are OrderedDict(x=float32[28, 28, 1], y=int32[]).

    TFF's in-memory ClientData copies the arrays; its `serializable_dataset_fn` (used by
    `dataset_computation` and `create_tf_dataset_from_all_clients`) embeds all clients'
    data in one TF graph, which must stay under 2 GB.
    """
    if not self.client_ids:
      raise ValueError("no clients: a TFF ClientData needs at least one")
    return tff.simulation.datasets.TestClientData({
        c: collections.OrderedDict(x=self.x[c], y=self.y[c]) for c in self.client_ids})

  def subset(self, client_ids: Iterable[str]) -> "ClientArrays":
    """The clients `client_ids` (each must be one of this set's clients)."""
    ids = tuple(sorted(set(client_ids)))
    unknown = [c for c in ids if c not in self.x]
    if unknown:
      raise KeyError(f"unknown client ids: {', '.join(unknown[:5])}")
    return ClientArrays(ids, {c: self.x[c] for c in ids}, {c: self.y[c] for c in ids})


@dataclasses.dataclass(frozen=True)
class ServerExamples:
  """Training examples a task sets aside for the server before splitting the rest.

  FedBE (Chen and Chao, ICLR 2021, Sec. 5) and FedDF (Lin et al., NeurIPS 2020, Sec. 4)
  carve the server's data out of the training set: images whose labels are dropped, for
  distillation, and a small labeled validation set.

  Attributes:
    unlabeled: float32 images [n, *INPUT_SHAPE] (no labels).
    validation_x: float32 images [m, *INPUT_SHAPE].
    validation_y: int32 labels [m].
  """
  unlabeled: np.ndarray
  validation_x: np.ndarray
  validation_y: np.ndarray


@dataclasses.dataclass(frozen=True)
class FederatedData:
  """The splits of a federated dataset (this one for FEMNIST; every task returns one).

  Attributes:
    train: writers with training data.
    test: test examples of the writers that have training data (the same writers as
      `train`, without those that have no test data).
    new_clients: writers that have test data only, never seen in training.
    source: where the data came from, "leaf:<absolute directory>" or "tff:emnist".
    server: examples the task set aside for the server, or None (FEMNIST: the server's
      data are taken from `new_clients`, see tff_ens/server_data.py).
    shift: labeled examples of the task's classes under covariate shift, or None
      (FEMNIST: the new writers; CIFAR-10: a corruption of its test set).
    ood: out-of-distribution inputs, or None (FEMNIST with digits only: the letters of
      the test writers; CIFAR: SVHN). Their labels are not the task's and never scored.
  """
  train: ClientArrays
  test: ClientArrays
  new_clients: ClientArrays
  source: str
  server: ServerExamples | None = None
  shift: ClientArrays | None = None
  ood: ClientArrays | None = None


def _client_arrays(examples: dict[str, tuple[np.ndarray, np.ndarray]]) -> ClientArrays:
  ids = tuple(sorted(examples))
  return ClientArrays(ids, {c: examples[c][0] for c in ids}, {c: examples[c][1] for c in ids})


def _split_by_writer(train, test, source: str) -> FederatedData:
  """FederatedData from writer -> (x, y) dicts of the train and test files."""
  new_clients = _client_arrays({c: v for c, v in test.items() if c not in train})
  return FederatedData(
      train=_client_arrays(train),
      test=_client_arrays({c: v for c, v in test.items() if c in train}),
      new_clients=new_clients, source=source, shift=new_clients)


def _leaf_writer(path: str, writer: str, count, data) -> tuple[np.ndarray, np.ndarray]:
  """One writer's (x, y) from a LEAF file, checked; raises DataError naming file and writer."""
  where = f"{path}: writer {writer!r}"
  fix = "regenerate the file with LEAF"
  if not isinstance(data, dict) or "x" not in data or "y" not in data:
    raise DataError(f"{where}: user_data entry needs keys x and y; {fix}")
  if not isinstance(data["x"], list) or not isinstance(data["y"], list):
    raise DataError(f"{where}: x and y must be lists, found "
                    f"{type(data['x']).__name__} and "
                    f"{type(data['y']).__name__}; {fix}")
  if isinstance(count, bool) or not isinstance(count, int):
    raise DataError(f"{where}: num_samples entry {repr(count)[:20]} is not "
                    f"an integer; {fix}")
  try:
    x = np.asarray(data["x"])
  except (ValueError, TypeError):
    lengths = sorted({len(r) if isinstance(r, list) else 1 for r in data["x"]})
    raise DataError(f"{where}: each x row must be a list of {_PIXELS} numbers (28x28 pixels), "
                    f"found row lengths {lengths[:5]}; {fix}") from None
  if x.size and x.dtype.kind not in "fiu":  # Strings, null, booleans.
    value = next(v for row in data["x"]
                 for v in (row if isinstance(row, list) else [row])
                 if isinstance(v, bool) or not isinstance(v, (int, float)) or
                 not 0 <= v <= 1)
    raise DataError(f"{where}: pixel values must be numbers in [0, 1], found "
                    f"{repr(value)[:20]}; {fix}")
  labels = data["y"]
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
    raise DataError(f"{where}: labels must be integers in 0..{NUM_CLASSES - 1}, found "
                    f"{str(labels)[:40]}; {fix}")
  if count != len(labels):
    raise DataError(f"{where}: num_samples says {count} but y has "
                    f"{len(labels)} labels; {fix}")
  if len(x) != len(labels):
    raise DataError(f"{where}: {len(x)} images but {len(labels)} labels; {fix}")
  if not labels:
    return np.zeros((0, *INPUT_SHAPE), np.float32), np.zeros((0,), np.int32)
  if x.ndim != 2 or x.shape[1] != _PIXELS:
    raise DataError(f"{where}: each x row must have {_PIXELS} values (28x28 pixels), "
                    f"got shape {list(x.shape)}; {fix}")
  # Checked as Python ints: a label beyond int64 must not overflow first.
  bad = [v for v in labels if not 0 <= v < NUM_CLASSES]
  if bad:
    raise DataError(f"{where}: labels must be integers in 0..{NUM_CLASSES - 1}, found "
                    f"{bad[:3]}; {fix}")
  x = x.astype(np.float32)
  if np.isnan(x).any():
    raise DataError(f"{where}: NaN pixel values; {fix}")
  if x.min() < 0 or x.max() > 1:
    raise DataError(f"{where}: pixel values must be in [0, 1], found {x.min()}..{x.max()}; "
                    f"{fix}")
  return x.reshape(-1, *INPUT_SHAPE), np.asarray(labels, np.int32)


def _load_leaf_file(path: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """writer -> (x, y) of one LEAF JSON file, skipping writers without examples."""
  try:
    with open(path, "rb") as f:
      content = json.load(f)
  except json.JSONDecodeError as e:
    problem = "empty" if not e.doc.strip() else f"not valid JSON ({e.msg} at char {e.pos})"
    raise DataError(f"{path}: {problem}; the file may be truncated: copy it again or "
                    "regenerate it with LEAF") from None
  except UnicodeDecodeError as e:
    raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); "
                    "the file may be damaged: copy it again or regenerate it "
                    "with LEAF") from None
  except OSError as e:
    raise DataError(f"{path}: cannot be read ({e.strerror}): make it a "
                    "readable LEAF JSON file, or move it out of the "
                    "directory") from None
  missing = [k for k in _LEAF_KEYS if not isinstance(content, dict) or k not in content]
  if missing:
    raise DataError(f"{path}: missing key(s) {', '.join(missing)}: a LEAF file is a JSON object "
                    "with users, num_samples and user_data; regenerate it with LEAF")
  users, counts, user_data = (content[k] for k in _LEAF_KEYS)
  fix = "regenerate the file with LEAF"
  if not (isinstance(users, list) and isinstance(counts, list) and
          isinstance(user_data, dict)):
    raise DataError(
        f"{path}: users and num_samples must be lists and user_data an "
        f"object, found {type(users).__name__}, {type(counts).__name__} and "
        f"{type(user_data).__name__}; {fix}")
  if len(users) != len(counts):
    raise DataError(f"{path}: {len(users)} users but {len(counts)} num_samples entries; "
                    f"{fix}")
  odd = [w for w in users if not isinstance(w, str)]
  if odd:
    raise DataError(f"{path}: users must be writer id strings, found "
                    f"{repr(odd[0])[:20]}; {fix}")
  repeated = [w for w, n in collections.Counter(users).items() if n > 1]
  if repeated:
    raise DataError(f"{path}: writer {repeated[0]!r} is listed more than once "
                    f"in users; {fix}")
  unlisted = sorted(set(user_data) - set(users))
  if unlisted:
    raise DataError(f"{path}: user_data holds writer(s) missing from users "
                    f"({', '.join(map(repr, unlisted[:3]))}); {fix}")
  examples, empty = {}, []
  for writer, count in zip(users, counts):
    if writer not in user_data:
      raise DataError(f"{path}: writer {writer!r} is in users but not in user_data; "
                      f"{fix}")
    x, y = _leaf_writer(path, writer, count, user_data[writer])
    if len(y):
      examples[writer] = (x, y)
    else:
      empty.append(writer)
  if empty:
    # A writer without examples is harmless (it is never sampled), so it is
    # skipped rather than refused; the log says which.
    logging.warning("%s: skipping %d writer(s) without examples (%s)", path,
                    len(empty), ", ".join(empty[:3]) + (", ..." if len(empty) > 3 else ""))
  return examples


def _load_leaf_split(data_dir: str, split: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """writer -> (x, y) over all JSON files of data_dir/split; a writer may be in one file only."""
  split_dir = os.path.join(data_dir, split)
  if not os.path.isdir(split_dir):
    raise DataError(f"{data_dir} has no {split}/ subdirectory: pass a LEAF femnist directory "
                    "with train/*.json and test/*.json")
  paths = sorted(glob.glob(os.path.join(split_dir, "*.json")))
  if not paths:
    raise DataError(f"{split_dir} has no *.json files: copy LEAF's {split} files into it")
  examples, file_of = {}, {}
  for path in paths:
    for writer, arrays in _load_leaf_file(path).items():
      if writer in examples:
        raise DataError(f"writer {writer!r} appears in two {split} files, {file_of[writer]} and "
                        f"{path}: remove one of the copies")
      examples[writer], file_of[writer] = arrays, path
  return examples


def load_leaf(data_dir: str) -> FederatedData:
  """Loads a LEAF femnist directory (data_dir/train/*.json, data_dir/test/*.json).

  Raises DataError, with a one-line message that names the file or directory, if the data
  is missing or malformed.
  """
  data_dir = os.path.abspath(os.path.expanduser(data_dir))
  if not os.path.exists(data_dir):
    raise DataError(f"FEMNIST data directory {data_dir} does not exist: pass a LEAF femnist "
                    "directory with train/ and test/")
  if not os.path.isdir(data_dir):
    raise DataError(f"FEMNIST data directory {data_dir} is not a directory: pass a LEAF "
                    "femnist directory with train/ and test/")
  train = _load_leaf_split(data_dir, "train")
  test = _load_leaf_split(data_dir, "test")
  if not train:
    raise DataError(f"{os.path.join(data_dir, 'train')}: no writer in its "
                    "*.json files has examples (every num_samples is 0): "
                    "copy LEAF's train files into it")
  return _split_by_writer(train, test, f"leaf:{data_dir}")


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
        "SELECT client_id, serialized_example_proto FROM examples WHERE split_name = ?",
        (split,))
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
  except Exception as e:  # pylint: disable=broad-except
    if not cached and os.path.exists(database):  # Else a partial download would pass for cached.
      os.remove(database)
    if cached:
      raise DataError(f"{database}: not TFF's FEMNIST database ({_one_line(e)}); delete it so "
                      "TFF downloads it again") from e
    raise DataError(
        "no FEMNIST data found: pass --data_dir=DIR (a LEAF femnist directory with train/ and "
        f"test/), set {DATA_DIR_ENV}, or allow network access so TFF can download it into "
        f"{cache_dir} ({_one_line(e)})") from e
  finally:
    socket.setdefaulttimeout(timeout)
  try:
    return _split_by_writer(_read_tff_split(database, "all_train"),
                            _read_tff_split(database, "all_test"), "tff:emnist")
  except (tf.errors.OpError, sqlite3.Error) as e:
    raise DataError(f"{database}: cannot be read as TFF's FEMNIST ({_one_line(e)}); delete it "
                    "so TFF downloads it again") from e


def _one_line(error: Exception) -> str:
  return " ".join(f"{type(error).__name__}: {error}".split())


def load_data(data_dir: str | None = None, *,
              partition: partition_lib.PartitionConfig | None = None,
              seed: int = 0) -> FederatedData:
  """Loads FEMNIST from `data_dir`, else from $TFF_ENS_DATA_DIR, else TFF's copy.

  `data_dir` and the environment variable name a LEAF directory (see `load_leaf`); TFF's
  copy is read from its cache or downloaded (see `load_tff`). Raises DataError with a
  one-line message saying how to provide the data when none is reachable, or when a
  `partition` other than the default is asked for: FEMNIST's clients are its writers
  (`seed` only matters for tasks that split their data).
  """
  del seed  # The split by writer is fixed.
  if partition is not None and partition != partition_lib.PartitionConfig():
    raise DataError("FEMNIST's clients are its writers: --partition, --num_clients and the "
                    "other partition flags apply to cifar10 and cifar100; leave them at "
                    "their defaults")
  data_dir = data_dir or os.environ.get(DATA_DIR_ENV)
  if data_dir:
    return load_leaf(data_dir)
  return load_tff()


def _build_cnn(seed: int, num_classes: int) -> tf.keras.Model:
  """LEAF's FEMNIST CNN (Caldas et al. 2018): two 5x5 conv + 2x2 max-pool, dense 2048."""
  seeds = resnet.seed_stream(seed)
  init = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential([
      tf.keras.Input(shape=INPUT_SHAPE),
      layers.Conv2D(32, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Conv2D(64, 5, padding="same", activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Flatten(),
      layers.Dense(2048, activation="relu", kernel_initializer=init()),
      layers.Dense(num_classes, kernel_initializer=init()),
  ], name="femnist_cnn")


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
  return tf.keras.Sequential([
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
  ], name="femnist_ppd_student")


def build_model(name: str, *, seed: int = 0, norm: str = "batch",
                num_classes: int = NUM_CLASSES) -> tf.keras.Model:
  """An un-compiled model from 28x28x1 images to `num_classes` logits (no softmax).

  Args:
    name: one of MODEL_NAMES: "cnn" (LEAF's CNN, which has no normalization layers, so
      only norm="batch", the default, is accepted), "cnn_ppd_student" (FedPPD's
      student, likewise), "resnet8", "resnet20", or their
      binarized versions "resnet8_binary" and "resnet20_binary" (`resnet.build_binary_resnet`).
    seed: the weights are a deterministic function of it.
    norm: "batch" or "group" normalization in the ResNets.
    num_classes: 62, or 10 for `DIGITS`.
  """
  if name in ("cnn", "cnn_ppd_student"):
    if norm != "batch":
      raise ValueError(f"model {name!r} has no normalization layers: norm={norm!r} applies "
                       "only to the ResNets")
    build = _build_cnn if name == "cnn" else _build_ppd_student
    return build(seed, num_classes)
  if name in ("resnet8", "resnet20"):
    return resnet.build_resnet(int(name[len("resnet"):]), input_shape=INPUT_SHAPE,
                               num_classes=num_classes, norm=norm, seed=seed)
  if name in BINARY_MODEL_NAMES:
    return resnet.build_binary_resnet(int(name[len("resnet"):-len("_binary")]),
                                      input_shape=INPUT_SHAPE, num_classes=num_classes,
                                      norm=norm, seed=seed)
  raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")


def _digits(arrays: ClientArrays, letters: bool = False) -> ClientArrays:
  """The clients' digit examples (or, with `letters`, the others); clients left empty go."""
  keep = {c: (arrays.y[c] >= DIGITS.NUM_CLASSES) == letters for c in arrays.client_ids}
  return _client_arrays({c: (arrays.x[c][k], arrays.y[c][k])
                         for c, k in keep.items() if k.any()})


def digits_only(data: FederatedData) -> FederatedData:
  """FEMNIST's digits as the task, its letters as out-of-distribution inputs.

  Training, test and new writers keep their digits (labels 0..9 as before); the letters of
  the test writers (the same writers as the in-distribution test set, so only the classes
  change) become `ood`, and the new writers' digits are the covariate `shift`.
  """
  new_clients = _digits(data.new_clients)
  return FederatedData(train=_digits(data.train), test=_digits(data.test),
                       new_clients=new_clients, source=data.source, shift=new_clients,
                       ood=_digits(data.test, letters=True))


class _Digits:
  """FEMNIST restricted to digits (`--classes=digits`): the task interface of this module
  with 10 classes, data from `digits_only`."""

  NUM_CLASSES = 10
  CLASS_LABELS = CLASS_LABELS[:10]
  INPUT_SHAPE = INPUT_SHAPE
  MODEL_NAMES = MODEL_NAMES
  STUDENT_MODELS = STUDENT_MODELS
  BINARY_MODEL_NAMES = BINARY_MODEL_NAMES
  TRAIN_AUGMENTATION = TRAIN_AUGMENTATION
  DataError = DataError

  def __repr__(self) -> str:
    return "femnist digits"

  def load_data(self, data_dir: str | None = None, *,
                partition: partition_lib.PartitionConfig | None = None,
                seed: int = 0) -> FederatedData:
    return digits_only(load_data(data_dir, partition=partition, seed=seed))

  def build_model(self, name: str, *, seed: int = 0, norm: str = "batch") -> tf.keras.Model:
    return build_model(name, seed=seed, norm=norm, num_classes=self.NUM_CLASSES)


DIGITS = _Digits()
