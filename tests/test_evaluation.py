"""Tests of `tff_ens.math.evaluation` on hand-made cases with hand-computed numbers."""

import math

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_federated as tff

from tff_ens.math import evaluation
from tff_ens.math import metrics

ModelWeights = tff.learning.models.ModelWeights


def h(*p):
  """Entropy in nats, written out."""
  return -sum(x * math.log(x) for x in p if x > 0)


class TestExpectedCalibrationError:
  # Confidence 0.9 right, 0.7 wrong, 0.75 right, 0.5 (a tie, argmax 0) right.
  PROBS = np.array([[0.9, 0.1], [0.3, 0.7], [0.25, 0.75], [0.5, 0.5]])
  Y = np.array([0, 0, 1, 0])

  def test_five_bins(self):
    # Bins of width 0.2: {0.9} -> bin 4, {0.7, 0.75} -> bin 3, {0.5} -> bin 2.
    expected = 1 / 4 * abs(1 - 0.9) + 2 / 4 * abs(0.5 - (0.7 + 0.75) / 2) + 1 / 4 * abs(1 - 0.5)
    assert expected == pytest.approx(0.2625)
    got = metrics.expected_calibration_error(self.PROBS, self.Y, num_bins=5)
    assert got == pytest.approx(expected, abs=1e-12)

  def test_default_fifteen_bins_separate_every_example(self):
    # 0.9 -> 13, 0.7 -> 10, 0.75 -> 11, 0.5 -> 7: each alone in its bin.
    expected = (0.1 + 0.7 + 0.25 + 0.5) / 4
    got = metrics.expected_calibration_error(self.PROBS, self.Y)
    assert got == pytest.approx(expected, abs=1e-12)

  def test_confident_and_right_is_calibrated(self):
    probs = np.array([[1.0, 0.0], [0.0, 1.0]])  # Confidence 1 is in the last bin.
    assert metrics.expected_calibration_error(probs, np.array([0, 1])) == 0.0
    assert metrics.expected_calibration_error(probs, np.array([1, 0])) == 1.0


class TestReliabilityBins:
  PROBS = TestExpectedCalibrationError.PROBS
  Y = TestExpectedCalibrationError.Y

  def test_five_bins_by_hand(self):
    # Bins of width 0.2: {0.5} -> bin 2 (right), {0.7 wrong, 0.75 right} ->
    # bin 3, {0.9 right} -> bin 4; bins 0 and 1 are empty.
    bins = metrics.reliability_bins(self.PROBS, self.Y, num_bins=5)
    assert bins["count"] == [0, 0, 1, 2, 1]
    assert bins["accuracy"] == [None, None, 1.0, 0.5, 1.0]
    assert bins["confidence"][:3] == [None, None, 0.5]
    assert bins["confidence"][3:] == pytest.approx([0.725, 0.9])

  def test_ece_is_the_bins_weighted_gap(self):
    bins = metrics.reliability_bins(self.PROBS, self.Y, num_bins=5)
    gap = (
      sum(
        n * abs(a - c) for n, a, c in zip(bins["count"], bins["accuracy"], bins["confidence"]) if n
      )
      / 4
    )
    assert gap == pytest.approx(
      metrics.expected_calibration_error(self.PROBS, self.Y, num_bins=5), abs=1e-12
    )


