"""The types every task's data come in, and the split of a pooled labeled set.

`FederatedData` is what a task's `load_data` returns. `split_pool` is how a
task without natural clients (CIFAR), or FEMNIST asked for a label-skewed
split (`--partition`), turns one labeled training set into clients: first
the server's examples are set aside (FedBE, Chen and Chao, ICLR 2021, Sec. 5;
FedDF, Lin et al., NeurIPS 2020, Sec. 4), then the rest is split by
`tasks.partition`, and the test set is split like the clients' labels.
"""

import collections
from collections.abc import Callable, Iterable, Mapping
import dataclasses
import hashlib
import logging
import zlib

import numpy as np

from tasks import partition as partition_lib


class DataError(ValueError):
  """A one-line, user-facing problem with the input data (names the file/dir and the fix)."""


class ExamplesOnDisk(Mapping):
  """client id -> its float32 examples [n, *shape], read from one file of rows each time
  they are asked for (`np.fromfile`): the process holds none of them between reads, so its
  memory does not grow with the clients.

  `spans`: client id -> (its first row, its rows) in the file.
  """

  def __init__(self, path: str, shape: tuple[int, ...], spans: Mapping[str, tuple[int, int]]):
    self._path, self._shape, self._spans = path, tuple(shape), dict(spans)
    self._row_values = int(np.prod(self._shape))

  def __getitem__(self, client_id: str) -> np.ndarray:
    first, rows = self._spans[client_id]
    values = np.fromfile(
      self._path, np.float32, count=rows * self._row_values, offset=first * self._row_values * 4
    )
    return values.reshape(rows, *self._shape)

  def __iter__(self):
    return iter(self._spans)

  def __len__(self) -> int:
    return len(self._spans)

  def restricted(self, client_ids: Iterable[str]) -> "ExamplesOnDisk":
    """The same file's examples of `client_ids` only."""
    return ExamplesOnDisk(self._path, self._shape, {c: self._spans[c] for c in client_ids})


@dataclasses.dataclass(frozen=True)
class ClientArrays:
  """Examples of a set of clients, in memory or read from disk when asked for.

  Attributes:
    client_ids: the client (FEMNIST: writer) ids, sorted.
    x: client id -> float32 images [n, *input_shape] (the task's preprocessing): a dict, or
      an `ExamplesOnDisk` that reads a client's when they are asked for.
    y: client id -> int32 labels [n], in 0..num_classes - 1.
    input_shape: the shape of one image, for `concatenated` of no clients.
  """

  client_ids: tuple[str, ...]
  x: Mapping[str, np.ndarray]
  y: dict[str, np.ndarray]
  input_shape: tuple[int, ...] = ()

  def num_examples(self, client_id: str | None = None) -> int:
    """The number of examples of `client_id`, or of all clients if it is None."""
    if client_id is not None:
      return len(self.y[client_id])
    return sum(len(self.y[c]) for c in self.client_ids)

  def concatenated(self) -> tuple[np.ndarray, np.ndarray]:
    """All clients' images and labels, in `client_ids` order."""
    if not self.client_ids:
      return (np.zeros((0, *self.input_shape), np.float32), np.zeros((0,), np.int32))
    return (
      np.concatenate([self.x[c] for c in self.client_ids]),
      np.concatenate([self.y[c] for c in self.client_ids]),
    )

  def to_client_data(self) -> "tff.simulation.datasets.ClientData":  # noqa: F821
    """A TFF ClientData whose elements are OrderedDict(x=float32 image, y=int32[]).

    TFF's in-memory ClientData copies the arrays; its `serializable_dataset_fn` (used by
    `dataset_computation` and `create_tf_dataset_from_all_clients`) embeds all clients'
    data in one TF graph, which must stay under 2 GB. (TFF is imported here, so that the
    rest of this module and `tasks.leaf` run where TensorFlow is not installed.)
    """
    import tensorflow_federated as tff

    if not self.client_ids:
      raise ValueError("no clients: a TFF ClientData needs at least one")
    return tff.simulation.datasets.TestClientData(
      {c: collections.OrderedDict(x=self.x[c], y=self.y[c]) for c in self.client_ids}
    )

  def subset(self, client_ids: Iterable[str]) -> "ClientArrays":
    """The clients `client_ids` (each must be one of this set's clients)."""
    ids = tuple(sorted(set(client_ids)))
    unknown = [c for c in ids if c not in self.x]
    if unknown:
      raise KeyError(f"unknown client ids: {', '.join(unknown[:5])}")
    x = (
      self.x.restricted(ids) if isinstance(self.x, ExamplesOnDisk) else {c: self.x[c] for c in ids}
    )
    return ClientArrays(ids, x, {c: self.y[c] for c in ids}, self.input_shape)

  def at_most(self, limit: int, seed: tuple[int, ...]) -> "ClientArrays":
    """At most `limit` (0: all) examples of each client (`subsample`); the images of
    examples on disk are subsampled when they are read."""
    kept = {c: kept_examples(len(self.y[c]), limit, seed, c) for c in self.client_ids}
    y = {c: _taken(self.y[c], kept[c]) for c in self.client_ids}
    if isinstance(self.x, ExamplesOnDisk):
      x = _Subsampled(self.x, kept)
    else:
      x = {c: _taken(self.x[c], kept[c]) for c in self.client_ids}
    return ClientArrays(self.client_ids, x, y, self.input_shape)


