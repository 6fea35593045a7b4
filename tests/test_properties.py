"""Property-based tests (hypothesis) of the partitions and aggregation math.

The example tests elsewhere check hand-computed cases (test_cifar.py: one
fixed label set per partition; test_fed_ensemble.py, test_weight_posterior.py
and test_client_work.py: hand numbers). These draw the sizes, labels, seeds,
weights and values at random and check what must hold for all of them:

* tasks/partition.py: the parts are disjoint, cover the data, are non-empty,
  are a function of the seed, and have the sizes and classes each split
  promises; CIFAR's server examples never reach a client or the test set.
* Fed-ensemble's per-slot weighted mean (Shi et al., Algorithm 1, line 9)
  against NumPy, in any client order; its aggregator's empty slots, split and merged,
  sum as zero slots do.
* FedBE's Gaussian (Chen and Chao, eq. 5) against NumPy, invariant to a shift
  of the models and to the scale of the client weights; its Dirichlet
  coefficients (eq. 7) on the simplex.
* `client_work.reject_bad_update`: NaN/Inf or a too large norm is rejected,
  anything else passes unchanged.
"""

import pathlib
import pickle
import tempfile

from hypothesis import HealthCheck
from hypothesis import assume
from hypothesis import given
from hypothesis import settings
from hypothesis import strategies as st
import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tasks import cifar
from tasks import cifar_files
from tasks import partition
from tff_ens.math import member_updates
from tff_ens.math import weight_posterior
from tff_ens.templates import client_work
from tff_ens.templates import keyed_stages

ModelWeights = tff.learning.models.ModelWeights

# Derandomized: the same examples on every run, so a failure reproduces.
NUMPY_SETTINGS = settings(max_examples=60, deadline=None, derandomize=True)
TF_SETTINGS = settings(
  max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

seeds = st.integers(0, 2**31 - 1)


@st.composite
def labels_and_config(draw, schemes=partition.PARTITIONS):
  """Labels of a small dataset and a PartitionConfig (one of `schemes`)."""
  num_classes = draw(st.integers(1, 6))
  labels = np.asarray(
    draw(st.lists(st.integers(0, num_classes - 1), min_size=1, max_size=120)), np.int64
  )
  config = partition.PartitionConfig(
    partition=draw(st.sampled_from(schemes)),
    num_clients=draw(st.integers(1, min(12, len(labels)))),
    alpha=draw(st.floats(0.05, 50.0)),
    classes_per_client=draw(st.integers(1, 4)),
    step_minor_examples=draw(st.integers(0, 3)),
  )
  return labels, config


def _too_small(labels: np.ndarray, config: partition.PartitionConfig) -> bool:
  """Whether the documented PartitionError conditions hold (not Dirichlet)."""
  c, n = config.num_clients, config.classes_per_client
  if config.partition == "iid":
    return False
  if config.partition == "classes":
    return c * n > len(labels)
  counts = np.bincount(labels)
  counts = counts[counts > 0]
  minor = c * config.step_minor_examples
  return (counts < minor).any() or len(labels) - minor * len(counts) < c * n


@NUMPY_SETTINGS
@given(labels_and_config(), seeds)
def test_partition_is_a_seeded_split_into_non_empty_parts(case, seed):
  labels, config = case
  try:
    parts = partition.partition(labels, config, seed)
  except partition.PartitionError as e:
    assert config.partition == "dirichlet" or _too_small(labels, config), e
    assert "\n" not in str(e)
    return
  assert config.partition == "dirichlet" or not _too_small(labels, config)
  assert len(parts) == config.num_clients
  joined = np.concatenate(parts)
  np.testing.assert_array_equal(np.sort(joined), np.arange(len(labels)))
  for p in parts:
    assert len(p) and np.all(np.diff(p) > 0)  # Non-empty, sorted, distinct.
  again = partition.partition(labels, config, seed)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))


