"""Tests of the CIFAR tasks: archives written here in the exact upstream format
(pickled dicts, uint8 rows of 3072), the partitions, the models, augmentation,
and short runs of every algorithm on a generated archive."""

import dataclasses
import json
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tasks
from tasks import cifar
from tasks import cifar_files
from tasks import partition
from tests.femnist_runs import reference_test_metrics
from tff_ens import algorithms
from tff_ens import run_files
from tff_ens.program import experiment
from tff_ens.program import finished_runs
from tff_ens.program import simulation
from tff_ens.program import training
from tff_ens.server import server_data

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _images(rng, n):
  return rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)


def _dump(path, content):
  with open(path, "wb") as f:
    pickle.dump(content, f, protocol=2)  # As the Python 2 originals.


def _labels(rng, n, num_classes):
  return rng.permutation(np.arange(n) % num_classes).tolist()


def write_cifar10(root, per_batch=40, test=50, seed=0) -> pathlib.Path:
  """cifar-10-batches-py/ as the CIFAR-10 tarball extracts, with fake images."""
  rng = np.random.default_rng(seed)
  directory = pathlib.Path(root) / "cifar-10-batches-py"
  directory.mkdir(parents=True)
  for i in range(1, 6):
    _dump(
      directory / f"data_batch_{i}",
      {
        b"batch_label": f"training batch {i} of 5".encode(),
        b"labels": _labels(rng, per_batch, 10),
        b"data": _images(rng, per_batch),
        b"filenames": [b"image.png"] * per_batch,
      },
    )
  _dump(
    directory / "test_batch",
    {
      b"batch_label": b"testing batch 1 of 1",
      b"labels": _labels(rng, test, 10),
      b"data": _images(rng, test),
      b"filenames": [b"image.png"] * test,
    },
  )
  _dump(
    directory / "batches.meta",
    {
      b"label_names": [n.encode() for n in cifar.CIFAR10_LABELS],
      b"num_cases_per_batch": per_batch,
      b"num_vis": 3072,
    },
  )
  return directory


