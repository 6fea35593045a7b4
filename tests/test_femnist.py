"""Tests of the FEMNIST task: the real LEAF slice, small hand-written LEAF directories, and a
small database in the format of TFF's emnist."""

import collections
import json
import math
import pathlib
import sqlite3
import time

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

import tasks
from tasks import femnist
from tasks import leaf
from tff_ens.program import experiment

DATA_DIR = pathlib.Path(__file__).resolve().parents[1].parent / "shared/data/femnist"


@pytest.fixture(scope="module")
def slice_data():
  return femnist.load_leaf(str(DATA_DIR))


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
  """No data unless a test provides it: no env var, an empty ~/.tff, and no network."""
  monkeypatch.delenv(femnist.DATA_DIR_ENV, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  for name in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
    monkeypatch.setenv(name, "http://127.0.0.1:9")  # The discard port: connection refused.
  for name in ("no_proxy", "NO_PROXY"):
    monkeypatch.delenv(name, raising=False)


# The real slice (counts from ../shared/data/femnist/README.md).


def test_slice_counts(slice_data):
  assert len(slice_data.train.client_ids) == 105
  assert slice_data.train.num_examples() == 14_708
  assert slice_data.test.num_examples() == 1_685
  assert len(slice_data.new_clients.client_ids) == 79
  assert slice_data.new_clients.num_examples() == 2_403
  assert slice_data.source == f"leaf:{DATA_DIR}"


def test_slice_splits(slice_data):
  train, test, new = (
    set(s.client_ids) for s in (slice_data.train, slice_data.test, slice_data.new_clients)
  )
  assert test <= train
  assert not new & train
  for split in (slice_data.train, slice_data.test, slice_data.new_clients):
    assert list(split.client_ids) == sorted(split.client_ids)
    assert set(split.x) == set(split.y) == set(split.client_ids)
    assert all(split.num_examples(c) > 0 for c in split.client_ids)


def test_slice_arrays(slice_data):
  for split in (slice_data.train, slice_data.test, slice_data.new_clients):
    for c in split.client_ids:
      x, y = split.x[c], split.y[c]
      assert x.dtype == np.float32 and x.shape == (len(y), 28, 28, 1)
      assert y.dtype == np.int32 and y.ndim == 1
    x, y = split.concatenated()
    assert 0.0 <= x.min() and x.max() == 1.0
    assert 0 <= y.min() and y.max() < femnist.NUM_CLASSES
    assert np.median(x) == 1.0  # Mostly background, which is 1.0.
  _, y = slice_data.train.concatenated()
  assert len(np.unique(y)) == femnist.NUM_CLASSES


def test_concatenated_follows_client_order(slice_data):
  sub = slice_data.train.subset(slice_data.train.client_ids[:3])
  x, y = sub.concatenated()
  n0 = sub.num_examples(sub.client_ids[0])
  assert len(y) == sub.num_examples()
  np.testing.assert_array_equal(x[:n0], sub.x[sub.client_ids[0]])
  np.testing.assert_array_equal(y[-sub.num_examples(sub.client_ids[2]) :], sub.y[sub.client_ids[2]])


def test_subset(slice_data):
  ids = slice_data.train.client_ids
  sub = slice_data.train.subset([ids[5], ids[2], ids[5]])
  assert sub.client_ids == (ids[2], ids[5])
  assert sub.num_examples() == slice_data.train.num_examples(
    ids[2]
  ) + slice_data.train.num_examples(ids[5])
  with pytest.raises(KeyError, match="nobody"):
    slice_data.train.subset(["nobody"])


def test_to_client_data(slice_data):
  client_data = slice_data.train.to_client_data()
  assert client_data.element_type_structure == collections.OrderedDict(
    x=tf.TensorSpec([28, 28, 1], tf.float32), y=tf.TensorSpec([], tf.int32)
  )
  assert client_data.client_ids == list(slice_data.train.client_ids)
  for c in client_data.client_ids:
    dataset = client_data.create_tf_dataset_for_client(c)
    assert dataset.cardinality().numpy() == slice_data.train.num_examples(c)
  c = client_data.client_ids[0]
  batch = next(iter(client_data.create_tf_dataset_for_client(c).batch(1000)))
  assert list(batch) == ["x", "y"]
  np.testing.assert_array_equal(batch["x"].numpy(), slice_data.train.x[c])
  np.testing.assert_array_equal(batch["y"].numpy(), slice_data.train.y[c])
  few = slice_data.test.subset(slice_data.test.client_ids[:3])
  all_clients = few.to_client_data().create_tf_dataset_from_all_clients()
  assert sum(1 for _ in all_clients) == few.num_examples()


def test_to_client_data_needs_clients():
  empty = tasks.data.ClientArrays((), {}, {}, femnist.INPUT_SHAPE)
  assert empty.num_examples() == 0
  assert empty.concatenated()[0].shape == (0, 28, 28, 1)
  with pytest.raises(ValueError, match="no clients"):
    empty.to_client_data()


def test_task_registry():
  assert tasks.get_task("femnist") is femnist
  assert tasks.get_task("femnist", "digits") is femnist.DIGITS
  with pytest.raises(ValueError, match="unknown task 'x': choose one of femnist"):
    tasks.get_task("x")
  with pytest.raises(ValueError, match="classes 'digits' applies to femnist, not cifar10"):
    tasks.get_task("cifar10", "digits")
  with pytest.raises(ValueError, match="unknown classes 'odd': choose one of all, digits"):
    tasks.get_task("femnist", "odd")


def test_new_writers_are_the_shift(slice_data):
  assert slice_data.shift is slice_data.new_clients
  assert slice_data.ood is None


def test_digits_keep_the_digits_and_make_the_letters_ood(slice_data):
  digits = femnist.digits_only(slice_data)
  for name in ("train", "test", "new_clients"):
    whole, kept = getattr(slice_data, name), getattr(digits, name)
    _, y = whole.concatenated()
    assert kept.num_examples() == np.sum(y < 10) > 0
    assert kept.concatenated()[1].max() == 9
    for c in kept.client_ids:  # Each writer's digits, in their order.
      np.testing.assert_array_equal(kept.x[c], whole.x[c][whole.y[c] < 10])
  assert digits.shift is digits.new_clients
  _, test_y = slice_data.test.concatenated()
  assert digits.ood.num_examples() == np.sum(test_y >= 10)
  assert digits.ood.concatenated()[1].min() >= 10
  assert set(digits.ood.client_ids) <= set(slice_data.test.client_ids)
  assert femnist.DIGITS.build_model("cnn").output_shape == (None, 10)
  assert femnist.DIGITS.CLASS_LABELS == "0123456789"


# Small LEAF directories written by the tests.


def _examples(n, label, seed):
  x = np.random.default_rng(seed).random((n, 784)).round(3)
  return x.tolist(), [label + i for i in range(n)]


def _leaf(writers):
  """A LEAF JSON object of writers: {id: (x rows, labels)}."""
  return {
    "users": list(writers),
    "num_samples": [len(y) for _, y in writers.values()],
    "user_data": {w: {"x": x, "y": y} for w, (x, y) in writers.items()},
  }


def _write(path, content):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(content if isinstance(content, str) else json.dumps(content))


def _tiny_leaf(root):
  """train: w1 (3 examples), w2 (3) and w0 (no examples); test: w1 (1) and w3 (2)."""
  _write(
    root / "train/a.json",
    _leaf({"w1": _examples(3, 0, 1), "w2": _examples(3, 59, 2), "w0": ([], [])}),
  )
  _write(root / "test/a.json", _leaf({"w1": _examples(1, 10, 3), "w3": _examples(2, 20, 4)}))
  return root


def _digests(images):
  return collections.Counter(row.tobytes() for row in images)


def test_label_skewed_split_pools_the_writers_once_and_is_fixed_by_the_seed(slice_data):
  config = tasks.partition.PartitionConfig(
    partition="dirichlet",
    num_clients=10,
    alpha=0.1,
    server_unlabeled_examples=2_000,
    server_validation_examples=500,
  )
  pooled = femnist.load_data(str(DATA_DIR), partition=config, seed=0)
  clients_x, clients_y = pooled.train.concatenated()
  server = pooled.server
  assert pooled.train.client_ids == tuple(f"client_{k}" for k in range(10))
  assert (len(server.unlabeled), len(server.validation_y)) == (2_000, 500)
  # Every training example of the writers is in exactly one place: a client or the server.
  writers_x, writers_y = slice_data.train.concatenated()
  assert _digests(np.concatenate([clients_x, server.unlabeled, server.validation_x])) == _digests(
    writers_x
  )
  assert collections.Counter(
    np.concatenate([clients_y, server.validation_y]).tolist()
  ) <= collections.Counter(writers_y.tolist())
  # The test examples are the writers' 1,685, split like the clients' labels.
  test_x, test_y = pooled.test.concatenated()
  assert _digests(test_x) == _digests(slice_data.test.concatenated()[0])
  for client in pooled.test.client_ids:
    assert set(pooled.test.y[client]) <= set(pooled.train.y[client])
  # Alpha 0.1 skews the labels: most of a client's examples are of few classes.
  top = [
    np.sort(np.bincount(pooled.train.y[c], minlength=62))[-5:].sum() / pooled.train.num_examples(c)
    for c in pooled.train.client_ids
  ]
  assert np.median(top) > 0.5
  assert pooled.new_clients.client_ids == slice_data.new_clients.client_ids
  again = femnist.load_data(str(DATA_DIR), partition=config, seed=0)
  other = femnist.load_data(str(DATA_DIR), partition=config, seed=1)
  for c in pooled.train.client_ids:
    np.testing.assert_array_equal(again.train.y[c], pooled.train.y[c])
  assert any(len(other.train.y[c]) != len(pooled.train.y[c]) for c in pooled.train.client_ids)


def test_a_split_without_server_examples_leaves_the_server_the_test_only_writers():
  config = tasks.partition.PartitionConfig(
    partition="classes",
    num_clients=20,
    classes_per_client=2,
    server_unlabeled_examples=0,
    server_validation_examples=0,
  )
  pooled = femnist.load_data(str(DATA_DIR), partition=config, seed=0)
  assert pooled.server is None
  assert pooled.train.num_examples() == 14_708
  with pytest.raises(tasks.DataError, match="--classes=digits keeps FEMNIST's writers"):
    femnist.DIGITS.load_data(str(DATA_DIR), partition=config)


def test_tiny_leaf_directory(tmp_path):
  data = femnist.load_leaf(str(_tiny_leaf(tmp_path / "leaf")))
  assert data.train.client_ids == ("w1", "w2")  # w0 has no examples: skipped.
  assert data.test.client_ids == ("w1",)
  assert data.new_clients.client_ids == ("w3",)
  assert data.source == f"leaf:{tmp_path / 'leaf'}"
  rows, labels = _examples(3, 59, 2)
  np.testing.assert_array_equal(data.train.y["w2"], [59, 60, 61])
  x = data.train.x["w2"]
  assert x.shape == (3, 28, 28, 1)
  assert x[1, 0, 5, 0] == np.float32(rows[1][5])  # Row-major 28x28.
  assert x[1, 2, 3, 0] == np.float32(rows[1][2 * 28 + 3])
  np.testing.assert_array_equal(data.new_clients.y["w3"], [20, 21])


def test_a_directory_is_parsed_once_and_its_images_read_from_disk(tmp_path, monkeypatch):
  root = _tiny_leaf(tmp_path / "leaf")
  monkeypatch.setenv(leaf.CACHE_DIR_ENV, str(tmp_path / "cache"))
  first = femnist.load_leaf(str(root))
  assert isinstance(first.train.x, tasks.data.ExamplesOnDisk)
  # The images are the JSON's rows, read back from the cache's file (not held).
  rows, _ = _examples(3, 59, 2)
  np.testing.assert_array_equal(
    first.train.x["w2"], np.float32(rows).reshape(3, 28, 28, 1), strict=True
  )
  # A second load reads the cache, not the JSON files.
  with monkeypatch.context() as patched:
    patched.setattr(leaf, "_load_leaf_file", lambda path: pytest.fail(f"parsed {path}"))
    again = femnist.load_leaf(str(root))
  for split in ("train", "test", "new_clients"):
    a, b = getattr(first, split), getattr(again, split)
    assert a.client_ids == b.client_ids
    for c in a.client_ids:
      np.testing.assert_array_equal(a.x[c], b.x[c], strict=True)
      np.testing.assert_array_equal(a.y[c], b.y[c], strict=True)
  # A file that changes is parsed again.
  _write(root / "test/a.json", _leaf({"w1": _examples(2, 30, 5)}))
  changed = femnist.load_leaf(str(root))
  np.testing.assert_array_equal(changed.test.y["w1"], [30, 31])
  assert changed.new_clients.client_ids == ()


def test_a_failed_parse_leaves_no_cache(tmp_path, monkeypatch):
  root = _tiny_leaf(tmp_path / "leaf")
  _write(root / "test/b.json", "{not json")
  monkeypatch.setenv(leaf.CACHE_DIR_ENV, str(tmp_path / "cache"))
  with pytest.raises(tasks.DataError, match="b.json: not valid JSON"):
    femnist.load_leaf(str(root))
  assert list((tmp_path / "cache" / "leaf").iterdir()) == []


def test_an_unwritable_cache_is_one_line_naming_the_variable(tmp_path, monkeypatch):
  (tmp_path / "file").write_text("")
  monkeypatch.setenv(leaf.CACHE_DIR_ENV, str(tmp_path / "file"))
  with pytest.raises(tasks.DataError, match=f"set {leaf.CACHE_DIR_ENV} to a writable directory"):
    femnist.load_leaf(str(_tiny_leaf(tmp_path / "leaf")))


def test_load_data_argument_beats_env_var(tmp_path, monkeypatch):
  arg, env = _tiny_leaf(tmp_path / "arg"), _tiny_leaf(tmp_path / "env")
  monkeypatch.setenv(femnist.DATA_DIR_ENV, str(env))
  assert femnist.load_data(str(arg)).source == f"leaf:{arg}"
  assert femnist.load_data().source == f"leaf:{env}"


def test_load_data_without_data_fails_fast_in_one_line(tmp_path):
  start = time.monotonic()
  with pytest.raises(tasks.data.DataError) as error:
    femnist.load_data()
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith("no FEMNIST data found: pass --data_dir=DIR")
  assert femnist.DATA_DIR_ENV in message
  assert str(tmp_path / "home/.tff") in message
  assert time.monotonic() - start < femnist.DOWNLOAD_TIMEOUT_SECONDS
  assert not (tmp_path / "home/.tff/emnist_all.sqlite").exists()


def _bad_json(root):
  _write(root / "test/b.json", '{"users": ["w9"], "num_samples": [1], "user_data": {"w9": {"x"')


def _mutate(split, mutation):
  """A change to the tiny layout that mutates the LEAF object of split/a.json."""

  def apply(root):
    path = root / split / "a.json"
    content = json.loads(path.read_text())
    mutation(content)
    _write(path, content)

  return apply


def _set_x(writer, rows):
  def apply(content):
    content["user_data"][writer]["x"] = rows

  return apply


def _set_y(writer, index, value):
  def apply(content):
    content["user_data"][writer]["y"][index] = value

  return apply


def _nan(content):
  content["user_data"]["w2"]["x"][2][400] = math.nan


def _pixel_255(content):
  content["user_data"]["w1"]["x"][0][3] = 255.0


def _more_samples(content):
  content["num_samples"][1] = 4  # Writer w2, which has 3 labels.


def _test_only(root):
  _write(root / "test/a.json", _leaf({}))


def _train_and_empty_test(root):
  _write(root / "train/a.json", _leaf({}))
  (root / "test").mkdir()


def _duplicate_writer(root):
  _write(root / "train/b.json", _leaf({"w2": _examples(1, 0, 5)}))


ERROR_CASES = {
  "missing dir": (lambda root: None, "missing", ["missing does not exist", "train/ and test/"]),
  "file not dir": (lambda root: _write(root / "file", "x"), "file", ["file is not a directory"]),
  "no train dir": (_test_only, "", ["has no train/ subdirectory"]),
  "no json in test": (_train_and_empty_test, "", ["test has no *.json files"]),
  "empty file": (
    lambda root: _write(root / "train/b.json", ""),
    "",
    ["train/b.json: empty", "truncated"],
  ),
  "truncated": (_bad_json, "", ["test/b.json: not valid JSON", "truncated"]),
  "not json": (
    lambda root: _write(root / "test/b.json", "hello"),
    "",
    ["test/b.json: not valid JSON"],
  ),
  "missing key": (
    _mutate("train", lambda c: c.pop("user_data")),
    "",
    ["train/a.json: missing key(s) user_data"],
  ),
  "short rows": (
    _mutate("train", _set_x("w2", [[1.0] * 783] * 3)),
    "",
    ["train/a.json: writer 'w2'", "784 values", "[3, 783]"],
  ),
  "ragged rows": (
    _mutate("test", _set_x("w3", [[1.0] * 784, [1.0] * 700])),
    "",
    ["test/a.json: writer 'w3'", "784 numbers", "[700, 784]"],
  ),
  "label 62": (
    _mutate("train", _set_y("w1", 1, 62)),
    "",
    ["train/a.json: writer 'w1'", "0..61", "[62]"],
  ),
  "label -1": (
    _mutate("test", _set_y("w3", 0, -1)),
    "",
    ["test/a.json: writer 'w3'", "0..61", "[-1]"],
  ),
  "label 1.5": (
    _mutate("test", _set_y("w3", 0, 1.5)),
    "",
    ["test/a.json: writer 'w3'", "labels must be integers"],
  ),
  "nan pixel": (_mutate("train", _nan), "", ["train/a.json: writer 'w2'", "NaN"]),
  "pixel 255": (_mutate("train", _pixel_255), "", ["train/a.json: writer 'w1'", "[0, 1]", "255.0"]),
  "duplicate writer": (
    _duplicate_writer,
    "",
    ["writer 'w2' appears in two train files", "train/a.json and", "train/b.json"],
  ),
  "num_samples": (
    _mutate("train", _more_samples),
    "",
    ["train/a.json: writer 'w2'", "num_samples says 4 but y has 3"],
  ),
}


@pytest.mark.parametrize("case", ERROR_CASES)
def test_leaf_errors_name_the_file(tmp_path, case):
  change, subdir, expected = ERROR_CASES[case]
  root = tmp_path / "leaf"
  if case not in ("missing dir", "file not dir", "no train dir", "no json in test"):
    _tiny_leaf(root)
  root.mkdir(exist_ok=True)
  change(root)
  with pytest.raises(tasks.data.DataError) as error:
    femnist.load_data(str(root / subdir) if subdir else str(root))
  message = str(error.value)
  assert "\n" not in message
  for part in expected:
    assert part in message


# A database in the format of TFF's emnist (tables of SqlClientData, protos of emnist).


def _proto(pixels, label):
  feature = tf.train.Feature
  return tf.train.Example(
    features=tf.train.Features(
      feature={
        "pixels": feature(float_list=tf.train.FloatList(value=pixels.ravel())),
        "label": feature(int64_list=tf.train.Int64List(value=[label])),
      }
    )
  ).SerializeToString()


def _write_tff_database(cache_dir):
  """Writers f0 (3 train, 1 test examples) and f1 (2 train, 2 test)."""
  cache_dir.mkdir(parents=True)
  rng = np.random.default_rng(0)
  with sqlite3.connect(cache_dir / "emnist_all.sqlite") as connection:
    connection.execute(
      "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT "
      "NULL, serialized_example_proto BLOB NOT NULL)"
    )
    connection.execute(
      "CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT "
      "NOT NULL, num_examples INTEGER NOT NULL)"
    )
    for client, counts in (("f1", (2, 2)), ("f0", (3, 1))):
      for split, n in zip(("all_train", "all_test"), counts):
        for i in range(n):
          pixels = rng.random((28, 28), dtype=np.float32)
          connection.execute(
            "INSERT INTO examples VALUES (?, ?, ?)",
            (split, client, _proto(pixels, 7 * i + len(client))),
          )
        connection.execute("INSERT INTO client_metadata VALUES (?, ?, ?)", (client, split, n))
  connection.close()


def test_load_tff_matches_tff_client_data(tmp_path):
  cache_dir = tmp_path / "cache"
  _write_tff_database(cache_dir)
  data = femnist.load_tff(str(cache_dir))
  assert data.source == "tff:emnist"
  assert data.train.client_ids == data.test.client_ids == ("f0", "f1")
  assert data.new_clients.client_ids == ()
  assert [data.train.num_examples(c) for c in ("f0", "f1")] == [3, 2]
  assert [data.test.num_examples(c) for c in ("f0", "f1")] == [1, 2]
  tff_train, tff_test = tff.simulation.datasets.emnist.load_data(
    only_digits=False, cache_dir=str(cache_dir)
  )
  for ours, theirs in ((data.train, tff_train), (data.test, tff_test)):
    for c in ours.client_ids:
      batch = next(iter(theirs.create_tf_dataset_for_client(c).batch(100)))
      np.testing.assert_array_equal(ours.x[c], batch["pixels"].numpy()[..., np.newaxis])
      np.testing.assert_array_equal(ours.y[c], batch["label"].numpy())
      assert ours.x[c].dtype == np.float32 and ours.y[c].dtype == np.int32


def test_load_data_falls_back_to_tff_cache(tmp_path):
  _write_tff_database(tmp_path / "home/.tff")
  assert femnist.load_data().source == "tff:emnist"


def test_load_tff_with_corrupt_cache(tmp_path):
  database = tmp_path / "cache/emnist_all.sqlite"
  _write(database, "not a database")
  with pytest.raises(tasks.data.DataError) as error:
    femnist.load_tff(str(tmp_path / "cache"))
  message = str(error.value)
  assert "\n" not in message
  assert message.startswith(f"{database}: ") and "delete it" in message
  assert database.exists()  # Only a partial download of our own is removed.


def test_split_flags_need_a_split_for_femnist():
  with pytest.raises(experiment.UsageError, match="--num_clients=5: applies to a pooled split"):
    experiment.ExperimentConfig(task="femnist", num_clients=5).validate()
  config = experiment.ExperimentConfig(task="femnist", partition="dirichlet")
  split = experiment.resolve(config).partition
  assert split.server_unlabeled_examples == femnist.SERVER_EXAMPLES[0]
  assert experiment.resolve(experiment.ExperimentConfig(task="femnist")).partition is None
  cifar = experiment.resolve(experiment.ExperimentConfig(task="cifar10"))
  assert cifar.partition.partition == "iid"