@NUMPY_SETTINGS
@given(st.integers(1, 500), st.integers(1, 40), seeds)
def test_iid_sizes_differ_by_at_most_one(n, num_clients, seed):
  assume(num_clients <= n)
  parts = partition.partition(
    np.zeros(n, np.int64), partition.PartitionConfig(partition="iid", num_clients=num_clients), seed
  )
  sizes = [len(p) for p in parts]
  assert max(sizes) - min(sizes) <= 1 and sum(sizes) == n


@NUMPY_SETTINGS
@given(st.integers(1, 8), st.integers(1, 4), st.integers(1, 5), st.data())
def test_classes_gives_n_labels_when_the_shards_tile_the_classes(num_clients, n, shard_size, data):
  # Classes whose sizes are multiples of the shard size: no shard straddles
  # two classes, so a client of N shards has at most N labels.
  shards = num_clients * n
  num_classes = data.draw(st.sampled_from([d for d in range(1, shards + 1) if shards % d == 0]))
  per_class = shard_size * shards // num_classes
  labels = np.repeat(np.arange(num_classes), per_class)
  labels = np.random.default_rng(data.draw(seeds)).permutation(labels)
  parts = partition.partition(
    labels,
    partition.PartitionConfig(partition="classes", num_clients=num_clients, classes_per_client=n),
    data.draw(seeds),
  )
  for p in parts:
    assert len(p) == n * shard_size
    assert len(np.unique(labels[p])) <= n


@NUMPY_SETTINGS
@given(labels_and_config(schemes=("classes", "step")), seeds)
def test_classes_and_step_client_sizes(case, seed):
  labels, config = case
  assume(not _too_small(labels, config))
  parts = partition.partition(labels, config, seed)
  classes = np.unique(labels)
  counts = partition.class_counts([labels[p] for p in parts], int(labels.max()) + 1)[:, classes]
  minor = config.step_minor_examples if config.partition == "step" else 0
  assert (counts >= minor).all()  # Step: `minor` of every class.
  # The rest is cut into num_clients * N near-equal shards, N per client.
  rest = len(labels) - config.num_clients * minor * len(classes)
  shards = config.num_clients * config.classes_per_client
  majors = counts.sum(1) - minor * len(classes)
  assert (majors >= config.classes_per_client * (rest // shards)).all()
  assert (majors <= config.classes_per_client * -(-rest // shards)).all()


@NUMPY_SETTINGS
@given(
  st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=15), min_size=1, max_size=6),
  st.lists(st.integers(0, 6), max_size=80),
  seeds,
)
def test_split_like_sends_each_class_only_to_its_clients(train, test, seed):
  train = [np.asarray(t, np.int64) for t in train]
  test = np.asarray(test, np.int64)
  parts = partition.split_like(train, test, seed)
  assert len(parts) == len(train)
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(len(test)))
  for t, p in zip(train, parts):
    for c in np.unique(test[p]):
      # A class goes to the clients that train on it; to anyone if none does.
      assert c in t or not any(c in other for other in train)
  again = partition.split_like(train, test, seed)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def _dump(path: pathlib.Path, content: dict):
  with open(path, "wb") as f:
    pickle.dump(content, f, protocol=2)


def _write_cifar10(root: pathlib.Path, train_images, train_labels, test_images, test_labels):
  """cifar-10-batches-py/ (the upstream pickles) holding the given images."""
  directory = root / cifar_files.CIFAR10_ARCHIVE.directory
  directory.mkdir()
  for name, images, labels in zip(
    cifar_files.CIFAR10_ARCHIVE.train_files,
    np.array_split(train_images, 5),
    np.array_split(train_labels, 5),
  ):
    _dump(directory / name, {b"data": images, b"labels": labels.tolist()})
  _dump(
    directory / cifar_files.CIFAR10_ARCHIVE.test_file,
    {b"data": test_images, b"labels": test_labels.tolist()},
  )
  _dump(
    directory / cifar_files.CIFAR10_ARCHIVE.meta_file,
    {b"label_names": [n.encode() for n in cifar.CIFAR10_LABELS]},
  )


def _rows(images: np.ndarray) -> list[bytes]:
  return [row.tobytes() for row in np.ascontiguousarray(images)]


@settings(max_examples=15, deadline=None, derandomize=True)
@given(
  st.integers(60, 120),
  st.integers(0, 10),
  st.integers(0, 20),
  st.integers(0, 10),
  st.sampled_from(partition.PARTITIONS),
  seeds,
)
def test_cifar_server_examples_reach_no_client_and_no_test_image(
  num_train, copied_test, unlabeled, validation, scheme, seed
):
  rng = np.random.default_rng(seed)
  test = rng.integers(0, 256, (20, 3072), dtype=np.uint8)
  train = rng.integers(0, 256, (num_train, 3072), dtype=np.uint8)
  train[:copied_test] = test[:copied_test]  # Training copies of test images.
  train_labels = rng.integers(0, 10, num_train)
  config = partition.PartitionConfig(
    partition=scheme,
    num_clients=3,
    step_minor_examples=0,
    server_unlabeled_examples=unlabeled,
    server_validation_examples=validation,
  )
  with tempfile.TemporaryDirectory() as root:
    _write_cifar10(pathlib.Path(root), train, train_labels, test, rng.integers(0, 10, 20))
    try:
      data = cifar.CIFAR10.load_data(root, partition=config, seed=seed)
    except cifar.DataError as e:
      assert scheme == "dirichlet", e  # Fits the others; Dirichlet may not.
      return
  clients = _rows(data.train.concatenated()[0])
  if unlabeled == validation == 0:  # Nothing set aside: no server examples.
    assert data.server is None
    server = []
  else:
    server = _rows(data.server.unlabeled) + _rows(data.server.validation_x)
    assert len(data.server.unlabeled) == unlabeled
    assert len(data.server.validation_y) == validation
  # Every training image once: at a client or at the server, never both.
  everything = _rows(cifar.CIFAR10.standardize(train.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)))
  assert sorted(clients + server) == sorted(everything)
  test_rows = set(_rows(data.test.concatenated()[0]))
  assert not set(server) & test_rows