def write_cifar100(root, train=300, test=100, seed=0) -> pathlib.Path:
  """cifar-100-python/ as the CIFAR-100 tarball extracts, with fake images."""
  rng = np.random.default_rng(seed)
  directory = pathlib.Path(root) / "cifar-100-python"
  directory.mkdir(parents=True)
  for name, n in (("train", train), ("test", test)):
    fine = _labels(rng, n, 100)
    _dump(
      directory / name,
      {
        b"filenames": [b"image.png"] * n,
        b"batch_label": name.encode(),
        b"fine_labels": fine,
        b"coarse_labels": [f // 5 for f in fine],
        b"data": _images(rng, n),
      },
    )
  _dump(
    directory / "meta",
    {
      b"fine_label_names": [n.encode() for n in cifar.CIFAR100_LABELS],
      b"coarse_label_names": [f"superclass_{i}".encode() for i in range(20)],
    },
  )
  return directory


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
  """No data unless a test provides it: no env vars, an empty ~, no network.

  Downloads go to a proxy on the discard port (connection refused); the TFF
  worker, on localhost, is reached directly (gRPC honors the variables too).
  """
  monkeypatch.delenv(cifar.DATA_DIR_ENV, raising=False)
  monkeypatch.delenv(cifar_files.TFDS_DATA_DIR_ENV, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
    monkeypatch.setenv(name, "http://127.0.0.1:9")
  for name in ("no_proxy", "NO_PROXY"):
    monkeypatch.setenv(name, "localhost,127.0.0.1")


@pytest.fixture(scope="module")
def cifar10_dir(tmp_path_factory):
  return write_cifar10(tmp_path_factory.mktemp("data"))


# Small enough for the generated archive (200 training, 50 test examples).
SMALL = partition.PartitionConfig(
  num_clients=4, server_unlabeled_examples=30, server_validation_examples=10, step_minor_examples=1
)


# The archive loader -----------------------------------------------------------


def test_registered_tasks():
  assert tasks.get_task("cifar10") is cifar.CIFAR10
  assert tasks.get_task("cifar100").NUM_CLASSES == 100
  assert len(set(cifar.CIFAR100_LABELS)) == 100
  assert list(cifar.CIFAR100_LABELS) == sorted(cifar.CIFAR100_LABELS)
  for task in (cifar.CIFAR10, cifar.CIFAR100):
    assert task.INPUT_SHAPE == (32, 32, 3)
    assert len(task.CLASS_LABELS) == task.NUM_CLASSES


def test_archive_rows_are_red_green_blue_planes(tmp_path):
  directory = write_cifar10(tmp_path, per_batch=10, test=10)
  path = directory / "data_batch_2"
  with open(path, "rb") as f:
    batch = pickle.load(f, encoding="bytes")
  row = batch[b"data"][3]
  (x, y), (test_x, test_y) = cifar_files.load_archive(
    str(directory), cifar_files.CIFAR10_ARCHIVE, cifar.CIFAR10_LABELS
  )
  assert x.shape == (50, 32, 32, 3) and x.dtype == np.uint8
  assert test_x.shape == (10, 32, 32, 3) and test_y.dtype == np.int32
  image = x[10 + 3]  # Batch 2 follows the 10 examples of batch 1.
  for channel in range(3):
    for r, c in ((0, 0), (1, 2), (31, 30)):
      assert image[r, c, channel] == row[channel * 1024 + r * 32 + c]
  assert y[13] == batch[b"labels"][3]


def test_cifar100_reads_fine_labels(tmp_path):
  directory = write_cifar100(tmp_path)
  with open(directory / "train", "rb") as f:
    fine = pickle.load(f, encoding="bytes")[b"fine_labels"]
  (_, y), (test_x, _) = cifar_files.load_archive(
    str(directory), cifar_files.CIFAR100_ARCHIVE, cifar.CIFAR100_LABELS
  )
  np.testing.assert_array_equal(y, fine)
  assert len(test_x) == 100


def test_archive_is_found_by_flag_variable_and_keras_cache(tmp_path, monkeypatch):
  directory = write_cifar10(tmp_path / "data")
  task = cifar.CIFAR10
  assert task.find_data(str(tmp_path / "data")) == ("archive", str(directory))
  assert task.find_data(str(directory)) == ("archive", str(directory))
  monkeypatch.setenv(cifar.DATA_DIR_ENV, str(tmp_path / "data"))
  assert task.find_data() == ("archive", str(directory))
  monkeypatch.delenv(cifar.DATA_DIR_ENV)
  cache = tmp_path / "home" / ".keras" / "datasets"
  cache.mkdir(parents=True)
  directory.rename(cache / directory.name)
  assert task.find_data() == ("archive", str(cache / directory.name))


def test_no_data_anywhere_is_one_line_with_the_fixes():
  with pytest.raises(tasks.DataError) as error:
    cifar.CIFAR10.load_data()
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith("no cifar10 data found: pass --data_dir=DIR")
  assert cifar.DATA_DIR_ENV in message and "network" in message


def test_directory_without_the_archive_is_named(tmp_path):
  with pytest.raises(
    tasks.DataError, match="holds no cifar-100-python/ and no tfds cifar100/3.0.2/"
  ) as error:
    cifar.CIFAR100.load_data(str(tmp_path))
  assert "\n" not in str(error.value)


def _truncate(path):
  path.write_bytes(path.read_bytes()[:100])


def _rewrite(path, **changes):
  with open(path, "rb") as f:
    batch = pickle.load(f, encoding="bytes")
  batch.update({k.encode(): v for k, v in changes.items()})
  _dump(path, {k: v for k, v in batch.items() if v is not None})


class _Exploit:
  def __reduce__(self):
    return (print, ("this must not run",))


@pytest.mark.parametrize(
  "file, damage, message",
  [
    ("data_batch_3", lambda p: p.unlink(), "is missing"),
    ("test_batch", _truncate, "not a CIFAR pickle"),
    ("data_batch_1", lambda p: _dump(p, [1, 2]), "holds a list"),
    (
      "data_batch_1",
      lambda p: _dump(p, {b"data": _Exploit()}),
      "asks to load __builtin__.print, which a CIFAR batch never holds",
    ),
    (
      "data_batch_5",
      lambda p: _rewrite(p, data=np.zeros((40, 3072))),
      "data must be uint8 rows of 3072",
    ),
    (
      "data_batch_5",
      lambda p: _rewrite(p, data=np.zeros((40, 1024), np.uint8)),
      "data must be uint8 rows of 3072",
    ),
    (
      "data_batch_2",
      lambda p: _rewrite(p, labels=[1, 2]),
      "40 images but labels is not a list of 40",
    ),
    (
      "test_batch",
      lambda p: _rewrite(p, labels=[10] * 50),
      r"labels must be in 0..9, found \[10, 10, 10\]",
    ),
    ("data_batch_4", lambda p: _rewrite(p, labels=None), "no labels entry"),
    (
      "batches.meta",
      lambda p: _rewrite(p, label_names=[b"apple"] * 100),
      "label_names are not the 10 classes",
    ),
  ],
)
def test_damaged_archive_is_one_line_naming_file_and_fix(tmp_path, file, damage, message):
  directory = write_cifar10(tmp_path)
  damage(directory / file)
  with pytest.raises(tasks.DataError, match=message) as error:
    cifar.CIFAR10.load_data(str(tmp_path), partition=SMALL)
  assert "\n" not in str(error.value)
  assert str(directory / file) in str(error.value)
  assert "cifar-10-python.tar.gz" in str(error.value)


# Partitions of labels ---------------------------------------------------------


LABELS = np.random.default_rng(7).permutation(np.arange(1000) % 10)


def _check_split(parts, n):
  joined = np.concatenate(parts)
  assert len(joined) == n and len(np.unique(joined)) == n  # Disjoint, all.
  assert all(len(p) for p in parts)


@pytest.mark.parametrize("scheme", partition.PARTITIONS)
def test_partition_is_disjoint_complete_and_seeded(scheme):
  config = partition.PartitionConfig(partition=scheme, num_clients=8)
  parts = partition.partition(LABELS, config, seed=1)
  assert len(parts) == 8
  _check_split(parts, len(LABELS))
  again = partition.partition(LABELS, config, seed=1)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))
  other = partition.partition(LABELS, config, seed=2)
  assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_iid_sizes_differ_by_at_most_one():
  parts = partition.partition(
    LABELS, partition.PartitionConfig(partition="iid", num_clients=7), seed=0
  )
  assert {len(p) for p in parts} == {142, 143}


