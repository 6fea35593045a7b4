"""Tiny Keras models and datasets whose numbers can be checked by hand."""

import numpy as np
import tensorflow as tf

from tff_ens.server import server_data
from tff_ens.server import student as student_lib

# Batches of 2x2x1 images and int32 labels of 3 classes.
SPEC = (tf.TensorSpec([None, 2, 2, 1], tf.float32), tf.TensorSpec([None], tf.int32))


_RNG = np.random.default_rng(0)
# A server's data for tiny models: 24 unlabeled 2x2 images and 6 labeled
# validation ones.
SERVER = server_data.ServerData(
  unlabeled=_RNG.random((24, 2, 2, 1), dtype=np.float32),
  validation_x=_RNG.random((6, 2, 2, 1), dtype=np.float32),
  validation_y=np.array([0, 1, 2, 0, 1, 2], np.int32),
  source="test",
)
# SERVER with 500 unlabeled images: more than a small distillation budget reads.
MANY = server_data.ServerData(
  np.random.default_rng(11).random((500, 2, 2, 1), dtype=np.float32),
  SERVER.validation_x,
  SERVER.validation_y,
  "test",
)


# Three clients' (rows, labels), for `one_batch`.
CLIENT_DATA = [
  ([[1, 0, 0, 0], [0, 1, 0, 0]], [0, 1]),
  ([[0, 0, 1, 0], [0, 0, 0, 1], [1, 1, 0, 0]], [2, 0, 1]),
  ([[0, 1, 1, 0]], [2]),
]


def tiny_model(seed=0, batch_norm=False):
  """Flatten(2x2x1) -> [BatchNorm] -> Dense(3), initialized from `seed`."""
  layers = [tf.keras.layers.Input((2, 2, 1)), tf.keras.layers.Flatten()]
  if batch_norm:
    layers.append(tf.keras.layers.BatchNormalization())
  layers.append(
    tf.keras.layers.Dense(
      3,
      kernel_initializer=tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed),
      bias_initializer=tf.keras.initializers.RandomNormal(stddev=0.5, seed=seed + 1),
    )
  )
  return tf.keras.Sequential(layers)


def one_batch(x, y):
  """A dataset of one batch of rows `x` (4 values each) and labels `y`."""
  return tf.data.Dataset.from_tensors(
    (np.asarray(x, np.float32).reshape(-1, 2, 2, 1), np.asarray(y, np.int32))
  )


def record_students(monkeypatch):
  """Records, for every `Student.distill` call, the images it is given and the
  `(images, targets)` of each minibatch it reads."""
  calls = []
  distill = student_lib.Student.distill

  def recording(self, initial, x, targets, seed, validation=None, batches=None):
    assert batches is not None  # The server steps pass the minibatches they labelled.
    calls.append(dict(labelled=len(x), batches=[(x[b], np.asarray(targets[b])) for b in batches]))
    return distill(self, initial, x, targets, seed, validation, batches)

  monkeypatch.setattr(student_lib.Student, "distill", recording)
  return calls


# What a run gives `fedppd_local.PosteriorConfig` from other groups' flags: one local epoch,
# no bound on an update's norm, seed 0.
POSTERIOR_USES = dict(epochs=1, max_update_norm=0.0, seed=0)
