"""The server's own data for ensemble distillation (FedBE, FedDF).

Both papers distill on the server with data the clients never send: an
*unlabeled* set (Chen & Chao, ICLR 2021, Sec. 4.2; Lin et al., NeurIPS 2020,
Algorithm 1) and, for FedDF's early stopping and drop-worst, a small
*labeled validation* set (Lin et al., Sec. 4).

Default (`server_split`): a task that sets examples aside for the server
(`FederatedData.server`; CIFAR carves them out of the training set before
splitting the rest over the clients, as both papers do) gives them. Otherwise
the writers of the task that have test data only (`FederatedData.new_clients`,
never sampled for training) are split by writer, seeded: a
`validation_fraction` of them is the server's labeled validation set, the
images of the others (labels dropped) are the unlabeled set. Neither contains
an example of the test data on which `test_accuracy` is measured;
`check_disjoint` enforces that for any source. (`new_client_accuracy` is
measured on all test-only writers, so for FedBE and FedDF it is transductive:
the server saw those writers' images, unlabeled.)

`--server_data=PATH` replaces the unlabeled set by another source: a LEAF
directory of the same task (all its images) or a `.npz` file with an array
`x` of images shaped like the task's inputs.
"""

import dataclasses
import hashlib
import os

import numpy as np

import tasks


@dataclasses.dataclass(frozen=True)
class ServerData:
  """Unlabeled images and a labeled validation split, owned by the server.

  Attributes:
    unlabeled: float32 images [n, *input_shape] (no labels).
    validation_x: float32 images [m, *input_shape].
    validation_y: int32 labels [m].
    source: where `unlabeled` came from.
  """

  unlabeled: np.ndarray
  validation_x: np.ndarray
  validation_y: np.ndarray
  source: str


def _load_unlabeled(path: str, task) -> np.ndarray:
  """Images of `path`: a `.npz` with `x`, or a LEAF directory of `task`."""
  if path.endswith(".npz"):
    if not os.path.isfile(path):
      raise tasks.DataError(
        f"--server_data={path} does not exist: pass a "
        ".npz file with an array x, or a LEAF directory"
      )
    try:
      with np.load(path) as archive:
        names = archive.files
        x = np.asarray(archive["x"], np.float32) if "x" in names else None
    except (OSError, ValueError) as e:
      raise tasks.DataError(
        f"--server_data={path} is not a readable .npz file ({e}): pass a file written by np.savez"
      )
    if x is None:
      raise tasks.DataError(
        f"--server_data={path} has no array 'x' (it has "
        f"{', '.join(names) or 'none'}): save the images as x"
      )
  else:
    data = task.load_data(path)
    x = np.concatenate(
      [split.concatenated()[0] for split in (data.train, data.test, data.new_clients)]
    )
  if x.shape[1:] != tuple(task.INPUT_SHAPE):
    raise tasks.DataError(
      f"--server_data={path} holds images of shape {x.shape[1:]}, the task "
      f"needs {tuple(task.INPUT_SHAPE)}: pass images of the task"
    )
  if not np.all(np.isfinite(x)):
    raise tasks.DataError(f"--server_data={path} has NaN or Inf pixels: clean the images")
  return x


def _row_hashes(x: np.ndarray) -> set[bytes]:
  return {
    hashlib.blake2b(row.tobytes(), digest_size=16).digest()
    for row in np.ascontiguousarray(x, np.float32)
  }


def check_disjoint(server_images: np.ndarray, test_images: np.ndarray, what: str) -> None:
  """Raises DataError if an image of the test data is among the server's."""
  shared = len(_row_hashes(server_images) & _row_hashes(test_images))
  if shared:
    raise tasks.DataError(
      f"{what} contains {shared} images of the test data used for "
      "test_accuracy: give the server data without them"
    )


def server_split(
  data, task, *, seed: int, validation_fraction: float = 0.2, unlabeled_path: str | None = None
) -> ServerData:
  """The server's data for `data` (a task's `FederatedData`); see module doc.

  Args:
    data: the task's `FederatedData`.
    task: the task module (for its input shape and loader).
    seed: seeds the split of the test-only writers.
    validation_fraction: share of the test-only writers (at least one) whose
      labeled examples form the validation set.
    unlabeled_path: another source of unlabeled images (`--server_data`).
  """
  if not 0 < validation_fraction < 1:
    raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
  if data.server is not None:
    validation_x = data.server.validation_x
    validation_y = data.server.validation_y
    unlabeled = data.server.unlabeled
    source = f"{data.source} (set aside from training, unlabeled)"
  else:
    validation_x, validation_y, unlabeled, source = _split_test_only_writers(
      data, seed, validation_fraction, unlabeled_path is None
    )
  if unlabeled_path is not None:
    unlabeled = _load_unlabeled(unlabeled_path, task)
    source = os.path.abspath(unlabeled_path)
  if not len(validation_y):
    raise tasks.DataError(
      f"the data at {data.source} give the server no labeled validation "
      "examples: set some aside (--server_validation_examples)"
    )
  test_x = data.test.concatenated()[0]
  check_disjoint(unlabeled, test_x, f"the server's unlabeled data ({source})")
  check_disjoint(validation_x, test_x, "the server's validation data")
  if not len(unlabeled):
    raise tasks.DataError(
      f"the server's unlabeled data ({source}) is empty: pass --server_data with images"
    )
  return ServerData(
    unlabeled=unlabeled, validation_x=validation_x, validation_y=validation_y, source=source
  )


def _split_test_only_writers(data, seed: int, validation_fraction: float, need_unlabeled: bool):
  """(validation x, y, unlabeled images, source) from the test-only writers."""
  writers = list(data.new_clients.client_ids)
  if len(writers) < 2 and need_unlabeled:
    raise tasks.DataError(
      f"the data at {data.source} has {len(writers)} writers with test data "
      "only; the server needs at least 2 (unlabeled and validation): use a "
      "fuller LEAF directory or pass --server_data"
    )
  if not writers:
    raise tasks.DataError(
      f"the data at {data.source} has no writers with test data only, so "
      "the server has no labeled validation split: use a fuller LEAF "
      "directory"
    )
  order = np.random.default_rng([seed, 2]).permutation(len(writers))
  num_validation = max(1, int(round(validation_fraction * len(writers))))
  validation = data.new_clients.subset([writers[i] for i in order[:num_validation]])
  validation_x, validation_y = validation.concatenated()
  unlabeled = data.new_clients.subset([writers[i] for i in order[num_validation:]]).concatenated()[
    0
  ]
  return (validation_x, validation_y, unlabeled, f"{data.source} (test-only writers, unlabeled)")