def test_classes_partition_gives_each_client_n_labels():
  # 100 examples of each class: shards of 100 / n examples.
  for n, most in ((1, 1), (2, 2), (5, 5), (3, 6)):  # Shards of 33 straddle.
    parts = partition.partition(
      LABELS,
      partition.PartitionConfig(partition="classes", num_clients=10, classes_per_client=n),
      seed=0,
    )
    counts = partition.class_counts([LABELS[p] for p in parts], 10)
    assert all(1 <= np.count_nonzero(row) <= most for row in counts)
    assert counts.sum() == 1000 and all(abs(len(p) - 100) <= n for p in parts)


def test_step_gives_minor_examples_of_every_class_and_two_majors():
  parts = partition.partition(
    LABELS,
    partition.PartitionConfig(
      partition="step", num_clients=5, classes_per_client=2, step_minor_examples=4
    ),
    seed=0,
  )
  counts = partition.class_counts([LABELS[p] for p in parts], 10)
  assert (counts >= 4).all()
  # Beyond the 4 minor examples, each client holds its 2 shards of 80.
  majors = counts - 4
  assert (majors.sum(1) == 160).all()
  assert all(np.count_nonzero(row) <= 2 for row in majors)


def test_dirichlet_alpha_controls_the_skew():
  def top_share(alpha):
    parts = partition.partition(
      LABELS, partition.PartitionConfig(partition="dirichlet", num_clients=10, alpha=alpha), seed=0
    )
    counts = partition.class_counts([LABELS[p] for p in parts], 10)
    return np.mean(counts.max(1) / counts.sum(1))

  assert top_share(0.1) > 0.5
  assert top_share(100.0) < 0.2


def test_split_like_follows_the_clients_classes():
  train = [np.array([0, 0, 1]), np.array([1, 2, 2, 2])]
  test = np.array([0, 0, 0, 0, 1, 1, 2, 2, 2, 3])
  parts = partition.split_like(train, test, seed=0)
  _check_split(parts, len(test))
  # No client trains on class 3: it goes by size, to the larger client.
  assert sorted(test[parts[0]].tolist()) == [0, 0, 0, 0, 1]
  assert sorted(test[parts[1]].tolist()) == [1, 2, 2, 2, 3]


