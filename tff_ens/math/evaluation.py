"""Centralized evaluation of federated models on per-client test data.

Simulation-side measurement shared by every algorithm: the server's model(s)
are loaded into one Keras model and run on every client's examples. Metrics are
computed from predicted probabilities with NumPy (`tff_ens.math.metrics`) so that
single models and ensembles (uniform or personalized weights) are measured the
same way.
"""

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.math import metrics

ModelWeights = tff.learning.models.ModelWeights


def assign_weights(model: tf.keras.Model, weights: ModelWeights) -> None:
  """Loads `ModelWeights` (e.g. from a process state) into a Keras model."""
  weights.assign_weights_to(model)


def predict_probabilities(
  model: tf.keras.Model, x: np.ndarray, batch_size: int = 512
) -> np.ndarray:
  """Softmax probabilities of a logits model on `x`, float64 [n, classes]."""
  if len(x) == 0:
    return np.zeros((0, model.output_shape[-1]))
  logits = model.predict(x, batch_size=batch_size, verbose=0)
  return tf.nn.softmax(logits.astype(np.float64)).numpy()


def test_accuracy(data, probabilities) -> float:
  """The test accuracy of predictions whose first rows are the test split's (of
  `tasks.data.FederatedData` `data`), in its clients' order."""
  counts = [data.test.num_examples(c) for c in data.test.client_ids]
  return metrics.classification_summary(
    dict(zip(data.test.client_ids, metrics.split_by_client(probabilities[: sum(counts)], counts))),
    data.test.y,
  )["test_accuracy"]
