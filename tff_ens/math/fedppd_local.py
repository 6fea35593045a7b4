"""FedPPD's local iterations: the SGLD step, its units and schedules, and the minibatches.

Bhatt, Gupta, Rai, ACML 2023, supplement, Algorithm 1 (`fedppd` builds the client work
and the process from these).

SGLD (Welling & Teh, ICML 2011, eq. 4), with U(theta) = -log p(theta) -
(N/n) sum_{i in batch} log p(y_i | x_i, theta) and a N(0, 1/lambda) prior:

    theta <- theta - (eps/2) grad U(theta) + xi,   xi ~ N(0, eps * T),

T = 1 being exact SGLD and T < 1 a tempered ("cold") posterior. In terms of
the minibatch's mean loss, grad U = N grad mean_nll + lambda theta, so the
step is SGD with learning rate eps N / 2 plus noise of standard deviation
sqrt(eps T).

The authors' SGLD optimizer (github.com/aishgupta/fedppd, lib/sgld_optim.py)
steps by lr/2 on the mean loss and adds noise of standard deviation
2 sqrt(lr) / N: with eps = lr / N that is T = 4 / N, a tempered posterior
whose temperature falls with the client's data (about 0.03 for a FEMNIST
writer). `PosteriorConfig.sgld_scaling="authors"` takes the step size and
temperature in their units (`chain_parameters`). With five local epochs on
FEMNIST, T = 0.1 kept the teacher on the initial plateau five rounds longer
than FedAvg, T = 0.01 did not (benchmarks/RESULTS.md, FedPPD).
"""

import dataclasses

import tensorflow as tf

from tff_ens import settings
from tff_ens.settings import setting

# What the student learns on (`minibatch_stream`).
STUDENT_MINIBATCHES = ("fresh", "same", "alternate_epochs")
# The units of the teacher's step size and temperature (`chain_parameters`).
SGLD_SCALINGS = ("posterior", "authors")
# The role of a minibatch in `minibatch_stream`: the teacher takes an SGLD
# step on it, the student an SGD step, or the teacher and then the student.
TEACHER, STUDENT, BOTH = 0, 1, 2
# The authors' noise is that of T = AUTHORS_NOISE / N (lib/sgld_optim.py).
AUTHORS_NOISE = 4.0


