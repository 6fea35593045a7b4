"""Metrics of predicted probabilities, NumPy only.

Accuracy, NLL, calibration, uncertainty and out-of-distribution detection, shared by the
simulation (`tff_ens.math.evaluation`, which runs the Keras models) and the device environment
(`export.evaluate`), which has no TensorFlow.
"""

from typing import Mapping, Sequence

import numpy as np
import scipy.stats

from tff_ens.math import ensemble_math

ECE_BINS = 15


def accuracy(probs: np.ndarray, y: np.ndarray) -> float:
  return float(np.mean(np.argmax(probs, -1) == y)) if len(y) else float("nan")


def negative_log_likelihood(probs: np.ndarray, y: np.ndarray) -> float:
  """Mean NLL of the true labels (the test loss)."""
  return float(-np.mean(ensemble_math.log_probabilities(probs[np.arange(len(y)), y])))


def reliability_bins(probs: np.ndarray, y: np.ndarray, num_bins: int = ECE_BINS) -> dict[str, list]:
  """A reliability diagram's data (Guo et al., ICML 2017, Sec. 2).

  Over `num_bins` equal-width bins B_b of the top-class confidence: `count`
  |B_b|, `confidence` conf(B_b) and `accuracy` acc(B_b) (None in an empty
  bin).
  """
  confidence = probs.max(-1)
  correct = (probs.argmax(-1) == y).astype(np.float64)
  bins = np.minimum((confidence * num_bins).astype(int), num_bins - 1)
  count = np.bincount(bins, minlength=num_bins)
  with np.errstate(invalid="ignore"):
    mean = lambda v: np.bincount(bins, v, minlength=num_bins) / count
    return {
      "count": count.tolist(),
      "confidence": [None if n == 0 else float(c) for n, c in zip(count, mean(confidence))],
      "accuracy": [None if n == 0 else float(a) for n, a in zip(count, mean(correct))],
    }


def expected_calibration_error(probs: np.ndarray, y: np.ndarray, num_bins: int = ECE_BINS) -> float:
  """Expected calibration error (Guo et al., ICML 2017, eq. 3).

  ECE = sum_b |B_b|/n * |acc(B_b) - conf(B_b)| over the bins of
  `reliability_bins`.
  """
  bins = reliability_bins(probs, y, num_bins)
  return float(
    sum(n * abs(a - c) for n, a, c in zip(bins["count"], bins["accuracy"], bins["confidence"]) if n)
    / len(y)
  )


def ensemble_uncertainty(
  member_probs: np.ndarray, alpha: np.ndarray | None = None
) -> dict[str, np.ndarray]:
  """Uncertainty of an ensemble's prediction, per example.

  Args:
    member_probs: [K, n, classes] probabilities of the K members.
    alpha: [K] member weights summing to 1 (uniform when None).

  Returns:
    `probabilities` (the weighted mean), `entropy` (predictive entropy of the
    mean) and `mutual_information` (entropy of the mean minus the mean entropy,
    Depeweg et al. 2018, eq. 4), as `ensemble_math.mixture_uncertainty`, and
    `variance` (variance over members of the probability of the predicted class).
  """
  k = member_probs.shape[0]
  alpha = np.full(k, 1.0 / k) if alpha is None else np.asarray(alpha)
  mean, predictive_entropy, mutual_information = ensemble_math.mixture_uncertainty(
    member_probs, alpha
  )
  predicted = mean.argmax(-1)
  chosen = member_probs[:, np.arange(mean.shape[0]), predicted]
  chosen_mean = np.tensordot(alpha, chosen, axes=1)
  variance = np.tensordot(alpha, (chosen - chosen_mean) ** 2, axes=1)
  return {
    "probabilities": mean,
    "entropy": predictive_entropy,
    "mutual_information": mutual_information,
    "variance": variance,
  }


def predictive_uncertainty(member_probs: np.ndarray) -> dict[str, np.ndarray]:
  """`ensemble_uncertainty` of K members' probabilities [K, n, classes],
  without mutual information when K = 1 (one model has none)."""
  predictions = ensemble_uncertainty(member_probs)
  if len(member_probs) == 1:
    del predictions["mutual_information"]
  return predictions


def auroc(scores: np.ndarray, positive: np.ndarray) -> float:
  """Area under the ROC curve of `scores` for the `positive` examples.

  The Mann-Whitney statistic with tied scores counted as half.
  """
  positive = np.asarray(positive, bool)
  n_pos, n_neg = int(positive.sum()), int((~positive).sum())
  if n_pos == 0 or n_neg == 0:
    return float("nan")
  ranks = scipy.stats.rankdata(scores)
  return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def split_by_client(values: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
  """Splits a concatenation of per-client rows back into clients."""
  return np.split(values, np.cumsum(counts)[:-1])


def classification_summary(
  probs_by_client: Mapping[str, np.ndarray],
  y_by_client: Mapping[str, np.ndarray],
  prefix: str = "test",
) -> dict[str, float]:
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
    summary["per_client_accuracy"] = float(
      np.mean([accuracy(probs_by_client[c], y_by_client[c]) for c in clients])
    )
  return summary


def ood_auroc(in_distribution: np.ndarray, out_of_distribution: np.ndarray) -> float:
  """AUROC of an uncertainty score for out-of-distribution against
  in-distribution inputs (higher scores should mean out-of-distribution)."""
  return auroc(
    np.concatenate([in_distribution, out_of_distribution]),
    np.arange(len(in_distribution) + len(out_of_distribution)) >= len(in_distribution),
  )


def uncertainty_summary(
  test: dict[str, np.ndarray],
  test_y: np.ndarray,
  ood: dict[str, np.ndarray] | None = None,
  shift: dict[str, np.ndarray] | None = None,
  shift_y: np.ndarray | None = None,
) -> dict:
  """Calibration, out-of-distribution detection and shift of a prediction.

  Args:
    test, ood, shift: `ensemble_uncertainty`-style dicts (`probabilities`,
      `entropy`, and `mutual_information` for ensembles) on in-distribution
      test inputs, out-of-distribution inputs and shifted test inputs.
    test_y, shift_y: the labels of `test` and `shift`.

  Returns:
    `reliability` (`reliability_bins` in distribution); with `ood`,
    `ood_auroc_entropy` and, for ensembles, `ood_auroc_mutual_information`
    (None for one model); with `shift`, `shift_accuracy`, `shift_loss` and
    `shift_ece`.
  """
  summary = {"reliability": reliability_bins(test["probabilities"], test_y)}
  if ood is not None:
    summary["ood_auroc_entropy"] = ood_auroc(test["entropy"], ood["entropy"])
    summary["ood_auroc_mutual_information"] = (
      ood_auroc(test["mutual_information"], ood["mutual_information"])
      if "mutual_information" in test
      else None
    )
  if shift is not None:
    probs = shift["probabilities"]
    summary.update(
      shift_accuracy=accuracy(probs, shift_y),
      shift_loss=negative_log_likelihood(probs, shift_y),
      shift_ece=expected_calibration_error(probs, shift_y),
    )
  return summary
