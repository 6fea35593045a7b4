"""Tests of `tff_ens.math.ensemble_math`: each formula by hand, computed with NumPy and with
`tf.experimental.numpy` (what the exported TFLite graph runs), the two agreeing."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow.experimental.numpy as tnp

from tff_ens.math import ensemble_math
from tff_ens.math import metrics
from tff_ens.math import personalization

# Two members, two examples, three classes; labels [0, 2].
HAND_PROBS = np.array(
  [
    [[0.5, 0.25, 0.25], [0.8, 0.1, 0.1]],  # member 0
    [[0.25, 0.5, 0.25], [0.25, 0.25, 0.5]],  # member 1
  ]
)
HAND_LABELS = np.array([0, 2])


def _both(fn, *args):
  """`fn` on NumPy arrays and on float32/int32 tensors with `tnp`, as NumPy arrays."""
  tensors = [
    tf.constant(a, tf.int32 if np.asarray(a).dtype.kind == "i" else tf.float32) for a in args
  ]
  return fn(*args), tf.nest.map_structure(np.asarray, fn(*tensors, xp=tnp))


def test_member_losses_and_personalization_weights_by_hand():
  # loss_0 = -(log 0.5 + log 0.1) / 2, loss_1 = -(log 0.25 + log 0.5) / 2.
  want = np.array([-(np.log(0.5) + np.log(0.1)) / 2, -(np.log(0.25) + np.log(0.5)) / 2])
  for losses in _both(ensemble_math.member_losses, HAND_PROBS, HAND_LABELS):
    np.testing.assert_allclose(losses, want, rtol=1e-6)
  # alpha = softmax(-loss / 2); an infinite temperature is the uniform ensemble.
  expected = np.exp(-want / 2) / np.exp(-want / 2).sum()
  for alpha in _both(ensemble_math.personalization_weights, want, np.float32(2.0)):
    np.testing.assert_allclose(alpha, expected, rtol=1e-6)
  for alpha in _both(ensemble_math.personalization_weights, want, np.float32(np.inf)):
    np.testing.assert_allclose(alpha, [0.5, 0.5])
  with pytest.raises(ValueError, match="temperature must be positive"):
    personalization.personalization_weights(want, 0.0)


def test_mixture_uncertainty_by_hand():
  alpha = np.array([0.25, 0.75])
  mean = 0.25 * HAND_PROBS[0] + 0.75 * HAND_PROBS[1]
  h = lambda p: -np.sum(p * np.log(p), -1)
  for probabilities, entropy, mutual_information in _both(
    ensemble_math.mixture_uncertainty, HAND_PROBS, alpha
  ):
    np.testing.assert_allclose(probabilities[0], [0.3125, 0.4375, 0.25], rtol=1e-6)
    np.testing.assert_allclose(probabilities, mean, rtol=1e-6)
    np.testing.assert_allclose(entropy, h(mean), rtol=1e-5)
    np.testing.assert_allclose(
      mutual_information, h(mean) - 0.25 * h(HAND_PROBS[0]) - 0.75 * h(HAND_PROBS[1]), atol=1e-6
    )
  # The evaluation's uncertainty is these formulas.
  expected = metrics.ensemble_uncertainty(HAND_PROBS, alpha)
  np.testing.assert_allclose(expected["mutual_information"], mutual_information, atol=1e-6)


def test_a_zero_probability_is_clipped_before_its_log():
  probs = np.array([[[1.0, 0.0]]])
  for losses in _both(ensemble_math.member_losses, probs, np.array([1])):
    np.testing.assert_allclose(losses, [-np.log(ensemble_math.EPSILON)], rtol=1e-6)
  for entropy in _both(ensemble_math.entropy, probs):
    np.testing.assert_allclose(entropy, [[0.0]], atol=1e-9)