@dataclasses.dataclass(frozen=True)
class PosteriorConfig:
  """Hyperparameters of FedPPD's client update.

  Attributes:
    teacher_step_size: with sgld_scaling "posterior", eps of SGLD (the noise
      variance at T = 1); with "authors", the step size on the minibatch's
      mean loss (the code's `teach_lr`; eps = it / N).
    temperature: T; the SGLD noise variance is eps * T. With sgld_scaling
      "authors", relative to the authors' noise (1: theirs).
    sgld_scaling: "posterior" (Welling & Teh, as the supplement's SGLD) or
      "authors" (lib/sgld_optim.py); see `chain_parameters`.
    prior_precision: lambda of the teacher's N(0, 1/lambda) weight prior
      (0: none besides teacher_weight_decay, as in the authors' code).
    teacher_weight_decay: wd added to the gradient of the teacher's mean loss
      as wd * w, i.e. a prior precision of N * wd (the code's 1e-4; the
      paper gives none).
    teacher_step_decay: the teacher's step size is multiplied by it every
      teacher_step_decay_epochs local epochs (the code's StepLR, gamma 0.85
      in its README commands; the paper gives no schedule; 1: none).
    teacher_step_decay_epochs: see teacher_step_decay (the code's 3).
    teacher_round_decay: the teacher's step size is multiplied by it every
      round (the code's FEMNIST script, 0.99; 1: none).
    student_lr: learning rate of the student's SGD.
    student_round_decay: the student's learning rate is multiplied by it
      every round (the code's FEMNIST script: 0.99, 0.995 with distillation
      at the server; 1: none).
    student_momentum: heavy-ball momentum of the student's SGD (0: plain).
    student_weight_decay: the student's prior (L2) term, added to its
      gradient as `student_weight_decay * w` (the code's 1e-4).
    student_minibatch: what the student learns on, one of
      `STUDENT_MINIBATCHES` (`minibatch_stream`): "fresh"
      (the supplement's Algorithm 1), "same" (the teacher's minibatch) or
      "alternate_epochs" (the authors' code).
    input_noise_std: standard deviation of the Gaussian noise added to the
      minibatch the teacher labels and the student learns from.
    epochs: local epochs; the client's dataset repeats this many times, so N
      (the number of examples of the likelihood) is its size / epochs.
    max_update_norm: larger updates (teacher and student) are rejected
      (`client_work.reject_bad_update`); 0: no limit.
    seed: the run's seed, from which every client's noise is drawn.
  """

  teacher_step_size: float = setting(
    0.0004,
    "FedPPD: SGLD step size eps of the teacher (noise variance eps * --sgld_temperature; like"
    " SGD at rate eps*N/2).",
    flag="teacher_lr",
    above=0,
  )
  temperature: float = setting(
    1.0,
    "FedPPD: posterior temperature T of SGLD (1: exact; the authors' code adds noise as T = "
    "4/N would, about 0.03 for a FEMNIST writer).",
    flag="sgld_temperature",
    at_least=0,
  )
  sgld_scaling: str = setting(
    "posterior",
    "FedPPD: units of --teacher_lr/--sgld_temperature: posterior (eps, T; the paper) or "
    "authors (lr on the mean loss; T=1 is their noise 2 sqrt(lr)/N).",
    choices=SGLD_SCALINGS,
  )
  prior_precision: float = setting(
    0.0,
    "FedPPD: precision of the teacher's Gaussian weight prior beyond --teacher_weight_decay "
    "(0: that only, as the authors' code).",
    at_least=0,
  )
  teacher_weight_decay: float = setting(
    0.0001,
    "FedPPD: wd*w added to the teacher's mean-loss gradient (prior precision N*wd; the "
    "authors' code, the paper gives none).",
    at_least=0,
    before=0.0,
  )
  teacher_step_decay: float = setting(
    0.85,
    "FedPPD: teacher step size times this every --teacher_step_decay_epochs local epochs (the"
    " authors' StepLR; 1: off).",
    above=0,
    before=1.0,
  )
  teacher_step_decay_epochs: int = setting(
    3, "FedPPD: local epochs between teacher step decays (the authors' code: 3).", above=0
  )
  teacher_round_decay: float = setting(
    0.99,
    "FedPPD: teacher step size times this each round (the authors' FEMNIST script; 1: off).",
    above=0,
    before=1.0,
  )
  student_lr: float = setting(0.05, "FedPPD: student SGD learning rate.", above=0)
  student_round_decay: float = setting(
    0.99,
    "FedPPD: student learning rate times this each round (the authors' code; 1: off).",
    above=0,
    before=1.0,
  )
  student_momentum: float = setting(0.0, "FedPPD: student SGD momentum.", at_least=0)
  student_weight_decay: float = setting(0.0001, "FedPPD: the student's L2 prior term.", at_least=0)
  student_minibatch: str = setting(
    "fresh",
    "FedPPD: the student's minibatch: fresh after each SGLD step (the supplement's Alg. 1), "
    "the teacher's (same), or alternate_epochs (authors).",
    choices=STUDENT_MINIBATCHES,
    before="same",
  )
  input_noise_std: float = setting(0.001, flag=None, at_least=0)
  epochs: int = setting(uses="client_epochs", above=0)
  max_update_norm: float = setting(uses="max_update_norm", at_least=0)
  seed: int = setting(uses="seed")

  def __post_init__(self):
    settings.check(self)


def sgld_step(weights, gradients, step_size, temperature, seed):
  """One SGLD step, Welling & Teh eq. 4: w - (eps/2) g + N(0, eps T).

  Args:
    weights: tensors theta.
    gradients: grad U(theta) for each tensor (potential energy, i.e. minus
      the log prior minus the rescaled minibatch log-likelihood).
    step_size: eps.
    temperature: T (1: exact SGLD).
    seed: a stateless-RNG seed `int64[2]`; tensor i draws from fold_in(seed,
      i).

  Returns:
    The new tensors.
  """
  noise_std = tf.sqrt(step_size * temperature)
  return [
    w
    - 0.5 * step_size * g
    + noise_std
    * tf.random.stateless_normal(
      tf.shape(w), seed=tf.random.experimental.stateless_fold_in(seed, i), dtype=w.dtype
    )
    for i, (w, g) in enumerate(zip(weights, gradients))
  ]


