"""An ensemble's prediction, its uncertainty and its personalization, written once.

Every function takes the array namespace `xp` it computes with: NumPy (the default), for
the simulation's evaluation and for the device environment, which has no TensorFlow; or
`tf.experimental.numpy`, for the TensorFlow graph `export.ensemble_module` converts to
TFLite. The exported file and the evaluation therefore compute the same formulas, to float
rounding. Member probabilities are [K, n, classes]; a probability is clipped to
[EPSILON, 1] before every log.
"""

import numpy as np

EPSILON = 1e-12


def log_probabilities(probs, xp=np):
  """log p, with p clipped to [EPSILON, 1]."""
  return xp.log(xp.clip(probs, EPSILON, 1.0))


def entropy(probs, xp=np):
  """Shannon entropy (nats) over the last axis."""
  return -xp.sum(probs * log_probabilities(probs, xp), axis=-1)


def mixture(member_probs, alpha, xp=np):
  """sum_k alpha_k p_k: [K, n, classes], [K] -> [n, classes].

  A broadcast product, not a tensordot: TFLite's converter lowers the latter to a
  batch_matmul it then rejects.
  """
  return xp.sum(alpha[:, None, None] * member_probs, axis=0)


def mixture_uncertainty(member_probs, alpha, xp=np):
  """The weighted ensemble's prediction and its uncertainty: (probabilities [n, classes],
  predictive entropy H(sum_k alpha_k p_k) [n], mutual information H(mixture) - sum_k
  alpha_k H(p_k) [n]; Depeweg et al., ICML 2018, eq. 4)."""
  probabilities = mixture(member_probs, alpha, xp)
  predictive_entropy = entropy(probabilities, xp)
  expected_entropy = xp.sum(alpha[:, None] * entropy(member_probs, xp), axis=0)
  return probabilities, predictive_entropy, predictive_entropy - expected_entropy


def member_losses(member_probs, labels, xp=np, mask=None):
  """loss_k, member k's mean cross-entropy on labeled examples: [K, n, classes], [n] -> [K]
  (Shi et al., Fed-ensemble, Sec. IV-C). `mask` [n] (1: an example, 0: padding of a
  fixed-size batch) averages over the examples it keeps; all zeros gives loss 0."""
  true_class = xp.take_along_axis(member_probs, labels[None, :, None], axis=-1)[..., 0]
  cross_entropy = -log_probabilities(true_class, xp)
  if mask is None:
    return xp.mean(cross_entropy, axis=-1)
  return xp.sum(mask * cross_entropy, axis=-1) / xp.maximum(xp.sum(mask), 1.0)


def personalization_weights(losses, temperature, xp=np):
  """alpha = softmax(-loss / temperature) over the last axis (Fed-ensemble, eq. 4): the
  entropy-regularized minimizer of the weighted local loss; an infinite temperature gives
  the uniform 1/K."""
  z = -losses / temperature
  z = z - xp.max(z, axis=-1, keepdims=True)
  e = xp.exp(z)
  return e / xp.sum(e, axis=-1, keepdims=True)