@pytest.mark.parametrize(
  "config, message",
  [
    (dict(partition="shards"), "unknown partition=shards"),
    (dict(num_clients=0), "num_clients must be a positive integer"),
    (dict(alpha=0.0), "alpha must be > 0"),
    (dict(server_unlabeled_examples=-1), "server_unlabeled_examples must be >= 0"),
  ],
)
def test_bad_partition_flags(config, message):
  with pytest.raises(ValueError, match=message):
    partition.PartitionConfig(**config)


def test_partition_report_counts_classes():
  report = partition.partition_report(
    ("client_0", "client_1"), [np.array([0, 0, 2]), np.array([1])], 3
  )
  assert report.splitlines() == [
    "client        n 0 1 2",
    "client_0      3 2 0 1",
    "client_1      1 0 1 0",
  ]


# The federated data -----------------------------------------------------------


def _hashes(x):
  return [row.tobytes() for row in np.ascontiguousarray(x)]


@pytest.mark.parametrize("scheme", partition.PARTITIONS)
def test_load_data_splits_train_server_and_test(cifar10_dir, scheme):
  config = dataclasses.replace(SMALL, partition=scheme)
  data = cifar.CIFAR10.load_data(str(cifar10_dir), partition=config, seed=3)
  train = data.train
  assert train.client_ids == ("client_0", "client_1", "client_2", "client_3")
  assert train.num_examples() == 200 - 40
  assert len(data.server.unlabeled) == 30
  assert len(data.server.validation_y) == 10
  train_x = _hashes(train.concatenated()[0])
  server = _hashes(data.server.unlabeled) + _hashes(data.server.validation_x)
  test = _hashes(data.test.concatenated()[0])
  assert len(set(train_x + server)) == 200  # No example in two places.
  assert data.test.num_examples() == 50 and len(set(test)) == 50
  assert not set(test) & set(train_x + server)
  assert train.x["client_0"].dtype == np.float32
  assert train.x["client_0"].shape[1:] == (32, 32, 3)
  assert not data.new_clients.client_ids
  for c in data.test.client_ids:  # Test classes are training classes.
    assert set(data.test.y[c]) <= set(train.y[c])
  again = cifar.CIFAR10.load_data(str(cifar10_dir), partition=config, seed=3)
  for c in train.client_ids:
    np.testing.assert_array_equal(train.x[c], again.train.x[c])


def test_images_are_standardized_with_the_archive_statistics(cifar10_dir):
  data = cifar.CIFAR10.load_data(str(cifar10_dir), partition=SMALL)
  (x, _), _ = cifar_files.load_archive(
    str(cifar10_dir), cifar_files.CIFAR10_ARCHIVE, cifar.CIFAR10_LABELS
  )
  pixels = (
    data.train.x["client_1"] * np.array(cifar_files.CIFAR10_ARCHIVE.std)
    + np.array(cifar_files.CIFAR10_ARCHIVE.mean)
  ) * 255
  np.testing.assert_allclose(pixels, np.round(pixels), atol=1e-3)
  assert set(_hashes(np.round(pixels).astype(np.uint8))) <= set(_hashes(x))


def test_server_split_comes_from_the_task(cifar10_dir):
  data = cifar.CIFAR10.load_data(str(cifar10_dir), partition=SMALL)
  split = server_data.server_split(data, cifar.CIFAR10, seed=0)
  np.testing.assert_array_equal(split.unlabeled, data.server.unlabeled)
  np.testing.assert_array_equal(split.validation_y, data.server.validation_y)
  assert "set aside from training" in split.source


def test_server_split_may_not_hold_test_images(cifar10_dir):
  data = cifar.CIFAR10.load_data(str(cifar10_dir), partition=SMALL)
  leaky = dataclasses.replace(
    data, server=dataclasses.replace(data.server, unlabeled=data.test.concatenated()[0][:2])
  )
  with pytest.raises(tasks.DataError, match="2 images of the test data"):
    server_data.server_split(leaky, cifar.CIFAR10, seed=0)


