"""Tests of `tff_ens.algorithms.fedavg` (FedAvg, FedAvgM) and the byte accounting of
`tff_ens.algorithms`, on two or three clients with a few examples each.

Expected models are computed outside the process: per client with
`client_work.train_locally` (itself checked against NumPy in
test_client_work.py) or with a NumPy SGD step, then averaged by hand.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import algorithms
from tff_ens.algorithms import algorithm
from tff_ens.algorithms import fedadam
from tff_ens.algorithms import fedavg
from tff_ens.templates import client_work
from tff_ens.templates import server_optimizer
from tiny import SPEC
from tiny import one_batch
from tiny import tiny_model as make_model

ModelWeights = tff.learning.models.ModelWeights
Config = client_work.LocalTrainingConfig

LR = 0.5


# Client A: two examples, client B: three (so the weighting is visible).
XA = [[1.0, 0.0, -1.0, 2.0], [0.5, -0.5, 1.0, 0.0]]
YA = [0, 2]
XB = [[-1.0, 2.0, 0.0, 1.0], [2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 1.0, 3.0]]
YB = [1, 1, 0]


def softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def numpy_sgd_update(kernel, bias, x, y, lr=LR):
  """initial - final after one SGD step on the mean softmax cross-entropy."""
  x = np.asarray(x, np.float64).reshape(len(y), -1)
  d = (softmax(x @ kernel + bias) - np.eye(kernel.shape[1])[y]) / len(y)
  return [lr * (x.T @ d), lr * d.sum(0)]


def as_numpy(weights):
  return ModelWeights(
    [np.asarray(t) for t in weights.trainable], [np.asarray(t) for t in weights.non_trainable]
  )


def assert_weights_close(got, expected, atol=1e-6):
  got, expected = tf.nest.flatten(got), tf.nest.flatten(expected)
  assert len(got) == len(expected)
  for g, e in zip(got, expected):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=atol)


@pytest.fixture(scope="module")
def bn_fedavg():
  process = fedavg.build_fedavg(
    lambda: make_model(batch_norm=True), SPEC, Config(learning_rate=LR)
  ).process
  return process


def locally_trained_update(initial, x, y):
  """One client's ClientResult from `train_locally`, run outside TFF."""
  result, _ = client_work.train_locally(
    make_model(batch_norm=True),
    tff.learning.optimizers.build_sgdm(learning_rate=LR),
    initial,
    one_batch(x, y),
    tf.constant(LR),
    Config(learning_rate=LR),
  )
  return result