class _Subsampled(Mapping):
  """client id -> its kept images (`kept_examples`), read when asked for."""

  def __init__(self, x: ExamplesOnDisk, kept: Mapping[str, np.ndarray | None]):
    self._x, self._kept = x, kept

  def __getitem__(self, client_id: str) -> np.ndarray:
    return _taken(self._x[client_id], self._kept[client_id])

  def __iter__(self):
    return iter(self._x)

  def __len__(self) -> int:
    return len(self._x)


def kept_examples(n: int, limit: int, seed: tuple[int, ...], client: str) -> np.ndarray | None:
  """Which of a client's `n` examples `subsample` keeps: at most `limit` (0: all), in order,
  drawn by `seed` and `client`; None for all of them."""
  if not limit or n <= limit:
    return None
  rng = np.random.default_rng([*seed, zlib.crc32(client.encode())])
  return np.sort(rng.choice(n, limit, replace=False))


def subsample(x, y, limit: int, seed: tuple[int, ...], client: str):
  """At most `limit` (0: all) of a client's examples (`kept_examples`)."""
  keep = kept_examples(len(y), limit, seed, client)
  return _taken(x, keep), _taken(y, keep)


def _taken(array: np.ndarray, keep: np.ndarray | None) -> np.ndarray:
  """`array`'s rows `keep`, or `array` itself for None (all)."""
  return array if keep is None else array[keep]


@dataclasses.dataclass(frozen=True)
class ServerExamples:
  """Training examples a task sets aside for the server before splitting the rest.

  FedBE (Chen and Chao, ICLR 2021, Sec. 5) and FedDF (Lin et al., NeurIPS 2020, Sec. 4)
  carve the server's data out of the training set: images whose labels are dropped, for
  distillation, and a small labeled validation set.

  Attributes:
    unlabeled: float32 images [n, *input_shape] (no labels).
    validation_x: float32 images [m, *input_shape].
    validation_y: int32 labels [m].
  """

  unlabeled: np.ndarray
  validation_x: np.ndarray
  validation_y: np.ndarray


