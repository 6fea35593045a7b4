"""Simulated federated splits of a centralized labeled dataset, seeded.

A task without natural clients (CIFAR) is split over `num_clients` clients
the way the ensemble-FL papers do, after the server's examples are set aside:

  iid: a uniformly random split into near-equal parts (McMahan et al.,
    "Communication-Efficient Learning of Deep Networks from Decentralized
    Data", AISTATS 2017, Sec. 3).
  dirichlet: per class, the class's examples are split over the clients in
    proportions q ~ Dir(alpha * 1); small alpha, few classes per client
    (Hsu, Qi and Brown, arXiv:1909.06335, 2019, Sec. 3; FedDF, Lin et al.,
    NeurIPS 2020, Sec. 4; FedBE, Chen and Chao, ICLR 2021, Sec. 5).
  classes: the examples sorted by label are cut into num_clients * N
    shards, each client gets N random shards, so about N labels (McMahan
    et al. 2017, Sec. 3, "pathological non-IID"; the label-sorted
    splits of Fed-ensemble, Shi et al. 2021).
  step: FedBE's "Step" (Chen and Chao 2021, Sec. 5 and its
    utils/sampling.py `cifar_noniid(method="step")`): first every client
    draws `step_minor_examples` of every class, then the rest is split as
    `classes` with N = classes_per_client major classes.

Every function returns index arrays into the labels it was given: disjoint,
and together all of them. `partition_report` tabulates the classes of each
client.
"""

import dataclasses

import numpy as np

from tff_ens import settings
from tff_ens.settings import setting

PARTITIONS = ("iid", "dirichlet", "step", "classes")
# Dirichlet draws are repeated until no client is empty; this many at most.
DIRICHLET_MAX_DRAWS = 1000


class PartitionError(ValueError):
  """The data are too small for the requested split (names the fix)."""


@dataclasses.dataclass(frozen=True)
class PartitionConfig:
  """How a task's pooled training examples are split over clients (the `--partition` flags).

  Attributes:
    partition: one of PARTITIONS; None: the task's own (`for_task`).
    num_clients: how many clients share the training examples.
    alpha: the Dirichlet concentration of `dirichlet` (FedDF: 1 and 0.1).
    classes_per_client: N of `classes`, the major classes of `step`.
    step_minor_examples: `step`'s examples of every class per client
      (FedBE: 10).
    server_unlabeled_examples: training examples set aside, labels dropped,
      as the server's unlabeled distillation data (FedBE: 10,000 of
      CIFAR-10's 50,000); None: the task's.
    server_validation_examples: training examples set aside as the server's
      labeled validation set (FedDF's early stopping and drop-worst); None: the task's.
  """

  partition: str | None = setting(
    None,
    "How the labeled training examples are split over clients (tasks/partition.py). Unset: "
    "the task's own clients (FEMNIST's writers; CIFAR: iid). FEMNIST with a value pools its "
    "training writers' examples and splits them by label, as CIFAR's are.",
    choices=PARTITIONS,
  )
  num_clients: int = setting(10, "Clients sharing a --partition split.", above=0)
  alpha: float = setting(
    1.0,
    "Dirichlet alpha of --partition=dirichlet (FedDF: 1 and 0.1).",
    flag="partition_alpha",
    above=0,
  )
  classes_per_client: int = setting(
    2, "Labels per client of --partition=classes, major classes of --partition=step.", above=0
  )
  step_minor_examples: int = setting(
    10, "--partition=step examples of every class per client.", at_least=0
  )
  server_unlabeled_examples: int | None = setting(
    None,
    "Training examples of a --partition split set aside as the server's unlabeled data "
    "(default: CIFAR 10,000, FEMNIST 2,000). FEMNIST with this and "
    "--server_validation_examples at 0 distills on its test-only writers instead.",
    at_least=0,
  )
  server_validation_examples: int | None = setting(
    None,
    "Training examples of a --partition split set aside as the server's labeled validation "
    "set (default: CIFAR 1,000, FEMNIST 500).",
    at_least=0,
  )

  def __post_init__(self):
    settings.check(self)

  def for_task(self, default_partition: str | None, server_examples: tuple[int, int]):
    """This split with a task's defaults filled in (`DEFAULT_PARTITION`, `SERVER_EXAMPLES`),
    or None for the task's natural clients.

    Raises:
      SettingError: a split setting given for natural clients, which have no split.
    """
    partition = self.partition or default_partition
    if partition is None:
      defaults = PartitionConfig()
      for field in dataclasses.fields(self):
        if getattr(self, field.name) != getattr(defaults, field.name):
          raise settings.SettingError(
            field.name,
            getattr(self, field.name),
            "applies to a pooled split, and the task's clients are its own: set a "
            "partition too, or leave it unset",
          )
      return None
    unlabeled, validation = server_examples
    return dataclasses.replace(
      self,
      partition=partition,
      server_unlabeled_examples=_given(self.server_unlabeled_examples, unlabeled),
      server_validation_examples=_given(self.server_validation_examples, validation),
    )


