"""CIFAR-10 and CIFAR-100 split over simulated clients, as FedBE and FedDF do.

Citations:
  Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", tech.
  report, University of Toronto, 2009 (the images and the python archives).
  Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to
  Federated Learning", ICLR 2021, Sec. 5 (server data carved from the
  training set, Step and Dirichlet splits, ConvNet and ResNets).
  Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model Fusion
  in Federated Learning", NeurIPS 2020, Sec. 4 (Dirichlet splits, ResNet-8).

Load: `load_archive` reads the python version of the dataset as its page
distributes it, the extracted `cifar-10-python.tar.gz` (cifar-10-batches-py/:
data_batch_1..5, test_batch, batches.meta) or `cifar-100-python.tar.gz`
(cifar-100-python/: train, test, meta): pickled dicts whose b"data" is uint8
[n, 3072], each row an image's 1024 red, 1024 green and 1024 blue values,
row by row, and whose b"labels" (CIFAR-100: b"fine_labels") are the labels.
`read_tfds` reads the same images from tensorflow-datasets (`cifar10`,
`cifar100`) where `tfds build` has prepared them, never downloading; sorted by
their `id` they are the archive's, in its order. `CifarTask.find_data` says
which is read: in the given directory (`--data_dir`, else $TFF_ENS_DATA_DIR)
tfds' dataset, else the archive; with none given, tfds' dataset in its default
data directory ($TFDS_DATA_DIR, else ~/tensorflow_datasets), else the archive
in Keras' cache (~/.keras/datasets, where Keras downloads it given network).

Shift and out-of-distribution sets, each one pseudo-client, when tfds has
prepared them in the given or its default directory: CIFAR-10's `shift` is
the test set of `cifar10_corrupted` (Hendrycks and Dietterich, "Benchmarking
Neural Network Robustness to Common Corruptions and Perturbations", ICLR 2019)
for one corruption and severity (SHIFT_CORRUPTION, SHIFT_SEVERITY by default);
tfds has no corrupted CIFAR-100, so its `shift` is None. Both tasks' `ood` is
SVHN's test set (`svhn_cropped`, Netzer et al., NeurIPS workshop 2011).

Preprocess: float32 images [n, 32, 32, 3] standardized per channel with the
mean and standard deviation of the dataset's training images (`Archive.mean`,
`Archive.std`, as both papers' code does), int32 labels.

Split (seeded): first the server's examples are drawn at random from the
training set (`ServerExamples`: unlabeled images and a labeled validation
set, never byte-identical to a test image), then the rest is split over the
clients by `tasks.partition`, then the test set is split over the clients in
proportion to their training examples of each class, so that pooled
`test_accuracy` is the accuracy on the whole test set (the papers' metric)
and `per_client_accuracy` measures each client on its own distribution.
There are no unseen clients (`new_clients` is empty).

Training examples are augmented by `augment_training_example` (pad, random
crop, flip); evaluation and the server's data never are.
"""

import dataclasses
import logging
import os
import pickle
import socket

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tasks import data as data_lib
from tasks import femnist
from tasks import partition as partition_lib
from tasks import resnet

INPUT_SHAPE = (32, 32, 3)
# The model's input: float32 images (standardized).
INPUT_DTYPE = np.float32
MODEL_NAMES = ("cnn", "resnet8", "resnet20", "resnet32", "resnet8_binary")
# The models with 1-bit layers (larq), which export as `lce` and `binary`.
BINARY_MODEL_NAMES = ("resnet8_binary",)
DATA_DIR_ENV = femnist.DATA_DIR_ENV
DataError = data_lib.DataError
KERAS_CACHE_DIR = os.path.join("~", ".keras")
# tfds' default data directory: $TFDS_DATA_DIR, else ~/tensorflow_datasets.
TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"
TFDS_DEFAULT_DATA_DIR = os.path.join("~", "tensorflow_datasets")
# CIFAR-10's covariate shift: tfds' `cifar10_corrupted/<corruption>_<severity>`
# (severity 1..5); by default Gaussian noise at the middle severity, 3.
SHIFT_DATASET = "cifar10_corrupted"
SHIFT_CORRUPTIONS = tuple(
  sorted({c.corruption for c in tfds.builder_cls(SHIFT_DATASET).BUILDER_CONFIGS})
)
SHIFT_SEVERITIES = (1, 2, 3, 4, 5)
SHIFT_CORRUPTION = "gaussian_noise"
SHIFT_SEVERITY = 3
# Both tasks' out-of-distribution inputs: SVHN's test digits, 32x32 RGB.
OOD_DATASET = "svhn_cropped"
DOWNLOAD_TIMEOUT_SECONDS = 30
# Zero padding on each side before the random 32x32 crop.
CROP_PADDING = 4

