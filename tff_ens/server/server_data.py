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
directory of the same task (all its images), a `.npz` file with an array `x`
of images shaped like the task's inputs, or a `.npy` file of such images. A
`.npy` file is not loaded: `ImageFile` reads the rows each batch needs from
it, so a set far larger than memory (ImageNet32-sized) streams from disk.
`ordered_batches` and `training_batches` are the `tf.data` pipelines through
which the server step reads images (and teacher targets) batch by batch; the
student's minibatches are drawn before it reads them (`student_draws`), so
`read_rows` gives the rows a round reads, the only ones its teachers need to label.
"""

import dataclasses
import hashlib
import os
import tempfile

import numpy as np
import tensorflow as tf

import tasks

# Rows read at a time when a whole file is scanned (checks, hashes).
_SCAN_ROWS = 8_192


class ImageFile:
  """Rows of one shape and dtype stored in a file, read and written by offset.

  A `.npy` file (`ImageFile.npy`) or an anonymous temporary file
  (`ImageFile.temporary`, deleted when closed). Reads and writes are
  `os.pread`/`os.pwrite` of the rows asked for, not a memory map, so the
  process's resident memory holds only those rows whatever the file's size.
  Indexing as a NumPy array's first axis: `f[i:j]`, `f[indices]` (float32
  copies) and `f[i:j] = rows`.
  """

  def __init__(self, fd: int, offset: int, shape: tuple, dtype, *, name: str, close_fd: bool):
    self._fd = fd
    self._offset = offset
    self.shape = tuple(shape)
    self.dtype = np.dtype(dtype)
    self.name = name
    self._close_fd = close_fd
    self._row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

  @classmethod
  def npy(cls, path: str) -> "ImageFile":
    """The array of a C-ordered `.npy` file; raises DataError naming the problem."""
    try:
      with open(path, "rb") as f:
        read_header = {
          (1, 0): np.lib.format.read_array_header_1_0,
          (2, 0): np.lib.format.read_array_header_2_0,
        }.get(np.lib.format.read_magic(f))
        if read_header is None:
          raise ValueError("unsupported .npy version")
        shape, fortran_order, dtype = read_header(f)
        offset = f.tell()
    except (OSError, ValueError) as e:
      raise tasks.DataError(
        f"--server_data={path} is not a readable .npy file ({e}): pass a file written by np.save"
      ) from None
    if fortran_order or dtype.hasobject or not shape:
      raise tasks.DataError(
        f"--server_data={path} holds a {'Fortran-ordered ' if fortran_order else ''}"
        f"{dtype} array of shape {shape}: save C-ordered numeric images with np.save"
      )
    return cls(os.open(path, os.O_RDONLY), offset, shape, dtype, name=path, close_fd=True)

  @classmethod
  def temporary(cls, shape: tuple, dtype=np.float32) -> "ImageFile":
    """A zero-filled file of `shape`, removed from disk when closed."""
    f = tempfile.TemporaryFile()
    rows = cls(os.dup(f.fileno()), 0, shape, dtype, name="<temporary>", close_fd=True)
    f.close()
    os.ftruncate(rows._fd, rows.shape[0] * rows._row_bytes)
    return rows

  def __len__(self) -> int:
    return self.shape[0]

  def _read(self, start: int, stop: int) -> np.ndarray:
    count = max(0, min(stop, len(self)) - start)
    data = os.pread(self._fd, count * self._row_bytes, self._offset + start * self._row_bytes)
    return np.frombuffer(data, self.dtype).reshape((count, *self.shape[1:]))

  def __getitem__(self, key) -> np.ndarray:
    if isinstance(key, slice):
      start, stop, step = key.indices(len(self))
      if step != 1:
        raise IndexError("ImageFile reads slices with step 1 only")
      rows = self._read(start, stop)
    else:
      indices = np.asarray(key, np.int64).reshape(-1)
      if np.any((indices < 0) | (indices >= len(self))):
        raise IndexError(f"row index out of range for {len(self)} rows")
      rows = np.empty((len(indices), *self.shape[1:]), self.dtype)
      for k, i in enumerate(indices):
        rows[k] = self._read(i, i + 1)[0]
    return rows.astype(np.float32)

  def __setitem__(self, key: slice, rows) -> None:
    start, stop, _ = key.indices(len(self))
    rows = np.ascontiguousarray(rows, self.dtype)
    if rows.shape != (stop - start, *self.shape[1:]):
      raise ValueError(f"cannot write rows of shape {rows.shape} to rows {start}:{stop}")
    os.pwrite(self._fd, rows.tobytes(), self._offset + start * self._row_bytes)

  def chunks(self):
    """The rows in order, `_SCAN_ROWS` at a time."""
    for start in range(0, len(self), _SCAN_ROWS):
      yield self[start : start + _SCAN_ROWS]

  def close(self) -> None:
    if self._close_fd and self._fd >= 0:
      os.close(self._fd)
      self._fd = -1

  def __del__(self):
    self.close()


def rows_like(images, row_shape: tuple):
  """Zero float32 rows, one per image of `images`, stored as the images are: an
  array, or a temporary `ImageFile` when the images stream from a file (teacher
  targets that must not fill memory either)."""
  shape = (len(images), *row_shape)
  if isinstance(images, ImageFile):
    return ImageFile.temporary(shape)
  return np.zeros(shape, np.float32)


def _chunks(x):
  """`x`'s rows in order, a bounded number at a time."""
  if isinstance(x, ImageFile):
    yield from x.chunks()
  else:
    yield x


