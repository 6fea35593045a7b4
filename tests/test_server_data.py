"""The server's unlabeled and validation data (tff_ens/server/server_data.py)."""

import os

import numpy as np
import pytest

import tasks
from tasks import femnist
from tff_ens.server import server_data

DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "femnist")


@pytest.fixture(scope="module")
def data():
  return femnist.load_data(DATA_DIR)


def _hashes(x):
  return {row.tobytes() for row in np.ascontiguousarray(x)}


def test_default_split_is_disjoint_from_the_test_data(data):
  split = server_data.server_split(data, femnist, seed=0)
  test = _hashes(data.test.concatenated()[0])
  assert not _hashes(split.unlabeled) & test
  assert not _hashes(split.validation_x) & test
  # Unlabeled and validation come from different test-only writers, and
  # together they are all of those writers' examples.
  assert not _hashes(split.unlabeled) & _hashes(split.validation_x)
  assert len(split.unlabeled) + len(split.validation_y) == data.new_clients.num_examples()
  assert 0.1 < len(split.validation_y) / data.new_clients.num_examples() < 0.35
  assert split.validation_y.dtype == np.int32
  assert split.unlabeled.dtype == np.float32


def test_split_is_a_function_of_the_seed(data):
  a = server_data.server_split(data, femnist, seed=1)
  b = server_data.server_split(data, femnist, seed=1)
  c = server_data.server_split(data, femnist, seed=2)
  np.testing.assert_array_equal(a.validation_y, b.validation_y)
  np.testing.assert_array_equal(a.unlabeled, b.unlabeled)
  assert _hashes(a.validation_x) != _hashes(c.validation_x)


def test_npz_source_replaces_the_unlabeled_images(data, tmp_path):
  path = str(tmp_path / "server.npz")
  x = np.random.default_rng(0).random((7, 28, 28, 1), dtype=np.float32)
  np.savez(path, x=x)
  split = server_data.server_split(data, femnist, seed=0, unlabeled_path=path)
  np.testing.assert_array_equal(split.unlabeled, x)
  assert split.source == os.path.abspath(path)


def test_a_source_with_test_images_is_refused(data, tmp_path):
  path = str(tmp_path / "leak.npz")
  np.savez(path, x=data.test.concatenated()[0][:3])
  with pytest.raises(tasks.DataError, match="3 images of the test data"):
    server_data.server_split(data, femnist, seed=0, unlabeled_path=path)


@pytest.mark.parametrize(
  "arrays, message",
  [
    ({"images": np.zeros((2, 28, 28, 1))}, "no array 'x'"),
    ({"x": np.zeros((2, 28, 28))}, "shape"),
    ({"x": np.full((2, 28, 28, 1), np.nan)}, "NaN"),
  ],
)
def test_bad_npz_sources_get_one_line_errors(data, tmp_path, arrays, message):
  path = str(tmp_path / "bad.npz")
  np.savez(path, **arrays)
  with pytest.raises(tasks.DataError, match=message) as error:
    server_data.server_split(data, femnist, seed=0, unlabeled_path=path)
  assert "\n" not in str(error.value)
  assert "--server_data" in str(error.value)


def test_missing_npz_is_named(data, tmp_path):
  with pytest.raises(tasks.DataError, match="does not exist"):
    server_data.server_split(data, femnist, seed=0, unlabeled_path=str(tmp_path / "none.npz"))


def test_npy_source_streams_from_the_file_and_is_checked(data, tmp_path):
  path = str(tmp_path / "server.npy")
  x = np.random.default_rng(0).random((9, 28, 28, 1), dtype=np.float32)
  np.save(path, x)
  split = server_data.server_split(data, femnist, seed=0, unlabeled_path=path)
  assert isinstance(split.unlabeled, server_data.ImageFile)  # Not loaded.
  np.testing.assert_array_equal(split.unlabeled[0:9], x)
  np.save(path, data.test.concatenated()[0][:2])
  with pytest.raises(tasks.DataError, match="2 images of the test data"):
    server_data.server_split(data, femnist, seed=0, unlabeled_path=path)


@pytest.mark.parametrize(
  "content, message",
  [
    (np.zeros((2, 28, 28)), "shape"),
    (np.full((2, 28, 28, 1), np.inf), "NaN or Inf"),
    (np.asfortranarray(np.zeros((2, 28, 28, 1))), "Fortran"),
    (b"not an array", "not a readable .npy"),
  ],
)
def test_bad_npy_sources_get_one_line_errors(data, tmp_path, content, message):
  path = str(tmp_path / "bad.npy")
  if isinstance(content, bytes):
    with open(path, "wb") as f:
      f.write(content)
  else:
    np.save(path, content)
  with pytest.raises(tasks.DataError, match=message) as error:
    server_data.server_split(data, femnist, seed=0, unlabeled_path=path)
  assert "\n" not in str(error.value)
  assert "--server_data" in str(error.value)