def _given(value, default):
  return default if value is None else value


def iid(labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
  """A uniformly random split into `num_clients` near-equal parts."""
  return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


def dirichlet(
  labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator
) -> list[np.ndarray]:
  """Each class split over the clients in proportions q ~ Dir(alpha * 1).

  Hsu et al. 2019, Sec. 3 (as FedDF and FedBE use it): client k receives
  the first floor(cumsum(q)_k * n_c) - floor(cumsum(q)_{k-1} * n_c) of the
  class's shuffled examples. The draw is repeated (up to
  DIRICHLET_MAX_DRAWS times) until every client has an example.
  """
  classes = np.unique(labels)
  for _ in range(DIRICHLET_MAX_DRAWS):
    parts = [[] for _ in range(num_clients)]
    for c in classes:
      members = rng.permutation(np.flatnonzero(labels == c))
      proportions = rng.dirichlet(np.full(num_clients, alpha))
      bounds = (np.cumsum(proportions)[:-1] * len(members)).astype(int)
      for k, piece in enumerate(np.split(members, bounds)):
        parts[k].append(piece)
    parts = [np.sort(np.concatenate(p)) for p in parts]
    if all(len(p) for p in parts):
      return parts
  raise PartitionError(
    f"{DIRICHLET_MAX_DRAWS} Dirichlet(alpha={alpha}) draws over "
    f"{num_clients} clients of {len(labels)} examples all left a client "
    "empty: use fewer --num_clients or a larger --partition_alpha"
  )


def label_shards(
  labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
  """McMahan et al.'s pathological split: each client gets sorted shards.

  The examples sorted by label (ties in random order) are cut into
  num_clients * shards_per_client near-equal shards; each client gets
  `shards_per_client` of them at random, so that many labels when the
  shards tile the classes (a shard across a class boundary adds one).
  """
  num_shards = num_clients * shards_per_client
  if num_shards > len(labels):
    raise PartitionError(
      f"{num_clients} clients x {shards_per_client} classes need "
      f"{num_shards} shards but there are {len(labels)} examples: use fewer "
      "--num_clients or --classes_per_client"
    )
  shuffled = rng.permutation(len(labels))
  by_label = shuffled[np.argsort(labels[shuffled], kind="stable")]
  shards = np.array_split(by_label, num_shards)
  order = rng.permutation(num_shards).reshape(num_clients, shards_per_client)
  return [np.sort(np.concatenate([shards[s] for s in row])) for row in order]


def step(
  labels: np.ndarray,
  num_clients: int,
  major_classes: int,
  minor_examples: int,
  rng: np.random.Generator,
) -> list[np.ndarray]:
  """FedBE's "Step" split: few examples of every class, many of a few.

  Chen and Chao 2021, Sec. 5: every client first draws `minor_examples` of
  each class; the rest is split by `label_shards` with `major_classes`
  shards per client.
  """
  minor = [[] for _ in range(num_clients)]
  for c in np.unique(labels):
    members = np.flatnonzero(labels == c)
    wanted = num_clients * minor_examples
    if wanted > len(members):
      raise PartitionError(
        f"--step_minor_examples={minor_examples} for {num_clients} clients "
        f"needs {wanted} examples of class {c}, which has {len(members)}: "
        "lower --step_minor_examples or --num_clients"
      )
    chosen = rng.choice(members, wanted, replace=False)
    for k, piece in enumerate(np.split(chosen, num_clients)):
      minor[k].append(piece)
  taken = np.concatenate([np.concatenate(m) for m in minor])
  rest = np.setdiff1d(np.arange(len(labels)), taken)
  major = label_shards(labels[rest], num_clients, major_classes, rng)
  return [np.sort(np.concatenate(m + [rest[j]])) for m, j in zip(minor, major)]


def partition(labels: np.ndarray, config: PartitionConfig, seed: int) -> list[np.ndarray]:
  """`config.partition` of `labels` over `config.num_clients`, seeded.

  Raises PartitionError if a client would be empty or the data are too
  small for the split.
  """
  rng = np.random.default_rng([seed, 4])
  if config.num_clients > len(labels):
    raise PartitionError(
      f"--num_clients={config.num_clients} exceeds the {len(labels)} "
      "training examples left for clients: use fewer clients"
    )
  if config.partition == "iid":
    return iid(labels, config.num_clients, rng)
  if config.partition == "dirichlet":
    return dirichlet(labels, config.num_clients, config.alpha, rng)
  if config.partition == "classes":
    return label_shards(labels, config.num_clients, config.classes_per_client, rng)
  return step(
    labels, config.num_clients, config.classes_per_client, config.step_minor_examples, rng
  )


def split_like(train_labels: list[np.ndarray], labels: np.ndarray, seed: int) -> list[np.ndarray]:
  """Splits `labels` (e.g. a test set) with the clients' class proportions.

  The examples of class c go to the clients in proportion to their training
  examples of c (to all clients in proportion to their sizes if none has
  any), so every example goes to exactly one client and each client's part
  follows its training distribution.
  """
  rng = np.random.default_rng([seed, 5])
  sizes = np.array([len(t) for t in train_labels], np.float64)
  parts = [[] for _ in train_labels]
  for c in np.unique(labels):
    members = rng.permutation(np.flatnonzero(labels == c))
    weights = np.array([np.sum(t == c) for t in train_labels], np.float64)
    weights = weights if weights.sum() else sizes
    bounds = np.round(np.cumsum(weights)[:-1] / weights.sum() * len(members)).astype(int)
    for k, piece in enumerate(np.split(members, bounds)):
      parts[k].append(piece)
  return [np.sort(np.concatenate(p)) if p else np.zeros(0, np.int64) for p in parts]


def class_counts(labels_by_client: list[np.ndarray], num_classes: int) -> np.ndarray:
  """[clients, classes] example counts."""
  return np.stack([np.bincount(y, minlength=num_classes) for y in labels_by_client])


def partition_report(client_ids, labels_by_client: list[np.ndarray], num_classes: int) -> str:
  """A table of each client's examples per class, one line per client."""
  counts = class_counts(labels_by_client, num_classes)
  id_width = max(len("client"), *(len(c) for c in client_ids))
  width = max(len(str(counts.max(initial=0))), len(str(num_classes - 1)))
  lines = [
    " ".join(
      [f"{'client':<{id_width}}", f"{'n':>6}"] + [f"{c:>{width}}" for c in range(num_classes)]
    )
  ]
  for client, row in zip(client_ids, counts):
    lines.append(
      " ".join([f"{client:<{id_width}}", f"{row.sum():>6}"] + [f"{v:>{width}}" for v in row])
    )
  return "\n".join(lines)