_PIXELS = 32 * 32 * 3
# Examples per batch read from tfds.
_TFDS_BATCH_SIZE = 10_000

CIFAR10_LABELS = (
  "airplane",
  "automobile",
  "bird",
  "cat",
  "deer",
  "dog",
  "frog",
  "horse",
  "ship",
  "truck",
)
CIFAR100_LABELS = (
  "apple",
  "aquarium_fish",
  "baby",
  "bear",
  "beaver",
  "bed",
  "bee",
  "beetle",
  "bicycle",
  "bottle",
  "bowl",
  "boy",
  "bridge",
  "bus",
  "butterfly",
  "camel",
  "can",
  "castle",
  "caterpillar",
  "cattle",
  "chair",
  "chimpanzee",
  "clock",
  "cloud",
  "cockroach",
  "couch",
  "crab",
  "crocodile",
  "cup",
  "dinosaur",
  "dolphin",
  "elephant",
  "flatfish",
  "forest",
  "fox",
  "girl",
  "hamster",
  "house",
  "kangaroo",
  "keyboard",
  "lamp",
  "lawn_mower",
  "leopard",
  "lion",
  "lizard",
  "lobster",
  "man",
  "maple_tree",
  "motorcycle",
  "mountain",
  "mouse",
  "mushroom",
  "oak_tree",
  "orange",
  "orchid",
  "otter",
  "palm_tree",
  "pear",
  "pickup_truck",
  "pine_tree",
  "plain",
  "plate",
  "poppy",
  "porcupine",
  "possum",
  "rabbit",
  "raccoon",
  "ray",
  "road",
  "rocket",
  "rose",
  "sea",
  "seal",
  "shark",
  "shrew",
  "skunk",
  "skyscraper",
  "snail",
  "snake",
  "spider",
  "squirrel",
  "streetcar",
  "sunflower",
  "sweet_pepper",
  "table",
  "tank",
  "telephone",
  "television",
  "tiger",
  "tractor",
  "train",
  "trout",
  "tulip",
  "turtle",
  "wardrobe",
  "whale",
  "willow_tree",
  "wolf",
  "woman",
  "worm",
)


@dataclasses.dataclass(frozen=True)
class Archive:
  """The layout of one dataset's python archive.

  Attributes:
    directory: the directory the tarball extracts to.
    tarball: the file distributed at `url`.
    url: where Keras downloads it from (keras/datasets/cifar10.py).
    sha256: the tarball's hash (as Keras checks it).
    train_files: the pickled training batches.
    test_file: the pickled test batch.
    meta_file: the pickle with the class names under `names_key`.
    label_key: the key of the labels in a batch.
    names_key: the key of the class names in `meta_file`.
    mean: per-channel mean of the training images in [0, 1].
    std: per-channel standard deviation of the training images in [0, 1].
  """

  directory: str
  tarball: str
  url: str
  sha256: str
  train_files: tuple[str, ...]
  test_file: str
  meta_file: str
  label_key: str
  names_key: str
  mean: tuple[float, float, float]
  std: tuple[float, float, float]


CIFAR10_ARCHIVE = Archive(
  directory="cifar-10-batches-py",
  tarball="cifar-10-python.tar.gz",
  url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
  sha256="6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
  train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
  test_file="test_batch",
  meta_file="batches.meta",
  label_key="labels",
  names_key="label_names",
  mean=(0.4914, 0.4822, 0.4465),
  std=(0.2470, 0.2435, 0.2616),
)
CIFAR100_ARCHIVE = Archive(
  directory="cifar-100-python",
  tarball="cifar-100-python.tar.gz",
  url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
  sha256="85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
  train_files=("train",),
  test_file="test",
  meta_file="meta",
  label_key="fine_labels",
  names_key="fine_label_names",
  mean=(0.5071, 0.4865, 0.4409),
  std=(0.2673, 0.2564, 0.2762),
)