@pytest.mark.parametrize(
  "change, message",
  [
    (dict(num_clients=200), "--num_clients=200 exceeds the 160"),
    (dict(server_unlabeled_examples=190), "leave none of its 200 training examples"),
    (
      dict(partition="step", step_minor_examples=10),
      "--step_minor_examples=10 for 4 clients needs 40 examples",
    ),
  ],
)
def test_data_too_small_for_the_split(cifar10_dir, change, message):
  with pytest.raises(tasks.DataError, match=message) as error:
    cifar.CIFAR10.load_data(str(cifar10_dir), partition=dataclasses.replace(SMALL, **change))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize(
  "change, error, message",
  [
    (dict(partition="shards"), experiment.UsageError, "unknown --partition=shards"),
    (dict(partition_alpha=-1.0), experiment.UsageError, "--partition_alpha must be > 0"),
    (
      dict(task="femnist", num_clients=3),
      experiment.UsageError,
      "--num_clients=3: applies to a pooled split, and the task's clients are its own",
    ),
  ],
)
def test_bad_partition_flags_of_a_run(cifar10_dir, tmp_path, change, error, message):
  config = experiment.ExperimentConfig(
    task="cifar10", data_dir=str(cifar10_dir), output_dir=str(tmp_path)
  )
  with pytest.raises(error, match=message):
    training.run_experiment(dataclasses.replace(config, **change))


# Models and augmentation ------------------------------------------------------


@pytest.mark.parametrize("task", [cifar.CIFAR10, cifar.CIFAR100], ids=repr)
@pytest.mark.parametrize("name", cifar.MODEL_NAMES)
def test_models_map_images_to_logits(task, name):
  model = task.build_model(name, seed=1)
  assert model.input_shape == (None, 32, 32, 3)
  assert model.output_shape == (None, task.NUM_CLASSES)
  logits = model(np.zeros((2, 32, 32, 3), np.float32))
  assert np.isfinite(logits.numpy()).all()


def test_convnet_has_fedbe_parameter_count():
  conv = 3 * 3 * 3 * 32 + 32 + 3 * 3 * 32 * 64 + 64 + 3 * 3 * 64 * 64 + 64
  dense = 4 * 4 * 64 * 64 + 64 + 64 * 10 + 10  # 32 -> 30 -> 15 -> 13 -> 6 -> 4.
  assert cifar.CIFAR10.build_model("cnn").count_params() == conv + dense
  assert conv + dense == 122_570


def test_resnet32_depth_and_group_norm():
  model = cifar.CIFAR10.build_model("resnet32", norm="group")
  convs = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Conv2D)]
  dense = [layer for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)]
  assert len([c for c in convs if c.kernel_size == (3, 3)]) + len(dense) == 32
  assert not [
    layer for layer in model.layers if isinstance(layer, tf.keras.layers.BatchNormalization)
  ]
  with pytest.raises(ValueError, match="no normalization layers"):
    cifar.CIFAR10.build_model("cnn", norm="group")
  with pytest.raises(ValueError, match="unknown model 'resnet56'"):
    cifar.CIFAR10.build_model("resnet56")


def test_augmentation_is_a_seeded_flip_and_crop():
  x = tf.constant(np.random.default_rng(0).random((32, 32, 3)), tf.float32)
  y = tf.constant(4, tf.int32)
  seed = tf.constant([5, 9], tf.int64)
  first, label = cifar.augment_training_example(x, y, seed)
  again, _ = cifar.augment_training_example(x, y, seed)
  assert int(label) == 4 and first.shape == (32, 32, 3)
  np.testing.assert_array_equal(first.numpy(), again.numpy())
  # Each result is a 32x32 window of the padded image, maybe mirrored.
  padded = np.pad(x.numpy(), ((4, 4), (4, 4), (0, 0)))
  windows = [padded[r : r + 32, c : c + 32] for r in range(9) for c in range(9)]
  outputs = [
    cifar.augment_training_example(x, y, tf.constant([s, 0], tf.int64))[0].numpy()
    for s in range(12)
  ]
  for out in outputs:
    assert any(np.array_equal(out, w) or np.array_equal(out[:, ::-1], w) for w in windows)
  assert len({o.tobytes() for o in outputs}) > 6


