"""FedBE's distributions over global models, and its ensemble of teachers.

Chen and Chao, "FedBE: Making Bayesian Model Ensemble Applicable to Federated
Learning", ICLR 2021 (arXiv:2009.01974), Sec. 4 and Table 3; the authors'
code is github.com/hongyouc/FedBE (`swag.py`, `SWAG_server`).

From the round's client models w_1..w_N with weights |D_i|/|D| the server fits
a distribution over global models and samples M of them:

* Gaussian over the clients' updates (`fit_gaussian_to_updates`), one of
  GAUSSIANS: "paper", eq. 5's weighted mean and diagonal variance of the
  client models (also from summed `moment_terms`, `gaussian_from_moments`);
  "code", the authors' fit to unit-norm updates, with a clamped variance and
  a std scaled by `var_scale` and the mean update norm
  (`normalized_update_gaussian`).
* Dirichlet (`sample_dirichlet_coefficients`): convex combinations
  sum_i c_i w_i of the client models, one of DIRICHLETS: "paper", eq. 7,
  gamma ~ Dir(alpha, ..., alpha) reweighted by |D_i|; "code", the authors'
  symmetric Dir(alpha, ..., alpha); "proportional", Dir(alpha N p), this
  library's variant whose mean is the weight average.

The teachers are then any of {the weight average (A), the clients (C), the
samples (S)} (`teacher_stack`). All functions are plain TensorFlow over nested
structures of tensors (`tff.learning.models.ModelWeights` or tuples), usable in
eager code and inside `tff.tensorflow.computation`s; stacked structures carry
the models along a leading dimension. Randomness is stateless: the same seed
gives the same samples.
"""

import dataclasses

import tensorflow as tf
import tensorflow_federated as tff

from tff_ens import settings
from tff_ens.settings import setting

ModelWeights = tff.learning.models.ModelWeights

DISTRIBUTIONS = ("gaussian", "dirichlet")
TARGETS = ("A", "S", "S+A", "A+C", "S+C", "S+A+C")
GAUSSIANS = ("paper", "code")
DIRICHLETS = ("paper", "code", "proportional")


@dataclasses.dataclass(frozen=True)
class WeightPosterior:
  """FedBE's distribution over global models and its teachers (the `--fedbe_*` flags).

  Attributes:
    distribution: "gaussian" (eq. 5) or "dirichlet" (eq. 7).
    num_samples: M, models sampled from it.
    targets: the teachers, one of TARGETS (A average, C clients, S samples; Table 3).
    dirichlet_alpha: the Dirichlet's alpha (eq. 7).
    gaussian: the Gaussian's fit, one of GAUSSIANS (`fit_gaussian_to_updates`).
    gaussian_var_scale, gaussian_var_clamp: the "code" Gaussian's std scale and least
      variance (`normalized_update_gaussian`).
    dirichlet: the Dirichlet, one of DIRICHLETS (`sample_dirichlet_coefficients`).
  """

  distribution: str = setting(
    "gaussian",
    "FedBE: distribution over global models (eq. 5 / eq. 7).",
    flag="fedbe_distribution",
    choices=DISTRIBUTIONS,
  )
  num_samples: int = setting(10, "FedBE: M, models sampled.", flag="fedbe_samples", at_least=0)
  targets: str = setting(
    "S+A+C",
    "FedBE: teachers (A average, C clients, S samples; Table 3).",
    flag="fedbe_targets",
    choices=TARGETS,
  )
  dirichlet_alpha: float = setting(1.0, "FedBE: Dirichlet alpha (eq. 7).", above=0)
  gaussian: str = setting(
    "paper",
    "FedBE's Gaussian: paper (eq. 5, moments of the client models) or code (the authors' "
    "swag.py: unit-norm updates, std x var_scale x mean norm).",
    flag="fedbe_gaussian",
    choices=GAUSSIANS,
  )
  gaussian_var_scale: float = setting(
    0.1,
    "FedBE, --fedbe_gaussian=code: std scale (the authors' code's 0.1; not in the paper).",
    flag="fedbe_var_scale",
    above=0,
  )
  gaussian_var_clamp: float = setting(
    1e-05,
    "FedBE, --fedbe_gaussian=code: least variance of the unit updates (the authors' code's 1e-5).",
    flag="fedbe_var_clamp",
    at_least=0,
  )
  dirichlet: str = setting(
    "paper",
    "FedBE's Dirichlet: paper (eq. 7, Dir(alpha) reweighted by |D_i|), code (the authors' "
    "symmetric Dir(alpha)) or proportional (Dir(alpha N p)).",
    flag="fedbe_dirichlet",
    choices=DIRICHLETS,
    before="proportional",
  )

  def __post_init__(self):
    settings.check(self)
    if self.num_samples < 1 and "S" in self.targets:
      raise settings.SettingError(
        "num_samples", self.num_samples, f"must be >= 1 for targets {self.targets}"
      )


