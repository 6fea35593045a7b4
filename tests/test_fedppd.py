"""FedPPD's client update: SGLD teacher, online-distilled student, process."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests import tiny
from tests.femnist_runs import QUICK, read_metrics
from tff_ens import fedppd
from tff_ens import runtime
from tff_ens import training
import tasks

ModelWeights = tff.learning.models.ModelWeights


def test_sgld_step_noise_has_variance_step_size_times_temperature():
  weights = [tf.zeros([200_000]), tf.ones([3, 100_000])]
  gradients = [tf.zeros([200_000]), tf.fill([3, 100_000], 4.0)]
  step_size, temperature = 0.01, 0.5
  new = fedppd.sgld_step(weights, gradients, step_size, temperature,
                         tf.constant([1, 2], tf.int64))
  # Drift -(eps/2) g: 0 for the first tensor, 1 - 0.005 * 4 for the second.
  np.testing.assert_allclose(np.mean(new[0]), 0.0, atol=1e-3)
  np.testing.assert_allclose(np.mean(new[1]), 0.98, atol=1e-3)
  for tensor in new:
    np.testing.assert_allclose(np.std(tensor), np.sqrt(step_size * temperature),
                               rtol=0.01)
  # The two tensors draw different noise.
  assert not np.allclose(new[0][:1000], new[1][0, :1000] - 0.98)


def test_sgld_step_at_temperature_zero_is_gradient_descent_at_half_step():
  new = fedppd.sgld_step([tf.constant([1.0, -2.0])], [tf.constant([3.0, 1.0])],
                         0.1, 0.0, tf.constant([0, 0], tf.int64))
  np.testing.assert_allclose(new[0], [1.0 - 0.15, -2.0 - 0.05], rtol=1e-6)


def test_distillation_loss_is_cross_entropy_to_teacher_by_hand():
  teacher = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
  student_logits = np.array([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])
  log_q = student_logits - np.log(np.exp(student_logits).sum(1, keepdims=True))
  expected = -np.mean(np.sum(teacher * log_q, 1))
  got = fedppd.distillation_loss(tf.constant(teacher, tf.float32),
                                 tf.constant(student_logits, tf.float32))
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def _initial(teacher_seed=0, student_seed=5):
  return fedppd.join(ModelWeights.from_model(tiny.tiny_model(teacher_seed)),
                     ModelWeights.from_model(tiny.tiny_model(student_seed)))


X = [[1, 0, 0, 1], [0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
Y = [0, 1, 2, 1]


def test_client_update_is_one_sgld_step_then_one_distillation_step():
  """T = 0 and no input noise: both steps checked against a separate path."""
  config = fedppd.PosteriorConfig(
      teacher_step_size=0.01, temperature=0.0, prior_precision=0.5,
      student_lr=0.3, input_noise_std=0.0)
  initial = _initial()
  result, metrics = fedppd.train_teacher_student(
      tiny.tiny_model(), tiny.tiny_model(), initial, tiny.one_batch(X, Y),
      tf.constant(0), config)
  x = np.asarray(X, np.float32)
  y = np.asarray(Y)
  # Teacher: w - eps/2 * (N * grad mean NLL + lambda w), N = 4 examples.
  kernel, bias = (np.asarray(t) for t in initial.trainable[:2])
  p = tf.nn.softmax(x @ kernel + bias).numpy()
  delta = (p - np.eye(3)[y]) / len(y)
  teacher_kernel = kernel - 0.005 * (4 * x.T @ delta + 0.5 * kernel)
  teacher_bias = bias - 0.005 * (4 * delta.sum(0) + 0.5 * bias)
  update = result.update.trainable
  np.testing.assert_allclose(kernel - update[0], teacher_kernel, rtol=1e-5,
                             atol=1e-6)
  np.testing.assert_allclose(bias - update[1], teacher_bias, rtol=1e-5,
                             atol=1e-6)
  # Student: one SGD step on the cross-entropy to the *updated* teacher.
  targets = tf.nn.softmax(
      tf.constant(x @ teacher_kernel + teacher_bias, tf.float32))
  student = [tf.Variable(t) for t in initial.trainable[2:]]
  with tf.GradientTape() as tape:
    loss = fedppd.distillation_loss(targets, x @ student[0] + student[1])
  grads = tape.gradient(loss, student)
  for k in range(2):
    np.testing.assert_allclose(update[2 + k], 0.3 * grads[k], rtol=1e-4,
                               atol=1e-6)
  assert float(result.update_weight) == 4.0
  np.testing.assert_allclose(metrics["student_loss"], 4 * loss, rtol=1e-5)


def test_client_noise_is_reproducible_and_differs_by_round():
  config = fedppd.PosteriorConfig(teacher_step_size=0.01)
  run = lambda round_num: fedppd.train_teacher_student(
      tiny.tiny_model(), tiny.tiny_model(), _initial(), tiny.one_batch(X, Y),
      tf.constant(round_num), config)[0].update.trainable[0].numpy()
  np.testing.assert_array_equal(run(3), run(3))
  assert not np.allclose(run(3), run(4))


def test_process_averages_students_and_uploads_teacher_plus_student():
  config = fedppd.PosteriorConfig(teacher_step_size=0.01, student_lr=0.5)
  with runtime.execution_context():
    built = fedppd.build_fedppd(tiny.tiny_model,
                                lambda: tiny.tiny_model(7), tiny.SPEC, config)
    state = built.process.initialize()
    before = built.student_weights(state)
    data = [tiny.one_batch(X[:2], Y[:2]), tiny.one_batch(X[2:], Y[2:])]
    output = built.process.next(state, data)
    after = built.student_weights(output.state)
  assert not np.allclose(before.trainable[0], after.trainable[0])
  metrics = output.metrics["client_work"]
  assert metrics["num_examples"] == 4.0
  assert np.isfinite(metrics["student_loss"])
  upload = built.client_work.client_update.type_signature.result[0].update
  # Two tiny models (Dense 4 -> 3): 2 * (12 + 3) float32 tensors.
  assert sum(np.prod(t.shape) for t in tff.structure.flatten(upload)) == 30


def test_fedppd_run_evaluates_and_saves_the_student(tmp_path):
  config = dataclasses.replace(QUICK, algorithm="fedppd", rounds=2,
                               eval_every=1, output_dir=str(tmp_path))
  summary = training.run_experiment(config)
  for key in ("test_accuracy", "test_loss", "ece", "new_client_accuracy"):
    assert np.isfinite(summary[key])
  assert float(read_metrics(tmp_path)[0]["student_loss"]) > 0
  saved = tf.keras.models.load_model(tmp_path / "model.keras")
  assert saved.name == "femnist_ppd_student"
  # A client uploads its teacher and its student, float32.
  sizes = [tasks.femnist.build_model(m).count_params()
           for m in ("cnn", "cnn_ppd_student")]
  assert summary["bytes_up_per_client_round"] == 4 * sum(sizes) + 4 + 4 * 5


@pytest.mark.parametrize("change, message", [
    ({"student_model": "vgg"}, "unknown --student_model=vgg"),
    ({"sgld_temperature": -1.0}, "fedppd: temperature must be >= 0"),
])
def test_bad_fedppd_flags_are_one_line_errors(change, message):
  config = dataclasses.replace(QUICK, algorithm="fedppd", **change)
  with pytest.raises(training.UsageError, match=message):
    config.validate()


def test_fedppd_distill_run_distills_the_students(tmp_path):
  unlabeled = tasks.femnist.load_data(QUICK.data_dir).new_clients
  np.savez(tmp_path / "server.npz", x=unlabeled.concatenated()[0][:64])
  config = dataclasses.replace(
      QUICK, algorithm="fedppd_distill", student_model="cnn", rounds=1,
      distill_steps=25,
      distill_batch_size=32, fedbe_samples=1,
      server_data=str(tmp_path / "server.npz"),
      output_dir=str(tmp_path / "out"))
  summary = training.run_experiment(config)
  assert np.isfinite(summary["test_accuracy"])
  assert summary["server_device"] == "/CPU:0"
  assert summary["distill_examples_per_second"] > 0
  assert float(read_metrics(config.output_dir)[0]["distill_steps"]) == 25