@dataclasses.dataclass(frozen=True)
class ServerData:
  """Unlabeled images and a labeled validation split, owned by the server.

  Attributes:
    unlabeled: float32 images [n, *input_shape] (no labels): an array, or
      an `ImageFile` read as the server step needs its rows.
    validation_x: float32 images [m, *input_shape].
    validation_y: int32 labels [m].
    source: where `unlabeled` came from.
  """

  unlabeled: np.ndarray
  validation_x: np.ndarray
  validation_y: np.ndarray
  source: str


def _load_unlabeled(path: str, task):
  """Images of `path`: a `.npy` file (an `ImageFile`), a `.npz` with `x`, or a LEAF
  directory of `task`."""
  if path.endswith(".npy"):
    if not os.path.isfile(path):
      raise tasks.DataError(
        f"--server_data={path} does not exist: pass a .npy file of images, a .npz file "
        "with an array x, or a LEAF directory"
      )
    x = ImageFile.npy(path)
  elif path.endswith(".npz"):
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
  if not all(np.all(np.isfinite(chunk)) for chunk in _chunks(x)):
    raise tasks.DataError(f"--server_data={path} has NaN or Inf pixels: clean the images")
  return x


def _row_hashes(x) -> set[bytes]:
  return {
    hashlib.blake2b(row.tobytes(), digest_size=16).digest()
    for chunk in _chunks(x)
    for row in np.ascontiguousarray(chunk, np.float32)
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


# Streaming the server's images to the server step (`tf.data`) --------------


def as_rows(x):
  """`x` as rows to index: an `ImageFile` as is, else a float32 array."""
  return x if isinstance(x, ImageFile) else np.asarray(x, np.float32)


def _reader(read, row_shape):
  """A `tf.data` map `key -> read(key)`: NumPy rows read as the pipeline needs them."""

  def map_fn(key):
    return tf.ensure_shape(tf.numpy_function(read, [key], tf.float32), [None, *row_shape])

  return map_fn


def ordered_batches(x, batch_size: int) -> tf.data.Dataset:
  """`(start, images)` batches of `x` in order, the last one partial.

  `x` is an array or an `ImageFile`; each batch is read when the
  pipeline reaches it and the next is prefetched, so memory holds a few
  batches whatever the number of images.
  """
  rows = as_rows(x)
  read = _reader(lambda start: rows[int(start) : int(start) + batch_size], rows.shape[1:])
  starts = tf.data.Dataset.range(0, len(rows), batch_size)
  return starts.map(lambda start: (start, read(start))).prefetch(2)


def student_draws(n: int, batch_size: int, num_steps: int, seed) -> tf.data.Dataset:
  """The row indices [min(batch_size, n)] of the student's `num_steps` minibatches of a set
  of `n` rows.

  Each epoch visits the rows in a stateless random order drawn from `seed` and the epoch
  number; the last partial batch of an epoch is skipped. Known before the student reads a
  row, so the teachers can label only the rows it will read (`read_rows`).
  """
  batch_size = min(batch_size, n)
  num_epochs = -(-num_steps // (n // batch_size))
  seed = _as_seed(seed)

  def epoch_batches(epoch):
    order = tf.random.experimental.stateless_shuffle(
      tf.range(n), seed=tf.random.experimental.stateless_fold_in(seed, epoch)
    )
    return tf.data.Dataset.from_tensor_slices(order).batch(batch_size, drop_remainder=True)

  return tf.data.Dataset.range(num_epochs).flat_map(epoch_batches).take(num_steps)


def drawn_rows(n: int, batch_size: int, num_steps: int, seed) -> np.ndarray:
  """`student_draws` as one array [num_steps, min(batch_size, n)]."""
  return np.stack(list(student_draws(n, batch_size, num_steps, seed).as_numpy_iterator()))


def batches_of(x, targets, indices) -> tf.data.Dataset:
  """The minibatches `(x[i], targets[i])` for each index batch `i` of `indices` (a
  dataset, or an array [steps, b]); the rows are read from `x` and `targets` (arrays or
  `ImageFile`s) batch by batch and prefetched."""
  rows, target_rows = as_rows(x), as_rows(targets)
  if not isinstance(indices, tf.data.Dataset):
    indices = tf.data.Dataset.from_tensor_slices(np.asarray(indices))
  read_images = _reader(lambda i: rows[i], rows.shape[1:])
  read_targets = _reader(lambda i: target_rows[i], target_rows.shape[1:])
  return indices.map(lambda i: (read_images(i), read_targets(i))).prefetch(2)


def training_batches(x, targets, batch_size: int, num_steps: int, seed) -> tf.data.Dataset:
  """The student's `num_steps` minibatches `(images, targets)`, drawn from `seed`
  (`student_draws`) and read by `batches_of`."""
  return batches_of(x, targets, student_draws(len(x), batch_size, num_steps, seed))


@dataclasses.dataclass(frozen=True)
class ReadRows:
  """The rows of an unlabeled set that a round's students read (`read_rows`).

  Attributes:
    images: those rows, in the set's order: the set itself when every row is read (or
      the whole set is asked for), else a float32 copy of them.
    batches: per student, its minibatches [num_steps, b] as positions into `images`.
  """

  images: np.ndarray
  batches: tuple


def read_rows(x, draws, *, whole: bool = False) -> ReadRows:
  """The rows of `x` (an array or an `ImageFile`) that minibatches `draws` (one
  [steps, b] index array per student, `drawn_rows`) read, and where they find them.

  The teachers then label len(images) <= min(len(x), sum of the draws' sizes) images, a
  number set by the distillation budget, not by the size of `x`. With `whole` (or when
  the draws read every row) `images` is `x` and the batches are the draws themselves: the
  whole set labelled, in the same batches as before.
  """
  draws = tuple(np.asarray(d, np.int64) for d in draws)
  rows = np.unique(np.concatenate([d.reshape(-1) for d in draws]))
  if whole or len(rows) == len(x):
    return ReadRows(x, draws)
  return ReadRows(as_rows(x)[rows], tuple(np.searchsorted(rows, d) for d in draws))


def _as_seed(seed):
  """A shape [2] int64 stateless seed from an int, scalar or [2] tensor."""
  seed = tf.cast(seed, tf.int64)
  if seed.shape.rank == 0:
    seed = tf.stack([seed, tf.constant(0, tf.int64)])
  return seed
