"""CIFAR-10 and CIFAR-100 split over simulated clients, as FedBE and FedDF do.

Citations:
  Krizhevsky, "Learning Multiple Layers of Features from Tiny Images", tech.
  report, University of Toronto, 2009 (the images and the python archives).
  Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to
  Federated Learning", ICLR 2021, Sec. 5 (server data carved from the
  training set, Step and Dirichlet splits, ConvNet and ResNets).
  Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model Fusion
  in Federated Learning", NeurIPS 2020, Sec. 4 (Dirichlet splits, ResNet-8).

Load (`tasks.cifar_files`): the python archives as the dataset's page distributes them,
or tfds' prepared `cifar10`/`cifar100`, never downloading. `CifarTask.find_data` says
which is read: in the given directory (`--data_dir`, else $TFF_ENS_DATA_DIR) tfds'
dataset, else the archive; with none given, tfds' dataset in its default data directory
($TFDS_DATA_DIR, else ~/tensorflow_datasets), else the archive in Keras' cache
(~/.keras/datasets, where Keras downloads it given network).

Shift and out-of-distribution sets, each one pseudo-client, when tfds has
prepared them in the given or its default directory: CIFAR-10's `shift` is
the test set of `cifar10_corrupted` (Hendrycks and Dietterich, "Benchmarking
Neural Network Robustness to Common Corruptions and Perturbations", ICLR 2019)
for one corruption and severity (SHIFT_CORRUPTION, SHIFT_SEVERITY by default);
tfds has no corrupted CIFAR-100, so its `shift` is None. Both tasks' `ood` is
SVHN's test set (`svhn_cropped`, Netzer et al., NeurIPS workshop 2011).

Preprocess: float32 images [n, 32, 32, 3] standardized per channel with the
mean and standard deviation of the dataset's training images
(`cifar_files.Archive.mean`, `.std`, as both papers' code does), int32 labels.

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

import logging
import os
import socket

import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from tasks import cifar_files
from tasks import data as data_lib
from tasks import femnist
from tasks import partition as partition_lib
from tasks import resnet

INPUT_SHAPE = cifar_files.IMAGE_SHAPE
# The model's input: float32 images (standardized).
INPUT_DTYPE = np.float32
MODEL_NAMES = ("cnn", "resnet8", "resnet20", "resnet32", "resnet8_binary")
# The models with 1-bit layers (larq), which export as `lce` and `binary`.
BINARY_MODEL_NAMES = ("resnet8_binary",)
DATA_DIR_ENV = femnist.DATA_DIR_ENV
DataError = data_lib.DataError
KERAS_CACHE_DIR = os.path.join("~", ".keras")
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


CIFAR10_LABELS = tuple("airplane automobile bird cat deer dog frog horse ship truck".split())
CIFAR100_LABELS = tuple(
  "apple aquarium_fish baby bear beaver bed bee beetle bicycle bottle bowl boy bridge "
  "bus butterfly camel can castle caterpillar cattle chair chimpanzee clock cloud "
  "cockroach couch crab crocodile cup dinosaur dolphin elephant flatfish forest fox "
  "girl hamster house kangaroo keyboard lamp lawn_mower leopard lion lizard lobster man "
  "maple_tree motorcycle mountain mouse mushroom oak_tree orange orchid otter palm_tree "
  "pear pickup_truck pine_tree plain plate poppy porcupine possum rabbit raccoon ray "
  "road rocket rose sea seal shark shrew skunk skyscraper snail snake spider squirrel "
  "streetcar sunflower sweet_pepper table tank telephone television tiger tractor train "
  "trout tulip turtle wardrobe whale willow_tree wolf woman worm".split()
)


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
    archive: cifar_files.Archive,
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
    tfds_dir = given or cifar_files.tfds_default_data_dir()
    if cifar_files.find_tfds(self.name, [tfds_dir]):
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
        f"no tfds {cifar_files.tfds_version_dir(self.name)}/: pass the "
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
    data_dirs = list(
      dict.fromkeys(d for d in (_given_dir(data_dir), cifar_files.tfds_default_data_dir()) if d)
    )
    names = {"ood": OOD_DATASET}
    if self.shift_dataset:
      names = {"shift": f"{self.shift_dataset}/{shift_corruption}_{shift_severity}", **names}
    sets, missing = {}, []
    for field, name in names.items():
      found = cifar_files.find_tfds(name, data_dirs)
      if found:
        x, y = cifar_files.read_tfds(name, found, "test")
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
        cifar_files.read_tfds(self.name, where, split) for split in ("train", "test")
      )
      where = os.path.join(where, cifar_files.tfds_version_dir(self.name))
      source = f"tfds:{where}"
    else:
      (train_x, train_y), (test_x, test_y) = cifar_files.load_archive(
        where, self.archive, self.CLASS_LABELS
      )
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


CIFAR10 = CifarTask(
  "cifar10", CIFAR10_LABELS, cifar_files.CIFAR10_ARCHIVE, shift_dataset=SHIFT_DATASET
)
CIFAR100 = CifarTask("cifar100", CIFAR100_LABELS, cifar_files.CIFAR100_ARCHIVE)
