"""Tests of `tff_ens.templates.client_work`: the local training shared by all algorithms.

Small cases checked against NumPy / hand computations (docs/STYLE.md, 3 and 7):
a linear softmax model on 2x2 images (4 features, 3 classes) and two or three
examples per batch.
"""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.templates import client_work
from tff_ens.templates import feddyn
from tiny import SPEC
from tiny import tiny_model as linear_model

ModelWeights = tff.learning.models.ModelWeights
Config = client_work.LocalTrainingConfig


def model_weights(model):
  return ModelWeights(
    [v.numpy() for v in model.trainable_variables],
    [v.numpy() for v in model.non_trainable_variables],
  )


def sgd_optimizer(momentum=0.0):
  return tff.learning.optimizers.build_sgdm(learning_rate=0.0, momentum=momentum or None)


def dataset(*batches):
  """A dataset whose batches are exactly `batches` [(x [n,4], y [n]), ...]."""
  # Built from tensors (no Python generator) so that TFF can serialize it.
  data = tf.data.Dataset.from_tensors(
    (np.zeros((0, 2, 2, 1), np.float32), np.zeros((0,), np.int32))
  ).take(0)
  for x, y in batches:
    data = data.concatenate(
      tf.data.Dataset.from_tensors(
        (np.asarray(x, np.float32).reshape(-1, 2, 2, 1), np.asarray(y, np.int32))
      )
    )
  return data


def softmax(z):
  z = z - z.max(-1, keepdims=True)
  e = np.exp(z)
  return e / e.sum(-1, keepdims=True)


def numpy_gradients(kernel, bias, x, y):
  """Gradient of the mean softmax cross-entropy of x @ kernel + bias."""
  x = np.asarray(x, np.float64).reshape(len(y), -1)
  p = softmax(x @ kernel + bias)
  d = (p - np.eye(kernel.shape[1])[y]) / len(y)
  return x.T @ d, d.sum(0)


def numpy_loss_and_correct(kernel, bias, x, y):
  x = np.asarray(x, np.float64).reshape(len(y), -1)
  logits = x @ kernel + bias
  p = softmax(logits)
  return -np.log(p[np.arange(len(y)), y]).sum(), np.sum(logits.argmax(-1) == y)


# Two batches: three examples, then two.
X1 = [[1.0, 0.0, -1.0, 2.0], [0.5, -0.5, 1.0, 0.0], [-1.0, 2.0, 0.0, 1.0]]
Y1 = [0, 2, 1]
X2 = [[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 1.0, 1.0]]
Y2 = [1, 1]


class TestLocalTrainingConfig:
  def test_defaults_are_valid_plain_sgd(self):
    config = Config()
    assert (config.momentum, config.weight_decay, config.proximal_mu) == (0, 0, 0)
    assert config.lr_schedule == "constant"

  @pytest.mark.parametrize(
    "kwargs",
    [
      dict(learning_rate=0.0),
      dict(learning_rate=-0.1),
      dict(total_rounds=0),
      dict(total_rounds=-3),
      dict(momentum=-0.9),
      dict(weight_decay=-1e-4),
      dict(proximal_mu=-0.01),
      dict(lr_schedule="cosine"),
    ],
  )
  def test_rejects_bad_values(self, kwargs):
    with pytest.raises(ValueError):
      Config(**kwargs)

  def test_error_names_the_field(self):
    with pytest.raises(ValueError, match="proximal_mu"):
      Config(proximal_mu=-1.0)
    with pytest.raises(ValueError, match="cosine"):
      Config(lr_schedule="cosine")


