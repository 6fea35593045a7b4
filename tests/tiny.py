"""Tiny Keras models and datasets whose numbers can be checked by hand."""

import numpy as np
import tensorflow as tf

# Batches of 2x2x1 images and int32 labels of 3 classes.
SPEC = (tf.TensorSpec([None, 2, 2, 1], tf.float32),
        tf.TensorSpec([None], tf.int32))


def tiny_model(seed=0, batch_norm=False):
  """Flatten(2x2x1) -> [BatchNorm] -> Dense(3), initialized from `seed`."""
  layers = [tf.keras.layers.Input((2, 2, 1)), tf.keras.layers.Flatten()]
  if batch_norm:
    layers.append(tf.keras.layers.BatchNormalization())
  layers.append(tf.keras.layers.Dense(
      3,
      kernel_initializer=tf.keras.initializers.RandomNormal(
          stddev=0.5, seed=seed),
      bias_initializer=tf.keras.initializers.RandomNormal(
          stddev=0.5, seed=seed + 1)))
  return tf.keras.Sequential(layers)


def one_batch(x, y):
  """A dataset of one batch of rows `x` (4 values each) and labels `y`."""
  return tf.data.Dataset.from_tensors(
      (np.asarray(x, np.float32).reshape(-1, 2, 2, 1),
       np.asarray(y, np.int32)))