# Aggregation math ------------------------------------------------------------


def _vectors(size):
  return st.lists(st.floats(-10, 10, width=32), min_size=size, max_size=size)


@st.composite
def ensemble_round(draw):
  """K members of 3 weights, and clients' (update, weight, key)."""
  k = draw(st.integers(1, 4))
  members = [np.asarray(draw(_vectors(3)), np.float32) for _ in range(k)]
  clients = draw(
    st.lists(
      st.tuples(_vectors(3), st.sampled_from([0.0, 1.0, 2.5, 7.0, 40.0]), st.integers(0, k - 1)),
      max_size=6,
    )
  )
  return members, [(np.asarray(u, np.float32), w, key) for u, w, key in clients]


def _aggregate(members, clients):
  slots, weights = tuple(tf.zeros([3]) for _ in members), tf.zeros([len(members)])
  for update, weight, key in clients:
    slots = keyed_stages.add_to_slot(
      slots, tf.constant(update), tf.constant(key, tf.int32), tf.constant(weight, tf.float32)
    )
    weights += weight * tf.one_hot(key, len(members))
  return [
    m.numpy()
    for m in member_updates.apply_slot_means(tuple(tf.constant(m) for m in members), slots, weights)
  ]


@TF_SETTINGS
@given(ensemble_round(), st.randoms(use_true_random=False))
def test_fed_ensemble_member_moves_by_its_clients_weighted_mean(case, rand):
  members, clients = case
  got = _aggregate(members, clients)
  for k, member in enumerate(members):
    mine = [(u.astype(np.float64), w) for u, w, key in clients if key == k]
    total = sum(w for _, w in mine)
    if total:
      want = member - sum(w * u for u, w in mine) / total
      np.testing.assert_allclose(got[k], want, rtol=1e-5, atol=1e-4)
    else:  # Nobody trained member k (or only weight-0 clients): unchanged.
      np.testing.assert_array_equal(got[k], member)
  rand.shuffle(clients)  # The cohort's order does not matter.
  for a, b in zip(got, _aggregate(members, clients)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)


