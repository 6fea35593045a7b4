"""FedBE's distributions over global models, and its ensemble of teachers.

Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning", ICLR 2021 (arXiv:2009.01974), Sec. 4 and Table 3.

From the round's client models w_1..w_N with weights |D_i|/|D| the server fits
a distribution over global models and samples M of them:

* Gaussian (eq. 5): mean and diagonal variance of the client models. Both come
  from weighted first and second moments, so a TFF *sum* aggregation of each
  client's `moment_terms` is all the server needs (`gaussian_from_moments`).
* Dirichlet (eq. 7): convex combinations sum_i gamma_i w_i of the client
  models with gamma drawn from a Dirichlet distribution.

The teachers are then any of {the weight average (A), the clients (C), the
samples (S)} (`teacher_stack`). All functions are plain TensorFlow over nested
structures of tensors (`tff.learning.models.ModelWeights` or tuples), usable in
eager code and inside `tff.tensorflow.computation`s; stacked structures carry
the models along a leading dimension. Randomness is stateless: the same seed
gives the same samples.
"""

import tensorflow as tf
import tensorflow_federated as tff

ModelWeights = tff.learning.models.ModelWeights

TARGETS = ("A", "S", "S+A", "A+C", "S+C", "S+A+C")


def moment_terms(weights, client_weight):
  """One client's contribution to the Gaussian's moments (eq. 5).

  Returns `(client_weight * w, client_weight * w**2, client_weight)` for every
  tensor of `weights`; their sum over the clients is the input of
  `gaussian_from_moments`. The variance is invariant to a shift of all client
  models, so `weights` may equally be the clients' updates `w0 - w_i` (better
  conditioned in float32); the mean is then `w0 - mean`.
  """
  client_weight = tf.cast(client_weight, tf.float32)
  first = tf.nest.map_structure(lambda t: client_weight * t, weights)
  second = tf.nest.map_structure(lambda t: client_weight * tf.square(t),
                                 weights)
  return first, second, client_weight


def gaussian_from_moments(weighted_sum, weighted_sum_of_squares, total_weight):
  """Mean and diagonal variance of the client models (FedBE, eq. 5).

  mu = sum_i p_i w_i and sigma^2 = sum_i p_i (w_i - mu)^2 = sum_i p_i w_i^2 -
  mu^2 with p_i = |D_i| / |D|, from the sums S1 = sum_i |D_i| w_i, S2 =
  sum_i |D_i| w_i^2 and W = sum_i |D_i|. The variance is clipped at 0 (the
  difference of moments can be slightly negative in floating point). With
  W = 0 (no client) mean and variance are 0.

  Returns:
    `(mean, variance)`, each of the structure of `weighted_sum`.
  """
  total_weight = tf.cast(total_weight, tf.float32)
  mean = tf.nest.map_structure(
      lambda s: tf.math.divide_no_nan(s, total_weight), weighted_sum)
  variance = tf.nest.map_structure(
      lambda s2, m: tf.maximum(
          tf.math.divide_no_nan(s2, total_weight) - tf.square(m), 0.0),
      weighted_sum_of_squares, mean)
  return mean, variance


def _seed_for(seed, index: int):
  """A stateless seed per tensor `index` of a structure, from `seed` [2]."""
  return tf.random.experimental.stateless_fold_in(
      tf.cast(seed, tf.int64), index)


def sample_gaussian(mean, variance, num_samples: int, seed):
  """`num_samples` models from N(mean, diag(variance)) (FedBE, eq. 5).

  For `ModelWeights`, only the trainable weights are sampled: the
  non-trainable ones (batch-norm moving statistics) are not parameters of the
  posterior but running averages of activations, and a random perturbation of
  a variance could make it negative; every sample gets the mean statistics,
  as in FedBE's code, which recomputes them after distillation anyway. Any
  other structure (e.g. a tuple of tensors) is sampled in every tensor.

  Args:
    mean: a structure of float tensors.
    variance: the same structure, element-wise variances (>= 0).
    num_samples: M, a Python int.
    seed: a shape [2] integer tensor (stateless RNG seed).

  Returns:
    The structure of `mean` with tensors stacked to [M, ...].
  """
  def sample(index, m, v):
    noise = tf.random.stateless_normal(
        [num_samples] + m.shape.as_list(), seed=_seed_for(seed, index),
        dtype=m.dtype)
    return m[None] + tf.sqrt(v)[None] * noise

  def tile(m):
    return tf.tile(m[None], [num_samples] + [1] * m.shape.rank)

  flat_mean = tf.nest.flatten(mean)
  flat_variance = tf.nest.flatten(variance)
  if isinstance(mean, ModelWeights):
    num_trainable = len(tf.nest.flatten(mean.trainable))
  else:
    num_trainable = len(flat_mean)
  samples = [sample(i, m, v) if i < num_trainable else tile(m)
             for i, (m, v) in enumerate(zip(flat_mean, flat_variance))]
  return tf.nest.pack_sequence_as(mean, samples)