def test_round_is_example_weighted_average_of_client_models(bn_fedavg):
  state = bn_fedavg.initialize()
  w0 = as_numpy(bn_fedavg.get_model_weights(state))
  output = bn_fedavg.next(state, [one_batch(XA, YA), one_batch(XB, YB)])
  got = as_numpy(bn_fedavg.get_model_weights(output.state))

  update_a = locally_trained_update(w0, XA, YA)
  update_b = locally_trained_update(w0, XB, YB)
  assert float(update_a.update_weight) == 2.0
  assert float(update_b.update_weight) == 3.0
  # FedAvg: w0 - (2 dA + 3 dB) / 5, i.e. the weighted average of the two
  # clients' trained models, trainable and batch-norm weights alike.
  expected = tf.nest.map_structure(
    lambda w, a, b: w - (2 * np.asarray(a) + 3 * np.asarray(b)) / 5,
    w0,
    update_a.update,
    update_b.update,
  )
  assert_weights_close(got, expected)

  # The batch-norm statistics by hand: from moving mean 0 / variance 1, each
  # client's one batch gives 0.99 * initial + 0.01 * batch statistic.
  xa, xb = np.reshape(XA, (2, 4)), np.reshape(XB, (3, 4))
  mean = (2 * 0.01 * xa.mean(0) + 3 * 0.01 * xb.mean(0)) / 5
  var = 0.99 + (2 * 0.01 * xa.var(0) + 3 * 0.01 * xb.var(0)) / 5
  np.testing.assert_allclose(got.non_trainable[0], mean, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(got.non_trainable[1], var, rtol=1e-5, atol=1e-7)

  train = output.metrics["client_work"]
  assert train["num_examples"] == 5.0
  assert train["rejected_updates"] == 0.0


def test_client_with_nan_data_is_rejected(bn_fedavg):
  state = bn_fedavg.initialize()
  w0 = as_numpy(bn_fedavg.get_model_weights(state))
  x_bad = np.array(XA)
  x_bad[0, 1] = np.nan
  output = bn_fedavg.next(state, [one_batch(XA, YA), one_batch(x_bad, [1, 1]), one_batch(XB, YB)])
  got = as_numpy(bn_fedavg.get_model_weights(output.state))

  update_a = locally_trained_update(w0, XA, YA)
  update_b = locally_trained_update(w0, XB, YB)
  expected = tf.nest.map_structure(
    lambda w, a, b: w - (2 * np.asarray(a) + 3 * np.asarray(b)) / 5,
    w0,
    update_a.update,
    update_b.update,
  )
  assert_weights_close(got, expected)
  assert all(np.isfinite(t).all() for t in tf.nest.flatten(got))
  assert output.metrics["client_work"]["rejected_updates"] == 1.0


@pytest.mark.parametrize(
  "x, y",
  [
    (np.full((2, 4), np.nan), [0, 1]),  # Update rejected.
    (np.zeros((0, 4)), np.zeros((0,), np.int32)),  # No examples.
  ],
  ids=["rejected", "empty"],
)
def test_round_where_every_client_has_weight_zero_keeps_the_model(bn_fedavg, x, y):
  state = bn_fedavg.initialize()
  w0 = as_numpy(bn_fedavg.get_model_weights(state))
  output = bn_fedavg.next(state, [one_batch(x, y)])
  got = as_numpy(bn_fedavg.get_model_weights(output.state))
  assert_weights_close(got, w0, atol=0)


def mean_delta(weights):
  """The mean update of clients A (2 examples) and B (3) from `weights`, by hand."""
  kernel, bias = [np.asarray(t, np.float64) for t in weights]
  ua = numpy_sgd_update(kernel, bias, XA, YA)
  ub = numpy_sgd_update(kernel, bias, XB, YB)
  return [(2 * a + 3 * b) / 5 for a, b in zip(ua, ub)]


@pytest.mark.parametrize("server_lr", [1.0, 0.5])
def test_fedavgm_second_round_adds_momentum_times_previous_delta(server_lr):
  momentum = 0.9
  process = fedavg.build_fedavg(
    make_model,
    SPEC,
    Config(learning_rate=LR),
    server_optimizer=server_optimizer.build_server_optimizer(server_lr, momentum),
  ).process
  data = [one_batch(XA, YA), one_batch(XB, YB)]

  state = process.initialize()
  w0 = as_numpy(process.get_model_weights(state)).trainable
  state = process.next(state, data).state
  w1 = as_numpy(process.get_model_weights(state)).trainable
  d1 = mean_delta(w0)
  # Round 1: the momentum buffer starts at 0, so v1 = d1.
  for got, w, d in zip(w1, w0, d1):
    np.testing.assert_allclose(got, w - server_lr * d, rtol=1e-5, atol=1e-6)
  state = process.next(state, data).state
  w2 = as_numpy(process.get_model_weights(state)).trainable
  d2 = mean_delta(w1)
  # Round 2: v2 = momentum * v1 + d2.
  for got, w, a, b in zip(w2, w1, d1, d2):
    np.testing.assert_allclose(got, w - server_lr * (momentum * a + b), rtol=1e-5, atol=1e-6)
  # Without momentum the second step would differ noticeably.
  assert not np.allclose(w2[0], w1[0] - server_lr * d2[0], atol=1e-4)


def test_fedadam_is_registered_fedavg_with_adam_on_the_averaged_update():
  """Two rounds of --algorithm=fedadam against Adam computed by hand (Reddi et al.,
  Algorithm 2, with TFF's bias correction) on the clients' mean update."""
  server_lr, epsilon = 0.1, 1e-3
  algorithm = algorithms.build_algorithm(
    "fedadam",
    lambda k=0: make_model(),
    SPEC,
    Config(learning_rate=LR),
    server_lr=server_lr,
    server_epsilon=epsilon,
  )
  process = algorithm.process
  data = [one_batch(XA, YA), one_batch(XB, YB)]

  state = process.initialize()
  weights = [
    np.asarray(w, np.float64) for w in as_numpy(process.get_model_weights(state)).trainable
  ]
  m = [np.zeros_like(w) for w in weights]
  v = [np.zeros_like(w) for w in weights]
  b1, b2 = fedadam.BETA_1, fedadam.BETA_2
  for t in (1, 2):
    d = mean_delta(weights)
    m = [b1 * a + (1 - b1) * g for a, g in zip(m, d)]
    v = [b2 * a + (1 - b2) * g * g for a, g in zip(v, d)]
    step = server_lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    weights = [w - step * a / (np.sqrt(p) + epsilon) for w, a, p in zip(weights, m, v)]
    state = process.next(state, data).state
    got = as_numpy(process.get_model_weights(state)).trainable
    for g, w in zip(got, weights):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
  assert fedadam.LEARNING_RATE != fedavg.LEARNING_RATE  # Its own default step size.


class TestTypeSizeBytes:
  def test_tensors(self):
    assert algorithm.type_size_bytes(tff.TensorType(np.float32, [2, 3])) == 24
    assert algorithm.type_size_bytes(tff.TensorType(np.int64)) == 8
    assert algorithm.type_size_bytes(tff.TensorType(np.int32, [1])) == 4
    assert algorithm.type_size_bytes(tff.TensorType(np.float64, [0, 5])) == 0

  def test_nested_struct_federated_and_sequence(self):
    struct = tff.StructType(
      [
        ("a", tff.TensorType(np.float32, [4, 3])),  # 48
        (
          "b",
          tff.StructType(
            [
              tff.TensorType(np.int64, [2]),  # 16
              tff.TensorType(np.bool_, [3]),
            ]
          ),
        ),  # 3
        ("data", tff.SequenceType(tff.TensorType(np.float32, [100]))),  # 0
      ]
    )
    assert algorithm.type_size_bytes(struct) == 67
    assert algorithm.type_size_bytes(tff.FederatedType(struct, tff.CLIENTS)) == 67

  def test_unknown_shape_and_function_types_raise(self):
    with pytest.raises(ValueError, match="unknown shape"):
      algorithm.type_size_bytes(tff.TensorType(np.float32, [None, 3]))
    with pytest.raises(TypeError):
      algorithm.type_size_bytes(tff.FunctionType(np.int32, np.int32))


def test_unknown_algorithm_and_objective_raise():
  with pytest.raises(ValueError, match="fedsgd"):
    algorithms.build_algorithm("fedsgd", lambda k: make_model(k), SPEC, Config())
  with pytest.raises(ValueError, match="fedavg reads no setting local_objective"):
    algorithms.build_algorithm(
      "fedavg", lambda k: make_model(k), SPEC, Config(), local_objective="feddyn"
    )


@pytest.mark.parametrize("name", ["fedavg", "fedavgm"])
def test_fedavg_bytes_are_the_model_plus_a_few_scalars(name):
  algorithm = algorithms.build_algorithm(
    name, lambda k: make_model(k, batch_norm=True), SPEC, Config()
  )
  # Flatten(2x2x1) -> BatchNorm(4) -> Dense(3): gamma, beta, moving mean and
  # variance (4 each), kernel 4x3 and bias 3.
  num_params = 4 * 4 + 4 * 3 + 3
  assert make_model(batch_norm=True).count_params() == num_params == 31
  down, up = algorithm.bytes_per_client_round()
  # Down: the model and the round's learning rate (float32).
  assert down == 4 * num_params + 4
  # Up: the update, its weight, and four float32 metric sums
  # (loss, correct, num_examples, rejected).
  assert up == 4 * num_params + 4 + 4 * 4


def dense_then_batch_norm():
  """Flatten(2x2x1) -> Dense(3) -> BatchNorm: its statistics depend on the dense weights."""
  return tf.keras.Sequential(
    [
      tf.keras.layers.Input((2, 2, 1)),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(3, kernel_initializer=tf.keras.initializers.RandomNormal(seed=4)),
      tf.keras.layers.BatchNormalization(),
    ]
  )


def test_recalibration_measures_the_new_models_batch_norm_statistics_on_server_images():
  server_images = np.random.default_rng(0).normal(size=(6, 2, 2, 1)).astype(np.float32)
  plain = fedavg.build_fedavg(dense_then_batch_norm, SPEC, Config(learning_rate=LR)).process
  recalibrated = fedavg.build_fedavg(
    dense_then_batch_norm, SPEC, Config(learning_rate=LR), recalibration_images=server_images
  ).process
  clients = [one_batch(XA, YA), one_batch(XB, YB)]
  averaged = as_numpy(plain.get_model_weights(plain.next(plain.initialize(), clients).state))
  got = as_numpy(
    recalibrated.get_model_weights(recalibrated.next(recalibrated.initialize(), clients).state)
  )
  # The trainable weights are FedAvg's; the statistics are the batch's of the new dense
  # layer's outputs on the server images (Keras' biased variance), not the clients' average.
  assert_weights_close(got.trainable, averaged.trainable)
  kernel, bias = got.trainable[:2]
  features = server_images.reshape(6, 4) @ kernel + bias
  np.testing.assert_allclose(got.non_trainable[0], features.mean(0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got.non_trainable[1], features.var(0), rtol=1e-5, atol=1e-6)
  assert not np.allclose(got.non_trainable[0], averaged.non_trainable[0], atol=1e-3)


def test_recalibration_is_refused_by_an_algorithm_without_it():
  with pytest.raises(ValueError, match="fedensemble does not take recalibrates: use one of fed"):
    algorithms.build_algorithm(
      "fedensemble",
      lambda k=0: make_model(batch_norm=True),
      SPEC,
      Config(),
      recalibration_images=np.zeros((2, 2, 2, 1), np.float32),
    )


def test_adams_first_local_step_moves_each_weight_by_the_learning_rate_against_its_gradient():
  initial = ModelWeights.from_model(make_model())
  kernel, bias = (np.asarray(t, np.float64) for t in initial.trainable)
  config = Config(learning_rate=0.01, optimizer="adam")
  result, _ = client_work.train_locally(
    make_model(),
    client_work.local_optimizer(config),
    initial,
    one_batch(XA, YA),
    tf.constant(0.01),
    config,
  )
  # Bias-corrected first step (Kingma and Ba, Algorithm 1, with Keras' epsilon outside the
  # correction): lr sqrt(1 - b2) / (1 - b1) * (1 - b1) g / (sqrt(1 - b2) |g| + eps), i.e.
  # about lr * sign(g).
  gradients = numpy_sgd_update(kernel, bias, XA, YA, lr=1.0)
  for update, g in zip(result.update.trainable, gradients):
    expected = 0.01 * g / (np.abs(g) + 1e-7 / np.sqrt(1 - 0.999))
    np.testing.assert_allclose(update, expected, atol=1e-7)


def test_adam_with_sgd_momentum_is_refused():
  with pytest.raises(ValueError, match="momentum must be 0 with the adam optimizer"):
    Config(optimizer="adam", momentum=0.9)
