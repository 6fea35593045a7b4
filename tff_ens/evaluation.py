"""Centralized evaluation of federated models on per-client test data.

Simulation-side measurement shared by every algorithm: the server's model(s)
are loaded into one Keras model and run on every client's examples. Metrics are
computed from predicted probabilities with NumPy so that single models and
ensembles (uniform or personalized weights) are measured the same way.
"""

from typing import Mapping, Sequence

import numpy as np
import scipy.stats
import tensorflow as tf
import tensorflow_federated as tff

ModelWeights = tff.learning.models.ModelWeights

ECE_BINS = 15


def assign_weights(model: tf.keras.Model, weights: ModelWeights) -> None:
  """Loads `ModelWeights` (e.g. from a process state) into a Keras model."""
  weights.assign_weights_to(model)


def predict_probabilities(model: tf.keras.Model, x: np.ndarray,
                          batch_size: int = 512) -> np.ndarray:
  """Softmax probabilities of a logits model on `x`, float64 [n, classes]."""
  if len(x) == 0:
    return np.zeros((0, model.output_shape[-1]))
  logits = model.predict(x, batch_size=batch_size, verbose=0)
  return tf.nn.softmax(logits.astype(np.float64)).numpy()


def accuracy(probs: np.ndarray, y: np.ndarray) -> float:
  return float(np.mean(np.argmax(probs, -1) == y)) if len(y) else float("nan")


def negative_log_likelihood(probs: np.ndarray, y: np.ndarray) -> float:
  """Mean NLL of the true labels (the test loss)."""
  p = probs[np.arange(len(y)), y]
  return float(-np.mean(np.log(np.clip(p, 1e-12, 1.0))))


def expected_calibration_error(probs: np.ndarray, y: np.ndarray,
                               num_bins: int = ECE_BINS) -> float:
  """Expected calibration error (Guo et al., ICML 2017, eq. 3).

  ECE = sum_b |B_b|/n * |acc(B_b) - conf(B_b)| over `num_bins` equal-width
  bins of the top-class confidence.
  """
  confidence = probs.max(-1)
  correct = (probs.argmax(-1) == y).astype(np.float64)
  bins = np.minimum((confidence * num_bins).astype(int), num_bins - 1)
  ece = 0.0
  for b in range(num_bins):
    in_bin = bins == b
    if in_bin.any():
      ece += in_bin.mean() * abs(correct[in_bin].mean() -
                                 confidence[in_bin].mean())
  return float(ece)


def entropy(probs: np.ndarray) -> np.ndarray:
  """Shannon entropy (nats) of each row of `probs`."""
  return -np.sum(probs * np.log(np.clip(probs, 1e-12, 1.0)), axis=-1)


def ensemble_uncertainty(member_probs: np.ndarray,
                         alpha: np.ndarray | None = None
                         ) -> dict[str, np.ndarray]:
  """Uncertainty of an ensemble's prediction, per example.

  Args:
    member_probs: [K, n, classes] probabilities of the K members.
    alpha: [K] member weights summing to 1 (uniform when None).

  Returns:
    `probabilities` (the weighted mean), `entropy` (predictive entropy of the
    mean), `mutual_information` (entropy of the mean minus the mean entropy,
    Depeweg et al. 2018, eq. 4) and `variance` (variance over members of the
    probability of the predicted class).
  """
  k = member_probs.shape[0]
  alpha = np.full(k, 1.0 / k) if alpha is None else np.asarray(alpha)
  mean = np.tensordot(alpha, member_probs, axes=1)
  predictive_entropy = entropy(mean)
  expected_entropy = np.tensordot(alpha, entropy(member_probs), axes=1)
  predicted = mean.argmax(-1)
  chosen = member_probs[:, np.arange(mean.shape[0]), predicted]
  chosen_mean = np.tensordot(alpha, chosen, axes=1)
  variance = np.tensordot(alpha, (chosen - chosen_mean) ** 2, axes=1)
  return {
      "probabilities": mean,
      "entropy": predictive_entropy,
      "mutual_information": predictive_entropy - expected_entropy,
      "variance": variance,
  }


def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
  """Area under the ROC curve of `scores` for the `positive` examples.

  The Mann-Whitney statistic with tied scores counted as half.
  """
  positive = np.asarray(positive, bool)
  n_pos, n_neg = int(positive.sum()), int((~positive).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  ranks = scipy.stats.rankdata(scores)
  return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) /
               (n_pos * n_neg))


def split_by_client(values: np.ndarray,
                    counts: Sequence[int]) -> list[np.ndarray]:
  """Splits a concatenation of per-client rows back into clients."""
  return np.split(values, np.cumsum(counts)[:-1])


def classification_summary(probs_by_client: Mapping[str, np.ndarray],
                           y_by_client: Mapping[str, np.ndarray],
                           prefix: str = "test") -> dict[str, float]:
  """Accuracy, NLL and ECE over all examples, and the mean per-client accuracy.

  Returns keys `{prefix}_accuracy`, `{prefix}_loss`, `ece` (only for the
  "test" prefix) and `per_client_accuracy` likewise.
  """
  clients = [c for c in probs_by_client if len(y_by_client[c])]
  if not clients:
    return {}
  probs = np.concatenate([probs_by_client[c] for c in clients])
  y = np.concatenate([y_by_client[c] for c in clients])
  summary = {
      f"{prefix}_accuracy": accuracy(probs, y),
      f"{prefix}_loss": negative_log_likelihood(probs, y),
  }
  if prefix == "test":
    summary["ece"] = expected_calibration_error(probs, y)
    summary["per_client_accuracy"] = float(np.mean(
        [accuracy(probs_by_client[c], y_by_client[c]) for c in clients]))
  return summary