@TF_SETTINGS
@given(ensemble_round(), st.integers(0, 6))
def test_unfilled_slots_split_and_merged_sum_as_zero_slots(case, split):
  """The K-slot aggregator's accumulator (empty slots a first update replaces), over the
  cohort split anywhere and merged as TFF's mergeable form does, gives the slot sums of K
  zero slots added into; a slot no client filled reports zeros."""
  members, clients = case
  k = len(members)
  update_type = tff.TensorType(np.float32, [3])

  def accumulated(part):
    accumulator = keyed_stages.unfilled_slots(update_type, k)
    for update, weight, key in part:
      accumulator = keyed_stages.add_client(
        accumulator, tf.constant(update), tf.constant(weight), tf.constant(key, tf.int32)
      )
    return accumulator

  slots, weights, filled = keyed_stages.merge_slots(
    accumulated(clients[:split]), accumulated(clients[split:])
  )
  want = tuple(tf.zeros([3]) for _ in members)
  for update, weight, key in clients:
    want = keyed_stages.add_to_slot(
      want, tf.constant(update), tf.constant(key, tf.int32), tf.constant(weight)
    )
  got = keyed_stages.filled_slots(slots, filled, update_type)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(
    weights, [sum(w for _, w, key in clients if key == i) for i in range(k)], rtol=1e-5
  )
  assert filled.numpy().tolist() == [any(key == i for _, _, key in clients) for i in range(k)]


@st.composite
def client_models(draw):
  """N clients' models (a 2x2 and a 3-vector tensor) and weights |D_i|."""
  n = draw(st.integers(1, 6))
  values = st.floats(-10, 10, width=32)
  kernels = np.asarray(
    draw(st.lists(st.lists(values, min_size=4, max_size=4), min_size=n, max_size=n)), np.float32
  ).reshape(n, 2, 2)
  biases = np.asarray(draw(st.lists(_vectors(3), min_size=n, max_size=n)), np.float32)
  sizes = np.asarray(draw(st.lists(st.floats(0.5, 500.0), min_size=n, max_size=n)), np.float32)
  return (kernels, biases), sizes


def _gaussian(stacked, sizes):
  """FedBE's mean and variance from the summed `moment_terms`."""
  terms = [
    weight_posterior.moment_terms(tuple(tf.constant(t[i]) for t in stacked), sizes[i])
    for i in range(len(sizes))
  ]
  summed = tf.nest.map_structure(lambda *t: tf.add_n(t), *terms)
  mean, variance = weight_posterior.gaussian_from_moments(*summed)
  return [m.numpy() for m in mean], [v.numpy() for v in variance]


def _gaussian_tolerance(stacked):
  # float32 moments: the variance is E[w^2] - mu^2, so its error scales
  # with the largest w^2.
  return 1e-5 * (1.0 + max(float(np.abs(t).max()) for t in stacked) ** 2)


@TF_SETTINGS
@given(client_models())
def test_fedbe_gaussian_is_the_weighted_mean_and_variance(case):
  stacked, sizes = case
  mean, variance = _gaussian(stacked, sizes)
  p = sizes.astype(np.float64) / sizes.sum()
  atol = _gaussian_tolerance(stacked)
  for got_mean, got_var, values in zip(mean, variance, stacked):
    want_mean = np.tensordot(p, values, axes=1)
    want_var = np.tensordot(p, (values - want_mean) ** 2, axes=1)
    np.testing.assert_allclose(got_mean, want_mean, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(got_var, want_var, rtol=1e-4, atol=atol)
    assert (got_var >= 0).all()


@TF_SETTINGS
@given(client_models(), st.floats(-10, 10, width=32), st.floats(0.01, 100.0))
def test_fedbe_variance_ignores_shifts_and_weight_scale(case, shift, scale):
  # The server fits the Gaussian to the updates w0 - w_i, not to w_i
  # (moment_terms' docstring): the variance must not change.
  stacked, sizes = case
  _, variance = _gaussian(stacked, sizes)
  _, shifted = _gaussian(tuple(np.float32(shift) - t for t in stacked), sizes * np.float32(scale))
  atol = _gaussian_tolerance(stacked) + _gaussian_tolerance(
    tuple(np.float32(shift) - t for t in stacked)
  )
  for a, b in zip(variance, shifted):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=atol)


