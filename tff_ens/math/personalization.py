"""Personalized ensemble weights from a client's own labeled data.

Shi et al., Fed-ensemble (arXiv:2107.10663), Sec. IV-C, eq. 3-4: a client with
labeled data weights the K models by

    alpha = argmin_{alpha in simplex} sum_k alpha_k loss_k - tau * H(alpha)
          = softmax(-loss / tau),

the entropy-regularized minimizer of the weighted local loss, where loss_k is
model k's mean cross-entropy on the client's training data. (The paper's
closed form and its sentence on gamma disagree on the sign; this is the
minimizer: models with lower local loss get more weight.) tau -> infinity
gives the uniform ensemble, tau -> 0 picks the single best model.
"""

from typing import Mapping, Sequence

import numpy as np

from tff_ens.math import ensemble_math

# Candidate temperatures for `choose_temperature`; inf is the uniform ensemble.
TEMPERATURE_GRID = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, float("inf"))


def personalization_weights(losses: np.ndarray, temperature: float) -> np.ndarray:
  """alpha = softmax(-losses / temperature) (eq. 4, `ensemble_math.personalization_weights`)
  in float64, for a temperature > 0 (inf: the uniform ensemble)."""
  if not temperature > 0:
    raise ValueError(f"temperature must be positive, got {temperature}")
  return ensemble_math.personalization_weights(np.asarray(losses, np.float64), temperature)


def weighting_examples(train, limit: int, seed: int):
  """The training examples (`tasks.data.ClientArrays`) each client weights the members on:
  at most `limit` (0: all) of its own, a subsample drawn by `seed`."""
  return train.at_most(limit, (seed, 10))


def choose_temperature(
  member_train_probs: Mapping[str, np.ndarray],
  train_labels: Mapping[str, np.ndarray],
  candidates: Sequence[float] = TEMPERATURE_GRID,
  seed: int = 0,
) -> float:
  """Picks tau from training data only, by a split of each client's data.

  Each client's training examples are split in two at random (seeded): the
  weights come from the losses on one half, the accuracy is measured on the
  other; the temperature with the best mean per-client accuracy wins (ties go
  to the larger, smoother temperature).
  """
  rng = np.random.default_rng(seed)
  scores = np.zeros(len(candidates))
  clients = [c for c in member_train_probs if len(train_labels[c]) >= 2]
  for client in clients:
    probs, y = member_train_probs[client], train_labels[client]
    order = rng.permutation(len(y))
    fit, held = order[: len(y) // 2], order[len(y) // 2 :]
    losses = ensemble_math.member_losses(probs[:, fit], y[fit])
    for i, tau in enumerate(candidates):
      alpha = personalization_weights(losses, tau)
      predicted = ensemble_math.mixture(probs[:, held], alpha).argmax(-1)
      scores[i] += np.mean(predicted == y[held])
  best = np.flatnonzero(scores >= scores.max() - 1e-12)
  return float(max(candidates[i] for i in best))