class TestOutOfDistribution:
  def test_ood_auroc_by_hand(self):
    # OOD scores 0.6 and 0.2 against in-distribution 0.1, 0.3, 0.5: 0.6 beats
    # all three, 0.2 beats one: (3 + 1) / 6.
    got = metrics.ood_auroc(np.array([0.1, 0.3, 0.5]), np.array([0.6, 0.2]))
    assert got == pytest.approx(4 / 6)

  def test_uncertainty_summary_of_an_ensemble_by_hand(self):
    # Two members on two test, two OOD and one shifted input.
    test = np.array([[[0.9, 0.1], [0.8, 0.2]], [[0.9, 0.1], [0.6, 0.4]]])
    ood = np.array([[[0.5, 0.5], [0.9, 0.1]], [[0.5, 0.5], [0.1, 0.9]]])
    shift = np.array([[[0.3, 0.7]], [[0.1, 0.9]]])
    summary = metrics.uncertainty_summary(
      metrics.ensemble_uncertainty(test),
      np.array([0, 1]),
      metrics.ensemble_uncertainty(ood),
      metrics.ensemble_uncertainty(shift),
      np.array([1]),
    )
    # Entropies: test h(.9,.1)=0.325, h(.7,.3)=0.611; OOD h(.5,.5)=0.693
    # twice: both above both test inputs.
    assert summary["ood_auroc_entropy"] == 1.0
    # Mutual information: test 0 and h(.7,.3) - (h(.8,.2) + h(.6,.4))/2 =
    # 0.0242; OOD 0 (agreeing members) and h(.5,.5) - h(.9,.1) = 0.368.
    # OOD 0.368 beats both (2), OOD 0 ties test 0 (1/2) and loses to 0.0242.
    assert h(0.7, 0.3) - (h(0.8, 0.2) + h(0.6, 0.4)) / 2 == pytest.approx(0.0242, abs=1e-4)
    assert summary["ood_auroc_mutual_information"] == pytest.approx(2.5 / 4)
    assert summary["shift_accuracy"] == 1.0
    assert summary["shift_loss"] == pytest.approx(-math.log(0.8))
    # One example at confidence 0.8 (bin 12 of 15), right: ECE 0.2.
    assert summary["shift_ece"] == pytest.approx(0.2)
    # Test: 0.9 right (bin 13) and 0.7 wrong (bin 10).
    assert summary["reliability"]["count"][10] == 1
    assert summary["reliability"]["accuracy"][10] == 0.0
    assert summary["reliability"]["accuracy"][13] == 1.0

  def test_one_model_has_no_mutual_information(self):
    test = {"probabilities": np.array([[0.9, 0.1]]), "entropy": np.array([0.3])}
    ood = {"probabilities": np.array([[0.6, 0.4]]), "entropy": np.array([0.6])}
    summary = metrics.uncertainty_summary(test, np.array([0]), ood)
    assert summary["ood_auroc_entropy"] == 1.0
    assert summary["ood_auroc_mutual_information"] is None
    assert "shift_accuracy" not in summary


class TestAuroc:
  def test_hand_count(self):
    # Positive 0.35 beats negative 0.1, loses to 0.4; positive 0.8 beats both.
    scores = np.array([0.1, 0.4, 0.35, 0.8])
    positive = np.array([False, False, True, True])
    assert metrics.auroc(scores, positive) == pytest.approx(3 / 4)

  def test_ties_count_half(self):
    # Positive 0.5 ties negative 0.5 (1/2), beats 0.2; positive 0.9 beats both.
    scores = np.array([0.5, 0.5, 0.2, 0.9])
    positive = np.array([1, 0, 0, 1])
    assert metrics.auroc(scores, positive) == pytest.approx(3.5 / 4)
    assert metrics.auroc(np.ones(4), positive) == pytest.approx(0.5)

  def test_perfect_inverted_and_one_class(self):
    positive = np.array([False, False, True])
    assert metrics.auroc(np.array([1.0, 2.0, 3.0]), positive) == 1.0
    assert metrics.auroc(np.array([3.0, 2.0, 1.0]), positive) == 0.0
    assert math.isnan(metrics.auroc(np.array([1.0, 2.0]), np.array([True, True])))
    assert math.isnan(metrics.auroc(np.array([1.0, 2.0]), np.array([False, False])))


class TestEnsembleUncertainty:
  # K = 2 members, n = 1 example, 2 classes.
  MEMBERS = np.array([[[0.8, 0.2]], [[0.4, 0.6]]])

  def test_uniform_weights_hand_numbers(self):
    got = metrics.ensemble_uncertainty(self.MEMBERS)
    np.testing.assert_allclose(got["probabilities"], [[0.6, 0.4]])
    np.testing.assert_allclose(got["entropy"], [h(0.6, 0.4)])
    np.testing.assert_allclose(
      got["mutual_information"], [h(0.6, 0.4) - (h(0.8, 0.2) + h(0.4, 0.6)) / 2]
    )
    assert got["mutual_information"][0] == pytest.approx(0.0863046, abs=1e-6)
    # Predicted class 0: member probabilities 0.8 and 0.4 around mean 0.6.
    np.testing.assert_allclose(got["variance"], [(0.2**2 + 0.2**2) / 2])

  def test_weighted_hand_numbers(self):
    got = metrics.ensemble_uncertainty(self.MEMBERS, alpha=np.array([0.75, 0.25]))
    np.testing.assert_allclose(got["probabilities"], [[0.7, 0.3]])
    np.testing.assert_allclose(got["entropy"], [h(0.7, 0.3)])
    np.testing.assert_allclose(
      got["mutual_information"], [h(0.7, 0.3) - (0.75 * h(0.8, 0.2) + 0.25 * h(0.4, 0.6))]
    )
    np.testing.assert_allclose(got["variance"], [0.75 * 0.1**2 + 0.25 * 0.3**2])

  def test_agreeing_members_have_no_mutual_information(self):
    member = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    got = metrics.ensemble_uncertainty(np.stack([member] * 3))
    np.testing.assert_allclose(got["mutual_information"], [0.0, 0.0], atol=1e-12)
    np.testing.assert_allclose(got["variance"], [0.0, 0.0], atol=1e-15)
    np.testing.assert_allclose(got["entropy"], [h(0.7, 0.2, 0.1), h(0.1, 0.1, 0.8)])

  def test_mutual_information_is_nonnegative(self):
    rng = np.random.default_rng(0)
    members = rng.dirichlet(np.ones(4), size=(3, 20))
    got = metrics.ensemble_uncertainty(members)
    assert (got["mutual_information"] >= -1e-12).all()
    assert (got["mutual_information"] <= got["entropy"] + 1e-12).all()