class TestLearningRateAt:
  def test_constant(self):
    config = Config(learning_rate=0.05, total_rounds=10)
    for r in (0, 3, 6, 9, 100):
      assert float(client_work.learning_rate_at(r, config)) == np.float32(0.05)

  @pytest.mark.parametrize(
    "total_rounds, before_30, at_30, before_60, at_60",
    [
      (10, 2, 3, 5, 6),
      (100, 29, 30, 59, 60),
      (7, 2, 3, 4, 5),  # 30% of 7 is 2.1, 60% is 4.2: decays start at 3 and 5.
    ],
  )
  def test_step_decays_by_ten_at_30_and_60_percent(
    self, total_rounds, before_30, at_30, before_60, at_60
  ):
    config = Config(learning_rate=0.2, lr_schedule="step", total_rounds=total_rounds)

    def rate(r):
      return float(client_work.learning_rate_at(tf.constant(r, tf.int32), config))

    assert rate(0) == pytest.approx(0.2, rel=1e-6)
    assert rate(before_30) == pytest.approx(0.2, rel=1e-6)
    assert rate(at_30) == pytest.approx(0.02, rel=1e-6)
    assert rate(before_60) == pytest.approx(0.02, rel=1e-6)
    assert rate(at_60) == pytest.approx(0.002, rel=1e-6)
    assert rate(total_rounds - 1) == pytest.approx(0.002, rel=1e-6)


class TestLocalObjectiveGradient:
  G, W, W0 = [1.0, -2.0], [3.0, 4.0], [1.0, 1.0]

  @pytest.mark.parametrize(
    "weight_decay, mu, expected",
    [
      (0.0, 0.0, [1.0, -2.0]),
      (0.1, 0.0, [1.3, -1.6]),  # g + 0.1 w
      (0.0, 0.5, [2.0, -0.5]),  # g + 0.5 (w - w0)
      (0.1, 0.5, [2.3, -0.1]),  # both
    ],
  )
  def test_hand_numbers(self, weight_decay, mu, expected):
    config = Config(weight_decay=weight_decay, proximal_mu=mu)
    got = client_work.local_objective_gradient(
      tf.constant(self.G), tf.constant(self.W), tf.constant(self.W0), config
    )
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)

  def test_proximal_term_vanishes_at_the_start_point(self):
    config = Config(proximal_mu=0.7)
    got = client_work.local_objective_gradient(
      tf.constant(self.G), tf.constant(self.W), tf.constant(self.W), config
    )
    np.testing.assert_array_equal(got.numpy(), self.G)


class TestRejectBadUpdate:
  def update(self, trainable_value, non_trainable_value):
    return ModelWeights(
      [tf.constant([1.0, trainable_value]), tf.constant(2.0)],
      [tf.constant([non_trainable_value, -3.0])],
    )

  def test_finite_update_is_kept(self):
    update, weight, rejected = client_work.reject_bad_update(
      self.update(5.0, 4.0), tf.constant(7.0)
    )
    np.testing.assert_array_equal(update.trainable[0].numpy(), [1.0, 5.0])
    np.testing.assert_array_equal(update.trainable[1].numpy(), 2.0)
    np.testing.assert_array_equal(update.non_trainable[0].numpy(), [4.0, -3.0])
    assert float(weight) == 7.0
    assert float(rejected) == 0.0

  @pytest.mark.parametrize(
    "trainable_value, non_trainable_value",
    [
      (np.nan, 4.0),
      (np.inf, 4.0),
      (-np.inf, 4.0),
      (5.0, np.nan),  # Only a batch-norm statistic is bad: still rejected.
    ],
  )
  def test_non_finite_update_is_zeroed_with_weight_zero(self, trainable_value, non_trainable_value):
    update, weight, rejected = client_work.reject_bad_update(
      self.update(trainable_value, non_trainable_value), tf.constant(7.0)
    )
    for t in tf.nest.flatten(update):
      np.testing.assert_array_equal(t.numpy(), np.zeros(t.shape))
    assert float(weight) == 0.0
    assert float(rejected) == 1.0

  @pytest.mark.parametrize("max_norm, rejected", [(0.0, 0.0), (5.1, 0.0), (4.9, 1.0)])
  def test_update_beyond_max_norm_is_rejected(self, max_norm, rejected):
    # Trainable norm sqrt(1 + 16 + 8) = 5.0; the BN statistic (100) is not
    # part of it.
    update = ModelWeights([tf.constant([1.0, 4.0]), tf.constant(8.0**0.5)], [tf.constant([100.0])])
    _, weight, got = client_work.reject_bad_update(update, tf.constant(7.0), max_norm)
    assert float(got) == rejected
    assert float(weight) == 7.0 * (1 - rejected)