class _RefusedObject(pickle.UnpicklingError):
  """A pickle asks for an object that CIFAR batches never hold."""


class _BatchUnpickler(pickle.Unpickler):
  """Unpickles CIFAR batches only: dicts, lists, bytes and NumPy arrays.

  The archives are Python 2 pickles; refusing every other global keeps a
  tampered file from running code when it is read.
  """

  _ALLOWED = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.numeric", "_frombuffer"),
    ("numpy.core.multiarray", "scalar"),
    ("_codecs", "encode"),
  }

  def find_class(self, module, name):
    if (module, name) not in self._ALLOWED:
      raise _RefusedObject(f"{module}.{name}")
    return super().find_class(module, name)


def _unpickle(path: str, archive: Archive) -> dict[str, object]:
  """The dict pickled in `path`, str keys; DataError naming the file."""
  fix = f"extract {archive.tarball} again"
  try:
    with open(path, "rb") as f:
      content = _BatchUnpickler(f, encoding="bytes").load()
  except FileNotFoundError:
    raise DataError(
      f"{path} is missing: {archive.directory}/ must hold "
      f"{', '.join(archive.train_files)}, {archive.test_file} "
      f"and {archive.meta_file}; {fix}"
    ) from None
  except OSError as e:
    raise DataError(f"{path}: cannot be read ({e.strerror}); check the file") from None
  except _RefusedObject as e:
    raise DataError(
      f"{path}: asks to load {e}, which a CIFAR batch never holds (not read, for safety); {fix}"
    ) from None
  except Exception as e:
    raise DataError(
      f"{path}: not a CIFAR pickle ({type(e).__name__}: "
      f"{' '.join(str(e).split())}); the file may be truncated: "
      f"{fix}"
    ) from None
  if not isinstance(content, dict):
    raise DataError(
      f"{path}: holds a {type(content).__name__}, not the dict of a CIFAR batch; {fix}"
    )
  return {k.decode("latin1") if isinstance(k, bytes) else str(k): v for k, v in content.items()}


