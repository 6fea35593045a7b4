"""The server step in the driver (tff_ens/templates/server_step.py): hand-checked on a
tiny model, streamed from a file, and bounded in memory for a 300,000-image set."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tests.femnist_runs import ROOT
from tff_ens.server import distillation
from tff_ens.server import server_data
from tff_ens.templates import server_distillation as sd
from tiny import SERVER
from tiny import tiny_model

ModelWeights = tff.learning.models.ModelWeights

ONE_SGD_STEP = distillation.DistillationConfig(
  num_steps=1,
  batch_size=64,  # More than the 24 unlabeled images: one step on all of them.
  optimizer="sgd",
  learning_rate=0.5,
  lr_schedule="constant",
  momentum=0.0,
  loss="cross_entropy",
  swa=False,
)


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _logits(weights, x):
  kernel, bias = (np.asarray(t, np.float64) for t in weights.trainable)
  return np.asarray(x, np.float64).reshape(len(x), -1) @ kernel + bias


def _one_client_round(data):
  """v-Distillation's step after one client (weight 2) of two slots: (global, client,
  (new weights, measurements))."""
  global_weights = ModelWeights.from_model(tiny_model(seed=0))
  client = ModelWeights.from_model(tiny_model(seed=4))
  update = tf.nest.map_structure(lambda g, c: (g - c).numpy(), global_weights, client)
  collected = (
    tf.nest.map_structure(lambda u: np.stack([u, np.zeros_like(u)]), update),
    np.array([2.0, 0.0], np.float32),
  )
  config = sd.ServerDistillationConfig(distill=ONE_SGD_STEP, sharpen_temperature=0.5)
  step = sd.DistillationStep(tiny_model, data, config)
  return global_weights, client, step(global_weights, collected, 0), step


def test_one_step_matches_the_hand_computed_distillation():
  _, client, (new, measurements), step = _one_client_round(SERVER)
  # Teacher: the client (the empty slot is no teacher); targets its probabilities
  # squared and renormalized (v-Distillation, T = 0.5); the student starts from the
  # average, the client, and takes one SGD step of the mean cross-entropy.
  x = SERVER.unlabeled.reshape(len(SERVER.unlabeled), -1).astype(np.float64)
  p = _softmax(_logits(client, x))
  targets = p**2 / np.sum(p**2, -1, keepdims=True)
  d = (p - targets) / len(x)
  kernel, bias = (np.asarray(t, np.float64) for t in client.trainable)
  np.testing.assert_allclose(new.trainable[0], kernel - 0.5 * x.T @ d, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(new.trainable[1], bias - 0.5 * d.sum(0), rtol=1e-5, atol=1e-6)
  assert int(measurements["distilled"]) == 1
  assert int(measurements["dropped_clients"]) == 0
  assert (int(measurements["distill_steps"]), int(measurements["distill_examples"])) == (1, 24)
  predicted = _logits(new, SERVER.validation_x).argmax(-1)
  np.testing.assert_allclose(
    measurements["student_validation_accuracy"], np.mean(predicted == SERVER.validation_y)
  )
  # Read from TensorFlow's placement of the step's ops.
  assert measurements["server_device"] == "/CPU:0"


def test_the_step_measures_the_average_and_the_teachers_it_competes_with():
  # Two clients of weights 2 and 1: the average is (2 w_a + w_b) / 3, v-Distillation's
  # teachers are the two clients, equally weighted (their mean probabilities).
  global_weights = ModelWeights.from_model(tiny_model(seed=0))
  clients = [ModelWeights.from_model(tiny_model(seed=s)) for s in (4, 5)]
  updates = [
    tf.nest.map_structure(lambda g, c: (g - c).numpy(), global_weights, c) for c in clients
  ]
  collected = (
    tf.nest.map_structure(lambda a, b: np.stack([a, b, np.zeros_like(a)]), *updates),
    np.array([2.0, 1.0, 0.0], np.float32),
  )
  # 300 validation images labeled by a third model: there the weighted average, the unweighted
  # one and the clients' weighted mixture all score differently (0.193, 0.167, 0.210).
  x = np.random.default_rng(7).normal(size=(300, *SERVER.validation_x.shape[1:]))
  x = x.astype(np.float32)
  y = _logits(ModelWeights.from_model(tiny_model(seed=6)), x).argmax(-1).astype(np.int32)
  data = server_data.ServerData(SERVER.unlabeled, x, y, "test")
  config = sd.ServerDistillationConfig(distill=ONE_SGD_STEP, sharpen_temperature=0.5)
  step = sd.DistillationStep(tiny_model, data, config)
  _, measurements = step(global_weights, collected, 0)
  average = ModelWeights(
    [(2 * np.asarray(a) + np.asarray(b)) / 3 for a, b in zip(*(c.trainable for c in clients))], []
  )
  teachers = np.mean([_softmax(_logits(c, x)) for c in clients], axis=0)
  np.testing.assert_allclose(
    measurements["average_validation_accuracy"], np.mean(_logits(average, x).argmax(-1) == y)
  )
  np.testing.assert_allclose(
    measurements["teachers_validation_accuracy"], np.mean(teachers.argmax(-1) == y)
  )
  # The same two on any images, for metrics.csv's teachers_test_accuracy and
  # average_test_accuracy.
  predictions = step.teacher_probabilities(global_weights, collected, 0, x)
  np.testing.assert_allclose(predictions["probabilities"], teachers, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    predictions["average_probabilities"], _softmax(_logits(average, x)), rtol=1e-5, atol=1e-6
  )


def test_a_round_without_clients_keeps_the_model(tmp_path):
  global_weights = ModelWeights.from_model(tiny_model(seed=0))
  nothing = (
    tf.nest.map_structure(lambda w: np.zeros((2, *w.shape), np.float32), global_weights),
    np.zeros([2], np.float32),
  )
  config = sd.ServerDistillationConfig(distill=ONE_SGD_STEP, sharpen_temperature=0.5)
  new, measurements = sd.DistillationStep(tiny_model, SERVER, config)(global_weights, nothing, 3)
  for a, b in zip(tf.nest.flatten(new), tf.nest.flatten(global_weights)):
    np.testing.assert_array_equal(a, b)
  assert int(measurements["distilled"]) == 0 and int(measurements["distill_steps"]) == 0
  assert float(measurements["average_validation_accuracy"]) == -1.0


def test_images_streamed_from_a_npy_file_give_the_same_step(tmp_path):
  np.save(tmp_path / "unlabeled.npy", SERVER.unlabeled)
  from_file = server_data.ServerData(
    server_data.ImageFile.npy(str(tmp_path / "unlabeled.npy")),
    SERVER.validation_x,
    SERVER.validation_y,
    "file",
  )
  _, _, (want, _), _ = _one_client_round(SERVER)
  _, _, (got, _), _ = _one_client_round(from_file)
  for a, b in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
    np.testing.assert_array_equal(a, b)


def test_image_file_reads_rows_and_slices_as_the_array(tmp_path):
  x = np.arange(5 * 6, dtype=np.uint8).reshape(5, 2, 3)
  np.save(tmp_path / "x.npy", x)
  rows = server_data.ImageFile.npy(str(tmp_path / "x.npy"))
  assert len(rows) == 5 and rows.shape == (5, 2, 3)
  np.testing.assert_array_equal(rows[1:4], x[1:4].astype(np.float32))
  np.testing.assert_array_equal(rows[np.array([4, 0, 4])], x[[4, 0, 4]].astype(np.float32))
  assert rows[3:9].shape == (2, 2, 3)
  store = server_data.ImageFile.temporary((4, 3))
  store[1:3] = np.ones((2, 3))
  np.testing.assert_array_equal(store[0:4], [[0, 0, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])


# Two FedBE rounds of a linear model on 28x28 images, first with 3,000 unlabeled images,
# then with 300,000 (940 MB as float32) streamed from a .npy file; prints the driver's peak
# resident memory during each run (Linux's VmHWM, reset before it; the TFF worker is another
# process).
_STREAMING_RUN = textwrap.dedent(
  """
  import sys
  import numpy as np
  import tensorflow as tf
  from tff_ens import algorithms
  from tff_ens.execution import runtime
  from tff_ens.server import server_data
  from tff_ens.templates import client_work

  def model_fn(k=0):
    return tf.keras.Sequential([
      tf.keras.layers.Input((28, 28, 1)),
      tf.keras.layers.Flatten(),
      tf.keras.layers.Dense(10, kernel_initializer=tf.keras.initializers.GlorotNormal(k)),
    ])

  def labeled(n):
    return rng.random((n, 28, 28, 1), np.float32), rng.integers(0, 10, n).astype(np.int32)

  spec = (tf.TensorSpec([None, 28, 28, 1], tf.float32), tf.TensorSpec([None], tf.int32))
  rng = np.random.default_rng(0)
  clients = [tf.data.Dataset.from_tensors(labeled(8)) for _ in range(3)]
  local = client_work.LocalTrainingConfig(learning_rate=0.1)
  with runtime.execution_context():
    for path in sys.argv[1:]:
      with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Resets the peak resident memory (VmHWM) to the current one.
      data = server_data.ServerData(server_data.ImageFile.npy(path), *labeled(20), path)
      fedbe = algorithms.build_algorithm(
        "fedbe", model_fn, spec, local, server_data=data, clients_per_round=3,
        distill_steps=50, distill_batch_size=128, distill_curve_every=0, fedbe_samples=2,
      )
      state = fedbe.process.initialize()
      for _ in range(2):
        state, metrics, _ = fedbe.process.next(state, clients)
        assert int(metrics["finalizer"]["distilled"]) == 1
      with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
      print(len(data.unlabeled), peak * 1024, flush=True)
  """
)


def _random_images(path, n):
  """A .npy file of n random 28x28x1 float32 images, written in chunks."""
  images = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, 28, 28, 1))
  rng = np.random.default_rng(n)
  for start in range(0, n, 50_000):
    stop = min(n, start + 50_000)
    images[start:stop] = rng.random((stop - start, 28, 28, 1), np.float32)
  images.flush()
  del images


# 131 s on a loaded machine (the watchdog's default is shorter: tests/watchdog.py).
@pytest.mark.timeout_seconds(600)
def test_a_300000_image_set_streams_without_growing_the_driver(tmp_path):
  small, large = str(tmp_path / "small.npy"), str(tmp_path / "large.npy")
  _random_images(small, 3_000)
  _random_images(large, 300_000)
  result = subprocess.run(
    [sys.executable, "-c", _STREAMING_RUN, small, large],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
  )
  assert result.returncode == 0, result.stderr[-3000:]
  (n_small, peak_small), (n_large, peak_large) = [
    tuple(int(v) for v in line.split()) for line in result.stdout.split("\n") if line
  ]
  assert (n_small, n_large) == (3_000, 300_000)
  # The large set is 940 MB; holding it (or its pages mapped) would raise the peak by that.
  assert peak_large - peak_small < 150 * 2**20, (peak_small, peak_large)