class TestTrainLocally:
  def run(self, model, batches, learning_rate, config, momentum=0.0):
    initial = model_weights(model)
    result, metrics = client_work.train_locally(
      model, sgd_optimizer(momentum), initial, dataset(*batches), tf.constant(learning_rate), config
    )
    return initial, result, {k: float(v) for k, v in metrics.items()}

  def test_one_batch_is_one_sgd_step_with_weight_decay(self):
    lr, wd = 0.5, 0.1
    model = linear_model()
    config = Config(learning_rate=lr, weight_decay=wd, proximal_mu=0.3)
    initial, result, metrics = self.run(model, [(X1, Y1)], lr, config)
    kernel, bias = initial.trainable
    g_kernel, g_bias = numpy_gradients(kernel, bias, X1, Y1)
    # The proximal term is zero at the first step (w = w0): only decay acts.
    new_kernel = kernel - lr * (g_kernel + wd * kernel)
    new_bias = bias - lr * (g_bias + wd * bias)
    np.testing.assert_allclose(
      result.update.trainable[0], kernel - new_kernel, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(result.update.trainable[1], bias - new_bias, rtol=1e-5, atol=1e-6)
    assert result.update.non_trainable == []
    assert float(result.update_weight) == 3.0
    loss, correct = numpy_loss_and_correct(kernel, bias, X1, Y1)
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["correct"] == correct
    assert metrics["num_examples"] == 3.0
    assert metrics["rejected"] == 0.0
    # The model passed in ends at the trained weights.
    np.testing.assert_allclose(
      model.trainable_variables[0].numpy(), new_kernel, rtol=1e-5, atol=1e-6
    )

  def test_proximal_term_acts_from_the_second_step(self):
    lr, wd, mu = 0.5, 0.1, 0.8
    model = linear_model(seed=3)
    initial, result, metrics = self.run(
      model, [(X1, Y1), (X2, Y2)], lr, Config(learning_rate=lr, weight_decay=wd, proximal_mu=mu)
    )
    w0 = [t.astype(np.float64) for t in initial.trainable]

    def numpy_run(mu):
      w = list(w0)
      for x, y in [(X1, Y1), (X2, Y2)]:
        grads = numpy_gradients(w[0], w[1], x, y)
        w = [wi - lr * (g + wd * wi + mu * (wi - w0i)) for wi, g, w0i in zip(w, grads, w0)]
      return w

    expected = numpy_run(mu)
    for got, w, w_init in zip(result.update.trainable, expected, w0):
      np.testing.assert_allclose(got, w_init - w, rtol=1e-5, atol=1e-6)
    # The proximal term made a difference (the check above is not vacuous).
    without = numpy_run(0.0)
    assert not np.allclose(expected[0], without[0], atol=1e-4)
    # Metrics are sums over both batches, each at the weights it was seen with.
    loss1, correct1 = numpy_loss_and_correct(w0[0], w0[1], X1, Y1)
    w1 = [wi - lr * (g + wd * wi) for wi, g in zip(w0, numpy_gradients(w0[0], w0[1], X1, Y1))]
    loss2, correct2 = numpy_loss_and_correct(w1[0], w1[1], X2, Y2)
    assert metrics["loss"] == pytest.approx(loss1 + loss2, rel=1e-5)
    assert metrics["correct"] == correct1 + correct2
    assert metrics["num_examples"] == 5.0
    assert float(result.update_weight) == 5.0

  def test_momentum_accumulates_over_steps(self):
    lr, momentum = 0.3, 0.9
    model = linear_model(seed=5)
    initial, result, _ = self.run(
      model,
      [(X1, Y1), (X2, Y2)],
      lr,
      Config(learning_rate=lr, momentum=momentum),
      momentum=momentum,
    )
    w = [t.astype(np.float64) for t in initial.trainable]
    velocity = [np.zeros_like(t) for t in w]
    for x, y in [(X1, Y1), (X2, Y2)]:
      grads = numpy_gradients(w[0], w[1], x, y)
      velocity = [momentum * v + g for v, g in zip(velocity, grads)]
      w = [wi - lr * v for wi, v in zip(w, velocity)]
    for got, final, w_init in zip(result.update.trainable, w, initial.trainable):
      np.testing.assert_allclose(got, w_init - final, rtol=1e-5, atol=1e-6)

  def test_learning_rate_argument_is_used(self):
    model = linear_model(seed=7)
    initial, result, _ = self.run(model, [(X1, Y1)], 0.25, Config(learning_rate=9.0))
    g_kernel, _ = numpy_gradients(*initial.trainable, X1, Y1)
    np.testing.assert_allclose(result.update.trainable[0], 0.25 * g_kernel, rtol=1e-5, atol=1e-6)

  def test_update_includes_batch_norm_statistics(self):
    model = linear_model(seed=11, batch_norm=True)
    initial, result, _ = self.run(model, [(X1, Y1), (X2, Y2)], 0.1, Config(learning_rate=0.1))
    final = model_weights(model)
    assert len(initial.trainable) == 4 and len(initial.non_trainable) == 2
    for got, a, b in zip(
      tf.nest.flatten(result.update), tf.nest.flatten(initial), tf.nest.flatten(final)
    ):
      np.testing.assert_allclose(got, a - b, rtol=1e-6, atol=1e-7)
    # Keras: moving = 0.99 moving + 0.01 batch statistic (biased variance),
    # from moving mean 0 and variance 1.
    x1 = np.reshape(X1, (3, 4))
    x2 = np.reshape(X2, (2, 4))
    mean, var = np.zeros(4), np.ones(4)
    for x in (x1, x2):
      mean = 0.99 * mean + 0.01 * x.mean(0)
      var = 0.99 * var + 0.01 * x.var(0)
    np.testing.assert_allclose(result.update.non_trainable[0], -mean, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(result.update.non_trainable[1], 1.0 - var, rtol=1e-5, atol=1e-7)
    assert all(np.any(u != 0) for u in result.update.trainable)

  def test_nan_inputs_are_rejected(self):
    model = linear_model(batch_norm=True)
    x = np.array(X1)
    x[1, 2] = np.nan
    _, result, metrics = self.run(model, [(x, Y1)], 0.1, Config(learning_rate=0.1))
    for t in tf.nest.flatten(result.update):
      np.testing.assert_array_equal(t, np.zeros(t.shape))
    assert float(result.update_weight) == 0.0
    assert metrics["rejected"] == 1.0
    # A rejected client's training metrics are dropped with its update.
    assert metrics["num_examples"] == 0.0
    assert metrics["loss"] == 0.0

  def test_empty_dataset_gives_zero_update_and_weight(self):
    model = linear_model()
    initial = model_weights(model)
    result, metrics = client_work.train_locally(
      model, sgd_optimizer(), initial, dataset(*[]), tf.constant(0.1), Config(learning_rate=0.1)
    )
    for t in tf.nest.flatten(result.update):
      np.testing.assert_array_equal(t, np.zeros(t.shape))
    assert float(result.update_weight) == 0.0
    assert float(metrics["rejected"]) == 0.0


class TestClientWorkProcess:
  """The TFF wrapper: round counter and the broadcast learning rate."""

  def test_process_uses_the_scheduled_rate_and_counts_rounds(self):
    config = Config(learning_rate=0.5, lr_schedule="step", total_rounds=2)
    work = client_work.build_client_work(lambda: linear_model(seed=13), SPEC, config)
    model = linear_model(seed=13)
    initial = model_weights(model)
    state = work.process.initialize()
    assert state == 0
    kernel, bias = initial.trainable
    g_kernel, g_bias = numpy_gradients(kernel, bias, X1, Y1)
    data = [dataset((X1, Y1))]
    # Round 0 at rate 0.5, round 1 (50% of 2 rounds: one decay) at 0.05.
    for round_num, rate in [(0, 0.5), (1, 0.05)]:
      output = work.process.next(state, [initial], data)
      assert output.state == round_num + 1
      (result,) = output.result
      np.testing.assert_allclose(result.update.trainable[0], rate * g_kernel, rtol=1e-5, atol=1e-7)
      np.testing.assert_allclose(result.update.trainable[1], rate * g_bias, rtol=1e-5, atol=1e-7)
      assert output.measurements["num_examples"] == 3.0
      state = output.state
    loss, correct = numpy_loss_and_correct(kernel, bias, X1, Y1)
    assert output.measurements["train_loss"] == pytest.approx(loss / 3, rel=1e-5)
    assert output.measurements["train_accuracy"] == pytest.approx(correct / 3)
    assert output.measurements["rejected_updates"] == 0.0

  def test_finalize_train_metrics_divides_sums(self):
    got = client_work.finalize_train_metrics(
      dict(
        loss=tf.constant(6.0),
        correct=tf.constant(3.0),
        num_examples=tf.constant(4.0),
        rejected=tf.constant(1.0),
      )
    )
    assert float(got["train_loss"]) == 1.5
    assert float(got["train_accuracy"]) == 0.75
    assert float(got["num_examples"]) == 4.0
    assert float(got["rejected_updates"]) == 1.0
    empty = client_work.finalize_train_metrics(
      dict(
        loss=tf.constant(0.0),
        correct=tf.constant(0.0),
        num_examples=tf.constant(0.0),
        rejected=tf.constant(0.0),
      )
    )
    assert float(empty["train_loss"]) == 0.0  # No division by zero.


def test_data_that_does_not_fit_the_model_is_a_named_error():
  wrong = (tf.TensorSpec([None, 32, 32, 3], tf.float32), tf.TensorSpec([None], tf.int32))
  with pytest.raises(
    client_work.TypeMismatchError, match=r"\(None, 32, 32, 3\).*\(None, 28, 28, 1\)"
  ):
    client_work.build_client_work(
      lambda: tf.keras.Sequential(
        [tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)]
      ),
      wrong,
      client_work.LocalTrainingConfig(),
    )
  float_labels = (tf.TensorSpec([None, 28, 28, 1], tf.float32), tf.TensorSpec([None], tf.float32))
  with pytest.raises(client_work.TypeMismatchError, match="integer"):
    client_work.check_data_fits_model(
      lambda: tf.keras.Sequential(
        [tf.keras.Input((28, 28, 1)), tf.keras.layers.Flatten(), tf.keras.layers.Dense(3)]
      ),
      float_labels,
    )


class TestTrainFedDyn:
  """FedDyn's client (Acar et al., ICLR 2021, Algorithm 1, lines 7-8)."""

  def run(self, model, batches, lr, alpha, dyn_state):
    initial = model_weights(model)
    result, metrics, new_state = feddyn.train_feddyn(
      model,
      sgd_optimizer(),
      initial,
      dataset(*batches),
      tf.constant(lr),
      Config(learning_rate=lr),
      alpha,
      [tf.constant(g, tf.float32) for g in dyn_state],
    )
    return initial, result, metrics, [np.asarray(g) for g in new_state]

  def test_two_steps_and_the_state_update_match_numpy(self):
    lr, alpha = 0.5, 0.3
    model = linear_model(seed=13)
    rng = np.random.default_rng(1)
    g = [rng.normal(size=(4, 3)), rng.normal(size=(3,))]
    initial, result, metrics, new_g = self.run(model, [(X1, Y1), (X2, Y2)], lr, alpha, g)
    w0 = [t.astype(np.float64) for t in initial.trainable]
    w = list(w0)
    for x, y in [(X1, Y1), (X2, Y2)]:
      grads = numpy_gradients(w[0], w[1], x, y)
      # grad of F(w) - <g, w> + alpha/2 ||w - w0||^2.
      w = [wi - lr * (gr - gi + alpha * (wi - w0i)) for wi, gr, gi, w0i in zip(w, grads, g, w0)]
    for got, final, start in zip(result.update.trainable, w, w0):
      np.testing.assert_allclose(got, start - final, rtol=1e-5, atol=1e-6)
    # Line 8: g <- g - alpha (w_final - w0).
    for got, gi, final, start in zip(new_g, g, w, w0):
      np.testing.assert_allclose(got, gi - alpha * (final - start), rtol=1e-5, atol=1e-6)
    # Unweighted server mean: weight 1, whatever the client's data size.
    assert float(result.update_weight) == 1.0
    assert float(metrics["num_examples"]) == 5.0
    # The linear term made a difference (the check above is not vacuous).
    _, plain, _ = TestTrainLocally().run(
      linear_model(seed=13), [(X1, Y1), (X2, Y2)], lr, Config(learning_rate=lr, proximal_mu=alpha)
    )
    assert not np.allclose(plain.update.trainable[0], result.update.trainable[0], atol=1e-4)

  def test_a_rejected_update_keeps_the_state_and_has_no_weight(self):
    x = np.array(X1)
    x[0, 0] = np.nan
    g = [np.full((4, 3), 0.25), np.full((3,), -0.5)]
    _, result, metrics, new_g = self.run(linear_model(), [(x, Y1)], 0.1, 0.3, g)
    assert float(result.update_weight) == 0.0
    assert float(metrics["rejected"]) == 1.0
    for got, gi in zip(new_g, g):
      np.testing.assert_array_equal(got, gi)


def random_op_types(graph_def) -> set[str]:
  """The random-number ops of `graph_def` and of its functions."""
  nodes = list(graph_def.node) + [n for f in graph_def.library.function for n in f.node_def]
  return {n.op for n in nodes if "Random" in n.op}


def computation_graph(computation):
  graph_def = tf.compat.v1.GraphDef()
  tff.framework.ConcreteComputation.get_proto(computation).tensorflow.graph_def.Unpack(graph_def)
  return graph_def


class TestModelToOverwrite:
  """A client's model is created as zeros, since `train_locally` assigns all its weights."""

  def test_a_clients_update_draws_no_initialization_and_trains_from_its_download(self):
    model_fn = lambda: linear_model(seed=5, batch_norm=True)
    with tf.Graph().as_default() as graph:
      model_fn()
    assert random_op_types(graph.as_graph_def())  # What the model's own initializers draw.
    config = Config(learning_rate=0.5)
    work = client_work.build_client_work(model_fn, SPEC, config)
    assert not random_op_types(computation_graph(work.client_update))
    initial = model_weights(linear_model(seed=9, batch_norm=True))
    data = dataset((X1, Y1))
    got = work.process.next(work.process.initialize(), [initial], [data]).result[0]
    want, _ = client_work.train_locally(
      linear_model(seed=9, batch_norm=True), sgd_optimizer(), initial, data, 0.5, config
    )
    for g, w in zip(tf.nest.flatten(got.update), tf.nest.flatten(want.update)):
      np.testing.assert_array_equal(g, w)

  def test_a_model_with_variables_beyond_its_weights_keeps_its_initializers(self):
    def model_with_a_counter():
      tf.Variable(tf.random.uniform([2]), name="not_a_weight")
      return linear_model(seed=5)

    with tf.Graph().as_default() as plain:
      linear_model(seed=5)
    with tf.Graph().as_default() as graph:
      model = client_work.model_to_overwrite(model_with_a_counter)
    assert len(model.weights) == 2
    assert random_op_types(graph.as_graph_def()) >= random_op_types(plain.as_graph_def())