@dataclasses.dataclass(frozen=True)
class FederatedData:
  """The splits of a federated dataset (every task's `load_data` returns one).

  Attributes:
    train: writers with training data.
    test: test examples of the writers that have training data (the same writers as
      `train`, without those that have no test data).
    new_clients: writers that have test data only, never seen in training.
    source: where the data came from (e.g. "leaf:<absolute directory>", "tff:emnist").
    server: examples the task set aside for the server (`split_pool`), or None (the
      server's data are then taken from `new_clients`, see tff_ens/server/server_data.py).
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


def _row_digests(images: np.ndarray) -> list[bytes]:
  return [hashlib.blake2b(row.tobytes(), digest_size=16).digest() for row in images]


def _server_indices(
  train_x: np.ndarray,
  test_x: np.ndarray,
  config: partition_lib.PartitionConfig,
  seed: int,
  source: str,
) -> tuple[np.ndarray, np.ndarray]:
  """(unlabeled, validation) training indices drawn for the server, seeded.

  Training images byte-identical to a test image are never drawn, so the
  server's data share no image with the test data (server_data.py checks).
  """
  wanted = config.server_unlabeled_examples + config.server_validation_examples
  if wanted >= len(train_x):
    raise DataError(
      f"{source}: --server_unlabeled_examples="
      f"{config.server_unlabeled_examples} and --server_validation_examples="
      f"{config.server_validation_examples} leave none of its "
      f"{len(train_x)} training examples to the clients: lower them"
    )
  if not wanted:  # Nothing to draw: skip hashing every image.
    return np.zeros(0, np.int64), np.zeros(0, np.int64)
  in_test = set(_row_digests(test_x))
  allowed = np.array([d not in in_test for d in _row_digests(train_x)])
  order = np.random.default_rng([seed, 3]).permutation(len(train_x))
  drawn = order[allowed[order]][:wanted]
  if len(drawn) < wanted:
    raise DataError(
      f"{source}: only {len(drawn)} training images differ from "
      f"every test image, the server needs {wanted}: lower "
      "--server_unlabeled_examples"
    )
  return (
    np.sort(drawn[: config.server_unlabeled_examples]),
    np.sort(drawn[config.server_unlabeled_examples :]),
  )


def split_pool(
  train: tuple[np.ndarray, np.ndarray],
  test: tuple[np.ndarray, np.ndarray],
  config: partition_lib.PartitionConfig,
  seed: int,
  *,
  where: str,
  num_classes: int,
  preprocess: Callable[[np.ndarray], np.ndarray] = lambda x: x,
) -> tuple[ClientArrays, ClientArrays, ServerExamples | None]:
  """(clients' training data, their test data, the server's examples).

  The server's `config.server_unlabeled_examples` and
  `config.server_validation_examples` are drawn from `train` first (None
  when both are 0), the rest is split over `config.num_clients` clients by
  `config.partition`, and `test` is split like the clients' labels
  (`partition.split_like`), so every example is in exactly one place and the
  whole split is fixed by `seed`. `preprocess` maps stored images to the
  model's inputs. Logs the examples of every class per client.
  """
  (train_x, train_y), (test_x, test_y) = train, test
  unlabeled, validation = _server_indices(train_x, test_x, config, seed, where)
  pool = np.setdiff1d(np.arange(len(train_y)), np.concatenate([unlabeled, validation]))
  try:
    parts = [pool[p] for p in partition_lib.partition(train_y[pool], config, seed)]
  except partition_lib.PartitionError as e:
    raise DataError(f"{where}: {e}") from None
  test_parts = partition_lib.split_like([train_y[p] for p in parts], test_y, seed)
  digits = len(str(config.num_clients - 1))
  ids = tuple(f"client_{k:0{digits}d}" for k in range(config.num_clients))
  shape = tuple(train_x.shape[1:])
  clients = ClientArrays(
    ids,
    {c: preprocess(train_x[p]) for c, p in zip(ids, parts)},
    {c: train_y[p] for c, p in zip(ids, parts)},
    shape,
  )
  tested = [(c, p) for c, p in zip(ids, test_parts) if len(p)]
  clients_test = ClientArrays(
    tuple(c for c, _ in tested),
    {c: preprocess(test_x[p]) for c, p in tested},
    {c: test_y[p] for c, p in tested},
    shape,
  )
  logging.info(
    "%s, %s split over %d clients (examples per class):\n%s",
    where,
    config.partition,
    config.num_clients,
    partition_lib.partition_report(ids, [clients.y[c] for c in ids], num_classes),
  )
  server = None
  if len(unlabeled) or len(validation):
    server = ServerExamples(
      unlabeled=preprocess(train_x[unlabeled]),
      validation_x=preprocess(train_x[validation]),
      validation_y=train_y[validation],
    )
  return clients, clients_test, server


def repartitioned(
  data: FederatedData, config: partition_lib.PartitionConfig, seed: int, num_classes: int
) -> FederatedData:
  """`data` with its training clients' examples pooled and split by `config` (`split_pool`,
  seeded by `seed`): new clients, their test examples split like their labels, and the
  server's examples if the partition sets any aside; the new clients (test data only) stay."""
  train, test, server = split_pool(
    data.train.concatenated(),
    data.test.concatenated(),
    config,
    seed,
    where=data.source,
    num_classes=num_classes,
  )
  return dataclasses.replace(
    data, train=train, test=test, server=server, source=f"{data.source} ({config.partition} split)"
  )