def dirichlet_concentration(client_weights, alpha):
  """Concentration of FedBE's Dirichlet over client coefficients (eq. 7).

  alpha_i = alpha * N * p_i with p_i = |D_i| / |D| over the N clients with
  weight > 0, so that E[gamma] = p (the mean sample is FedAvg's weight
  average) and, for clients of equal size, the distribution is FedBE code's
  symmetric Dir(alpha, ..., alpha) (`swag.py`, mode "dir"). Smaller alpha
  gives coefficients farther from p (sparser combinations).
  """
  client_weights = tf.cast(client_weights, tf.float32)
  present = tf.cast(client_weights > 0, tf.float32)
  proportions = tf.math.divide_no_nan(client_weights,
                                      tf.reduce_sum(client_weights))
  return alpha * tf.reduce_sum(present) * proportions


def sample_dirichlet_coefficients(client_weights, alpha, num_samples: int,
                                  seed):
  """Coefficients gamma ~ Dir(alpha_1..alpha_N), [M, N] (FedBE, eq. 7).

  Drawn as normalized Gamma(alpha_i, 1) variables (the standard construction;
  TensorFlow has a stateless Gamma sampler but no Dirichlet one, and
  TensorFlow Probability is no direct dependency). Clients with weight 0 get
  coefficient 0. If every Gamma draw of a row underflows to 0 (tiny alpha),
  that row is p, the mean of the distribution. Each row lies on the simplex.

  Args:
    client_weights: [N] client weights |D_i| (>= 0, not all 0).
    alpha: the concentration scale (> 0), see `dirichlet_concentration`.
    num_samples: M, a Python int.
    seed: a shape [2] integer tensor.
  """
  concentration = dirichlet_concentration(client_weights, alpha)
  present = tf.cast(concentration > 0, tf.float32)
  # A zero concentration is outside Gamma's domain: draw with 1, then drop.
  draws = tf.random.stateless_gamma(
      [num_samples, concentration.shape[0]], seed=tf.cast(seed, tf.int64),
      alpha=tf.where(present > 0, concentration, 1.0)) * present
  totals = tf.reduce_sum(draws, axis=1, keepdims=True)
  proportions = concentration / tf.reduce_sum(concentration)
  return tf.where(totals > 0, tf.math.divide_no_nan(draws, totals),
                  proportions[None])


def combine_models(stacked_models, coefficients):
  """Models sum_i gamma_{s,i} w_i for each row s of `coefficients` (eq. 7).

  Args:
    stacked_models: a structure of tensors [N, ...] (the N client models).
    coefficients: [S, N] convex-combination coefficients.

  Returns:
    The structure with tensors [S, ...]. Non-trainable weights (batch-norm
    statistics) are combined with the same coefficients.
  """
  return tf.nest.map_structure(
      lambda t: tf.tensordot(tf.cast(coefficients, t.dtype), t, axes=1),
      stacked_models)


def teacher_stack(targets: str, average, clients=None, samples=None):
  """The teachers of FedBE's ensemble variant `targets` (Table 3).

  "A" is the weight average, "C" the client models, "S" the sampled models;
  `targets` is one of TARGETS ("S+A+C", the full FedBE, by default in the
  paper). Teachers are stacked in the order A, C, S of those included.

  Args:
    targets: one of TARGETS.
    average: a structure of tensors (one model).
    clients: the same structure stacked [N, ...]; needed with "C".
    samples: the same structure stacked [M, ...]; needed with "S".

  Returns:
    The structure with tensors [num_teachers, ...].
  """
  if targets not in TARGETS:
    raise ValueError(f"unknown targets {targets!r}: choose one of "
                     f"{', '.join(TARGETS)}")
  parts = [tf.nest.map_structure(lambda t: t[None], average)] if (
      "A" in targets) else []
  for letter, stacked in (("C", clients), ("S", samples)):
    if letter in targets:
      if stacked is None:
        raise ValueError(f"targets {targets!r} include {letter!r}: pass the "
                         f"{'clients' if letter == 'C' else 'samples'}")
      parts.append(stacked)
  if len(parts) == 1:
    return parts[0]
  return tf.nest.map_structure(lambda *ts: tf.concat(ts, axis=0), *parts)


def num_teachers(targets: str, num_clients: int, num_samples: int) -> int:
  """How many teachers `teacher_stack(targets, ...)` returns."""
  return (("A" in targets) + num_clients * ("C" in targets) +
          num_samples * ("S" in targets))


def teacher_weights(targets: str, client_weights, num_samples: int):
  """Weights [num_teachers] of `teacher_stack(targets, ...)`'s teachers.

  1 for the average and the samples, and for each client 1 if its weight is
  positive, else 0: a client whose update was rejected (weight 0) is no
  teacher. For `distillation.ensemble_predictions(member_weights=...)`.
  """
  if targets not in TARGETS:
    raise ValueError(f"unknown targets {targets!r}: choose one of "
                     f"{', '.join(TARGETS)}")
  parts = [tf.ones([1])] if "A" in targets else []
  if "C" in targets:
    parts.append(tf.cast(tf.convert_to_tensor(client_weights) > 0,
                         tf.float32))
  if "S" in targets:
    parts.append(tf.ones([num_samples]))
  return tf.concat(parts, axis=0)