@TF_SETTINGS
@given(
  st.lists(st.sampled_from([0.0, 0.0, 1.0, 3.0, 20.0, 600.0]), min_size=1, max_size=8),
  st.floats(1e-4, 100.0),
  st.integers(1, 20),
  st.tuples(seeds, seeds),
)
def test_fedbe_dirichlet_coefficients_lie_on_the_simplex(client_weights, alpha, num_samples, seed):
  assume(any(client_weights))
  gamma = weight_posterior.sample_dirichlet_coefficients(
    client_weights, alpha, num_samples, seed
  ).numpy()
  weights = np.asarray(client_weights)
  assert gamma.shape == (num_samples, len(weights))
  assert np.isfinite(gamma).all() and (gamma >= 0).all()
  np.testing.assert_allclose(gamma.sum(1), 1.0, atol=1e-5)
  assert (gamma[:, weights == 0] == 0).all()  # No weight, no coefficient.
  concentration = weight_posterior.dirichlet_concentration(client_weights, alpha).numpy()
  # alpha_i = alpha * N * p_i over the N clients present: mean p.
  np.testing.assert_allclose(
    concentration, alpha * np.count_nonzero(weights) * weights / weights.sum(), rtol=1e-5
  )


@st.composite
def client_update(draw):
  """A ModelWeights update, maybe with a NaN/Inf, and a max_norm."""
  trainable = [
    np.asarray(draw(_vectors(n)), np.float32)
    for n in draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
  ]
  non_trainable = [
    np.asarray(draw(_vectors(2)), np.float32) for _ in range(draw(st.integers(0, 1)))
  ]
  tensors = trainable + non_trainable
  bad = draw(st.sampled_from([None, np.nan, np.inf, -np.inf]))
  if bad is not None:
    where = draw(st.integers(0, len(tensors) - 1))
    tensors[where][draw(st.integers(0, len(tensors[where]) - 1))] = bad
  max_norm = draw(st.sampled_from([0.0]) | st.floats(0.1, 30.0))
  return trainable, non_trainable, max_norm


@TF_SETTINGS
@given(client_update(), st.floats(0.0, 1000.0, width=32))
def test_reject_bad_update_rejects_exactly_non_finite_or_too_large(case, weight):
  trainable, non_trainable, max_norm = case
  finite = all(np.isfinite(t).all() for t in trainable + non_trainable)
  norm = np.sqrt(sum(np.sum(t.astype(np.float64) ** 2) for t in trainable))
  if finite and max_norm:
    assume(abs(norm - max_norm) > 1e-4 * max_norm)  # Not float32-close.
  rejected = not finite or bool(max_norm and norm > max_norm)
  update, got_weight, got_rejected = client_work.reject_bad_update(
    ModelWeights([tf.constant(t) for t in trainable], [tf.constant(t) for t in non_trainable]),
    tf.constant(weight, tf.float32),
    max_norm,
  )
  assert float(got_rejected) == float(rejected)
  assert float(got_weight) == (0.0 if rejected else np.float32(weight))
  for got, original in zip(tf.nest.flatten(update), trainable + non_trainable):
    want = np.zeros_like(original) if rejected else original
    np.testing.assert_array_equal(got.numpy(), want)