def _check_choice(name: str, value: str, allowed):
  """Raises ValueError unless `value` is one of `allowed`."""
  if value not in allowed:
    raise ValueError(f"unknown {name} {value!r}: choose one of {', '.join(allowed)}")


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
  second = tf.nest.map_structure(lambda t: client_weight * tf.square(t), weights)
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
  mean = tf.nest.map_structure(lambda s: tf.math.divide_no_nan(s, total_weight), weighted_sum)
  variance = tf.nest.map_structure(
    lambda s2, m: tf.maximum(tf.math.divide_no_nan(s2, total_weight) - tf.square(m), 0.0),
    weighted_sum_of_squares,
    mean,
  )
  return mean, variance


def normalized_update_gaussian(updates, client_weights, var_scale: float, var_clamp: float):
  """The authors' Gaussian over updates (FedBE code, `swag.py`, "gaussian").

  Per tensor, over the n clients with weight > 0 and unweighted: the unit
  updates u_i = d_i / ||d_i|| (d_i = w0 - w_i; 0 if d_i = 0), their mean m,
  variance v = max(mean_i u_i^2 - m^2, var_clamp) and the mean norm r =
  mean_i ||d_i||. The update distribution is N(r m, (var_scale r)^2 v):
  samples are w0 - r (m + var_scale sqrt(v) eps). Not in the paper, whose
  Gaussian is eq. 5 (`gaussian_from_moments`).

  Args:
    updates: a structure of tensors [N, ...], the clients' w0 - w_i.
    client_weights: [N]; only which are > 0 matters.
    var_scale: the std's scale (the code's `--var_scale`, 0.1).
    var_clamp: the least variance of the unit updates (the code's 1e-5).

  Returns:
    `(mean_update, variance)`, each of the structure of one update; the mean
    model is w0 - mean_update. With no client both are 0.
  """
  present = tf.cast(tf.convert_to_tensor(client_weights) > 0, tf.float32)
  share = tf.math.divide_no_nan(present, tf.reduce_sum(present))

  def fit(update):
    update = tf.cast(update, tf.float32)
    norms = tf.sqrt(tf.reduce_sum(tf.square(update), axis=list(range(1, update.shape.rank))))
    units = tf.math.divide_no_nan(update, tf.reshape(norms, [-1] + [1] * (update.shape.rank - 1)))
    mean_unit = tf.tensordot(share, units, axes=1)
    variance_unit = tf.maximum(
      tf.tensordot(share, tf.square(units), axes=1) - tf.square(mean_unit), var_clamp
    )
    mean_norm = tf.tensordot(share, norms, axes=1)
    return (mean_norm * mean_unit, tf.square(var_scale * mean_norm) * variance_unit)

  fitted = [fit(update) for update in tf.nest.flatten(updates)]
  return tuple(tf.nest.pack_sequence_as(updates, [f[part] for f in fitted]) for part in (0, 1))


