"""CIFAR's images as distributed: the python archives and tfds' prepared datasets.

`load_archive` reads the python version of the dataset as its page distributes it
(Krizhevsky 2009), the extracted `cifar-10-python.tar.gz` (cifar-10-batches-py/:
data_batch_1..5, test_batch, batches.meta) or `cifar-100-python.tar.gz`
(cifar-100-python/: train, test, meta): pickled dicts whose b"data" is uint8 [n, 3072],
each row an image's 1024 red, 1024 green and 1024 blue values, row by row, and whose
b"labels" (CIFAR-100: b"fine_labels") are the labels. `read_tfds` reads the same images
from tensorflow-datasets (`cifar10`, `cifar100`) where `tfds build` has prepared them,
never downloading; sorted by their `id` they are the archive's, in its order. Which one a
run reads is `tasks.cifar.CifarTask.find_data`'s choice.
"""

import dataclasses
import os
import pickle

import numpy as np
import tensorflow_datasets as tfds

from tasks import data as data_lib

DataError = data_lib.DataError
IMAGE_SHAPE = (32, 32, 3)
# tfds' default data directory: $TFDS_DATA_DIR, else ~/tensorflow_datasets.
TFDS_DATA_DIR_ENV = "TFDS_DATA_DIR"
TFDS_DEFAULT_DATA_DIR = os.path.join("~", "tensorflow_datasets")

_PIXELS = 32 * 32 * 3
# Examples per batch read from tfds.
_TFDS_BATCH_SIZE = 10_000


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
  if images.dtype != np.uint8 or images.shape[1:] != IMAGE_SHAPE:
    raise DataError(
      f"{where}: {split} images are {images.dtype} "
      f"{list(images.shape[1:])}, not uint8 32x32 RGB; {fix}"
    )
  order = np.argsort(examples["id"], kind="stable") if "id" in examples else np.arange(len(images))
  return images[order], examples["label"][order].astype(np.int32)
