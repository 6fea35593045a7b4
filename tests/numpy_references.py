"""What the program reports, recomputed apart from `tff_ens.math`: float64 NumPy from the
saved Keras models' logits, scikit-learn's AUROC, `np.digitize`'s calibration bins."""

import os

import numpy as np
import sklearn.metrics

from tff_ens import run_files


def softmax(logits) -> np.ndarray:
  logits = np.asarray(logits, np.float64)
  exp = np.exp(logits - logits.max(-1, keepdims=True))
  return exp / exp.sum(-1, keepdims=True)


def member_probabilities(models, x) -> np.ndarray:
  """[K, n, classes]: each Keras model's softmax of its logits on `x`."""
  return np.stack([softmax(m(x, training=False).numpy()) for m in models])


def accuracy(probabilities, y) -> float:
  return float(np.mean(np.argmax(probabilities, -1) == np.asarray(y)))


def entropy(probabilities) -> np.ndarray:
  p = np.asarray(probabilities, np.float64)
  return -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), -1)


def _normalized(weights, k: int) -> np.ndarray:
  weights = np.ones(k) if weights is None else np.asarray(weights, np.float64)
  return weights / weights.sum()


def mixture(member_probs, weights=None) -> dict[str, np.ndarray]:
  """A weighted (uniform by default) mixture's `probabilities`, `entropy` and
  `mutual_information` (the entropy of the mean minus the members' mean entropy)."""
  weights = _normalized(weights, len(member_probs))
  mean = np.tensordot(weights, member_probs, 1)
  return {
    "probabilities": mean,
    "entropy": entropy(mean),
    "mutual_information": entropy(mean) - np.tensordot(weights, entropy(member_probs), 1),
  }


def teacher_ensemble(member_logits, weights, targets: str) -> dict[str, np.ndarray]:
  """Weighted teachers as `mixture` gives them, or for FedDF's "avg_logits" with the softmax
  of their mean logits as the prediction (its mutual information against the same members'
  mean entropy)."""
  logits = np.asarray(member_logits, np.float64)
  ensemble = mixture(softmax(logits), weights)
  if targets != "avg_logits":
    return ensemble
  mean_entropy = ensemble["entropy"] - ensemble["mutual_information"]
  probabilities = softmax(np.tensordot(_normalized(weights, len(logits)), logits, 1))
  return {
    "probabilities": probabilities,
    "entropy": entropy(probabilities),
    "mutual_information": entropy(probabilities) - mean_entropy,
  }


def ood_auroc(in_distribution, out_of_distribution) -> float:
  """scikit-learn's AUROC of a score that should be higher out of distribution."""
  scores = np.concatenate([in_distribution, out_of_distribution])
  labels = np.r_[np.zeros(len(in_distribution)), np.ones(len(out_of_distribution))]
  return float(sklearn.metrics.roc_auc_score(labels, scores))


def calibration_error(probabilities, y, num_bins: int = 15) -> float:
  """Guo et al.'s ECE over equal-width confidence bins, binned by `np.digitize`."""
  confidence = probabilities.max(-1)
  correct = probabilities.argmax(-1) == np.asarray(y)
  bins = np.clip(np.digitize(confidence, np.linspace(0, 1, num_bins + 1)[1:-1]), 0, num_bins - 1)
  return float(
    sum(
      np.sum(bins == b) * abs(correct[bins == b].mean() - confidence[bins == b].mean())
      for b in np.unique(bins)
    )
    / len(y)
  )


def saved_models(output_dir) -> list:
  """The Keras model(s) a finished run saved: `model.keras` or its members, in order."""
  import tensorflow as tf

  members = os.path.join(output_dir, run_files.MEMBERS_DIR)
  paths = (
    [os.path.join(members, run_files.member_file(k)) for k in range(len(os.listdir(members)))]
    if os.path.isdir(members)
    else [os.path.join(output_dir, run_files.MODEL_FILE)]
  )
  return [tf.keras.models.load_model(p, compile=False) for p in paths]