def fit_gaussian_to_updates(
  updates, client_weights, gaussian: str = "paper", var_scale: float = 0.1, var_clamp: float = 1e-5
):
  """Mean and diagonal variance of FedBE's Gaussian over the clients' updates.

  `gaussian` is one of GAUSSIANS:
  * "paper" (default; the paper states it): eq. 5 over the updates d_i = w0 -
    w_i weighted by |D_i| (`gaussian_from_moments`; the variance is that of
    the client models, the mean model w0 - mean_update their weight average).
    `var_scale` and `var_clamp` are unused.
  * "code": the authors' normalized, scaled fit (`normalized_update_gaussian`
    with `var_scale` and `var_clamp`, defaults from their code).

  Args:
    updates: a structure of tensors [N, ...], the clients' w0 - w_i.
    client_weights: [N] client weights |D_i| (0: left out).

  Returns:
    `(mean_update, variance)`; sample with `sample_gaussian(w0 - mean_update,
    variance, ...)`.
  """
  _check_choice("gaussian", gaussian, GAUSSIANS)
  if gaussian == "code":
    if var_scale <= 0 or var_clamp < 0:
      raise ValueError(f"need var_scale > 0 and var_clamp >= 0, got {var_scale} and {var_clamp}")
    return normalized_update_gaussian(updates, client_weights, var_scale, var_clamp)
  client_weights = tf.cast(client_weights, tf.float32)
  return gaussian_from_moments(
    tf.nest.map_structure(lambda t: tf.tensordot(client_weights, t, axes=1), updates),
    tf.nest.map_structure(lambda t: tf.tensordot(client_weights, tf.square(t), axes=1), updates),
    tf.reduce_sum(client_weights),
  )


def _seed_for(seed, index: int):
  """A stateless seed per tensor `index` of a structure, from `seed` [2]."""
  return tf.random.experimental.stateless_fold_in(tf.cast(seed, tf.int64), index)