def test_negative_log_likelihood():
  probs = np.array([[0.5, 0.5], [0.2, 0.8], [0.1, 0.9]])
  y = np.array([0, 1, 0])
  expected = -(math.log(0.5) + math.log(0.8) + math.log(0.1)) / 3
  assert metrics.negative_log_likelihood(probs, y) == pytest.approx(expected)
  # A zero probability is clipped to 1e-12, not infinite.
  zero = metrics.negative_log_likelihood(np.array([[1.0, 0.0]]), np.array([1]))
  assert zero == pytest.approx(-math.log(1e-12))


def test_accuracy_and_split_by_client():
  probs = np.array([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
  assert metrics.accuracy(probs, np.array([0, 1, 1])) == pytest.approx(2 / 3)
  assert math.isnan(metrics.accuracy(np.zeros((0, 2)), np.zeros(0, int)))
  parts = metrics.split_by_client(np.arange(5), [2, 0, 3])
  assert [p.tolist() for p in parts] == [[0, 1], [], [2, 3, 4]]


class TestClassificationSummary:
  PROBS = {
    "a": np.array([[0.9, 0.1], [0.3, 0.7]]),  # y 0, 1: both right.
    "b": np.array([[0.6, 0.4], [0.6, 0.4], [0.2, 0.8]]),  # y 1, 1, 1: 1 of 3.
    "c": np.zeros((0, 2)),  # No test data.
  }
  Y = {"a": np.array([0, 1]), "b": np.array([1, 1, 1]), "c": np.zeros(0, int)}

  def test_test_prefix(self):
    got = metrics.classification_summary(self.PROBS, self.Y)
    assert set(got) == {"test_accuracy", "test_loss", "ece", "per_client_accuracy"}
    assert got["test_accuracy"] == pytest.approx(3 / 5)  # Pooled.
    assert got["per_client_accuracy"] == pytest.approx((1 + 1 / 3) / 2)  # Mean.
    expected_loss = -(math.log(0.9) + math.log(0.7) + 2 * math.log(0.4) + math.log(0.8)) / 5
    assert got["test_loss"] == pytest.approx(expected_loss)
    probs = np.concatenate([self.PROBS["a"], self.PROBS["b"]])
    y = np.concatenate([self.Y["a"], self.Y["b"]])
    assert got["ece"] == pytest.approx(metrics.expected_calibration_error(probs, y))

  def test_other_prefix_has_no_ece_nor_per_client(self):
    got = metrics.classification_summary(self.PROBS, self.Y, prefix="train")
    assert set(got) == {"train_accuracy", "train_loss"}
    assert got["train_accuracy"] == pytest.approx(3 / 5)

  def test_no_examples(self):
    assert metrics.classification_summary({"c": np.zeros((0, 2))}, {"c": np.zeros(0, int)}) == {}


def test_assign_weights_and_predict_probabilities():
  model = tf.keras.Sequential([tf.keras.layers.Input((2,)), tf.keras.layers.Dense(3)])
  kernel = np.array([[1.0, 0.0, -1.0], [0.0, 2.0, 0.0]], np.float32)
  bias = np.array([0.0, 0.0, 1.0], np.float32)
  evaluation.assign_weights(model, ModelWeights([kernel, bias], []))
  x = np.array([[1.0, 0.0], [0.0, 1.0]], np.float32)
  got = evaluation.predict_probabilities(model, x)
  logits = x @ kernel + bias  # [[1, 0, 0], [0, 2, 1]]
  expected = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  assert got.dtype == np.float64
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  np.testing.assert_allclose(got.sum(-1), 1.0)
  assert evaluation.predict_probabilities(model, x[:0]).shape == (0, 3)