def chain_parameters(sgld_scaling: str, step_size, temperature, num_data):
  """(eps, T) of `sgld_step` from the configured step size and temperature.

  "posterior": they are eps and T. "authors": `step_size` is lr, the step on
  the minibatch's mean loss, and the noise is the authors' (std 2 sqrt(lr) /
  N, lib/sgld_optim.py) times sqrt(temperature): eps = lr / N and
  T = temperature * 4 / N.
  """
  if sgld_scaling == "posterior":
    return step_size, temperature
  return (step_size / num_data, temperature * AUTHORS_NOISE / num_data)


def scheduled_rate(rate, round_num, epoch, round_decay, step_decay=1.0, step_epochs=1):
  """rate * round_decay^round * step_decay^floor(epoch / step_epochs).

  The authors' schedules: a per-round decay (train_femnist.py) and, within
  the round, a step decay every `step_epochs` local epochs (StepLR in
  trainers/ClientServUpdate.py). `round_num` and `epoch` are 0-based.
  """
  steps = tf.math.floordiv(tf.cast(epoch, tf.int64), tf.cast(step_epochs, tf.int64))
  return (
    rate
    * tf.pow(round_decay, tf.cast(round_num, tf.float32))
    * tf.pow(step_decay, tf.cast(steps, tf.float32))
  )


def batch_sizes(dataset: tf.data.Dataset):
  """The number of examples of each batch of `dataset`, `int64[batches]`."""
  return dataset.reduce(
    tf.zeros([0], tf.int64),
    lambda sizes, batch: tf.concat([sizes, tf.shape(batch[1], out_type=tf.int64)[:1]], 0),
  )


def batch_epochs(sizes, epochs: int):
  """The 0-based local epoch of each batch: that of its first example.

  The stream holds `epochs` passes over the client's data, so example i is
  in epoch floor(i * epochs / examples).
  """
  starts = tf.cumsum(sizes, exclusive=True)
  return starts * epochs // tf.maximum(tf.reduce_sum(sizes), 1)


def minibatch_stream(
  dataset: tf.data.Dataset, sizes, student_minibatch: str, epochs: int
) -> tf.data.Dataset:
  """The client's minibatches `(x, y, role)` in the order they are learned.

  `sizes` is `batch_sizes(dataset)`.

  The teacher takes an SGLD step on a TEACHER batch, the student an SGD
  step on a STUDENT one, and on a BOTH batch the teacher, then the student:
    "same": each batch of `dataset` is BOTH.
    "fresh" (supplement, Algorithm 1): each batch of `dataset` (TEACHER) is
      followed by one of another pass over it (STUDENT), started one batch
      later (its first batch last) so that the two differ also if `dataset`
      is not reshuffled.
    "alternate_epochs" (the authors' code): the TEACHER batches of a local
      epoch (`batch_epochs`), then as many STUDENT batches of another pass.
  A reshuffling `dataset` orders each pass differently.
  """

  def role(value):
    return lambda x, y: (x, y, tf.constant(value))

  if student_minibatch == "same":
    return dataset.map(role(BOTH))
  if student_minibatch == "fresh":
    student = dataset.skip(1).concatenate(dataset.take(1))
    choices = tf.data.Dataset.from_tensor_slices(tf.constant([TEACHER, STUDENT], tf.int64)).repeat(
      tf.size(sizes, out_type=tf.int64)
    )
  else:
    student = dataset
    per_epoch = tf.math.bincount(
      tf.cast(batch_epochs(sizes, epochs), tf.int32), minlength=epochs, dtype=tf.int64
    )
    choices = tf.data.Dataset.range(epochs).flat_map(
      lambda e: tf.data.Dataset.from_tensors(tf.constant(TEACHER, tf.int64))
      .repeat(per_epoch[e])
      .concatenate(
        tf.data.Dataset.from_tensors(tf.constant(STUDENT, tf.int64)).repeat(per_epoch[e])
      )
    )
  return tf.data.Dataset.choose_from_datasets(
    [dataset.map(role(TEACHER)), student.map(role(STUDENT))], choices
  )


def distillation_loss(teacher_probabilities, student_logits):
  """Mean cross-entropy -sum_c p_T(c|x) log p_S(c|x) over the minibatch.

  The student's objective of Algorithm 1 (its KL to the teacher's predictive
  distribution up to the teacher's entropy, which has no student gradient).
  """
  return -tf.reduce_mean(
    tf.reduce_sum(teacher_probabilities * tf.nn.log_softmax(student_logits), axis=-1)
  )