def _read_batch(path: str, archive: Archive, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
  """(uint8 images [n, 32, 32, 3], int32 labels [n]) of one batch file."""
  fix = f"extract {archive.tarball} again"
  batch = _unpickle(path, archive)
  missing = [k for k in ("data", archive.label_key) if k not in batch]
  if missing:
    raise DataError(
      f"{path}: no {' or '.join(missing)} entry (it has "
      f"{', '.join(sorted(batch)) or 'none'}): is it a "
      f"{archive.directory} file? {fix}"
    )
  data = batch["data"]
  if (
    not isinstance(data, np.ndarray)
    or data.dtype != np.uint8
    or data.ndim != 2
    or data.shape[1] != _PIXELS
  ):
    found = (
      f"{data.dtype} {list(data.shape)}" if isinstance(data, np.ndarray) else type(data).__name__
    )
    raise DataError(
      f"{path}: data must be uint8 rows of {_PIXELS} values (32x32 RGB), found {found}; {fix}"
    )
  try:
    labels = np.asarray(batch[archive.label_key], np.int64)
  except (TypeError, ValueError):
    labels = None
  if labels is None or labels.ndim != 1 or len(labels) != len(data):
    raise DataError(
      f"{path}: {len(data)} images but {archive.label_key} is "
      f"not a list of {len(data)} integers; {fix}"
    )
  bad = labels[(labels < 0) | (labels >= num_classes)]
  if bad.size:
    raise DataError(
      f"{path}: labels must be in 0..{num_classes - 1}, found "
      f"{bad[:3].tolist()}; is it a {archive.directory} file? "
      f"{fix}"
    )
  images = data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
  return images, labels.astype(np.int32)


def load_archive(
  directory: str, archive: Archive, class_labels
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
  """((train images, labels), (test images, labels)) of an archive directory.

  Images are uint8 [n, 32, 32, 3] as stored; labels int32. Raises DataError,
  one line naming the file and the fix, if a file is missing or malformed
  or the class names in the meta file are not `class_labels`.
  """
  meta_path = os.path.join(directory, archive.meta_file)
  names = _unpickle(meta_path, archive).get(archive.names_key)
  names = [
    n.decode("latin1") if isinstance(n, bytes) else n
    for n in (names if isinstance(names, list) else [])
  ]
  if tuple(names) != tuple(class_labels):
    raise DataError(
      f"{meta_path}: {archive.names_key} are not the "
      f"{len(class_labels)} classes of {archive.directory} "
      f"(found {len(names)}: {', '.join(map(str, names[:3]))}"
      f"{', ...' if len(names) > 3 else ''}); pass the directory "
      f"extracted from {archive.tarball}"
    )
  train = [
    _read_batch(os.path.join(directory, f), archive, len(class_labels)) for f in archive.train_files
  ]
  test = _read_batch(os.path.join(directory, archive.test_file), archive, len(class_labels))
  return tuple(map(np.concatenate, zip(*train))), test


def _check_shift(corruption: str, severity: int) -> None:
  """ValueError unless SHIFT_DATASET has `corruption` at `severity`."""
  if corruption not in SHIFT_CORRUPTIONS or severity not in SHIFT_SEVERITIES:
    raise ValueError(
      f"unknown shift corruption {corruption!r} at severity {severity!r}: "
      f"choose one of {', '.join(SHIFT_CORRUPTIONS)} and a severity in "
      f"1..{SHIFT_SEVERITIES[-1]}"
    )


def _given_dir(data_dir: str | None) -> str | None:
  """`data_dir`, else $TFF_ENS_DATA_DIR, absolute; None if neither is set."""
  given = data_dir or os.environ.get(DATA_DIR_ENV)
  return os.path.abspath(os.path.expanduser(given)) if given else None


def tfds_default_data_dir() -> str:
  """tfds' default data directory, absolute (as TFDS_DATA_DIR_ENV says)."""
  return os.path.abspath(
    os.path.expanduser(os.environ.get(TFDS_DATA_DIR_ENV) or TFDS_DEFAULT_DATA_DIR)
  )


def tfds_version_dir(name: str) -> str:
  """dataset[/config]/version: where a tfds data directory holds `name`.

  `name` is "dataset" or "dataset/config"; the version is the one tfds reads.
  """
  dataset, _, config = name.partition("/")
  cls = tfds.builder_cls(dataset)
  version = cls.builder_configs[config].version if config else None
  return os.path.join(dataset, config, str(version or cls.VERSION))


def find_tfds(name: str, data_dirs) -> str | None:
  """The first of `data_dirs` in which tfds has prepared `name`, or None.

  Looks for the dataset_info.json that preparing writes; no builder is made
  (an unprepared one would ask Google Cloud Storage for the metadata).
  """
  relative = tfds_version_dir(name)
  for data_dir in data_dirs:
    if os.path.isfile(os.path.join(data_dir, relative, "dataset_info.json")):
      return data_dir
  return None


def read_tfds(name: str, data_dir: str, split: str) -> tuple[np.ndarray, np.ndarray]:
  """(uint8 images [n, 32, 32, 3], int32 labels [n]) of a prepared tfds split.

  `name` is prepared in `data_dir` (see `find_tfds`); nothing is downloaded.
  Examples with an `id` are sorted by it: tfds' CIFAR ids ("train_00000", ...)
  number the archive's examples, so its images come out as `load_archive`
  reads them. Raises DataError (one line, with the fix) if the prepared
  files cannot be read.
  """
  where = os.path.join(data_dir, tfds_version_dir(name))
  fix = f"prepare it again: tfds build {name} --data_dir={data_dir}"
  try:
    builder = tfds.builder(name, data_dir=data_dir)
    batches = list(tfds.as_numpy(builder.as_dataset(split=split).batch(_TFDS_BATCH_SIZE)))
  except Exception as e:
    raise DataError(
      f"{where}: cannot read its {split} split ("
      f"{type(e).__name__}: {' '.join(str(e).split())}); "
      f"{fix}"
    ) from None
  if not batches:
    raise DataError(f"{where}: its {split} split is empty; {fix}")
  examples = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  images = examples["image"]
  if images.dtype != np.uint8 or images.shape[1:] != INPUT_SHAPE:
    raise DataError(
      f"{where}: {split} images are {images.dtype} "
      f"{list(images.shape[1:])}, not uint8 32x32 RGB; {fix}"
    )
  order = np.argsort(examples["id"], kind="stable") if "id" in examples else np.arange(len(images))
  return images[order], examples["label"][order].astype(np.int32)


def augment_training_example(
  x: tf.Tensor, y: tf.Tensor, seed: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
  """A random horizontal flip and a random crop of the zero-padded image.

  The augmentation of He et al., "Deep Residual Learning for Image
  Recognition", CVPR 2016, Sec. 4.2 (4 pixels of padding, a 32x32 crop,
  a flip with probability 1/2), which FedBE and FedDF train clients with.
  Padding with 0 after standardization is padding with the mean color.
  Stateless: a function of `seed` (int64 [2]); `y` passes through.
  """
  flip_seed, crop_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
  x = tf.image.stateless_random_flip_left_right(x, flip_seed)
  pad = [[CROP_PADDING, CROP_PADDING], [CROP_PADDING, CROP_PADDING], [0, 0]]
  x = tf.image.stateless_random_crop(tf.pad(x, pad), tf.shape(x), crop_seed)
  return x, y


def _build_convnet(num_classes: int, seed: int) -> tf.keras.Model:
  """FedBE's CIFAR ConvNet: three 3x3 convolutions and two dense layers.

  Chen and Chao, ICLR 2021, Sec. 5 ("ConvNet"), as their code builds it
  (models/Nets.py `CNNCifar`): conv 32, 2x2 max-pool, conv 64, 2x2 max-pool,
  conv 64 (all 3x3, unpadded, ReLU), dense 64 (ReLU), dense to the logits;
  122,570 parameters for 10 classes.
  """
  seeds = resnet.seed_stream(seed)
  init = lambda: tf.keras.initializers.GlorotUniform(seed=next(seeds))
  layers = tf.keras.layers
  return tf.keras.Sequential(
    [
      tf.keras.Input(shape=INPUT_SHAPE),
      layers.Conv2D(32, 3, activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Conv2D(64, 3, activation="relu", kernel_initializer=init()),
      layers.MaxPool2D(2),
      layers.Conv2D(64, 3, activation="relu", kernel_initializer=init()),
      layers.Flatten(),
      layers.Dense(64, activation="relu", kernel_initializer=init()),
      layers.Dense(num_classes, kernel_initializer=init()),
    ],
    name="cifar_convnet",
  )


class CifarTask:
  """CIFAR-10 or CIFAR-100, with the interface of a task module.

  See tasks/__init__.py: NUM_CLASSES, INPUT_SHAPE, INPUT_DTYPE, CLASS_LABELS, MODEL_NAMES,
  BINARY_MODEL_NAMES, TRAIN_AUGMENTATION, DEFAULT_PARTITION, SERVER_EXAMPLES,
  DataError, load_data, build_model.
  `shift_dataset` names the tfds dataset of its `shift` set, or is None.
  """

  INPUT_SHAPE = INPUT_SHAPE
  INPUT_DTYPE = INPUT_DTYPE
  MODEL_NAMES = MODEL_NAMES
  BINARY_MODEL_NAMES = BINARY_MODEL_NAMES
  DataError = DataError
  TRAIN_AUGMENTATION = staticmethod(augment_training_example)
  # No natural clients: an iid split unless --partition says otherwise.
  DEFAULT_PARTITION = "iid"
  # The server's (unlabeled, validation) examples: FedBE's 10,000 of the 50,000.
  SERVER_EXAMPLES = (10_000, 1_000)

  def __init__(
    self,
    name: str,
    class_labels: tuple[str, ...],
    archive: Archive,
    shift_dataset: str | None = None,
  ):
    self.name = name
    self.NUM_CLASSES = len(class_labels)
    self.CLASS_LABELS = class_labels
    self.archive = archive
    self.shift_dataset = shift_dataset

  def __repr__(self) -> str:
    return f"CifarTask({self.name!r})"

  @property
  def INPUT_DESCRIPTION(self) -> dict:  # noqa: N802 (the task interface's name)
    """What a model's input is (`standardize`), for an exported file's metadata."""
    mean, std = np.asarray(self.archive.mean), np.asarray(self.archive.std)
    return {
      "value_range": [float(np.min(-mean / std)), float(np.max((1 - mean) / std))],
      "background": None,
      "preprocessing": (
        "32x32 RGB image as float32 [batch, 32, 32, 3]: uint8 pixels / 255, then per channel "
        f"(x - mean) / std with mean {[round(m, 4) for m in self.archive.mean]} and std "
        f"{[round(d, 4) for d in self.archive.std]} (the training images')"
      ),
    }

  def find_data(self, data_dir: str | None = None) -> tuple[str, str]:
    """("tfds", tfds data directory) or ("archive", archive directory).

    The first found of: in the given directory (`data_dir`, else
    $TFF_ENS_DATA_DIR) tfds' prepared dataset (CIFAR-10: DIR/cifar10/3.0.2/),
    then the archive (DIR/cifar-10-batches-py/, or DIR itself); with none
    given, tfds' prepared dataset in its default data directory
    (`tfds_default_data_dir`), then the archive in Keras' cache, which Keras
    downloads it into if it is not there. Raises DataError (one line, with
    the fix) when a given directory holds neither, or nothing has the data.
    """
    archive = self.archive
    given = _given_dir(data_dir)
    tfds_dir = given or tfds_default_data_dir()
    if find_tfds(self.name, [tfds_dir]):
      return "tfds", tfds_dir
    if given:
      files = (*archive.train_files, archive.test_file, archive.meta_file)
      if os.path.isdir(os.path.join(given, archive.directory)):
        return "archive", os.path.join(given, archive.directory)
      if any(os.path.exists(os.path.join(given, f)) for f in files):
        return "archive", given
      flag = "--data_dir" if data_dir else f"${DATA_DIR_ENV}"
      raise DataError(
        f"{flag}={given} holds no {archive.directory}/ and "
        f"no tfds {tfds_version_dir(self.name)}/: pass the "
        f"directory where {archive.tarball} was extracted or a "
        f"tfds data directory with {self.name} prepared"
      )
    cache = os.path.expanduser(KERAS_CACHE_DIR)
    cached = os.path.join(cache, "datasets", archive.directory)
    if os.path.isdir(cached):
      return "archive", cached
    timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_SECONDS)
    try:
      return "archive", tf.keras.utils.get_file(
        archive.directory, origin=archive.url, untar=True, file_hash=archive.sha256, cache_dir=cache
      )
    except Exception as e:
      raise DataError(
        f"no {self.name} data found: pass --data_dir=DIR (the directory "
        f"where {archive.tarball} was extracted, or a tfds data directory "
        f"with {self.name} prepared), set {DATA_DIR_ENV}, prepare it in "
        f"{tfds_dir} with tfds, or allow network access so Keras can "
        f"download it into {cached} ({type(e).__name__}: "
        f"{' '.join(str(e).split())})"
      ) from e
    finally:
      socket.setdefaulttimeout(timeout)

  def evaluation_sets(
    self,
    data_dir: str | None = None,
    *,
    shift_corruption: str = SHIFT_CORRUPTION,
    shift_severity: int = SHIFT_SEVERITY,
  ) -> tuple[data_lib.ClientArrays | None, data_lib.ClientArrays | None]:
    """(shift, ood): standardized pseudo-clients, each None if not prepared.

    Read with tfds from the given directory (as `find_data`), else tfds'
    default data directory: `shift` is the test set of
    SHIFT_DATASET/<shift_corruption>_<shift_severity> (None for CIFAR-100),
    client "cifar10_corrupted"; `ood` is the test set of OOD_DATASET, client
    "svhn_cropped", its labels SVHN's digits. A set not prepared is None and
    logged (info); ValueError for an unknown corruption or severity.
    """
    _check_shift(shift_corruption, shift_severity)
    data_dirs = list(dict.fromkeys(d for d in (_given_dir(data_dir), tfds_default_data_dir()) if d))
    names = {"ood": OOD_DATASET}
    if self.shift_dataset:
      names = {"shift": f"{self.shift_dataset}/{shift_corruption}_{shift_severity}", **names}
    sets, missing = {}, []
    for field, name in names.items():
      found = find_tfds(name, data_dirs)
      if found:
        x, y = read_tfds(name, found, "test")
        client = name.split("/")[0]
        sets[field] = data_lib.ClientArrays((client,), {client: self.standardize(x)}, {client: y})
      else:
        missing.append((field, name))
    if missing:
      logging.info(
        "%s: no %s set: tfds has not prepared %s in %s (tfds "
        "build NAME --data_dir=DIR prepares it)",
        self.name,
        " or ".join(f for f, _ in missing),
        " or ".join(n for _, n in missing),
        " or ".join(data_dirs),
      )
    return sets.get("shift"), sets.get("ood")

  def load_data(
    self,
    data_dir: str | None = None,
    *,
    partition: partition_lib.PartitionConfig | None = None,
    seed: int = 0,
    shift_corruption: str = SHIFT_CORRUPTION,
    shift_severity: int = SHIFT_SEVERITY,
  ) -> data_lib.FederatedData:
    """The federated split of the dataset (see the module docstring).

    Args:
      data_dir: where the data are (see `find_data`).
      partition: the split (`PartitionConfig.for_task`); None: iid with the defaults.
      seed: seeds the server's examples, the clients' split and the test
        split.
      shift_corruption, shift_severity: CIFAR-10's `shift` set (see
        `evaluation_sets`; CIFAR-100 has none).

    Raises DataError (one line, naming the file or flag and the fix) if
    the data are missing, malformed or too small for the split.
    """
    config = (partition or partition_lib.PartitionConfig()).for_task(
      self.DEFAULT_PARTITION, self.SERVER_EXAMPLES
    )
    _check_shift(shift_corruption, shift_severity)
    kind, where = self.find_data(data_dir)
    if kind == "tfds":
      (train_x, train_y), (test_x, test_y) = (
        read_tfds(self.name, where, split) for split in ("train", "test")
      )
      where = os.path.join(where, tfds_version_dir(self.name))
      source = f"tfds:{where}"
    else:
      (train_x, train_y), (test_x, test_y) = load_archive(where, self.archive, self.CLASS_LABELS)
      source = f"{self.name}:{where}"
    train, test, server = data_lib.split_pool(
      (train_x, train_y),
      (test_x, test_y),
      config,
      seed,
      where=source,
      num_classes=self.NUM_CLASSES,
      preprocess=self.standardize,
    )
    shift, ood = self.evaluation_sets(
      data_dir, shift_corruption=shift_corruption, shift_severity=shift_severity
    )
    return data_lib.FederatedData(
      train=train,
      test=test,
      new_clients=data_lib.ClientArrays((), {}, {}, INPUT_SHAPE),
      source=source,
      server=server,
      shift=shift,
      ood=ood,
    )

  def standardize(self, images: np.ndarray) -> np.ndarray:
    """uint8 [n, 32, 32, 3] -> float32 (images / 255 - mean) / std."""
    mean = np.asarray(self.archive.mean, np.float32)
    std = np.asarray(self.archive.std, np.float32)
    return (images.astype(np.float32) / 255 - mean) / std

  def build_model(self, name: str, *, seed: int = 0, norm: str = "batch") -> tf.keras.Model:
    """An un-compiled model from 32x32x3 images to NUM_CLASSES logits.

    Args:
      name: one of MODEL_NAMES: "cnn" (FedBE's ConvNet, `_build_convnet`,
        without normalization layers, so only norm="batch", the default, is
        accepted), "resnet8", "resnet20", "resnet32" (`resnet.build_resnet`;
        FedDF's ResNet-8, FedBE's ResNet-20 and -32) or "resnet8_binary"
        (`resnet.build_binary_resnet`, FedDF's Table 4).
      seed: the weights are a deterministic function of it.
      norm: "batch" or "group" normalization in the ResNets.
    """
    if name == "cnn":
      if norm != "batch":
        raise ValueError(
          f"model 'cnn' has no normalization layers: norm={norm!r} applies only to the ResNets"
        )
      return _build_convnet(self.NUM_CLASSES, seed)
    if name in ("resnet8", "resnet20", "resnet32"):
      return resnet.build_resnet(
        int(name[len("resnet") :]),
        input_shape=INPUT_SHAPE,
        num_classes=self.NUM_CLASSES,
        norm=norm,
        seed=seed,
      )
    if name in BINARY_MODEL_NAMES:
      return resnet.build_binary_resnet(
        int(name[len("resnet") : -len("_binary")]),
        input_shape=INPUT_SHAPE,
        num_classes=self.NUM_CLASSES,
        norm=norm,
        seed=seed,
      )
    raise ValueError(f"unknown model {name!r}: choose one of {', '.join(MODEL_NAMES)}")


CIFAR10 = CifarTask("cifar10", CIFAR10_LABELS, CIFAR10_ARCHIVE, shift_dataset=SHIFT_DATASET)
CIFAR100 = CifarTask("cifar100", CIFAR100_LABELS, CIFAR100_ARCHIVE)