def test_client_dataset_augments_training_examples_only_when_asked():
  x = np.random.default_rng(0).random((6, 32, 32, 3)).astype(np.float32)
  y = np.arange(6, dtype=np.int32)
  plain = simulation.client_dataset(x, y, epochs=1, batch_size=6, seed=1)
  augmented = simulation.client_dataset(
    x, y, epochs=2, batch_size=6, seed=1, augmentation=cifar.CIFAR10.TRAIN_AUGMENTATION
  )
  assert augmented.element_spec == plain.element_spec
  ((plain_x, plain_y),) = plain.as_numpy_iterator()
  assert {row.tobytes() for row in plain_x} == {row.tobytes() for row in x}
  batches = list(augmented.as_numpy_iterator())
  again = list(
    simulation.client_dataset(
      x, y, epochs=2, batch_size=6, seed=1, augmentation=cifar.CIFAR10.TRAIN_AUGMENTATION
    ).as_numpy_iterator()
  )
  assert len(batches) == 2
  for (a, b), (c, d) in zip(batches, again):
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(b, d)
  assert sorted(batches[0][1]) == sorted(plain_y)
  assert {r.tobytes() for r in batches[0][0]} != {r.tobytes() for r in x}


# Every algorithm on a generated archive ---------------------------------------


def _quick(data_dir, output_dir, **changes):
  """A small run of `changes["algorithm"]` (default fedavg), with the flags it reads."""
  flags = dict(
    task="cifar10",
    data_dir=str(data_dir),
    num_clients=4,
    server_unlabeled_examples=32,
    server_validation_examples=16,
    step_minor_examples=1,
    rounds=2,
    clients_per_round=2,
    batch_size=16,
    client_lr=0.02,
    eval_every=1,
    checkpoint_every=2,
    distill_steps=25,
    distill_batch_size=16,
    distill_eval_every=5,
    distill_patience=10,
    fedbe_samples=2,
    ensemble_size=2,
    seed=1,
    output_dir=str(output_dir),
    **changes,
  )
  read = experiment.flags_read(flags.get("algorithm", "fedavg"), "cifar10")
  return experiment.ExperimentConfig(**{k: v for k, v in flags.items() if k in read})


# Each algorithm on another partition, so that every partition trains.
SMOKE_PARTITIONS = dict(zip(algorithms.ALGORITHMS, partition.PARTITIONS * 4))


# The server-distillation runs take 15-25 s each: run with `-m slow`.
SLOW_ON_CIFAR = ("fedbe", "feddf", "fedppd_distill")


@pytest.mark.parametrize(
  "algorithm",
  [
    pytest.param(a, marks=pytest.mark.slow) if a in SLOW_ON_CIFAR else a
    for a in algorithms.ALGORITHMS
  ],
)
def test_every_algorithm_runs_on_cifar(cifar10_dir, tmp_path, algorithm):
  # The summary's test metrics are those of the model(s) the run saved, computed apart
  # from its evaluator: each reloaded from its Keras file, its logits softmaxed and the
  # members' probabilities averaged in NumPy.
  config = _quick(
    cifar10_dir.parent, tmp_path, algorithm=algorithm, partition=SMOKE_PARTITIONS[algorithm]
  )
  summary = training.run_experiment(config)
  assert summary["task"] == "cifar10" and summary["algorithm"] == algorithm
  models = finished_runs.load_models(finished_runs.load_run(str(tmp_path)))
  accuracy, nll = reference_test_metrics(
    models, *experiment.resolve(config).load_data().test.concatenated()
  )
  assert summary["test_accuracy"] == pytest.approx(accuracy, abs=1e-12)
  assert summary["test_loss"] == pytest.approx(nll, rel=1e-5)
  assert summary["new_client_accuracy"] is None  # CIFAR has no new clients.
  with open(tmp_path / run_files.SUMMARY_FILE) as f:
    assert json.load(f)["config"]["partition"] == SMOKE_PARTITIONS[algorithm]


@pytest.mark.slow
def test_cli_runs_cifar100_with_a_resnet(tmp_path):
  data_dir = tmp_path / "data"
  write_cifar100(data_dir)
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "tff_ens.main",
      "--task=cifar100",
      f"--data_dir={data_dir}",
      "--model=resnet8",
      "--norm=group",
      "--partition=dirichlet",
      "--partition_alpha=0.5",
      "--num_clients=3",
      "--server_unlabeled_examples=20",
      "--server_validation_examples=10",
      "--rounds=1",
      "--clients_per_round=2",
      "--batch_size=32",
      f"--output_dir={tmp_path / 'out'}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert "test_accuracy=" in result.stdout
  with open(tmp_path / "out" / run_files.SUMMARY_FILE) as f:
    summary = json.load(f)
  assert summary["task"] == "cifar100"
  assert summary["config"]["partition_alpha"] == 0.5
