"""Tests of CIFAR through tensorflow-datasets, offline.

One test prepares a real tfds `cifar10` from a generated archive (tfds'
download mocked, its binary format written here) and reads it back as the
archive. The others mark datasets prepared (the dataset_info.json preparing
writes) and serve their examples through `tfds.testing.mock_data`, with
examples per dataset and split: its default generator gives every split the
same examples, and CIFAR's test images may not be training images.
"""

import logging
import pathlib
from unittest import mock

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from test_cifar import write_cifar10

import tasks
from tasks import cifar
from tasks import cifar_files
from tasks import partition

# The version directories tfds 4.9.3 prepares the datasets in.
CIFAR10_DIR = "cifar10/3.0.2"
CIFAR100_DIR = "cifar100/3.0.2"
SHIFT_DIR = "cifar10_corrupted/gaussian_noise_3/1.0.0"
OOD_DIR = "svhn_cropped/3.0.0"

SMALL = partition.PartitionConfig(
  num_clients=4, server_unlabeled_examples=30, server_validation_examples=10, step_minor_examples=1
)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
  """No data unless a test provides it: no env vars, an empty ~, no network."""
  monkeypatch.delenv(cifar.DATA_DIR_ENV, raising=False)
  monkeypatch.delenv(cifar_files.TFDS_DATA_DIR_ENV, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
    monkeypatch.setenv(name, "http://127.0.0.1:9")


def _examples(seed, n, num_classes, prefix=None):
  """Random uint8 images and balanced labels; with `prefix`, ids
  (prefix00000, ...) in a shuffled order, as tfds stores CIFAR."""
  rng = np.random.default_rng(seed)
  examples = {
    "image": rng.integers(0, 256, (n, 32, 32, 3), np.uint8),
    "label": rng.permutation(np.arange(n) % num_classes),
  }
  if prefix:
    examples["id"] = np.array([f"{prefix}{i:05d}" for i in rng.permutation(n)], object)
  return examples


# Examples mock_data serves: (dataset[/config], split) -> examples.
EXAMPLES = {
  ("cifar10", "train"): _examples(1, 200, 10, "train_"),
  ("cifar10", "test"): _examples(2, 50, 10, "test_"),
  ("cifar100", "train"): _examples(3, 300, 100, "train_"),
  ("cifar100", "test"): _examples(4, 100, 100, "test_"),
  ("cifar10_corrupted/gaussian_noise_3", "test"): _examples(5, 20, 10),
  ("cifar10_corrupted/fog_5", "test"): _examples(6, 15, 10),
  ("svhn_cropped", "test"): _examples(7, 30, 10),
}


def _serve(builder, split, **unused_kwargs):
  config = builder.builder_config
  name = builder.name + (f"/{config.name}" if config else "")
  return tf.data.Dataset.from_tensor_slices(EXAMPLES[name, split])


@pytest.fixture
def mock_tfds():
  with tfds.testing.mock_data(policy=tfds.testing.MockPolicy.USE_CODE, as_dataset_fn=_serve):
    yield


def _prepare(data_dir, *version_dirs):
  """Marks datasets prepared in `data_dir` as tfds finds them."""
  for version_dir in version_dirs:
    directory = pathlib.Path(data_dir) / version_dir
    directory.mkdir(parents=True)
    (directory / "dataset_info.json").write_text("{}")


def _pixels(task, x):
  """Standardized images back to uint8."""
  pixels = (x * np.array(task.archive.std) + np.array(task.archive.mean)) * 255
  np.testing.assert_allclose(pixels, np.round(pixels), atol=1e-3)
  return np.round(pixels).astype(np.uint8)


def _rows(x):
  return {row.tobytes() for row in x}


def _check_labels(task, arrays, examples):
  """Each client's labels are those of its images in `examples`."""
  labels = {image.tobytes(): label for image, label in zip(examples["image"], examples["label"])}
  for c in arrays.client_ids:
    assert arrays.y[c].dtype == np.int32
    assert arrays.y[c].tolist() == [labels[image.tobytes()] for image in _pixels(task, arrays.x[c])]


def test_version_directories():
  assert cifar_files.tfds_version_dir("cifar10") == CIFAR10_DIR
  assert cifar_files.tfds_version_dir("cifar100") == CIFAR100_DIR
  assert cifar_files.tfds_version_dir("cifar10_corrupted/gaussian_noise_3") == SHIFT_DIR
  assert cifar_files.tfds_version_dir(cifar.OOD_DATASET) == OOD_DIR
  assert "gaussian_noise" in cifar.SHIFT_CORRUPTIONS
  assert len(cifar.SHIFT_CORRUPTIONS) == 19


def _binary_rows(images, labels):
  """CIFAR-10's binary format (tfds' source): a label byte, then R, G, B."""
  return b"".join(
    bytes([label]) + image.transpose(2, 0, 1).tobytes() for image, label in zip(images, labels)
  )


def test_prepared_cifar10_reads_as_the_archive(tmp_path, caplog):
  archive = write_cifar10(tmp_path / "archive")
  (x, y), (test_x, test_y) = cifar_files.load_archive(
    str(archive), cifar_files.CIFAR10_ARCHIVE, cifar.CIFAR10_LABELS
  )
  binary = tmp_path / "download" / "cifar-10-batches-bin"
  binary.mkdir(parents=True)
  for i in range(5):
    (binary / f"data_batch_{i + 1}.bin").write_bytes(
      _binary_rows(x[40 * i : 40 * (i + 1)], y[40 * i : 40 * (i + 1)])
    )
  (binary / "test_batch.bin").write_bytes(_binary_rows(test_x, test_y))
  (binary / "batches.meta.txt").write_text("\n".join(cifar.CIFAR10_LABELS))
  data_dir = tmp_path / "tfds"
  with (
    mock.patch("tensorflow_datasets.core.utils.gcs_utils._is_gcs_disabled", True),
    mock.patch.object(
      tfds.download.DownloadManager,
      "download_and_extract",
      lambda self, url: str(tmp_path / "download"),
    ),
  ):
    tfds.builder("cifar10", data_dir=str(data_dir)).download_and_prepare(
      download_config=tfds.download.DownloadConfig(
        try_download_gcs=False, compute_stats=tfds.download.ComputeStatsMode.SKIP
      )
    )
  stored = tfds.builder("cifar10", data_dir=str(data_dir)).as_dataset(split="train")
  assert [e["id"] for e in tfds.as_numpy(stored)] != [
    f"train_{i:05d}".encode() for i in range(200)
  ]  # tfds shuffles.

  caplog.set_level(logging.INFO)
  from_tfds = cifar.CIFAR10.load_data(str(data_dir), partition=SMALL, seed=2)
  from_archive = cifar.CIFAR10.load_data(str(archive), partition=SMALL, seed=2)
  assert from_tfds.source == f"tfds:{data_dir / CIFAR10_DIR}"
  for split in ("train", "test"):
    tfds_split = getattr(from_tfds, split)
    archive_split = getattr(from_archive, split)
    assert tfds_split.client_ids == archive_split.client_ids
    for c in tfds_split.client_ids:
      np.testing.assert_array_equal(tfds_split.x[c], archive_split.x[c])
      np.testing.assert_array_equal(tfds_split.y[c], archive_split.y[c])
  np.testing.assert_array_equal(from_tfds.server.unlabeled, from_archive.server.unlabeled)
  np.testing.assert_array_equal(from_tfds.server.validation_y, from_archive.server.validation_y)
  assert from_tfds.shift is None and from_tfds.ood is None
  [line] = [
    r.getMessage()
    for r in caplog.records
    if "not prepared" in r.getMessage() and str(data_dir) in r.getMessage()
  ]
  assert line.startswith(
    "cifar10: no shift or ood set: tfds has not prepared "
    "cifar10_corrupted/gaussian_noise_3 or svhn_cropped"
  )


def test_tfds_cifar10_with_shift_and_ood(tmp_path, mock_tfds):
  _prepare(tmp_path, CIFAR10_DIR, SHIFT_DIR, OOD_DIR)
  data = cifar.CIFAR10.load_data(str(tmp_path), partition=SMALL, seed=3)
  assert data.source == f"tfds:{tmp_path / CIFAR10_DIR}"
  train, test = EXAMPLES["cifar10", "train"], EXAMPLES["cifar10", "test"]
  assert data.train.client_ids == ("client_0", "client_1", "client_2", "client_3")
  assert data.train.num_examples() == 200 - 40
  assert data.test.num_examples() == 50
  for split in (data.train, data.test):
    for c in split.client_ids:
      assert split.x[c].dtype == np.float32 and split.y[c].dtype == np.int32
      assert split.x[c].shape[1:] == (32, 32, 3)
  server = np.concatenate([data.server.unlabeled, data.server.validation_x])
  assert _rows(_pixels(cifar.CIFAR10, data.train.concatenated()[0])) | _rows(
    _pixels(cifar.CIFAR10, server)
  ) == _rows(train["image"])
  assert _rows(_pixels(cifar.CIFAR10, data.test.concatenated()[0])) == _rows(test["image"])
  _check_labels(cifar.CIFAR10, data.train, train)
  _check_labels(cifar.CIFAR10, data.test, test)

  for field, name, n in (
    ("shift", "cifar10_corrupted/gaussian_noise_3", 20),
    ("ood", "svhn_cropped", 30),
  ):
    arrays = getattr(data, field)
    client = name.split("/")[0]
    assert arrays.client_ids == (client,)
    examples = EXAMPLES[name, "test"]
    assert arrays.x[client].shape == (n, 32, 32, 3)
    assert arrays.x[client].dtype == np.float32
    # Standardized with CIFAR-10's statistics, like the test set.
    np.testing.assert_allclose(arrays.x[client], cifar.CIFAR10.standardize(examples["image"]))
    np.testing.assert_array_equal(arrays.y[client], examples["label"])
    assert arrays.y[client].dtype == np.int32


def test_tfds_split_is_reproducible_by_seed(tmp_path, mock_tfds):
  _prepare(tmp_path, CIFAR10_DIR)
  config = partition.PartitionConfig(
    partition="dirichlet",
    num_clients=4,
    server_unlabeled_examples=30,
    server_validation_examples=10,
  )
  first, again, other = (
    cifar.CIFAR10.load_data(str(tmp_path), partition=config, seed=seed) for seed in (5, 5, 6)
  )
  for c in first.train.client_ids:
    np.testing.assert_array_equal(first.train.x[c], again.train.x[c])
    np.testing.assert_array_equal(first.train.y[c], again.train.y[c])
  np.testing.assert_array_equal(first.server.unlabeled, again.server.unlabeled)
  assert any(not np.array_equal(first.train.y[c], other.train.y[c]) for c in first.train.client_ids)


def test_shift_corruption_and_severity_choose_the_set(tmp_path, mock_tfds):
  _prepare(tmp_path, CIFAR10_DIR, "cifar10_corrupted/fog_5/1.0.0")
  default = cifar.CIFAR10.load_data(str(tmp_path), partition=SMALL)
  assert default.shift is None  # gaussian_noise_3 is not prepared.
  fog = cifar.CIFAR10.load_data(
    str(tmp_path), partition=SMALL, shift_corruption="fog", shift_severity=5
  )
  np.testing.assert_array_equal(
    fog.shift.y["cifar10_corrupted"], EXAMPLES["cifar10_corrupted/fog_5", "test"]["label"]
  )
  for corruption, severity in (("fog", 6), ("blur", 3)):
    with pytest.raises(ValueError, match="unknown shift corruption"):
      cifar.CIFAR10.load_data(
        str(tmp_path), partition=SMALL, shift_corruption=corruption, shift_severity=severity
      )


def test_tfds_cifar100_has_ood_but_no_shift(tmp_path, mock_tfds):
  _prepare(tmp_path, CIFAR100_DIR, SHIFT_DIR, OOD_DIR)
  data = cifar.CIFAR100.load_data(str(tmp_path), partition=SMALL)
  assert data.source == f"tfds:{tmp_path / CIFAR100_DIR}"
  assert data.train.num_examples() == 300 - 40
  _check_labels(cifar.CIFAR100, data.train, EXAMPLES["cifar100", "train"])
  assert data.shift is None
  assert data.ood.client_ids == ("svhn_cropped",)
  np.testing.assert_allclose(
    data.ood.x["svhn_cropped"],
    cifar.CIFAR100.standardize(EXAMPLES["svhn_cropped", "test"]["image"]),
  )


def test_evaluation_sets_are_found_in_tfds_default_directory(tmp_path, monkeypatch, mock_tfds):
  write_cifar10(tmp_path / "data")
  _prepare(tmp_path / "tfds", SHIFT_DIR, OOD_DIR)
  monkeypatch.setenv(cifar_files.TFDS_DATA_DIR_ENV, str(tmp_path / "tfds"))
  data = cifar.CIFAR10.load_data(str(tmp_path / "data"), partition=SMALL)
  assert data.source.startswith("cifar10:")
  assert data.shift.client_ids == ("cifar10_corrupted",)
  assert data.ood.client_ids == ("svhn_cropped",)


# Where each layout puts CIFAR-10: a prepared tfds dataset and/or the archive.
_PLACES = {
  "flag": "flag",  # --data_dir.
  "env": "env",  # $TFF_ENS_DATA_DIR.
  "tfds_env": "tfds_env",  # $TFDS_DATA_DIR.
  "home_tfds": "home/tensorflow_datasets",
  "keras": "home/.keras/datasets",
}


@pytest.mark.parametrize(
  "layout, expected",
  [
    (dict(flag=("tfds", "archive"), home_tfds=("tfds",)), ("flag", "tfds")),
    (dict(flag=("archive",), env=("tfds",), home_tfds=("tfds",)), ("flag", "archive")),
    (dict(env=("tfds", "archive")), ("env", "tfds")),
    (dict(env=("archive",), home_tfds=("tfds",)), ("env", "archive")),
    (dict(tfds_env=("tfds",), home_tfds=("tfds",), keras=("archive",)), ("tfds_env", "tfds")),
    (dict(home_tfds=("tfds",), keras=("archive",)), ("home_tfds", "tfds")),
    (dict(keras=("archive",)), ("keras", "archive")),
  ],
  ids=[
    "flag-tfds",
    "flag-archive",
    "env-tfds",
    "env-archive",
    "tfds-data-dir",
    "home-tfds",
    "keras-cache",
  ],
)
def test_sources_are_tried_in_the_documented_order(
  tmp_path, monkeypatch, mock_tfds, layout, expected
):
  for place, kinds in layout.items():
    directory = tmp_path / _PLACES[place]
    if "tfds" in kinds:
      _prepare(directory, CIFAR10_DIR)
    if "archive" in kinds:
      write_cifar10(directory)
  if "env" in layout:
    monkeypatch.setenv(cifar.DATA_DIR_ENV, str(tmp_path / "env"))
  if "tfds_env" in layout:
    monkeypatch.setenv(cifar_files.TFDS_DATA_DIR_ENV, str(tmp_path / "tfds_env"))
  data = cifar.CIFAR10.load_data(
    str(tmp_path / "flag") if "flag" in layout else None, partition=SMALL
  )
  place, kind = expected
  directory = tmp_path / _PLACES[place]
  assert data.source == (
    f"tfds:{directory / CIFAR10_DIR}"
    if kind == "tfds"
    else f"cifar10:{directory / 'cifar-10-batches-py'}"
  )


def test_unreadable_prepared_dataset_is_one_line(tmp_path):
  _prepare(tmp_path, CIFAR10_DIR)  # No mock: "{}" is no dataset_info.
  write_cifar10(tmp_path)  # Not used: the tfds dataset comes first.
  with pytest.raises(tasks.DataError) as error:
    cifar.CIFAR10.load_data(str(tmp_path), partition=SMALL)
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"{tmp_path / CIFAR10_DIR}: cannot read its train split")
  assert message.endswith(f"tfds build cifar10 --data_dir={tmp_path}")