def sample_gaussian(mean, variance, num_samples: int, seed):
  """`num_samples` models from N(mean, diag(variance)) (FedBE, eq. 5).

  For `ModelWeights`, only the trainable weights are sampled and every
  sample gets the mean of the non-trainable ones (batch-norm moving
  statistics): they are running averages of activations, not parameters, and
  a perturbed moving variance could turn negative. This is a choice of this
  library: the paper does not say, and the authors' code samples every entry
  of the state dict but the batch counter, moving statistics included. Any
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
      [num_samples] + m.shape.as_list(), seed=_seed_for(seed, index), dtype=m.dtype
    )
    return m[None] + tf.sqrt(v)[None] * noise

  def tile(m):
    return tf.tile(m[None], [num_samples] + [1] * m.shape.rank)

  flat_mean = tf.nest.flatten(mean)
  flat_variance = tf.nest.flatten(variance)
  if isinstance(mean, ModelWeights):
    num_trainable = len(tf.nest.flatten(mean.trainable))
  else:
    num_trainable = len(flat_mean)
  samples = [
    sample(i, m, v) if i < num_trainable else tile(m)
    for i, (m, v) in enumerate(zip(flat_mean, flat_variance))
  ]
  return tf.nest.pack_sequence_as(mean, samples)


def dirichlet_concentration(client_weights, alpha, symmetric: bool = False):
  """Concentration alpha_1..alpha_N of FedBE's Dirichlet over the clients.

  Over the N clients with weight > 0 (the others get 0): alpha_i = alpha if
  `symmetric` (Dir(alpha, ..., alpha) of the paper's eq. 7 and of the
  authors' code), else alpha_i = alpha * N * p_i with p_i = |D_i| / |D| (the
  "proportional" variant: E[gamma] = p, the weight average). Smaller alpha
  gives coefficients farther from their mean (sparser combinations).
  """
  client_weights = tf.cast(client_weights, tf.float32)
  present = tf.cast(client_weights > 0, tf.float32)
  if symmetric:
    return alpha * present
  proportions = tf.math.divide_no_nan(client_weights, tf.reduce_sum(client_weights))
  return alpha * tf.reduce_sum(present) * proportions


def reweight_by_size(gamma, client_weights):
  """c_{s,i} = gamma_{s,i} |D_i| / sum_j gamma_{s,j} |D_j| (FedBE, eq. 7).

  Args:
    gamma: [S, N] rows on the simplex.
    client_weights: [N] client weights |D_i|.
  """
  weighted = gamma * tf.cast(client_weights, gamma.dtype)[None]
  return tf.math.divide_no_nan(weighted, tf.reduce_sum(weighted, axis=1, keepdims=True))


def sample_dirichlet_coefficients(
  client_weights, alpha, num_samples: int, seed, dirichlet: str = "paper"
):
  """Convex-combination coefficients [M, N] of FedBE's Dirichlet (Sec. 4.2).

  `dirichlet` is one of DIRICHLETS:
  * "paper" (default; the paper states it): eq. 7, gamma ~ Dir(alpha, ...,
    alpha) over the clients, coefficients `reweight_by_size(gamma)`.
  * "code": the authors' `swag.py` (mode "dir"), coefficients gamma ~
    Dir(alpha, ..., alpha), client sizes unused.
  * "proportional": gamma ~ Dir(alpha N p) (`dirichlet_concentration`), so
    that the mean is FedAvg's weight average; in neither paper nor code, it
    equals "code" for clients of equal size.

  gamma is drawn as normalized Gamma(alpha_i, 1) variables (TensorFlow has a
  stateless Gamma sampler but no Dirichlet one, and TensorFlow Probability
  is no direct dependency). Clients with weight 0 get coefficient 0. If
  every Gamma draw of a row underflows to 0 (tiny alpha), that row of gamma
  is its mean. Each row lies on the simplex. "paper" and "code" share the
  draws: the same seed gives the same gamma.

  Args:
    client_weights: [N] client weights |D_i| (>= 0, not all 0).
    alpha: the concentration scale (> 0), see `dirichlet_concentration`.
    num_samples: M, a Python int.
    seed: a shape [2] integer tensor.
    dirichlet: one of DIRICHLETS.
  """
  _check_choice("dirichlet", dirichlet, DIRICHLETS)
  concentration = dirichlet_concentration(
    client_weights, alpha, symmetric=dirichlet != "proportional"
  )
  present = tf.cast(concentration > 0, tf.float32)
  # A zero concentration is outside Gamma's domain: draw with 1, then drop.
  draws = (
    tf.random.stateless_gamma(
      [num_samples, concentration.shape[0]],
      seed=tf.cast(seed, tf.int64),
      alpha=tf.where(present > 0, concentration, 1.0),
    )
    * present
  )
  totals = tf.reduce_sum(draws, axis=1, keepdims=True)
  mean = concentration / tf.reduce_sum(concentration)
  gamma = tf.where(totals > 0, tf.math.divide_no_nan(draws, totals), mean[None])
  if dirichlet == "paper":
    return reweight_by_size(gamma, client_weights)
  return gamma


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
    lambda t: tf.tensordot(tf.cast(coefficients, t.dtype), t, axes=1), stacked_models
  )


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
  _check_choice("targets", targets, TARGETS)
  parts = [tf.nest.map_structure(lambda t: t[None], average)] if ("A" in targets) else []
  for letter, stacked in (("C", clients), ("S", samples)):
    if letter in targets:
      if stacked is None:
        raise ValueError(
          f"targets {targets!r} include {letter!r}: pass the "
          f"{'clients' if letter == 'C' else 'samples'}"
        )
      parts.append(stacked)
  if len(parts) == 1:
    return parts[0]
  return tf.nest.map_structure(lambda *ts: tf.concat(ts, axis=0), *parts)


def num_teachers(targets: str, num_clients: int, num_samples: int) -> int:
  """How many teachers `teacher_stack(targets, ...)` returns."""
  return ("A" in targets) + num_clients * ("C" in targets) + num_samples * ("S" in targets)


def teacher_weights(targets: str, client_weights, num_samples: int):
  """Weights [num_teachers] of `teacher_stack(targets, ...)`'s teachers.

  1 for the average and the samples, and for each client 1 if its weight is
  positive, else 0: a client whose update was rejected (weight 0) is no
  teacher. For `distillation.ensemble_predictions(member_weights=...)`.
  """
  _check_choice("targets", targets, TARGETS)
  parts = [tf.ones([1])] if "A" in targets else []
  if "C" in targets:
    parts.append(tf.cast(tf.convert_to_tensor(client_weights) > 0, tf.float32))
  if "S" in targets:
    parts.append(tf.ones([num_samples]))
  return tf.concat(parts, axis=0)
